"""The settings a run folder's ``run.json`` pins: those that change the answers, so one folder never mixes them
(`statekv.eval.runner.check_run_file`), and which `statekv.eval.report.paper_table` reads to tell two rows of one
model and method apart. A ``run.json`` written before one of them existed does not name it: it is taken as that
setting's default (`with_defaults`)."""

from __future__ import annotations

from typing import Any

from statekv.settings.engine import DEFAULT_CACHE_LIMIT, DEFAULT_QUESTION_SPAN

RUN_IDENTITY = ("benchmark", "model", "name", "method", "budget", "parser", "protocol", "max_fps", "max_frames",
                "layout", "attention", "dtype", "ovobench_videos", "max_new_tokens", "retrieve", "sinks",
                "retrieval", "kv_cache_dtype", "mode", "groups", "steer", "positions", "bounded_layout",
                "question_span", "max_cache_bytes", "cache_limit")
IDENTITY_DEFAULTS = {"retrieve": None, "sinks": None, "retrieval": None, "kv_cache_dtype": None, "groups": None,
                     "steer": True, "positions": None, "bounded_layout": None, "question_span": DEFAULT_QUESTION_SPAN,
                     "max_cache_bytes": None, "cache_limit": DEFAULT_CACHE_LIMIT}


def with_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """A ``run.json``'s ``settings``, each setting it does not name taken as its default."""
    return {**IDENTITY_DEFAULTS, **settings}


def unrecorded(settings: dict[str, Any], name: str) -> bool:
    """Whether a ``run.json``'s ``settings`` do not name ``name`` (written before it was pinned)."""
    return name in IDENTITY_DEFAULTS and name not in settings
