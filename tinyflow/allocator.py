"""A caching allocator for eager Tensors, after PyTorch's CUDA caching allocator.

Define-by-run code cannot plan its memory ahead the way the static planner
(memory.py) does: each op asks for its result's bytes when it runs. Asking the
system for every one would be slow (on a GPU, cudaMalloc synchronizes the device),
so PyTorch keeps the memory it got and hands it out again: requests are rounded up,
carved out of larger segments (small requests share 2 MiB segments), a free block
of the right pool is found by best fit, the rest of it split off, and freed blocks
merge with free neighbours so that large requests can use the space later. Nothing
goes back to the system until `empty_cache()`.

One thing is added in front, from glibc's malloc (its tcache and fast bins): a freed
small block first waits whole in a bin of its size, and a request of exactly that
size takes it back without a search, a split or a merge. An eager loop frees and
asks for the same sizes op after op; PyTorch's path in C++ costs it little, but here
every other op of benchmarks/eager_bench.py's chain split the segment's free rest and
the next merged it back, 0.69 us of Python per op, more than the op's numpy call
(0.26 us with bins). When no bin and no free block fits, the bins are merged back
first (glibc's consolidation) before a new segment is reserved. Best fit does not
see a block waiting in a bin, though, so it may split other free space than
PyTorch's scheme would, and rarely that costs a segment that scheme would not have
reserved (3 of 3,000 random malloc/free scripts in review); `fast_bins=False` is
PyTorch's scheme alone.

This module is that allocator, written to teach: numpy arrays are views of its
segments, every alloc and free is recorded with its reason (which free block it
took, or a new segment), and `validate` proves that no two live blocks share a byte,
as `memory.validate_plan` does for the static plan. Eager mode (eager.py) allocates
every Tensor here; the debugger's memory view and lesson 9 show it beside the plan.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyflow.backend import host_bytes
from tinyflow.graph import TinyFlowError


# PyTorch's constants (c10/cuda/CUDACachingAllocator.cpp), kept so the numbers in the
# lesson match what PyTorch users see: sizes are rounded up to 512 bytes (which also
# keeps every block aligned for any dtype); requests up to 1 MiB share 2 MiB segments
# (the "small pool"); larger ones get segments of 20 MiB while under 10 MiB, else
# their own size rounded up to 2 MiB (the "large pool").
ROUND = 512
SMALL_REQUEST = 1 << 20
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
# A free remainder is split off as its own block only when it is worth keeping:
# any remainder in the small pool, more than 1 MiB in the large pool.
SPLIT_REMAINDER_LARGE = 1 << 20
POISON_BYTE = 0xFF  # freed blocks are filled with it when poisoning (NaN in floats)


class Block:
    """A run of bytes inside a segment, free or handed out to one Tensor.

    `prev` and `next` are its neighbours in the same segment (for merging);
    `requested` is what the Tensor asked for (the size is rounded up); `pool` is the
    free list it goes back to. A block's segment and offset never change (a split
    keeps the front part, a merge keeps the lower block), so `view` can keep the
    ndarray it last handed out for `view_key` = (shape, dtype) and hand it out again.
    A plain class with slots, not a dataclass: one is made per split, on every
    eager op's path.
    """

    __slots__ = ("segment", "offset", "size", "allocated", "requested", "prev", "next", "id",
                 "pool", "view", "view_key", "binned")

    def __init__(self, segment: int, offset: int, size: int, pool: list, id: int = 0) -> None:
        # One name a line: a tuple assignment of five builds a tuple, on the op path.
        self.segment = segment
        self.offset = offset
        self.size = size
        self.pool = pool
        self.id = id
        self.allocated = False
        self.binned = False   # free, but waiting whole in a fast bin (not in `pool`)
        self.requested = 0
        self.prev: Block | None = None
        self.next: Block | None = None
        self.view: np.ndarray | None = None
        self.view_key: tuple | None = None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"<Block #{self.id} {state} {self.size} B at {self.segment}:{self.offset}>"


@dataclass
class Segment:
    id: int
    buffer: np.ndarray               # uint8, the memory that blocks are views of
    small: bool
    head: Block | None = None        # the block at offset 0 (merging keeps it first)
    address: int = 0                 # of buffer's first byte (asking numpy costs ~1 us)


class BlockMemory:
    """A block's bytes as numpy sees them (`__array_interface__`), the base of the
    arrays `view_as` hands out. Their base is this object, not the segment's array,
    so numpy makes every slice, reshape or transpose of such an array a view *of
    that array*: its reference count then says whether anything over the block is
    still held (eager.Tensor.__del__ asks before it frees the block). Over the
    segment's array itself, numpy would point those views at the segment, and
    `y = (a + b).data[1:]` would silently change when a later op reused the block.
    Keeps the segment's buffer alive while any of them lives."""

    __slots__ = ("__array_interface__", "buffer")

    def __init__(self, segment: Segment, offset: int, shape: tuple, dtype: np.dtype) -> None:
        self.buffer = segment.buffer
        self.__array_interface__ = {"data": (segment.address + offset, False),
                                    "shape": shape, "typestr": dtype.str, "version": 3}


@dataclass(slots=True)
class CachingAllocator:
    """Hands out numpy arrays that are views of cached segments.

    `malloc(nbytes)` rounds the size up, takes the best-fitting free block of the
    right pool (the smallest that is large enough), splits off the remainder, and only
    when no free block fits reserves a new segment. `free(block)` returns the block
    and merges it with free neighbours, so large requests can reuse the space later.
    `events` records every step (for the debugger's memory view and the lesson);
    `reserved` is what segments hold, `allocated` what live blocks hold.

    With `fast_bins` (the default), a freed small-pool block waits whole in
    `bins[size]` instead, and `malloc` of that exact size pops it first; the bins are
    merged back (`_consolidate`) before a new segment is reserved and in
    `empty_cache`. `fast_bins=False` is PyTorch's scheme alone.

    Each pool is a list of its free blocks as (size, segment, offset, block), kept
    sorted: best fit is one binary search, and ties go to the lowest address, as
    PyTorch's set of blocks orders them. Both calls run once per eager op, so they
    are written as straight-line code with the rare cases (a new segment, a split,
    a merge, recording) behind one test each.
    """

    poison: bool = False
    record: bool = True
    fast_bins: bool = True
    segments: list[Segment] = field(default_factory=list)
    free_small: list[tuple] = field(default_factory=list)   # sorted (size, seg, off, block)
    free_large: list[tuple] = field(default_factory=list)
    bins: dict[int, list[Block]] = field(default_factory=dict)   # size -> blocks waiting
    events: list[dict] = field(default_factory=list)
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    _next_block: int = 0
    # Blocks whose last array died somewhere the allocator may be busy (a garbage
    # collection inside malloc runs weakref callbacks, or another thread is using
    # it): freed at the next malloc.
    deferred: list[Block] = field(default_factory=list)
    # The thread that mallocs from it (eager.py says which): only that thread may
    # change it, so another thread's frees go into `deferred` (free_later).
    thread: int | None = None
    # True while malloc or free is changing the pools. CPython may run a garbage
    # collection at any allocation of a Python object (the Block a split makes, a
    # pool entry), and a Tensor collected there frees its block right then, in
    # the middle of this allocator's work: that free waits in `deferred` instead.
    busy: bool = False

    # -- the two calls -----------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        """A block of at least `nbytes` bytes (a multiple of ROUND), not shared."""
        if self.deferred:
            self._free_deferred()
        size = -(-nbytes // ROUND) * ROUND if nbytes > ROUND else ROUND
        waiting = self.bins.get(size)
        if waiting:   # a freed block of exactly this size waits whole in its bin
            block = waiting.pop()
            block.binned = False
            found_size, how = size, "bin"
        else:   # (the pools change: a free from a collection in here waits, see `busy`)
            self.busy = True
            try:
                block, found_size, how = self._best_fit(size)
            finally:
                self.busy = False
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.record:  # the reason is text: made only when someone keeps it
            self._event("alloc", block, self._alloc_reason(block, found_size, how))
        return block

    def free_later(self, block: Block) -> None:
        """Free `block` at the next malloc: safe to call at any moment, even from a
        callback run in the middle of this allocator's own work (a list append)."""
        self.deferred.append(block)

    def _free_deferred(self) -> None:
        while self.deferred:
            self.free(self.deferred.pop())

    def free(self, block: Block) -> None:
        """Give `block` back: a small block waits whole in the fast bin of its size;
        any other merges with its free neighbours at once."""
        if self.busy:   # called from inside malloc or free: see `busy`
            self.deferred.append(block)
            return
        if not block.allocated:
            raise TinyFlowError(f"block #{block.id} is freed twice")
        block.allocated = False
        self.allocated -= block.size
        if self.poison:
            self.view(block, block.size, np.uint8).fill(POISON_BYTE)
        if self.fast_bins and block.pool is self.free_small:
            # (binned before a Python object is made, so a collection there finds no
            # block half freed: no `busy` on the common path)
            block.binned = True
            waiting = self.bins.get(block.size)
            if waiting is not None:
                waiting.append(block)
            else:   # (setdefault keeps a bin that a free in a collection made meanwhile)
                self.bins.setdefault(block.size, []).append(block)
            if self.record:
                self._event("free", block, "its Tensor was released")
            return
        self.busy = True
        try:
            if self.record:   # (before the merge, which may grow the block)
                self._event("free", block, "its Tensor was released")
            self._release(block)
        finally:
            self.busy = False

    def array(self, shape: tuple, dtype: Any) -> tuple[np.ndarray, Block]:
        """An uninitialized array of `shape` and `dtype` in a fresh block."""
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        block = self.malloc(math.prod(shape) * dtype.itemsize)
        return self.view_as(block, (shape, dtype)), block

    def view_as(self, block: Block, layout: tuple) -> np.ndarray:
        """`block`'s bytes as an array of `layout` = (shape, dtype) (they must fit).

        Making an ndarray over a buffer costs about 1 us, more than a one-element
        kernel, and an eager loop asks for the same (shape, dtype) in the same block
        step after step; so the block keeps the last view it gave, and the layout
        tuple it gave it for (`apply` compares that tuple by identity first)."""
        if block.view_key != layout:
            shape, dtype = layout
            segment = self.segments[block.segment]
            block.view = np.asarray(BlockMemory(segment, block.offset, shape, dtype))
        block.view_key = layout
        return block.view

    def view(self, block: Block, nbytes: int, dtype: Any) -> np.ndarray:
        buffer = self.segments[block.segment].buffer
        return buffer[block.offset:block.offset + nbytes].view(dtype)

    def empty_cache(self) -> None:
        """Release segments that hold no live block (torch.cuda.empty_cache)."""
        self._free_deferred()
        self.busy = True   # (see `busy`)
        try:
            self._consolidate()
            for pool in (self.free_small, self.free_large):
                for entry in list(pool):
                    block = entry[3]
                    seg = self.segments[block.segment]
                    if block.prev is None and block.next is None and seg.buffer.size:
                        pool.remove(entry)
                        self.reserved -= seg.buffer.size
                        self._event("segment_free", block, "empty_cache: the segment was unused")
                        seg.buffer, seg.head = np.empty(0, np.uint8), None
                        block.view = block.view_key = None
        finally:
            self.busy = False

    # -- checks and figures ------------------------------------------------------
    def live_blocks(self) -> list[Block]:
        blocks = []
        for seg in self.segments:
            block = self._first_block(seg.id)
            while block is not None:
                if block.allocated:
                    blocks.append(block)
                block = block.next
        return blocks

    def validate(self) -> None:
        """Prove the bookkeeping: blocks tile each segment (linked both ways), no two
        live blocks share a byte, every free block is in exactly one place (its
        pool, sorted and up to date, or the fast bin of its size), free neighbours
        outside the bins are merged, and the counters equal what the blocks say."""
        self._check_pools()
        allocated, seen = 0, set()
        waiting = self._listed([(size, b) for size, blocks in self.bins.items() for b in blocks],
                               "bin")
        pooled = self._listed([(entry[0], entry[3]) for entry in self.free_small +
                               self.free_large], "pool")
        for seg in self.segments:
            block, end, previous = self._first_block(seg.id), 0, None
            while block is not None:
                if block.offset != end:
                    raise TinyFlowError(f"segment {seg.id}: block #{block.id} starts at "
                                        f"{block.offset}, the previous one ends at {end}")
                if block.segment != seg.id or block.prev is not previous:
                    raise TinyFlowError(f"segment {seg.id}: block #{block.id} names segment "
                                        f"{block.segment} or has a broken back link")
                previous = block
                self._check_free_block(block, waiting, pooled)
                seen.add(id(block))
                end = block.offset + block.size
                allocated += block.size if block.allocated else 0
                block = block.next
            if seg.buffer.size and end != seg.buffer.size:
                raise TinyFlowError(f"segment {seg.id}: blocks cover {end} of "
                                    f"{seg.buffer.size} bytes")
        if (waiting | pooled) - seen:
            raise TinyFlowError("a bin or a pool lists a block that is in no segment")
        if allocated != self.allocated:
            raise TinyFlowError(f"allocated counter {self.allocated} != {allocated} in blocks")
        reserved = sum(seg.buffer.size for seg in self.segments)
        if reserved != self.reserved:
            raise TinyFlowError(f"reserved counter {self.reserved} != {reserved} in segments")

    def _check_pools(self) -> None:
        """Each pool sorted, each entry (size, segment, offset, block) the block's
        own and in the block's own pool (best fit and merging rely on both)."""
        for pool in (self.free_small, self.free_large):
            if any(a[:3] > b[:3] for a, b in zip(pool, pool[1:])):
                raise TinyFlowError("a pool of free blocks is out of order")
            for size, segment, offset, block in pool:
                if (size, segment, offset) != (block.size, block.segment, block.offset) \
                        or block.pool is not pool:
                    raise TinyFlowError(f"block #{block.id}'s pool entry is stale: "
                                        f"{(size, segment, offset)}")

    @staticmethod
    def _listed(entries: list[tuple[int, Block]], where: str) -> set[int]:
        """The ids of the blocks a bin or pool lists as (size, block); each must be
        listed once, under its own size."""
        ids = set()
        for size, block in entries:
            if id(block) in ids:
                raise TinyFlowError(f"block #{block.id} is listed twice in a {where}")
            if size != block.size:
                raise TinyFlowError(f"block #{block.id} of {block.size} B is listed in a "
                                    f"{where} as {size} B")
            ids.add(id(block))
        return ids

    @staticmethod
    def _check_free_block(block: Block, waiting: set[int], pooled: set[int]) -> None:
        where = (id(block) in waiting, id(block) in pooled)
        expected = (False, False) if block.allocated else (block.binned, not block.binned)
        if where != expected:
            raise TinyFlowError(f"block #{block.id} (allocated={block.allocated}, "
                                f"binned={block.binned}) is in a bin: {where[0]}, in its "
                                f"pool: {where[1]}")
        after = block.next
        if (after is not None and not (block.allocated or block.binned)
                and not (after.allocated or after.binned)):
            raise TinyFlowError(f"free neighbours #{block.id} and #{after.id} were not merged")

    def fragmentation(self) -> float:
        """1 - allocated / reserved: the share of reserved bytes no Tensor uses."""
        return 0.0 if not self.reserved else 1.0 - self.allocated / self.reserved

    # -- inside ------------------------------------------------------------------
    def _best_fit(self, size: int) -> tuple[Block, int, str]:
        """PyTorch's path: the smallest free block of the pool that fits (merging the
        fast bins first when none does), split to `size`; else a new segment.
        Returns the block, the size it had when found, and "best fit" or "segment"."""
        pool = self.free_small if size <= SMALL_REQUEST else self.free_large
        # (size,) sorts before every (size, segment, offset, block): the first fit.
        index = bisect.bisect_left(pool, (size,))
        if index == len(pool) and self._consolidate():
            index = bisect.bisect_left(pool, (size,))
        if index == len(pool):
            block, how = self._new_segment(size, pool), "segment"
        else:
            block, how = pool.pop(index)[3], "best fit"
        found_size = block.size
        if found_size != size:
            self._split(block, size)
        return block, found_size, how

    def _release(self, block: Block) -> None:
        """Free `block` for good: merge it with free neighbours (not those waiting in
        a bin) and put the result in its pool."""
        before, after = block.prev, block.next
        if before is not None and not before.allocated and not before.binned:
            self._take(before)
            block = self._merge(before, block)
        if after is not None and not after.allocated and not after.binned:
            self._take(after)
            block = self._merge(block, after)
        bisect.insort(block.pool, (block.size, block.segment, block.offset, block))

    def _consolidate(self) -> bool:
        """Release every block waiting in a fast bin (glibc's malloc_consolidate),
        so that they merge with their neighbours. Returns whether any waited."""
        waiting, self.bins = self.bins, {}
        released = False
        for blocks in waiting.values():   # (a bin emptied by malloc stays, empty)
            for block in blocks:
                block.binned = False
                self._release(block)
                released = True
        return released

    @staticmethod
    def _alloc_reason(block: Block, found_size: int, how: str) -> str:
        if how == "bin":
            return (f"fast bin: block #{block.id} ({found_size} B at offset {block.offset} "
                    f"of segment {block.segment}), freed earlier and kept whole for "
                    "this size")
        if how == "best fit":
            return (f"best fit: free block #{block.id} ({found_size} B at offset "
                    f"{block.offset} of segment {block.segment})")
        return f"new segment {block.segment} of {found_size} B (no free block fits)"

    def _new_segment(self, size: int, pool: list) -> Block:
        small = pool is self.free_small
        if small:
            seg_size = SMALL_SEGMENT
        elif size < MIN_LARGE_ALLOC:
            seg_size = LARGE_SEGMENT
        else:
            seg_size = -(-size // ROUND_LARGE) * ROUND_LARGE
        buffer = host_bytes(seg_size)   # (2 MiB-aligned, in huge pages where Linux has them)
        seg = Segment(len(self.segments), buffer, small, address=buffer.ctypes.data)
        self.segments.append(seg)
        self.reserved += seg_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        block = seg.head = self._block(seg.id, 0, seg_size, pool)
        self._event("segment_alloc", block, f"reserved {seg_size} B "
                    f"({'small' if small else 'large'} pool)")
        return block

    def _split(self, block: Block, size: int) -> None:
        """Cut `block` to `size` and free the rest, when the rest is worth keeping."""
        remainder = block.size - size
        if block.pool is self.free_large and remainder <= SPLIT_REMAINDER_LARGE:
            return
        self._next_block += 1
        rest = Block(block.segment, block.offset + size, remainder, block.pool, self._next_block)
        rest.prev = block
        rest.next = block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        bisect.insort(rest.pool, (remainder, rest.segment, rest.offset, rest))

    def _merge(self, first: Block, second: Block) -> Block:
        """`second` (the block right after `first`) joins `first`; `first` remains."""
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _block(self, segment: int, offset: int, size: int, pool: list) -> Block:
        self._next_block += 1
        return Block(segment, offset, size, pool, self._next_block)

    def _first_block(self, segment: int) -> Block | None:
        return self.segments[segment].head

    def _take(self, block: Block) -> None:
        """Remove free `block` from its pool (to merge it)."""
        pool = block.pool
        del pool[bisect.bisect_left(pool, (block.size, block.segment, block.offset))]

    def _event(self, kind: str, block: Block, reason: str) -> None:
        if self.record:
            self.events.append({"event": kind, "block": block.id, "segment": block.segment,
                                "offset": block.offset, "size": block.size,
                                "requested": block.requested,
                                "allocated": self.allocated, "reserved": self.reserved,
                                "reason": reason})
