"""`actcfg import FILE`: the actcfg policy for what a ds_config (or a gpt-neox config),
TrainingArguments keywords or DeepSpeedStrategy keywords run, with a warning for each key that
does not do what it says."""

from __future__ import annotations

import argparse
from typing import Any

from actcfg.backends import Backend
from actcfg.cli._diagnostics import (
    exit_code,
    in_file_order,
    located_diagnostics,
    problem_diagnostics,
    read_ds_config,
    report_diagnostics,
)
from actcfg.cli._output import Usage, refuse_output_over, write_output
from actcfg.errors import TranslationError
from actcfg.policy.checker import failure_diagnostic
from actcfg.policy.diagnostics import Diagnostic
from actcfg.policy.loader import LoadFailure, read_document

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Print (or write to `-o`) the policy for what FILE runs, with a warning per key it does not honour."""
    if args.backend in (Backend.HF, Backend.LIGHTNING):
        return _import_trainer(args)
    from actcfg.translators import import_ds_config

    refuse_output_over(args.output, [args.file])
    doc, failed = read_ds_config(args.file)
    if failed:
        report_diagnostics(failed)
        return exit_code(failed)
    if args.num_checkpoints is not None and args.num_checkpoints < 1:
        raise Usage(f"--num-checkpoints must be at least 1, got {args.num_checkpoints}")
    if doc.data == {}:  # `{}`: not yet written, or the wrong file; DeepSpeed would not start
        empty = [Diagnostic(args.file, 1, 1, "bad-value", "error",
                            "the ds_config is an empty object: DeepSpeed refuses it (`Either "
                            "train_batch_size or train_micro_batch_size_per_gpu needs to be "
                            "provided`), and it says nothing about activation checkpointing",
                            "pass the ds_config your training runs with")]
        report_diagnostics(empty)
        return 1
    imported = import_ds_config(doc.data, modules=args.modules, external=args.external,
                                num_checkpoints=args.num_checkpoints)
    diagnostics = in_file_order(problem_diagnostics(doc, args.file)
                                 + located_diagnostics(doc, args.file, imported.findings))
    diagnostics = [d._replace(hint=d.hint.replace("FILE", args.file))
                   if d.code == "not-a-ds-config" else d for d in diagnostics]
    report_diagnostics(diagnostics)
    if imported.yaml is None or any(d.severity == "error" for d in diagnostics):
        return 1
    write_output(imported.yaml, args.output)
    return 0


def _import_trainer(args: argparse.Namespace) -> int:
    """`actcfg import --backend hf|lightning`: TrainingArguments or DeepSpeedStrategy keywords,
    as YAML or JSON, back to a policy."""
    from actcfg.translators.trainer_import import import_strategy_keywords, import_training_arguments

    hf = args.backend == Backend.HF
    trainer = "transformers" if hf else "Lightning"
    what = "TrainingArguments keywords" if hf else "DeepSpeedStrategy keywords"
    if hf and args.num_checkpoints is not None:
        raise Usage("--num-checkpoints sizes DeepSpeed's contiguous buffers: it is for --backend "
                     "deepspeed or lightning, not hf")
    if args.num_checkpoints is not None and args.num_checkpoints < 1:
        raise Usage(f"--num-checkpoints must be at least 1, got {args.num_checkpoints}")
    refuse_output_over(args.output, [args.file])
    try:
        # As transformers reads the file: HfArgumentParser.parse_yaml_file is yaml.safe_load
        # (YAML 1.1: `gradient_checkpointing: yes` is true). Lightning's keywords come from
        # Python or its CLI, not one YAML reader: actcfg's own (only true/false are booleans).
        doc = read_document(args.file, yaml11=hf)
    except LoadFailure as e:
        failure = [failure_diagnostic(args.file, e)]
        if e.code == "yaml-not-mapping":  # the loader's hint speaks of policies
            failure = [Diagnostic(args.file, e.line, e.column, e.code, "error",
                                  f"{what} are a mapping of `name: value` lines",
                                  f"write the {what} as a YAML or JSON mapping")]
        report_diagnostics(failure)
        return exit_code(failure)
    problems = problem_diagnostics(doc, args.file)
    if problems:  # duplicate keys: which one the trainer keeps is its parser's accident
        report_diagnostics(problems)
        return 1
    try:
        if hf:
            imported = import_training_arguments(doc.data, modules=args.modules, external=args.external)
        else:
            imported = import_strategy_keywords(doc.data, modules=args.modules, external=args.external,
                                                num_checkpoints=args.num_checkpoints)
    except TranslationError as e:
        report_diagnostics([Diagnostic(args.file, None, None, "unsupported-on-backend", "error", str(e),
                            f"pass {what}")])
        return 1

    def where(key: str) -> tuple[int | None, int | None]:
        return doc.locate(tuple(key.split(".")), key=True) if key.split(".")[0] in doc.data else (None, None)

    # Each reason says what became of the key when it is more than "not imported" (a truthy
    # "false" is imported as on): the hint never contradicts it.
    report_diagnostics([Diagnostic(args.file, *where(key), "ignored-key", "warning", f"`{key}`: {why}",
                        "" if "imported" in why or "not used" in why else "not imported")
             for key, why in imported.ignored]
            + [Diagnostic(args.file, None, None, "dropped-by-backend", "warning", f"`{key}`: {why}",
                          f"imported: the policy keeps what {trainer} would lose")
               for key, why in imported.dropped]
            + ([_placeholder_diagnostic(args.file, what, hf)] if imported.placeholder else []))
    write_output(imported.yaml, args.output)
    return 0


def _placeholder_diagnostic(name: str, what: str, hf: bool) -> Diagnostic:
    from actcfg.translators.ds_config import placeholder_finding

    f = placeholder_finding(f"the {what}", (), "to keep transformers' own checkpointing "
                            "(`mode: external`)" if hf else "if the model calls "
                            "deepspeed.checkpointing.checkpoint itself")
    return Diagnostic(name, None, None, f.code, f.severity, f.message, f.hint)


def add_parser(sub: Any) -> None:
    """Add `import` to the subcommands `sub`, with its flags and `run`."""
    p = sub.add_parser("import", help="print the actcfg policy for what a ds_config.json (or a "
                                      "gpt-neox config), TrainingArguments or DeepSpeedStrategy "
                                      "keywords run")
    p.add_argument("file", metavar="FILE",
                   help="a ds_config (JSON or hjson) or gpt-neox config (.yml); with --backend hf, "
                        "TrainingArguments keywords (YAML or JSON); with --backend lightning, "
                        "DeepSpeedStrategy keywords (YAML or JSON)")
    p.add_argument("--backend", choices=[Backend.DEEPSPEED.value, Backend.HF.value, Backend.LIGHTNING.value],
                   default=Backend.DEEPSPEED.value, help="what FILE holds (default: deepspeed)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--modules", nargs="+", metavar="NAME",
                       help="class names (or patterns) of the modules to checkpoint, which no "
                            "ds_config or trainer keyword can say (without it or --external, the "
                            "policy holds CHANGE_ME, which validate refuses)")
    which.add_argument("--external", action="store_true",
                       help="the model checkpoints itself: it calls deepspeed.checkpointing."
                            "checkpoint (Megatron, gpt-neox), or with --backend hf transformers "
                            "keeps its own checkpointing; write `checkpoint: {mode: external}`")
    p.add_argument("--num-checkpoints", type=int, metavar="N",
                   help="checkpointed calls per step, as the program passes num_checkpoints to "
                        "configure() itself (Megatron: its --num-layers); needed for contiguous "
                        "buffers with --external when the file has no number_checkpoints "
                        "(deepspeed and lightning)")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write here instead of stdout (never over the input)")
    p.set_defaults(run=run)
