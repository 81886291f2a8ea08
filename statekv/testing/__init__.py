"""Test scaffolding, for the tests, the benchmarks and trying statekv offline: tiny random checkpoints of the
supported families (`checkpoints`), numbered synthetic videos (`videos`), and a count of the ATen ops a
streaming step dispatches (`op_trace`).

Nothing in the product imports this package.
"""

from __future__ import annotations

from .checkpoints import (CHAT_TOKENS, FAMILIES, TinyEagleConfig, TinyEagleForConditionalGeneration, build_tokenizer,
                          chatml_template, make_long_context_checkpoint, make_tiny_checkpoint)
from .op_trace import OpTrace
from .videos import FRAME_INDEX_BITS, draw_test_frame, synthetic_timestamps, write_test_video

__all__ = ["CHAT_TOKENS", "FAMILIES", "FRAME_INDEX_BITS", "OpTrace", "TinyEagleConfig",
           "TinyEagleForConditionalGeneration", "build_tokenizer", "chatml_template", "draw_test_frame",
           "make_long_context_checkpoint", "make_tiny_checkpoint", "synthetic_timestamps", "write_test_video"]

