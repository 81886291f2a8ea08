"""Steering: the standing questions of a stream also choose what its carried state keeps while they stand.

A scored carry rule (StateKV) keeps, per layer and KV head, the candidates that drew the most attention from the
step's queries. With a :class:`QuestionGuide` on the stream's cache, each candidate's score is that attention mass
plus, for each standing question, the mass it draws from the question's queries at its latest evaluation
(`StandingQuestion.queries`, placed right after the step's chunk, as if the question were asked there), scaled to the chunk's total and
weighted by ``weight``: a composition of the base rule's score with the question's, in the way kvpress composes
presses. A token a standing question attends to stays carried, so later evaluations of the question, which read
the carried state and the new frames only, still see it. Rules that read no attention mass (recency, key norm,
full attention) are not affected.

The queries' positions: under ``stream`` positions the chunk sits at its own positions, under ``bounded`` at the
base its step was placed at (read on the device, `StreamPositions.device_scalars`). Streams whose positions have
several rows (M-RoPE) are not steered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_WEIGHT = 1.0


class QuestionGuide:
    """The standing questions steering one stream (``questions``: each a `StandingQuestion` and its weight)."""

    def __init__(self):
        self.questions: list[tuple[object, float]] = []

    @property
    def active(self) -> bool:
        return bool(self.questions)

    def add(self, question, weight: float | None = None) -> None:
        self.questions.append((question, float(DEFAULT_WEIGHT if weight is None else weight)))

    def remove(self, question) -> None:
        self.questions = [(q, w) for q, w in self.questions if q is not question]

    def mass(self, cache, layer: int, keys: torch.Tensor, chunk_len: int, scale: float) -> torch.Tensor:
        """``[1, H_kv, N]`` the weighted attention mass the standing questions' queries, placed after the step's
        chunk, give the candidates ``keys`` ``[1, H_kv, N, D]`` (as they are handed to attention), each question's
        scaled to the chunk's total (``chunk_len`` queries per query head)."""
        device = keys.device
        heads = keys.shape[1]
        if cache.positions.bounded:
            first = cache.positions.device_scalars(device)[1] + chunk_len
        else:
            first = cache.seen_device.to(device).reshape(1) + chunk_len
        total = torch.zeros(keys.shape[:3], dtype=torch.float32, device=device)
        for question, weight in self.questions:
            if question.queries is None:  # not evaluated yet
                continue
            queries = question.queries_at(layer, first, device)  # [1, Hq, Q, D]
            length = queries.shape[2]
            grouped = queries.reshape(1, heads, -1, queries.shape[-1]).float()
            share = ((grouped @ keys.float().transpose(-1, -2)) * scale).softmax(-1).sum(2)
            total += share * (weight * chunk_len / length)
        return total


def steered(caches: Sequence, layer: int, keys: torch.Tensor, scores: torch.Tensor, chunk_len: int,
            scale: float) -> torch.Tensor:
    """``scores`` ``[S, H_kv, N]`` (row ``s``: stream ``caches[s]``'s candidates ``keys[s]``) plus each guided
    stream's question mass (:meth:`QuestionGuide.mass`); the same tensor when no stream is guided."""
    guided = [row for row, cache in enumerate(caches) if getattr(cache, "guide", None) is not None
              and cache.guide.active]
    if not guided:
        return scores
    scores = scores.clone()
    for row in guided:
        scores[row:row + 1] += caches[row].guide.mass(caches[row], layer, keys[row:row + 1], chunk_len, scale)
    return scores
