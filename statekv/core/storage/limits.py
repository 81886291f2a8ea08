"""A hard cap on a stream's cache (``max_cache_bytes``) and what happens when a step would pass it.

What is counted: the detailed cache as stored (keys and values in the model's dtype, or int8/int4 codes with every
scale and zero point), each step's retrieval summaries, the segment index (its segments not wholly evicted), and on
the disk tier its journal and carried-state checkpoints (`StreamStats` says how much of each).

``cache_limit`` (`statekv.settings.engine.CACHE_LIMITS`), chosen up front:

``refuse`` (the default)
    The step is refused with a one-line `CacheLimitError` naming the cap before anything changes: nothing
    streamed is lost and the stream still answers (`VideoQA.encode` stops there, the error carrying what it
    encoded).
``evict-oldest``
    The oldest steps (frames) are evicted until the step fits.
``evict-least-attended``
    The steps whose tokens received the least attention from the stream's own scored steps (summed over
    layers and heads, as the carry policy computed it) are evicted first; ties go to the oldest.

Evicting a step marks it in ``TwoStateCache.evicted_steps`` (answers from the whole cache skip it, retrieval never
chooses it) and gives its detailed keys and values back (the disk tier punches them out of its files; host memory
returns their whole pages, `statekv.core.storage.host_pages`; evicted rows read as zeros), except the tokens a
layer still carries: those are kept until it no longer does, so the carried state stays the detailed cache's own
tokens, as saved and resumed streams require. A segment of the retrieval index every step of which is evicted
gives its index row back too, and retrieval no longer ranks it. Positions do not move: the remaining tokens keep
their RoPE and the stream's length counts every token streamed. Never evicted: the first ``protect_tokens`` tokens
(the prompt prefix and the sinks). The first eviction is stated in one log line.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Container, Iterator
from typing import Any

import torch

from ...errors import CacheLimitError, ConfigurationError
from ...settings.engine import CacheLimit
from ...settings.values import format_bytes
from .host_pages import ReleasedRuns
from .step_values import StepValues

log = logging.getLogger("statekv")


class CacheKeeper:
    """Holds one stream's cache under a `CacheLimit`: everything it keeps, counted.

    Args:
        cache: the stream's `TwoStateCache`. bytes_per_token: detailed bytes one token costs (all layers: keys and
        values or their codes, with the values' per-token scales). protect_tokens: leading tokens never evicted.
        name: how messages name the stream. bytes_per_step: what each step adds besides its tokens (all layers:
        its summaries, and quantized, its keys' scales). other_bytes: ``() -> (held, growth)``: the bytes held
        besides (the segment index, the disk tier's journal: `DiskTier.counted_bytes`) and what a step adds to them.
        step_other_bytes: what each step held counts in ``other_bytes`` (the disk tier's journal share), which its
        eviction gives back.
    """

    def __init__(self, limit: CacheLimit, cache, bytes_per_token: int, protect_tokens: int = 0,
                 name: str = "stream", bytes_per_step: int = 0, other_bytes=lambda: (0, 0), step_other_bytes: int = 0):
        self.limit, self.cache, self.bytes_per_token = limit, cache, bytes_per_token
        self.bytes_per_step, self.other_bytes, self.step_other_bytes = bytes_per_step, other_bytes, step_other_bytes
        self.protect_tokens, self.name = protect_tokens, name
        self.evicted_tokens = 0
        self.retained: dict[int, torch.Tensor] = {}  # per layer: evicted tokens it still carries (not given back)
        self.batch = 1
        self.announced = False
        self._held: dict[int, None] = {}  # evictable steps not evicted yet, oldest first
        self._registered = 0  # steps looked at for _held
        self._evicted_in: dict[int, int] = {}  # per segment of the retrieval index not given back: steps evicted
        self._scales_waiting: dict[int, set[int]] = {}  # per layer: evicted steps whose key scales are still held
        self.released_segments = 0  # segments every step of which was evicted: their index rows given back
        if limit.when_full == "evict-least-attended":
            cache.tally = AttentionTally()

    @property
    def held_bytes(self) -> int:
        """Bytes held now: every token streamed and not evicted, every step's summaries (and scales) not
        evicted, and the rest (`other_bytes`)."""
        steps = len(self.cache.chunk_lengths) - len(self.cache.evicted_steps)
        return ((self.cache.seen_tokens - self.evicted_tokens) * self.bytes_per_token
                + steps * self.bytes_per_step) * self.batch + self.other_bytes()[0]

    def make_room(self, chunk_len: int, batch: int = 1) -> list[int]:
        """The steps to evict so that a step of ``chunk_len`` tokens (of ``batch`` streams) fits, or a
        `CacheLimitError` refusing it."""
        self.batch = batch
        needed = (self.held_bytes + (chunk_len * self.bytes_per_token + self.bytes_per_step) * batch
                  + self.other_bytes()[1] - self.limit.max_bytes)
        if needed <= 0:
            return []
        cap = f"max_cache_bytes={format_bytes(self.limit.max_bytes)}"
        if not self.limit.evicts:
            raise CacheLimitError(f"{self.name}: the detailed cache is full ({cap}, holding "
                                  f"{format_bytes(self.held_bytes)}): a step of {chunk_len} more tokens was refused; "
                                  "everything streamed before it is kept and can be asked about (an evicting "
                                  "cache_limit keeps streaming)")
        chosen, freed = [], 0
        for step, length in self._candidates():
            if freed >= needed:
                break
            chosen.append(step)
            freed += (length * self.bytes_per_token + self.bytes_per_step) * self.batch + self.step_other_bytes
        if freed < needed:
            raise CacheLimitError(f"{self.name}: this step ({chunk_len} tokens) does not fit under {cap} even after "
                                  "evicting every frame but the protected prompt prefix and sinks; nothing was "
                                  "streamed")
        if not self.announced:
            self.announced = True
            rule = "oldest" if self.limit.when_full == "evict-oldest" else "least attended"
            log.warning("%s: the detailed cache reached %s; evicting the %s frames from now on", self.name, cap,
                        rule)
        return chosen

    def evict(self, steps: list[int]) -> None:
        """Never read ``steps`` again and give their detailed keys and values back, except the tokens a layer
        still carries (kept until it no longer does, so the carried state stays the detailed cache's own)."""
        cache = self.cache
        starts = self._step_starts()
        if cache.tally is not None:
            cache.tally.forget(steps)
        tokens = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in steps])
        step_runs = runs(torch.tensor(sorted(steps), dtype=torch.long))
        for layer in cache.layers:
            carried = _carried_tokens(layer)
            gone = torch.cat([tokens, self.retained.get(layer.index, tokens[:0])])
            held = torch.isin(gone, carried)
            self.retained[layer.index] = gone[held]
            layer.storage.release_tokens(runs(gone[~held].sort().values))
            layer.storage.release_steps(step_runs)
            self._release_scales(layer, steps, starts)
        for step in steps:
            cache.evicted_steps.add(step)
            self._held.pop(step, None)
            self.evicted_tokens += cache.chunk_lengths[step]
        self._release_segments(step_runs)

    def settle(self) -> None:
        """Give back the evicted tokens each layer no longer carries (an eviction gives back those it finds so;
        between evictions the carried state moves on), so the cache is as a loaded copy of it holds it."""
        starts = self._step_starts()
        for layer in self.cache.layers:
            retained = self.retained.get(layer.index)
            if retained is None or not retained.numel():
                continue
            held = torch.isin(retained, _carried_tokens(layer))
            self.retained[layer.index] = retained[held]
            layer.storage.release_tokens(runs(retained[~held].sort().values))
            self._release_scales(layer, [], starts)

    def _release_scales(self, layer, steps, starts: list[int]) -> None:
        """Give back the key scales of ``steps`` and of earlier evicted steps, once the layer carries none of their
        tokens (a quantized cache keeps one scale per step; a carried token is read back with it)."""
        if layer.storage.kv_cache_dtype is None:
            return
        waiting = self._scales_waiting.setdefault(layer.index, set())
        waiting.update(steps)
        owners = {bisect.bisect_right(starts, token) - 1 for token in self.retained[layer.index].tolist()}
        free = sorted(waiting - owners)
        if free:
            waiting.difference_update(free)
            layer.storage.release_step_scales(runs(torch.tensor(free, dtype=torch.long)))

    def _release_segments(self, step_runs: list[tuple[int, int]]) -> None:
        """Give back the retrieval index's rows of the segments the newly evicted steps (``[start, end)`` runs,
        ascending) leave wholly evicted: counted a run at a time, so a resumed stream's history is not walked."""
        per_segment = self.cache.layers[0].storage.segment_steps
        emptied = ReleasedRuns()
        for start, end in step_runs:
            first, last = -(-start // per_segment), end // per_segment  # the segments wholly inside the run
            if first < last:
                emptied.add(first, last)
            edges = [(start, end)] if first > last else [(start, min(end, first * per_segment)),
                                                          (max(start, last * per_segment), end)]
            for low, high in edges:
                if low >= high:
                    continue
                segment = low // per_segment
                count = self._evicted_in.pop(segment, 0) + high - low
                if count == per_segment:
                    emptied.add(segment, segment + 1)
                else:
                    self._evicted_in[segment] = count
        if emptied.rows:
            segments = list(zip(emptied.starts, emptied.ends))
            for layer in self.cache.layers:
                layer.storage.release_segments(segments)
            self.released_segments += emptied.rows

    def adopt(self) -> None:
        """A state was loaded or resumed: its evicted tokens some layer still carries are the retained ones, and
        the rest of what it evicted is given back again (a load wrote it in whole)."""
        cache = self.cache
        self.evicted_tokens = cache.evicted_tokens()
        if self.evicted_tokens and not self.announced:  # the cap was reached before it was saved: said once, here,
            self.announced = True  # not again as if it were new at its next eviction
            rule = "oldest" if self.limit.when_full == "evict-oldest" else "least attended"
            log.info("%s: resumed at its detailed cache's cap max_cache_bytes=%s (%d steps evicted before); evicting "
                     "the %s frames goes on", self.name, format_bytes(self.limit.max_bytes),
                     len(cache.evicted_steps), rule)
        lengths, starts = cache.chunk_lengths, cache.starts  # as runs: a weeks-long stream is not walked
        step_runs = [(first, end) for first, end in cache.evicted_steps.runs()]
        self._held = {step: None for first, end in cache.evicted_steps.held_runs(len(lengths))
                      for step in range(first, end) if starts[step] >= self.protect_tokens}
        self._registered = len(lengths)
        token_runs = [(starts[first], starts[end]) for first, end in step_runs]
        self._evicted_in, self.released_segments, self._scales_waiting = {}, 0, {}
        self.retained = {}
        for layer in cache.layers:
            if layer.is_initialized:
                carried = _carried_tokens(layer)
                retained = carried[_inside(carried, token_runs)]
                self.retained[layer.index] = retained
                if step_runs:
                    layer.storage.release_tokens(_without(token_runs, retained.tolist()))
                    layer.storage.release_steps(step_runs)
                    if layer.storage.kv_cache_dtype is not None:  # scales of the steps no retained token is of
                        owners = sorted({bisect.bisect_right(starts, token) - 1 for token in retained.tolist()})
                        self._scales_waiting[layer.index] = set(owners)
                        layer.storage.release_step_scales(_without(step_runs, owners))
        if step_runs and cache.layers[0].is_initialized:
            self._release_segments(step_runs)

    def _step_starts(self) -> StepValues:
        """Each committed step's first token, then the end of the last: the cache's own (`TwoStateCache.starts`)."""
        return self.cache.starts

    def _candidates(self) -> Iterator[tuple[int, int]]:
        """``(step, length)`` of the evictable steps (not evicted, after the protected tokens), in the order to
        evict them."""
        cache, starts = self.cache, self._step_starts()
        for step in range(self._registered, len(cache.chunk_lengths)):
            if step not in cache.evicted_steps and starts[step] >= self.protect_tokens:
                self._held[step] = None
        self._registered = len(cache.chunk_lengths)
        steps = list(self._held)
        if self.limit.when_full == "evict-least-attended":
            totals = dict(zip(cache.tally.steps.tolist(), cache.tally.totals.tolist()))
            steps.sort(key=lambda s: (totals.get(s, 0.0), s))
        return ((s, cache.chunk_lengths[s]) for s in steps)


class AttentionTally:
    """Per step the stream may still evict, the attention mass its tokens received from the stream's own scored
    steps, summed over layers and heads (``totals`` float64 ``[H]`` on the host, of the ascending ``steps`` ``[H]``;
    a step absent has none): what ``evict-least-attended`` ranks by. Told every scored layer of every step
    (`TwoStateCache.attend`); a host read, so such streams are neither captured nor batched. A step's mass is staged
    until it commits (`commit`), and the last commit can be taken back (`undo`: a step the disk tier could not
    journal), so the totals are always those of the steps the stream holds. An evicted step's entry goes
    (`forget`) and mass it still receives (a token of it carried) is never tallied: what the tally holds follows the
    steps held, not the steps ever streamed."""

    def __init__(self):
        self.steps = torch.zeros(0, dtype=torch.long)
        self.totals = torch.zeros(0, dtype=torch.float64)
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # the running step's (steps, mass)
        self._staged_at = -1  # the step they are of
        self._undo: tuple[torch.Tensor, torch.Tensor] | None = None  # the last commit's steps and their totals before

    @property
    def nbytes(self) -> int:
        """Host bytes the totals take (with their steps)."""
        return self.steps.nbytes + self.totals.nbytes

    def add(self, cache, positions: torch.Tensor, scores: torch.Tensor) -> None:
        """Stage ``scores`` ``[B, H_kv, K + T]`` of the tokens at ``positions`` for their steps' totals."""
        # the step of each token (those of the step being run lie past the last start)
        steps = (cache.starts.searched(positions.reshape(-1).cpu()) - 1).clamp(min=0)
        if self._staged_at != len(cache.chunk_lengths):  # what a step that never committed staged goes
            self._staged, self._staged_at = [], len(cache.chunk_lengths)
        self._staged.append((steps, scores.reshape(-1).to("cpu", torch.float64)))

    def commit(self, steps: int, evicted: Container[int]) -> None:
        """The step that made the cache ``steps`` steps long committed: its staged mass joins the totals (but what
        went to the ``evicted`` steps)."""
        if self._staged_at != steps - 1 or not self._staged:
            self._staged, self._undo = [], None
            return
        touched = torch.cat([index for index, _ in self._staged]).unique()
        if evicted:
            touched = touched[torch.tensor([step not in evicted for step in touched.tolist()], dtype=torch.bool)]
        new = touched[~torch.isin(touched, self.steps)]
        if new.numel():
            self.steps, order = torch.cat([self.steps, new]).sort()
            self.totals = torch.cat([self.totals, torch.zeros(new.numel(), dtype=torch.float64)])[order]
        self._undo = (touched, self.totals[self._rows(touched)[0]].clone())
        for index, mass in self._staged:  # added in the order staged: each total summed as before, bit for bit
            rows, held = self._rows(index)
            self.totals.index_add_(0, rows[held], mass[held])
        self._staged = []

    def undo(self) -> None:
        """Take the last commit back (its step was not kept): the totals are again what they were before it."""
        if self._undo is not None:
            touched, before = self._undo
            rows, held = self._rows(touched)
            self.totals[rows[held]] = before[held]
            self._undo = None

    def export(self, evicted: Container[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The steps ``[L]`` (int64, ascending) with a total, but the ``evicted`` ones (never ranked again), and
        their totals ``[L]`` (float64): what a saved or checkpointed stream needs to rank as it would have."""
        had = self.totals != 0
        if evicted:
            had &= torch.tensor([step not in evicted for step in self.steps.tolist()], dtype=torch.bool)
        return self.steps[had], self.totals[had]

    def forget(self, steps: list[int]) -> None:
        """``steps`` were evicted: never ranked again, their totals go (so that `export` reads only held ones)."""
        kept = ~torch.isin(self.steps, torch.tensor(steps, dtype=torch.long))
        self.steps, self.totals = self.steps[kept], self.totals[kept]

    def restore(self, steps: torch.Tensor, totals: torch.Tensor, count: int) -> None:
        """Install what `export` gave, for a state of ``count`` steps (the others' totals zero)."""
        self.steps, self.totals = steps.to(torch.long).clone(), totals.to(torch.float64).clone()
        self._staged, self._staged_at, self._undo = [], -1, None

    def _rows(self, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``steps`` ``[N]`` are in ``steps`` and ``totals`` ``[N]``, and whether each has a total there."""
        if not self.steps.numel():
            return torch.zeros_like(steps), torch.zeros_like(steps, dtype=torch.bool)
        rows = torch.searchsorted(self.steps, steps).clamp(max=self.steps.numel() - 1)
        return rows, self.steps[rows] == steps


def released_segments(cache, keeper: CacheKeeper | None) -> int:
    """Segments of the retrieval index given back (every step evicted): the ``keeper``'s count, or for a stream
    holding evictions without a cap (one loaded so), counted from them."""
    if keeper is not None:
        return keeper.released_segments
    per_segment = cache.layers[0].storage.segment_steps
    return sum(max(0, end // per_segment + start // -per_segment) for start, end in cache.evicted_steps.runs())


def _carried_tokens(layer) -> torch.Tensor:
    """The token positions ``[K']`` (ascending, CPU) the layer carries into the next step, any head."""
    return layer.positions().reshape(-1).cpu().unique()


def check_limit(limit: CacheLimit | None, offloaded: bool, policy: Any) -> None:
    """A one-line `ConfigurationError` for a limit a stream cannot keep: evicting needs the detailed cache off the
    model's device (one contiguous buffer there cannot give part of itself back) and a carry rule (``policy``, a
    `CarryPolicy`) that gives tokens back (full attention carries them all), and evicting the least attended needs
    the attention scores."""
    if limit is None or not limit.evicts:
        return
    if not offloaded:
        raise ConfigurationError(f"cache_limit={limit.when_full} needs the detailed cache offloaded (offload=True "
                                 "or offload='disk'); with the model it can only refuse")
    if policy.carries_everything:
        raise ConfigurationError(f"cache_limit={limit.when_full} cannot bound {policy}: it carries every token, "
                                 "which eviction never gives back; use cache_limit=refuse, or a method with a "
                                 "budget (statekv, recency)")
    if limit.when_full == "evict-least-attended" and not policy.scores_needed(1 << 30):
        raise ConfigurationError(f"cache_limit=evict-least-attended needs attention scores, which {policy} never "
                                 "computes; choose evict-oldest or a scoring method (statekv)")


def _inside(points: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """``[N]`` bool: which of ``points`` ``[N]`` lie in ``spans`` (ascending, disjoint ``[start, end)`` runs)."""
    if not spans:
        return torch.zeros_like(points, dtype=torch.bool)
    starts, ends = (torch.tensor(column, dtype=torch.long) for column in zip(*spans))
    at = torch.searchsorted(starts, points, right=True) - 1
    return (at >= 0) & (points < ends[at.clamp(min=0)])


def _without(spans: list[tuple[int, int]], points: list[int]) -> list[tuple[int, int]]:
    """``spans`` (ascending, disjoint ``[start, end)`` runs) less the ascending ``points`` among them."""
    kept, at = [], 0
    for start, end in spans:
        while at < len(points) and points[at] < start:
            at += 1
        while at < len(points) and points[at] < end:
            if points[at] > start:
                kept.append((start, points[at]))
            start, at = points[at] + 1, at + 1
        if start < end:
            kept.append((start, end))
    return kept


def runs(tokens: torch.Tensor) -> list[tuple[int, int]]:
    """Ascending token positions ``[N]`` as ``[start, end)`` runs of consecutive ones."""
    if not tokens.numel():
        return []
    breaks = (torch.diff(tokens) != 1).nonzero().squeeze(1) + 1
    edges = [0, *breaks.tolist(), tokens.numel()]
    return [(int(tokens[a]), int(tokens[b - 1]) + 1) for a, b in zip(edges, edges[1:])]
