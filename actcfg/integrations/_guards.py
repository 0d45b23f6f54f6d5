"""What both trainer callbacks check: which backend applies the policy, whether the trainer's
DeepSpeed section agrees with it, whether the trainer already checkpoints (two recomputes
stacked), and whether what the policy promised really happened once training ran.

Imports neither torch nor a trainer library at module level.
"""

from __future__ import annotations

import json
from typing import Any

from actcfg.backends import Backend
from actcfg.backends.deepspeed import SECTION, TABLE
from actcfg.backends.table import Key
from actcfg.errors import PolicyApplyError, TranslationError
from actcfg.policy.schema import Policy
from actcfg.translators import to_deepspeed

__all__ = [
    "EXTERNAL_FIX",
    "backend_for",
    "hf_checkpointed_modules",
    "refuse_disagreeing_section",
    "refuse_drifted_deepspeed_state",
    "refuse_idle_offload",
    "refuse_no_recompute",
    "refuse_stacked",
]

EXTERNAL_FIX = ("write `checkpoint: {mode: external}` to keep HF's own checkpointing and let actcfg "
                "offload around it")
"""The second way out of stacked checkpointing, in every sentence that refuses it."""

# ds_config JSON key -> actcfg field, from the one DeepSpeed table.
_FIELD_BY_KEY = {entry.key: path for path, entry in TABLE.items() if isinstance(entry, Key)}


def backend_for(policy: Policy, backend: Backend | str | None, trainer_runs_deepspeed: bool) -> Backend:
    """The backend a callback applies with: its `backend=`, else a `backend:` the policy file
    sets, else deepspeed when the trainer runs DeepSpeed (actcfg then configures DeepSpeed in
    the trainer's place), else the policy's default."""
    if backend is not None:
        return Backend.parse(backend)
    if "backend" not in policy.model_fields_set and trainer_runs_deepspeed:
        return Backend.DEEPSPEED
    return policy.backend


def _deepspeed_section(policy: Policy) -> dict[str, Any]:
    try:
        return to_deepspeed(policy)[SECTION]
    except TranslationError as e:
        raise PolicyApplyError(str(e)) from e


def _same(a: Any, b: Any) -> bool:
    # `1 == True` in Python, but DeepSpeed reads "false" and 1 as truthy values, not booleans.
    return type(a) is type(b) and a == b


def refuse_disagreeing_section(section: Any, policy: Policy, backend: Backend, where: str) -> None:
    """PolicyApplyError when a trainer's DeepSpeed `activation_checkpointing` section says
    something other than what actcfg configures DeepSpeed with (`where` names the config)."""
    if section is None:
        return
    if not isinstance(section, dict):
        raise PolicyApplyError(
            f"{where}'s `{SECTION}` must be a JSON object, got {type(section).__name__}: "
            f"remove it (actcfg configures DeepSpeed from the policy)"
        )
    if backend is Backend.DEEPSPEED:
        wanted = _deepspeed_section(policy)
    else:
        # The torch backend leaves DeepSpeed's activation checkpointing unconfigured: DeepSpeed
        # keeps its defaults, which are the policy schema's defaults.
        wanted = _deepspeed_section(Policy.model_validate({"version": 1}))
    problems: list[str] = []
    for key, value in section.items():
        if key not in wanted:
            problems.append(f"{SECTION}.{key} is not a key DeepSpeed reads (it reads "
                            f"{', '.join(wanted)}) and would be ignored")
        elif not _same(value, wanted[key]):
            field = _FIELD_BY_KEY[key]
            if backend is Backend.DEEPSPEED:
                problems.append(f"{SECTION}.{key} is {json.dumps(value)} in {where}, policy field "
                                f"{field} is {json.dumps(wanted[key])}")
            else:
                problems.append(f"{SECTION}.{key} is {json.dumps(value)} in {where}, but the policy "
                                f"is applied with backend torch, which leaves DeepSpeed's {key} at "
                                f"{json.dumps(wanted[key])}")
    if not problems:
        return
    instead = ("which configures DeepSpeed in its place" if backend is Backend.DEEPSPEED
               else "which does not configure DeepSpeed (backend torch)")
    raise PolicyApplyError(
        f"{where}'s `{SECTION}` section disagrees with the actcfg policy, {instead}: "
        + "; ".join(problems)
        + f"; remove the section from {where}, or make it agree with the policy"
    )


def refuse_stacked(setting: str, fix: str, policy: Policy) -> None:
    """PolicyApplyError: the trainer checkpoints already (`setting`), and so does the policy."""
    raise PolicyApplyError(
        f"{setting} and the actcfg policy's `checkpoint: {{mode: {policy.checkpoint.mode}}}` would "
        f"stack two recomputes of each layer in backward: {fix}, or {EXTERNAL_FIX}"
    )


def hf_checkpointed_modules(model: Any) -> list[str]:
    """Qualified names of the layers whose Hugging Face activation checkpointing is on: the
    `gradient_checkpointing` flag transformers sets on each layer it checkpoints (and on the
    stack holding them, which is left out)."""
    flagged = [name for name, module in model.named_modules()
               if getattr(module, "gradient_checkpointing", False) is True]
    return [name or "<root>" for name in flagged
            if not any(other != name and (not name or other.startswith(name + ".")) for other in flagged)]


def refuse_idle_offload(applied: Any, why: str) -> None:
    """PolicyApplyError when the policy offloads with actcfg's engine and a training step ran
    without the engine seeing a forward pass (its scope is the root module's forward)."""
    engine = getattr(applied, "engine", None)
    if engine is None or engine.stats.steps > 0:
        return
    raise PolicyApplyError(
        "cpu_checkpointing: a training step ran and actcfg's offload engine saw no forward pass, "
        f"so nothing was offloaded: it offloads inside the forward of the module the policy was "
        f"applied to ({type(applied.model).__name__}), and {why}"
    )


def refuse_no_recompute(applied: Any) -> None:
    """PolicyApplyError when a training step ran checkpointed forwards and backward recomputed
    none of them (the counters stay still under torch.compile, where there are no calls)."""
    counters = getattr(applied, "counters", None)
    if counters is None or not applied.checkpointed or counters.calls == 0 or counters.recomputes:
        return
    raise PolicyApplyError(
        f"checkpoint: a training step ran {counters.calls} checkpointed forwards and backward "
        "recomputed none of them, so checkpointing saved nothing: no gradient flows through "
        f"{', '.join(f'`{n}`' for n in applied.checkpointed[:3])}"
        f"{', ...' if len(applied.checkpointed) > 3 else ''} (frozen, or outside the loss); "
        "narrow checkpoint.modules to the modules that train"
    )


def refuse_drifted_deepspeed_state(applied: Any, when: str) -> None:
    """PolicyApplyError when DeepSpeed's activation-checkpointing globals no longer hold what
    actcfg configured (someone called deepspeed.checkpointing.configure after it)."""
    if applied is None or applied.deepspeed is None:
        return
    wanted = applied.deepspeed.configure_kwargs
    state = applied.deepspeed_state()
    differ = [f"{k}: policy {wanted[k]!r}, DeepSpeed has {state[k]!r}"
              for k in wanted if not _same(state[k], wanted[k])]
    if differ:
        raise PolicyApplyError(
            f"DeepSpeed's activation-checkpointing settings {when} differ from what actcfg "
            "configured (deepspeed.checkpointing.configure was called again after it, which "
            "resets all six settings): " + "; ".join(differ)
            + "; remove the other configure() call, or the trainer's activation_checkpointing "
            "settings"
        )
