"""Test scaffolding, for the tests, the benchmarks and trying statekv offline: tiny random checkpoints of the
supported families (`checkpoints`), numbered synthetic videos (`videos`), and a count of the ATen ops a
streaming step dispatches (`op_trace`).

Nothing in the product imports this package. Importing it also lets the production adapter registry serve
tiny Eagle checkpoints written by earlier releases (``model_type`` ``statekv_tiny_eagle``; new ones declare
Eagle2.5's own type).
"""

from __future__ import annotations

from statekv.models.registry import register_adapter
from statekv.models.remote_internvl import RemoteInternVLAdapter

from .checkpoints import (CHAT_TOKENS, FAMILIES, TinyEagleConfig, TinyEagleForConditionalGeneration, build_tokenizer,
                          chatml_template, make_long_context_checkpoint, make_tiny_checkpoint)
from .op_trace import OpTrace
from .videos import FRAME_INDEX_BITS, draw_test_frame, synthetic_timestamps, write_test_video

__all__ = ["CHAT_TOKENS", "FAMILIES", "FRAME_INDEX_BITS", "OpTrace", "TinyEagleConfig",
           "TinyEagleForConditionalGeneration", "build_tokenizer", "chatml_template", "draw_test_frame",
           "make_long_context_checkpoint", "make_tiny_checkpoint", "synthetic_timestamps", "write_test_video"]


@register_adapter
class LegacyTinyEagleAdapter(RemoteInternVLAdapter):
    """Serves tiny Eagle checkpoints of earlier releases, whose config names the ``statekv_tiny_eagle`` type."""

    model_types = ("statekv_tiny_eagle",)
    eagle_model_types = ("statekv_tiny_eagle",)
