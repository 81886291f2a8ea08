"""The one base of the engine's cache layers: a stream's (`statekv.core.cache.layer.StreamingLayer`), a batch's
(`statekv.core.step.batching.BatchLayer`) and a question's (`statekv.core.answering.answer_cache.AnswerLayer`).

transformers' ``CacheLayerMixin`` gives every layer methods that act on ``keys``/``values`` as its own layers hold
them. No engine layer holds them so: a stream's detailed cache lives in its storage, a batch's layers hold
nothing of their own, and a question's keys may be the stream's own detailed buffer (answered in place). So the
base implements what a forward calls of every layer and refuses, with one line, what none of them can honour.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ...errors import UnsupportedModelError


class EngineLayer(CacheLayerMixin):
    """A transformers cache layer of the engine. Subclasses implement what a forward calls (``update``,
    ``lazy_initialization``, ``get_seq_length``, ``get_mask_sizes``); here: no maximum length, not compileable,
    croppable or sliding, no early initialization, and the calls that would move, zero or reorder ``keys`` and
    ``values`` refused."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def get_max_length(self) -> int:  # no maximum
        return -1

    # A stream's detailed cache is offloaded by its storage (the ``offload`` setting), never reset in place (a
    # question's keys may be the stream's own buffer), and one stream is one sequence.
    def offload(self):
        raise UnsupportedModelError("a streaming layer is offloaded by its storage (the offload setting), not by "
                                    "transformers' layer offloading")

    def prefetch(self):
        raise UnsupportedModelError("a streaming layer is offloaded by its storage (the offload setting), not by "
                                    "transformers' layer offloading")

    def reset(self) -> None:
        raise UnsupportedModelError("a stream's cache is never reset in place; make a new stream")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModelError("a stream's cache holds one sequence and cannot be reordered (beam search)")
