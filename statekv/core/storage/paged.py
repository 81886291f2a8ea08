"""The detailed cache and step summaries of many streams in pages of tensors they share (one set per layer).

A :class:`PagePool` holds, per layer, one tensor per field (keys and values for tokens; means and sampled keys
for steps), ``[H_kv, pages * page, W]``, cut into pages of ``page`` slots. Each stream holds a row of the pool: the
pages it owns, in order, as a host list and as a row of the pool's device page table, so a slot's place is
found on the device (``table[row, slot // page] * page + slot % page``) and the chunks of several streams are
written with one indexed copy per field. Page 0 is scratch: the table's unused entries point at it, and the
padding rows of a pooled batch (`statekv.core.step.pooled`) write there.

:class:`PagedBuffer` is one stream's view of one layer's fields with the API of
:class:`~statekv.core.storage.buffers.TokenBuffer` (``length``, ``reserve``, ``write``, ``write_at``, ``view``,
``load``, and ``gather``), so a :class:`PagedStorage` is a
:class:`~statekv.core.storage.layer_storage.LayerStorage` whose buffers are paged: every read (``read_range``,
``read_tokens``, ``summaries``) and every write of a stream's own step goes through it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ...errors import InputError
from .buffers import TokenBuffer
from .host_pages import with_released
from .layer_storage import LayerStorage

PAGE_SLOTS = 64  # slots (tokens, or steps) per page


class PagePool:
    """Pages of ``page`` slots of ``fields`` (name -> width W) for ``layers`` layers of ``heads`` KV heads, shared by
    rows (streams, see :class:`PageRow`).

    ``data[name][layer]`` ``[heads, pages * page, W]`` in ``dtype`` on ``device``; ``table`` LongTensor
    ``[rows, width]`` on ``device``: row ``r``'s ``i``-th page (0 past its pages). ``on_change`` is called whenever
    a tensor moved to new memory (pages or table grown), which invalidates recorded steps.
    """

    def __init__(self, fields: dict[str, int], layers: int, heads: int, dtype: torch.dtype, device: torch.device,
                 on_change: Callable[[], None], page: int = PAGE_SLOTS, pages: int = 8, rows: int = 8,
                 width: int = 4):
        self.fields, self.layers, self.heads, self.dtype, self.device = dict(fields), layers, heads, dtype, device
        self.page, self.on_change = page, on_change
        self.data = {name: [self._zeros(size, pages) for _ in range(layers)] for name, size in self.fields.items()}
        self.table = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.free = list(range(pages - 1, 0, -1))  # page 0 is scratch

    def _zeros(self, width: int, pages: int) -> torch.Tensor:
        return torch.zeros(self.heads, pages * self.page, width, dtype=self.dtype, device=self.device)

    @property
    def pages(self) -> int:
        return next(iter(self.data.values()))[0].shape[1] // self.page

    def open(self, row: int) -> "PageRow":
        """Row ``row`` (of the pool's owner) starts holding pages, none yet."""
        if row >= self.table.shape[0]:
            self._resize(rows=max(row + 1, 2 * self.table.shape[0]))
        self.table[row].zero_()
        return PageRow(self, row)

    def take(self, count: int) -> list[int]:
        """``count`` free pages (the pool grows if it must)."""
        if len(self.free) < count:
            self._resize(pages=max(2 * self.pages, self.pages + count - len(self.free)))
        return [self.free.pop() for _ in range(count)]

    def widen(self, width: int) -> None:
        """Room for ``width`` pages per row in the table."""
        if width > self.table.shape[1]:
            self._resize(width=max(2 * self.table.shape[1], width))

    def _resize(self, pages: int | None = None, rows: int | None = None, width: int | None = None) -> None:
        if pages is not None:
            old = self.pages
            for name, size in self.fields.items():
                for layer, tensor in enumerate(self.data[name]):
                    grown = self._zeros(size, pages)
                    grown[:, : old * self.page] = tensor
                    self.data[name][layer] = grown
            self.free = list(range(pages - 1, old - 1, -1)) + self.free
        if rows is not None or width is not None:
            table = torch.zeros(rows or self.table.shape[0], width or self.table.shape[1], dtype=torch.long,
                                device=self.device)
            table[: self.table.shape[0], : self.table.shape[1]] = self.table
            self.table = table
        self.on_change()

    def places(self, tables: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Where ``slots`` (LongTensor ``[..., N]`` on the device) are in the data, given the rows' ``tables``
        (``[..., width]``, rows of `table`): device ops only, no host read."""
        return tables.gather(-1, torch.div(slots, self.page, rounding_mode="floor")) * self.page + slots % self.page


class PageRow:
    """The pages one stream holds in a :class:`PagePool` (its row ``row`` of the table), until :meth:`close`."""

    def __init__(self, pool: PagePool, row: int):
        self.pool, self.row = pool, row
        self.pages: list[int] | None = []

    def close(self) -> None:
        """Give the pages back (host bookkeeping only: safe at any time, a step recorded or not)."""
        if self.pages is not None:
            self.pool.free.extend(reversed(self.pages))
            self.pages = None

    def _held(self) -> list[int]:
        if self.pages is None:
            raise InputError("this stream's pooled cache was given back (the stream was closed)")
        return self.pages

    @property
    def capacity(self) -> int:
        """Slots held now."""
        return 0 if self.pages is None else len(self.pages) * self.pool.page

    def ensure(self, needed: int, expected: int = 0) -> bool:
        """Room for ``needed`` slots (for ``expected`` if it grows anyway, at least doubling); True if it took pages."""
        pages, pool = self._held(), self.pool
        if needed <= len(pages) * pool.page:
            return False
        count = math.ceil(max(needed, expected, 2 * len(pages) * pool.page) / pool.page) - len(pages)
        new = pool.take(count)
        pool.widen(len(pages) + count)
        pool.table[self.row, len(pages):len(pages) + count] = torch.tensor(new, dtype=torch.long).to(pool.device)
        pages.extend(new)
        return True

    def places(self, slots: torch.Tensor) -> torch.Tensor:
        """Where ``slots`` (LongTensor ``[N]`` on the device) are (device ops only)."""
        self._held()
        return self.pool.places(self.pool.table[self.row], slots)

    def host_places(self, start: int, end: int) -> torch.Tensor:
        """Where slots ``[start, end)`` are, ``[end - start]`` on the device (computed on the host)."""
        slots = torch.arange(start, end)
        pages = torch.tensor(self._held(), dtype=torch.long)
        return (pages[slots // self.pool.page] * self.pool.page + slots % self.pool.page).to(self.pool.device)


class PagedBuffer:
    """One stream's slots (``pages``, a :class:`PageRow`) of ``fields`` at layer ``layer``, with TokenBuffer's API:
    parts ``[1, H_kv, N, W]`` in and out (one stream: batch 1). Reads are copies, never views of the pool."""

    def __init__(self, pages: PageRow, fields: tuple[str, ...], layer: int, capacity_hint: int | None = None):
        self.rows, self.fields, self.layer = pages, fields, layer
        self.parts, self.capacity_hint = len(fields), capacity_hint
        self.device, self.on_replace = pages.pool.device, None
        self.length = 0

    tensors = None  # no tensors of its own: pages of the pool
    keys = values = None

    @property
    def capacity(self) -> int:
        return self.rows.capacity

    @property
    def nbytes(self) -> int:
        pool = self.rows.pool
        return self.capacity * pool.heads * sum(pool.fields[name] for name in self.fields) * pool.dtype.itemsize

    def _data(self) -> list[torch.Tensor]:
        return [self.rows.pool.data[name][self.layer] for name in self.fields]

    def reserve(self, like: torch.Tensor, needed: int, expected: int = 0) -> bool:
        return self.rows.ensure(needed, max(expected, self.capacity_hint or 0))

    def write(self, start: int, *parts: torch.Tensor) -> None:
        """Copy ``[1, H_kv, T, W]`` tensors to slots ``[start, start + T)``."""
        end = start + parts[0].shape[2]
        self.reserve(parts[0], end)
        self._copy(self.rows.host_places(start, end), parts)

    def write_at(self, index: torch.Tensor, *parts: torch.Tensor) -> None:
        """Copy ``[1, H_kv, T, W]`` tensors to the slots ``index`` (LongTensor ``[T]`` on the device)."""
        self._copy(self.rows.places(index), parts)

    def _copy(self, places: torch.Tensor, parts) -> None:
        for tensor, part in zip(self._data(), parts):
            tensor.index_copy_(1, places, part[0].to(tensor.device, tensor.dtype))

    def view(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Slots ``[start, end)``, ``[1, H_kv, end - start, W]`` each (copies)."""
        places = self.rows.host_places(start, end)
        return tuple(tensor.index_select(1, places)[None] for tensor in self._data())

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Slots ``index`` (LongTensor ``[N]``, any device), ``[1, H_kv, N, W]`` each."""
        places = self.rows.places(index.to(self.device))
        return tuple(tensor.index_select(1, places)[None] for tensor in self._data())

    def load(self, *parts: torch.Tensor, released: Sequence[tuple[int, int]] = ()) -> None:
        """Replace the contents with ``length`` committed slots: tensors ``[1, H_kv, length, W]`` (with ``released``
        runs, see `TokenBuffer.load`, the other slots: the released ones are written as zeros)."""
        parts = with_released(parts, released)
        self.length = 0
        if parts[0].shape[2]:
            self.write(0, *parts)
            self.length = parts[0].shape[2]

    def synchronize(self) -> None:
        pass


class PagedStorage(LayerStorage):
    """A layer's storage in the model's dtype on its device, its detailed cache and step summaries in the pages of
    ``tokens`` and ``steps`` (:class:`PageRow` s of pools with fields ``keys``/``values`` and ``means``/``samples``).
    A carried window cannot be a view of it (a stream whose storage is paged carries slots or a ring), and a
    question reads its whole cache as a copy."""

    holds_window = False

    def __init__(self, tokens: PageRow, steps: PageRow, layer: int, capacity_hint: int | None,
                 on_replace: Callable[[], None]):
        def make_buffer(name: str, parts: int, hint: int | None):
            if name == "detailed":
                return PagedBuffer(tokens, ("keys", "values"), layer, hint)
            if name in ("step_means", "step_samples"):
                return PagedBuffer(steps, ("means" if name == "step_means" else "samples",), layer)
            return TokenBuffer(parts, hint, tokens.pool.device, on_replace=on_replace)
        self.rows = (tokens, steps)
        super().__init__(capacity_hint, tokens.pool.device, on_replace, make_buffer)

    def answer_in_place(self, like: torch.Tensor, room: int) -> None:
        return None

    # a steady step's host part checks capacities only (its pages are the row's, shared by every layer)
    def prepare(self, chunk_len: int) -> None:
        if (self.rows[1].capacity <= self.block_keys.length
                or self.segment_index.capacity <= self.segment_index.length):
            super().prepare(chunk_len)

    def reserve_chunk(self, slots, chunk_len: int) -> None:
        if self.rows[0].capacity < self.detailed.length + chunk_len:
            super().reserve_chunk(slots, chunk_len)
