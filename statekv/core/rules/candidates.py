"""The candidates a carry rule chooses from: what a layer carried into a step, then the step's own tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import torch


class Candidates:
    """The tokens a layer may carry after one step: what it carried into the step, then the step's tokens.

    Attributes:
        size: number of candidates N.
        layer: decoder layer index.
        scores: float32 ``[B, H_kv, N]``: attention mass each candidate received from the step's queries,
            summed over those queries and the query heads of its KV group (each row sums to ``T * G``);
            ``None`` unless the policy needs them (:meth:`CarryPolicy.scores_needed`).
        keys, values: ``[B, H_kv, N, D]`` the candidates' keys (post-RoPE) and values.
        queries: ``[B, Hq, T, D]`` the step's queries (post-RoPE), query head ``h`` reading KV head ``h // G``;
            the tensor the attention already used, so reading it costs nothing until a rule computes with it.
        positions: LongTensor ``[B, H_kv, N]``: logical sequence position of each candidate.
        steps: LongTensor ``[B, H_kv, N]``: index of the step that produced each candidate.
        step: index of the current step (0 for the first chunk).
        chunk_lengths: token count of every step so far, the current one last.

    Candidates are in time order, except that a carried state may hold its tokens in any order (positions
    say which is which). ``step``, ``chunk_lengths`` and ``steps`` are host-side facts that change every step:
    a rule that reads them cannot be captured as a CUDA graph, and a step that reads them is never captured.
    """

    def __init__(self, *, layer: int, scores: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                 positions: Callable[[], torch.Tensor] | torch.Tensor,
                 history: Callable[[], Sequence[int]] | Sequence[int],
                 queries: Callable[[], torch.Tensor] | torch.Tensor | None = None):
        self.size, self.layer = keys.shape[2], layer
        self.scores, self.keys, self.values = scores, keys, values
        self._positions, self._history, self._queries = positions, history, queries
        self.read_host_state = False

    @cached_property
    def queries(self) -> torch.Tensor:
        if self._queries is None:
            raise NotImplementedError("these candidates were made without the step's queries")
        return self._queries() if callable(self._queries) else self._queries

    def after(self, count: int) -> "Candidates":
        """The candidates past the first ``count`` (views; indices in the result count from ``count``)."""
        parent = self
        view = Candidates(layer=self.layer, scores=None if self.scores is None else self.scores[..., count:],
                          keys=self.keys[:, :, count:], values=self.values[:, :, count:],
                          positions=lambda: parent.positions[..., count:], history=self._history,
                          queries=lambda: parent.queries)
        return view

    @cached_property
    def positions(self) -> torch.Tensor:
        return self._positions() if callable(self._positions) else self._positions

    @property
    def chunk_lengths(self) -> Sequence[int]:
        self.read_host_state = True
        if callable(self._history):
            self._history = self._history()  # made once: a long stream's history is not walked per read
        return self._history

    @property
    def step(self) -> int:
        return len(self.chunk_lengths) - 1

    @cached_property
    def steps(self) -> torch.Tensor:
        lengths = self.chunk_lengths
        lengths = lengths.tensor() if hasattr(lengths, "tensor") else torch.tensor(lengths, dtype=torch.long)
        starts = lengths.to(self.positions.device).cumsum(0)
        return torch.searchsorted(starts, self.positions, right=True)

    def last_steps(self, count: int) -> slice:
        """The candidates produced by the ``count`` most recent steps, as a slice.

        Valid when the carried state already holds every token of the previous ``count - 1`` steps, in time
        order (true for any rule that never drops a recent token before an older one, such as recency).
        """
        recent = sum(self.chunk_lengths[-count:])
        return slice(max(self.size - recent, 0), None)
