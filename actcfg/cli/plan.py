"""`actcfg plan CONFIG`: profile a training step on the GPU, solve for the fastest per-module
policy within memory_budget, apply it and measure; write the plan (`-o`) and say whether it held."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from actcfg.backends import Backend
from actcfg.cli._diagnostics import exit_code, report_diagnostics
from actcfg.cli._launch import (build_model, process_group, rank_zero_writes, refuse_run,
                                require_torch, to_device)
from actcfg.cli._output import Usage, check_output, refuse_output_over, write_error, write_output
from actcfg.errors import ActcfgError
from actcfg.policy.checker import check_file
from actcfg.policy.diagnostics import escape_controls

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Under torchrun every rank profiles, the ranks plan from their profiles reduced to the
    worst case (actcfg.plan.consensus) and all apply the same plan; only rank 0 writes (the
    plan file, the report, the errors), and every rank returns the exit code of the slowest."""
    return rank_zero_writes(_plan_here, args)


def _with_compile(args: argparse.Namespace, policy: Any) -> Any:
    """`policy` with --compile and --compile-backend over its `compile:` (None: a backend given
    with nothing to compile)."""
    from actcfg.policy.schema import Compile

    given = policy.compile.model_dump(exclude_unset=True) if policy.compile is not None else {}
    if args.compile is not None:
        given["scope"] = args.compile
    if args.compile_backend is not None:
        given["backend"] = args.compile_backend
    if "scope" not in given:
        return None
    return policy.model_copy(update={"compile": Compile(**given)})


def _plan_here(args: argparse.Namespace, write: bool = True) -> int:
    """Profile, solve, write the rules policy, apply it and measure: exit 0 when the measured
    peak is within the budget, 1 when it is not or no plan fits, 2 for usage."""
    from actcfg.policy.schema import parse_size

    refuse_output_over(args.output, [args.config])
    try:  # before the minutes of profiling that a target -o cannot write would lose
        check_output(args.output)
    except Usage as e:
        return refuse_run(args, 2, str(e))
    policy, diagnostics = check_file(args.config)
    if policy is None:
        return refuse_run(args, exit_code(diagnostics) or 1, None, diagnostics)
    report_diagnostics(diagnostics)
    if policy.checkpoint.mode != "auto":
        return refuse_run(args, 2, (
            f"actcfg plan plans for a policy that asks for one (`checkpoint: {{mode: auto, "
            f"modules: [...]}}` with `memory_budget`), and {args.config} has checkpoint.mode "
            f"{policy.checkpoint.mode}; write mode auto with the modules to plan over"))
    if args.budget is not None:
        try:
            budget = parse_size(args.budget)
        except ValueError as e:
            return refuse_run(args, 2, f"--budget {args.budget!r}: {e}")
        if budget == 0:  # the file's memory_budget is refused at 0 by the schema; so is this
            return refuse_run(args, 2, f"--budget {args.budget!r}: a budget of 0 bytes leaves "
                                           "no room for a training step")
        policy = policy.model_copy(update={"memory_budget": budget})
    if args.compile is not None or args.compile_backend is not None:
        try:
            policy = _with_compile(args, policy)
        except ValueError as e:  # pydantic's ValidationError: an empty backend name
            return refuse_run(args, 2, f"--compile-backend {args.compile_backend!r}: "
                                       f"{e.errors()[0]['msg'] if hasattr(e, 'errors') else e}")
        if policy is None:
            return refuse_run(args, 2, "--compile-backend names torch.compile's backend for "
                                       "--compile (or the file's `compile:`), and neither is "
                                       "given: add --compile blocks|model")
    if args.steps < 1:
        return refuse_run(args, 2, f"--steps must be at least 1, got {args.steps}")
    from actcfg.verification import load_factory

    try:
        require_torch("actcfg plan")
        import torch

        factory = load_factory(args.model)
        if not torch.cuda.is_available():
            raise ActcfgError("actcfg plan profiles a training step on the GPU and needs a CUDA "
                              "GPU, but torch.cuda.is_available() is False here: run it on a GPU "
                              "machine")
    except ActcfgError as e:
        return refuse_run(args, 2, str(e))
    from actcfg.errors import PlanError
    from actcfg.plan import plan_model
    from actcfg.plan.consensus import slowest_rank
    from actcfg.plan.profile import measure_steps
    from actcfg.api import apply
    from actcfg.verification.measure import BUILD_SEED

    with contextlib.ExitStack() as stack:
        try:  # under torchrun, the group the ranks plan together in (one GPU each)
            stack.enter_context(process_group(Backend.TORCH))
        except Usage as e:
            return refuse_run(args, 2, str(e))
        torch.manual_seed(BUILD_SEED)
        try:
            model, inputs = build_model(factory, args.model)
        except Usage as e:
            return refuse_run(args, 2, str(e))
        if any(t.device.type != "cuda" for t in [*model.parameters(), *model.buffers()]):
            model.cuda()
        inputs = to_device(inputs, next(model.parameters()).device)
        try:
            planned = plan_model(model, policy, inputs, apply=apply, origin=args.config)
        except PlanError as e:
            return refuse_run(args, 1, str(e), status="no-plan-fits")
        with apply(model, planned.policy):
            if planned.policy.compile is not None:  # its graphs built before the timed steps
                measure_steps(model, inputs, steps=2)
            step_ms, peak = measure_steps(model, inputs, steps=args.steps)
        step_ms, peak = slowest_rank(step_ms, peak)  # the plan holds only if it holds on each
    report, budget = planned.report, planned.plan.budget
    ok = peak <= budget
    unwritten = None
    if args.output and write:  # one file, from rank 0
        try:
            write_output(report.policy_yaml, args.output)
        except Usage as e:
            # Checked before profiling, failed now (a full disk, /dev/full): the plan is printed
            # below as without -o, so that the minutes spent on it are not lost.
            unwritten, args.output = str(e), None
    if args.format == "json":
        import json

        body = {
            "ok": ok, "config": args.config, "written": args.output, **report.plan_json(),
            "measured": {"step_time_ms": step_ms, "peak": peak, "steps": args.steps},
            "profile": planned.profile.to_json(), "copy_windows": planned.profile.copy_windows(),
        }
        write_output(json.dumps(body, indent=2) + "\n")
    else:
        write_output(_render_plan(args, planned, step_ms, peak, ok))
    if unwritten is not None:
        write_error(f"actcfg: error: {escape_controls(unwritten)}; the plan is printed on standard "
             "output instead\n")
        return 2
    return 0 if ok else 1


def _render_plan(args: argparse.Namespace, planned: Any, step_ms: float, peak: int, ok: bool) -> str:
    report, budget = planned.report, planned.plan.budget

    from actcfg.plan import OFFLOADS
    from actcfg.units import memory_size

    def off(measured: float, predicted: float) -> str:
        return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"

    width = max(len(m) for m, _ in report.choices)
    lines = [f"actcfg plan: {len(report.choices)} modules, memory_budget {memory_size(budget)}, "
             f"profiled on {report.device}", ""]
    lines += [f"{m.ljust(width)}  {c}" for m, c in report.choices]
    lines += [
        "",
        f"step time  predicted {report.predicted_step_time_ms:.1f} ms, measured {step_ms:.1f} ms "
        f"(median of {args.steps}; prediction {off(step_ms, report.predicted_step_time_ms)})",
        f"peak       predicted {memory_size(report.predicted_peak)}, measured {memory_size(peak)} "
        f"(prediction {off(peak, report.predicted_peak)})",
        f"plain      {report.plain_step_time_ms:.1f} ms, {memory_size(report.plain_peak)}",
        f"planning   {report.planning()}" + (f" ({report.compiled})" if report.compiled else ""),
        ("offload    none" if not any(c in OFFLOADS for _, c in report.choices) else
         f"offload    max_inflight {report.max_inflight}; {report.kept_at_turn} modules after the "
         "last offloaded one stay on the GPU at the turn"),
        "",
        (f"PASS  memory_budget  the measured peak {memory_size(peak)} is within {memory_size(budget)}" if ok else
         f"FAIL  memory_budget  the measured peak {memory_size(peak)} is above {memory_size(budget)}: the "
         "profile did not predict this step; lower memory_budget, or profile with the batch you "
         "train with"),
    ]
    text = "\n".join(lines) + "\n"
    if args.output:
        return text + f"wrote {args.output}\n"
    return text + "\n" + report.policy_yaml


def add_parser(sub: Any) -> None:
    """Add `plan` to the subcommands `sub`, with its flags and `run`."""
    p = sub.add_parser("plan", help="profile a training step on the GPU and write the fastest "
                                    "per-module policy whose peak fits memory_budget")
    p.add_argument("config", metavar="CONFIG",
                   help="policy YAML with `checkpoint: {mode: auto, modules: [...]}` and memory_budget")
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY", required=True,
                   help="factory returning (model, example_inputs), as for actcfg verify")
    p.add_argument("--budget", metavar="SIZE", help="overrides the file's memory_budget (16GiB, ...)")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write the plan (a `checkpoint.mode: rules` policy) here (never over CONFIG)")
    p.add_argument("--steps", type=int, default=3,
                   help="steps measured under the plan after one warm-up (default 3)")
    p.add_argument("--compile", choices=["blocks", "model"],
                   help="plan for a compiled model (overrides the file's `compile.scope`): "
                        "profile each block, or the whole model, under torch.compile; the plan "
                        "written says so and actcfg.apply compiles it the same way")
    p.add_argument("--compile-backend", metavar="NAME",
                   help="torch.compile backend for --compile (default: the file's, else inductor)")
    p.add_argument("--format", choices=["json", "text"], default="text", help="output format")
    p.set_defaults(run=run)
