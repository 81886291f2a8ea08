"""Steering: the standing questions of a stream also choose what its carried state keeps while they stand.

A scored carry rule (StateKV) keeps, per layer and KV head, the candidates that drew the most attention from the
step's queries. With a :class:`QuestionGuide` on the stream's cache, each candidate's score is that attention mass
plus, for each standing question, the mass it draws from the question's queries at its latest evaluation
(`StandingQuestion.queries`, placed right after the step's chunk, as if the question were asked there), scaled to the chunk's total and
weighted by ``weight``: a composition of the base rule's score with the question's, in the way kvpress composes
presses. A token a standing question attends to stays carried, so later evaluations of the question, which read
the carried state and the new frames only, still see it. Rules that read no attention mass (recency, key norm,
full attention) are not affected.

The queries' positions: under ``stream`` positions (and under ``bounded`` while every step sits at its own
position, `StreamPositions.still`) the chunk sits at its own positions, else at the base its step was placed at
(`StreamPositions.step_base`, on the device). Streams whose positions have
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
        self._step: tuple | None = None  # (step key, [(pack, turn [D, D], weights [G * R])]) for the step being run

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
        total = None
        heads = keys.shape[1]
        candidates = keys[0].transpose(-1, -2).float()  # [H_kv, D, N]
        for queries, weights in self.placed(cache, heads, device, chunk_len, scale):
            # the batched products `@` makes of these shapes, without its broadcasting views
            share = torch.bmm(queries[layer], candidates).softmax(-1)  # [H_kv, G * R, N]
            mass = torch.bmm(weights.expand(heads, 1, -1), share).view(1, heads, -1)  # [1, H_kv, N]
            total = mass if total is None else total + mass
        return total if total is not None else torch.zeros(keys.shape[:3], device=device)

    def placed(self, cache, heads: int, device: torch.device, chunk_len: int, scale: float) -> list[tuple]:
        """For the step being run, each pack's queries at every layer ``[L, H_kv, G * R, D]`` rotated to right after the
        step's chunk (times ``scale``: one product for all layers) and its rows' weights scaled to the chunk: made at
        the step's first layer, read by the others."""
        key = (cache.step_index, id(cache), chunk_len, scale, device, self._signature)
        if self._step is None or self._step[0] != key:
            packs = self.packs(0, heads, device)
            key = (cache.step_index, id(cache), chunk_len, scale, device, self._signature)
            if cache.positions.bounded and not cache.positions.still:
                first = cache.positions.step_base.to(device) + chunk_len
            else:
                first = cache.seen_device.to(device).reshape(1) + chunk_len
            step = (id(cache), cache.step_index)
            self._step = (key, [(pack.stacked @ pack.turn(first, step, scale), pack.weighed(chunk_len))
                                for pack in packs])
        return self._step[1]

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
    """Standing questions placed at one ``start``: ``stacked``, their queries at every layer ``[L, H_kv, G * R, D]``
    (float32, R the rows of all of them, grouped by the KV head each query head reads); ``weights`` ``[G * R]``: each row's share
    (its question's weight over its length). A rotation by ``d`` positions is the product with one ``[D, D]``
    matrix (`turn`), the same at every layer of a step."""

    def __init__(self, members: list[tuple[object, float]], start: int, heads: int, device: torch.device):
        self.start = start
        frequencies = members[0][0].frequencies.to(device, torch.float32)
        self.frequencies, self.rotary = frequencies, 2 * frequencies.shape[0]
        queries = torch.cat([torch.cat(q.queries) for q, _ in members], 2)  # [L, Hq, R, D]: every layer's
        self.dim = queries.shape[-1]
        self.stacked = queries.to(device, torch.float32).reshape(queries.shape[0], heads, -1, self.dim)
        group = self.stacked.shape[2] // sum(q.length for q, _ in members)
        rows = torch.cat([torch.full((q.length,), weight / q.length) for q, weight in members])
        self.weights = rows.repeat(group).to(device)
        self._where, self._rest = _turn_layout(self.rotary, self.dim, device)
        self._turn: tuple | None = None
        self._weighed: tuple[int, torch.Tensor] | None = None

    def weighed(self, chunk_len: int) -> torch.Tensor:
        """``weights`` scaled to a chunk of ``chunk_len`` queries (kept for the next steps of that length)."""
        if self._weighed is None or self._weighed[0] != chunk_len:
            self._weighed = (chunk_len, self.weights * chunk_len)
        return self._weighed[1]

    def turn(self, first: torch.Tensor, step: tuple, scale: float) -> torch.Tensor:
        """``[D, D]``: RoPE's rotation from ``start`` to ``first`` (LongTensor ``[1]``; rotate-half layout, the dims
        past the rotary ones unchanged) times the attention's ``scale``, applied on the left of the keys
        (``queries @ turn @ keys^T`` is the placed queries' logits); computed once per step for every layer
        (``step``: the cache and its step index; one guide may steer two caches, a stream's and its successor's,
        whose steps are placed apart)."""
        if self._turn is None or self._turn[0] != step:
            angles = (first - self.start).float() * self.frequencies  # [R / 2]
            cos, sin = angles.cos() * scale, angles.sin() * scale
            # q' = q cos + rotate_half(q) sin, rotate_half(q) = [-q2, q1]: q'1 = q1 cos - q2 sin, q'2 = q2 cos + q1 sin;
            # row (source) half + i feeds column (target) i with -sin, row i feeds column half + i with sin
            values = torch.cat([cos, cos, -sin, sin, self._rest * scale])
            turn = torch.zeros(self.dim * self.dim, device=angles.device).index_put_((self._where,), values)
            self._turn = (step, turn.view(self.dim, self.dim))
        return self._turn[1]


_layouts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _turn_layout(rotary: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `_Pack.turn` puts cos, cos, -sin, sin and the scale, as flat indices of a ``[D, D]`` matrix, and ones for
    the dims past the rotary ones (kept per shape)."""
    key = (rotary, dim, device)
    if key not in _layouts:
        half = rotary // 2
        index, rest = torch.arange(half), torch.arange(rotary, dim)
        where = torch.cat([index * dim + index, (index + half) * dim + index + half, (index + half) * dim + index,
                           index * dim + index + half, rest * dim + rest])
        _layouts[key] = where.to(device), torch.ones(dim - rotary, device=device)
    return _layouts[key]


def steered(caches: Sequence, layer: int, keys: torch.Tensor, scores: torch.Tensor, chunk_len: int,
            scale: float) -> torch.Tensor:
    """``scores`` ``[S, H_kv, N]`` (row ``s``: stream ``caches[s]``'s candidates ``keys[s]``) plus each guided
    stream's question mass (:meth:`QuestionGuide.mass`); the same tensor when no stream is guided."""
    guided = [row for row, cache in enumerate(caches) if getattr(cache, "guide", None) is not None
              and cache.guide.active]
    if not guided:
        return scores
    if len(caches) == 1:
        return scores + caches[0].guide.mass(caches[0], layer, keys, chunk_len, scale)
    scores = scores.clone()
    for row in guided:
        scores[row:row + 1] += caches[row].guide.mass(caches[row], layer, keys[row:row + 1], chunk_len, scale)
    return scores
