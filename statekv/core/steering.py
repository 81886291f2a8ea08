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
        self._signature: tuple = ()
        self._packs: dict = {}

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
        scaled to the chunk's total (``chunk_len`` queries per query head). The questions evaluated together
        (one start) go through one product."""
        device = keys.device
        if cache.positions.bounded:
            first = cache.positions.device_scalars(device)[1] + chunk_len
        else:
            first = cache.seen_device.to(device).reshape(1) + chunk_len
        total = None
        for pack in self.packs(layer, keys.shape[1], device):
            cos, sin = pack.turn(first, cache.step_index, scale)
            queries = pack.queries[layer] * cos + pack.turned[layer] * sin  # [1, H_kv, G * R, D], placed, scaled
            share = (queries @ keys.transpose(-1, -2).float()).softmax(-1)  # [1, H_kv, G * R, N]
            mass = pack.weights @ share  # [1, H_kv, N]
            mass = mass * chunk_len if chunk_len != 1 else mass
            total = mass if total is None else total + mass
        return total if total is not None else torch.zeros(keys.shape[:3], device=device)

    def packs(self, layer: int, heads: int, device: torch.device) -> list["_Pack"]:
        """The questions' queries packed by where they were placed (one pack per start, every question's queries
        side by side), kept until a question's queries change."""
        signature = tuple((id(q), id(q.queries), q.start) for q, _ in self.questions if q.queries is not None)
        if self._signature != signature:
            by_start: dict[int, list[tuple[object, float]]] = {}
            for question, weight in self.questions:
                if question.queries is not None:
                    by_start.setdefault(question.start, []).append((question, weight))
            self._signature = signature
            self._packs = [_Pack(members, start, heads, device) for start, members in by_start.items()]
        return self._packs


class _Pack:
    """Standing questions placed at one ``start``: per layer their queries ``[1, H_kv, G * R, D]`` (float32, R the
    rows of all of them, grouped by the KV head each query head reads) and their halves turned (RoPE's
    rotate-half, so a rotation by ``d`` is ``queries * cos + turned * sin``); ``weights`` ``[G * R]``: each row's
    share (its question's weight over its length)."""

    def __init__(self, members: list[tuple[object, float]], start: int, heads: int, device: torch.device):
        self.start = start
        frequencies = members[0][0].frequencies.to(device, torch.float32)
        self.frequencies, self.rotary = frequencies, 2 * frequencies.shape[0]
        layers = len(members[0][0].queries)
        self.queries, self.turned = [], []
        for layer in range(layers):
            queries = torch.cat([q.queries[layer].to(device, torch.float32) for q, _ in members], 2)  # [1,Hq,R,D]
            grouped = queries.reshape(1, heads, -1, queries.shape[-1])
            half = self.rotary // 2
            turned = torch.zeros_like(grouped)
            turned[..., :half] = -grouped[..., half:self.rotary]
            turned[..., half:self.rotary] = grouped[..., :half]
            self.queries.append(grouped)
            self.turned.append(turned)
        group = self.queries[0].shape[2] // sum(q.length for q, _ in members)
        rows = torch.cat([torch.full((q.length,), weight / q.length) for q, weight in members])
        self.weights = rows.repeat(group).to(device)
        self.dim = self.queries[0].shape[-1]
        self._turn: tuple | None = None

    def turn(self, first: torch.Tensor, step: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[D]`` rotating the queries from ``start`` to ``first`` (LongTensor ``[1]``), times the
        attention's ``scale``, computed once per step (``step``: the stream's step index) for every layer."""
        if self._turn is None or self._turn[0] != step:
            angles = (first - self.start).float() * self.frequencies  # [R / 2]
            rest = self.dim - self.rotary
            ones, zeros = angles.new_ones(rest), angles.new_zeros(rest)
            cos = torch.cat([angles.cos(), angles.cos(), ones]) * scale
            sin = torch.cat([angles.sin(), angles.sin(), zeros]) * scale
            self._turn = (step, cos, sin)
        return self._turn[1], self._turn[2]


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
