"""The settings a run folder's ``run.json`` pins: those that change the answers, so one folder never mixes them
(`statekv.eval.runner.check_run_file`), and which `statekv.eval.report.paper_table` reads to tell two rows of one
model and method apart. A ``run.json`` written before one of them existed does not name it: it is taken as that
setting's default (`with_defaults`). Settings that change how a run computes, not what (`RUN_CONDITIONS`), are
recorded, not pinned: a run may resume with ``--offload`` after running out of GPU memory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from statekv.settings.engine import DEFAULT_CACHE_LIMIT, DEFAULT_QUESTION_SPAN

logger = logging.getLogger(__name__)

RUN_IDENTITY = ("benchmark", "model", "name", "method", "budget", "parser", "protocol", "max_fps", "max_frames",
                "layout", "attention", "dtype", "ovobench_videos", "max_new_tokens", "retrieve", "sinks",
                "retrieval", "kv_cache_dtype", "mode", "groups", "steer", "positions", "bounded_layout",
                "question_span", "max_cache_bytes", "cache_limit")
RUN_CONDITIONS = ("vision_batch", "offload", "compile_step", "cuda_graph")  # how, not what: recorded, not pinned
IDENTITY_DEFAULTS = {"retrieve": None, "sinks": None, "retrieval": None, "kv_cache_dtype": None, "groups": None,
                     "steer": True, "positions": None, "bounded_layout": None, "question_span": DEFAULT_QUESTION_SPAN,
                     "max_cache_bytes": None, "cache_limit": DEFAULT_CACHE_LIMIT}


def with_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """A ``run.json``'s ``settings``, each setting it does not name taken as its default."""
    return {**IDENTITY_DEFAULTS, **settings}


def unrecorded(settings: dict[str, Any], name: str) -> bool:
    """Whether a ``run.json``'s ``settings`` do not name ``name`` (written before it was pinned)."""
    return name in IDENTITY_DEFAULTS and name not in settings


def conditions_used(out: Path, options: Any, run: dict[str, Any] | None, device: str | None = None
                    ) -> list[dict[str, Any]]:
    """``run.json``'s ``conditions``: each set of `RUN_CONDITIONS` (read from ``options``, a `ModelOptions`) and the
    ``device`` (`device_named`) the run in ``out`` answered under, the current one last; ``run``: its ``run.json``
    when it holds answers. A resume under another set than the last is said in one warning line (a set an earlier
    statekv recorded without its device is not said to differ in it)."""
    current = {**{name: getattr(options, name) for name in RUN_CONDITIONS}, "device": device}
    used = [entry for entry in (run or {}).get("conditions") or [] if isinstance(entry, dict)]
    changed = ", ".join(f"{name} {value!r} (before: {used[-1].get(name)!r})" for name, value in current.items()
                        if used and (name in used[-1] or name != "device") and used[-1].get(name) != value)
    if changed:
        logger.warning("%s: resumed with %s; these settings are not meant to change the answers (a batched, compiled "
                       "or captured computation may differ in the last bits; run.json lists each set used)", out,
                       changed)
    return [*(entry for entry in used if entry != current), current]


def device_named(device: Any) -> str:
    """A device as ``run.json`` records it: its type (``cpu``, ``mps``), a GPU's with its name (``cuda: NAME``),
    since answers may differ in their last bits between GPUs, not between the ranks of one machine."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return device.type
