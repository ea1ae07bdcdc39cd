"""Arena assignment: where in one buffer each block of bytes goes.

memory.py turns a schedule into blocks (a tensor and the tensors written in place over
it), each alive over a window of steps. Choosing their offsets so that blocks alive
at once never share a byte, in the smallest arena, is strip packing with every
rectangle's time span fixed: NP-hard, so real systems run greedy heuristics, and so
do we. A strategy is a function (blocks, conflicts) -> offsets, registered in
STRATEGIES; memory.plan_memory tries them and keeps the smallest arena.

``naive``             every tensor its own bytes; the baseline, no reuse at all.
``refcount``          NNVM/MXNet's planner (Chen et al. 2015): walk the schedule;
                      when a tensor's last reader has run, its block goes back to a
                      free list keyed by size, and the next request of a similar
                      size (within 16x) takes it, growing it if needed.
``greedy_by_size``    TensorFlow Lite's arena planner (Pisarchyk & Lee 2020):
                      largest tensor first, each into the best-fitting gap among
                      the tensors it overlaps in time.
``greedy_by_breadth`` Pisarchyk & Lee's other order: the steps with the most bytes
                      alive first, and each step's tensors largest first.
``greedy_by_conflicts`` hardest first: the tensors that overlap the most bytes
                      over their lifetime, each at its best fit (our variant).

`Conflicts` answers "which blocks may not share bytes with this one" (with several
streams, through happens-before rather than list order), and `_Occupancy` answers
"which bytes are taken during these steps" from a tree over the steps, so a plan of
50,000 tensors stays fast.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

MATCH_RANGE = 16     # NNVM: a free block is reused for requests within 16x its size

HappensBefore = Callable[[int, int], bool]


@dataclass
class Block:
    """Bytes that one or more tensors use in turn: a tensor plus the tensors written
    in place over it (a chain). The strategies place blocks, not tensors."""

    names: list[str]          # the chain; names[0] gets fresh bytes
    size: int                 # aligned bytes
    first: int                # first step alive (list order)
    last: int                 # last step alive (list order)
    define: int               # the step that writes names[0]
    touches: set[int]         # every step that writes or reads a tensor of the chain
    to_end: bool = False      # holds a fetched output: alive until the run ends


def _safe_from(touches: set[int], stream_of: Sequence[int],
               on_stream: Sequence[Sequence[int]], happens_before: HappensBefore
               ) -> list[float]:
    """For each stream, the first step on it that every step in `touches`
    happens-before (inf if none): a block may take these bytes from there on.

    A stream runs its steps in order, so once one of its steps is ordered after the
    touches, every later step on it is too: a binary search finds the first. And of
    the touches on one stream only the last needs asking about.
    """
    last_touch: dict[int, int] = {}
    for t in touches:
        last_touch[stream_of[t]] = max(t, last_touch.get(stream_of[t], t))
    safe: list[float] = []
    for steps in on_stream:
        lo, hi = 0, len(steps)
        while lo < hi:
            mid = (lo + hi) // 2
            if all(happens_before(t, steps[mid]) for t in last_touch.values()):
                hi = mid
            else:
                lo = mid + 1
        safe.append(steps[lo] if lo < len(steps) else math.inf)
    return safe


class Conflicts:
    """Which blocks may not share bytes with a block: those alive at the same time.

    Serial order: two blocks conflict when their [first, last] step ranges meet.
    With happens_before: block a is safely before block b only when every step
    touching a happens-before the step that writes b (`stream_of` says which stream
    each step runs on; steps on one stream must happen in list order).

    A query does not compare against every block (that made planning O(n^2)): each
    block has a window of steps, [first, last] serially, [define, the step from
    which every stream may overwrite it) with streams, and only blocks whose windows
    meet can conflict. Blocks with short windows are kept sorted by window start,
    so their candidates are one slice found by binary search; the few long-lived
    ones (fetched outputs, values read much later) are always candidates. The exact
    test then runs in numpy on the candidates alone. That is still O(n) per block
    when O(n) blocks are alive at once (a gradient's activations), so without
    streams the greedy strategies and `crowd` do not list conflicts at all
    (`_Occupancy`, sums over sorted arrays); with streams they still do.
    """

    SHORT = 64      # windows of at most this many steps are "short"

    def __init__(self, blocks: Sequence[Block], happens_before: HappensBefore | None = None,
                 stream_of: Sequence[int] | None = None) -> None:
        self.first = np.array([b.first for b in blocks], dtype=np.int64)
        self.last = np.array([b.last for b in blocks], dtype=np.int64)
        self.size = np.array([b.size for b in blocks], dtype=np.int64)
        self.define = np.array([b.define for b in blocks], dtype=np.int64)
        self.serial = happens_before is None
        # Serially, each block's _Occupancy keys (set by _place_serial, once).
        self.occupancy_keys: list[tuple[list[int], list[int]]] | None = None
        # The offsets each placement order gave (`_place_in_order`), by order.
        self.placed: dict[tuple[int, ...], list[int]] = {}
        if self.serial:
            self._index(self.first, self.last)
            return
        if stream_of is None:
            raise ValueError("happens_before needs the stream of every step")
        streams = max(stream_of, default=0) + 1
        on_stream: list[list[int]] = [[] for _ in range(streams)]
        for step, s in enumerate(stream_of):
            on_stream[s].append(step)
        self.define_stream = np.array([stream_of[b.define] for b in blocks], dtype=np.int64)
        # safe[i, s]: the first step on stream s that may write over block i.
        self.safe = np.array([[math.inf] * streams if b.to_end else
                              _safe_from(b.touches, stream_of, on_stream, happens_before)
                              for b in blocks], dtype=float).reshape(len(blocks), streams)
        # Block j can conflict with i only if define_j < max(safe[i]) and
        # define_i < max(safe[j]): the windows [define, max(safe)) meet.
        until = np.minimum(self.safe.max(axis=1, initial=0.0), len(stream_of) + 1)
        self._index(self.define, until.astype(np.int64) - 1)

    def _index(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Index the blocks' step windows [lo, hi] for `_candidates`."""
        self.lo, self.hi = lo, hi
        long = (hi - lo) > self.SHORT
        by_lo = np.argsort(lo, kind="stable")
        self.short_ids = by_lo[~long[by_lo]]
        self.short_lo = lo[self.short_ids]
        self.long_ids = np.flatnonzero(long)

    def _candidates(self, i: int) -> np.ndarray:
        """Blocks whose window meets block i's (a superset of its conflicts)."""
        a = np.searchsorted(self.short_lo, self.lo[i] - self.SHORT, side="left")
        b = np.searchsorted(self.short_lo, self.hi[i], side="right")
        return np.concatenate([self.short_ids[a:b], self.long_ids])

    def of(self, i: int) -> np.ndarray:
        """Indices of the (non-empty) blocks that conflict with block i, ascending."""
        return np.sort(self.unsorted_of(i))

    def unsorted_of(self, i: int, among: np.ndarray | None = None) -> np.ndarray:
        """`of` in no particular order (for sums and unions, where order is moot);
        `among`: a mask over the blocks, to ask only about those where it is True."""
        j = self._candidates(i)
        if among is not None:
            j = j[among[j]]
        if self.serial:
            clash = (self.first[j] <= self.last[i]) & (self.last[j] >= self.first[i])
        else:
            after = self.define[j] >= self.safe[i, self.define_stream[j]]        # j after i
            before = self.define[i] >= self.safe[j, self.define_stream[i]]  # j before i
            clash = ~after & ~before
        clash &= (self.size[j] > 0) & (j != i)
        return j[clash]

    def crowd(self) -> list[int]:
        """For each block, its own bytes plus the bytes of every block it conflicts
        with. Serially that is every block minus those dead before it is born and
        those born after it dies: two sums over sorted arrays, not a list per block
        (one block can conflict with O(n) others)."""
        if not self.serial:
            return [int(self.size[self.unsorted_of(i)].sum() + self.size[i])
                    for i in range(len(self.size))]
        by_last, by_first = np.argsort(self.last), np.argsort(self.first)
        died = np.concatenate([[0], np.cumsum(self.size[by_last])])
        born = np.concatenate([[0], np.cumsum(self.size[by_first])])
        dead_before = died[np.searchsorted(self.last[by_last], self.first, side="left")]
        born_after = born[-1] - born[np.searchsorted(self.first[by_first], self.last,
                                                     side="right")]
        return (born[-1] - dead_before - born_after).tolist()

    def clash(self, i: int, j: int) -> bool:
        """Whether blocks i and j conflict."""
        if self.serial:
            return bool(self.first[i] <= self.last[j] and self.first[j] <= self.last[i])
        return not (self.define[j] >= self.safe[i, self.define_stream[j]] or
                    self.define[i] >= self.safe[j, self.define_stream[i]])


def _best_fit(size: int, starts: np.ndarray, ends: np.ndarray) -> int:
    """The offset of the smallest gap between the byte ranges [starts, ends) (the
    blocks alive at the same time) that holds `size` bytes; above them all if none
    does. (The loop "for each range by start: gap = start - top; top = max(top, end)",
    written as numpy operations.)"""
    if len(starts) == 0:
        return 0
    by_start = np.argsort(starts, kind="stable")
    starts, ends = starts[by_start], ends[by_start]
    top_after = np.maximum.accumulate(ends)           # highest byte used so far
    top_before = np.concatenate([[0], top_after[:-1]])
    gaps = starts - top_before
    fits = np.flatnonzero(gaps >= size)
    if len(fits) == 0:
        return int(top_after[-1])
    return int(top_before[fits[np.argmin(gaps[fits])]])


class _Occupancy:
    """The bytes taken by placed blocks, queried by a window of steps: which bytes
    does any placed block alive during steps [first, last] use? (Serial conflicts:
    two blocks conflict exactly when their [first, last] windows meet.)

    Asking every placed block is O(n) per query, and the answer can name O(n)
    blocks (a gradient keeps every forward activation alive at once), so the
    greedy strategies were O(n^2). Instead a segment tree over the steps keeps
    unions of byte ranges as sorted, disjoint runs. A placed block's window
    [f', l'] meets the query's [f, l] exactly when the block is alive at step f
    (f' <= f <= l') or is born during the window (f < f' <= l), never both:

    * alive at f: a window splits into O(log n) tree nodes (its "cover" nodes);
      alive(v) holds the bytes of the blocks with v among their cover nodes, and
      the blocks alive at step f are those in alive(v) for the nodes v on the
      path from leaf f to the root;
    * born during (f, l]: born(v) holds the bytes of the blocks born at a leaf
      under v (a block goes into born(v) for every v on its birth leaf's path),
      and the query asks the cover nodes of (f, l].

    So an answer is the union of O(log n) sets of runs, each a few runs when the
    packing is tight, and `_best_fit_runs` sees the same bytes taken as with the
    blocks one by one: the same gap wins. In `runs`, the key of alive(v) is v and
    that of born(v) is -v (tree nodes are numbered from 1).
    """

    def __init__(self, steps: int) -> None:
        self.leaves = 1 << max(steps - 1, 0).bit_length()   # a power of two >= steps
        self.runs: dict[int, tuple[list[int], list[int]]] = {}

    def keys(self, first: int, last: int) -> tuple[list[int], list[int]]:
        """(the sets a block alive over steps [first, last] goes into, the sets
        whose union answers a query for that window): the same for every
        strategy, so callers may keep them. (`_occupancy_keys` finds them for all
        blocks at once, in numpy; this is their definition, one block at a time.)"""
        path: list[int] = []         # leaf `first` and its ancestors
        v = first + self.leaves
        while v:
            path.append(v)
            v >>= 1
        return (self._cover(first, last) + [-v for v in path],
                path + [-v for v in self._cover(first + 1, last)])

    def _cover(self, first: int, last: int) -> list[int]:
        """The tree nodes whose leaves together are exactly steps [first, last]."""
        cover: list[int] = []
        lo, hi = first + self.leaves, last + 1 + self.leaves
        while lo < hi:
            if lo & 1:
                cover.append(lo)
                lo += 1
            if hi & 1:
                hi -= 1
                cover.append(hi)
            lo, hi = lo >> 1, hi >> 1
        return cover

    def add(self, keys: list[int], lo: int, hi: int) -> None:
        """A block whose window has these insertion `keys` now holds [lo, hi): each
        set adds it to its runs, merged with the runs it overlaps or touches (so
        tensors packed side by side stay one run). (Called some 20 times per
        block, hence written out here and not a function per set.)"""
        runs = self.runs
        for key in keys:
            found = runs.get(key)
            if found is None:
                runs[key] = ([lo], [hi])
                continue
            starts, ends = found
            if len(ends) == 1 and lo <= ends[0] and starts[0] <= hi:
                # One run that [lo, hi) meets: the usual case when packing is tight.
                # (Comparisons, not min/max: this line runs millions of times.)
                if lo < starts[0]:
                    starts[0] = lo
                if hi > ends[0]:
                    ends[0] = hi
                continue
            i = bisect.bisect_left(ends, lo)           # the first run ending at/after lo
            j = bisect.bisect_right(starts, hi, i)     # runs i..j-1 start at/before hi
            if i == j:
                starts.insert(i, lo)
                ends.insert(i, hi)
                continue
            starts[i:j] = [min(lo, starts[i])]
            ends[i:j] = [max(hi, ends[j - 1])]

    def taken(self, keys: list[int]) -> list[tuple[int, int]]:
        """Byte runs whose union is exactly the bytes of the placed blocks alive at
        some step of the window with these query `keys` (they may overlap)."""
        get, taken = self.runs.get, []
        for key in keys:
            found = get(key)
            if found is not None:
                taken.extend(zip(*found))
        return taken


def _best_fit_runs(size: int, runs: list[tuple[int, int]]) -> int:
    """`_best_fit` for a few byte runs [start, end), in plain Python: the start of
    the smallest gap between them that holds `size` bytes (the lowest among equals),
    else the top of the highest run. Only the union of the runs matters."""
    runs.sort()
    top, best, best_gap = 0, None, 0
    for start, end in runs:
        gap = start - top
        if gap >= size and (best is None or gap < best_gap):
            best, best_gap = top, gap
        if end > top:
            top = end
    return top if best is None else best


def _place_in_order(order: Iterable[int], blocks: Sequence[Block],
                    conflicts: Conflicts) -> list[int]:
    """Place blocks one by one in `order`, each at its best fit among the already
    placed blocks it conflicts with (the common core of the greedy strategies).

    Their orders often coincide (with blocks of one size, largest first is birth
    order, and so is busiest step first when every step holds the same bytes), and
    one order always gives the same offsets: each order is placed once per
    `conflicts` and remembered there."""
    order = tuple(order)
    if order not in conflicts.placed:
        place = _place_serial if conflicts.serial else _place_with_streams
        conflicts.placed[order] = place(order, blocks, conflicts)
    return list(conflicts.placed[order])


def _place_with_streams(order: Iterable[int], blocks: Sequence[Block],
                        conflicts: Conflicts) -> list[int]:
    """`_place_in_order` with streams: the conflicts are listed block by block."""
    offsets = np.zeros(len(blocks), dtype=np.int64)
    placed = np.zeros(len(blocks), dtype=bool)
    for i in order:
        placed[i] = True
        if blocks[i].size == 0:
            continue
        others = conflicts.unsorted_of(i, among=placed)  # best fit: their union alone
        offsets[i] = _best_fit(blocks[i].size, offsets[others],
                               offsets[others] + conflicts.size[others])
    return [int(o) for o in offsets]


def _occupancy_keys(taken: _Occupancy, blocks: Sequence[Block]
                    ) -> list[tuple[list[int], list[int]]]:
    """Each block's (insertion keys, query keys) in `taken` (`_Occupancy.keys`), less
    the sets no block ever asks about (not kept up to date) and those no block ever
    goes into (always empty): most of them, and they cost as much as the others.

    Found for every block at once, in numpy, one tree level at a time (block by
    block in Python this cost as much as a placement). The order of a block's keys
    does not matter: an insertion goes into each set, a query takes their union.
    """
    ids = np.array([i for i, b in enumerate(blocks) if b.size], dtype=np.int64)
    if len(ids) == 0:
        return [([], []) for _ in blocks]
    first = np.array([blocks[i].first for i in ids], dtype=np.int64)
    last = np.array([blocks[i].last for i in ids], dtype=np.int64)
    path = _tree_paths(taken.leaves, ids, first)           # alive(v) asked, born(v) added
    alive = _tree_covers(taken.leaves, ids, first, last)   # alive(v) added
    born = _tree_covers(taken.leaves, ids, first + 1, last)    # born(v) asked
    tree = 2 * taken.leaves
    # Insert only into the sets some block asks about ...
    keep_alive = _marked(tree, path[1])[alive[1]]
    keep_born = _marked(tree, born[1])[path[1]]
    # ... and ask only the sets some block goes into.
    ask_alive = _marked(tree, alive[1][keep_alive])[path[1]]
    ask_born = _marked(tree, path[1][keep_born])[born[1]]
    add = _per_block(len(blocks), [(alive[0][keep_alive], alive[1][keep_alive]),
                                   (path[0][keep_born], -path[1][keep_born])])
    ask = _per_block(len(blocks), [(path[0][ask_alive], path[1][ask_alive]),
                                   (born[0][ask_born], -born[1][ask_born])])
    return list(zip(add, ask))


def _tree_paths(leaves: int, ids: np.ndarray, first: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """(block id, tree node) for every node on the path from leaf first[k] to the
    root, for every block ids[k] (the `path` of `_Occupancy.keys`)."""
    depth = leaves.bit_length()           # nodes on a leaf's path to the root
    nodes = (first + leaves)[:, None] >> np.arange(depth)[None, :]
    return np.repeat(ids, depth), nodes.ravel()


def _tree_covers(leaves: int, ids: np.ndarray, first: np.ndarray, last: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(block id, tree node) for every cover node of every window [first[k], last[k]]
    (none when empty): `_Occupancy._cover`, for all windows at once, level by level."""
    who, nodes = [], []
    lo, hi = first + leaves, last + 1 + leaves
    while True:
        live = lo < hi
        if not live.any():
            break
        left = live & (lo & 1 == 1)
        who.append(ids[left])
        nodes.append(lo[left])
        right = live & (hi & 1 == 1)    # (lo + 1 == hi here only when hi is even)
        hi = hi - right
        who.append(ids[right])
        nodes.append(hi[right])
        lo, hi = (lo + left) >> 1, hi >> 1
    empty = np.zeros(0, dtype=np.int64)
    return np.concatenate(who or [empty]), np.concatenate(nodes or [empty])


def _marked(size: int, nodes: np.ndarray) -> np.ndarray:
    """A mask over tree nodes 0..size-1, True at `nodes`."""
    mask = np.zeros(size, dtype=bool)
    mask[nodes] = True
    return mask


def _per_block(count: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> list[list[int]]:
    """For each block 0..count-1, the keys of `parts` ((block ids, keys) pairs) that
    belong to it, as a Python list (what `_Occupancy.add` and `taken` loop over)."""
    who = np.concatenate([w for w, _ in parts])
    keys = np.concatenate([k for _, k in parts])
    by_block = np.argsort(who, kind="stable")
    keys = keys[by_block].tolist()
    ends = np.cumsum(np.bincount(who, minlength=count)).tolist()
    return [keys[start:end] for start, end in zip([0] + ends[:-1], ends)]


def _place_serial(order: Iterable[int], blocks: Sequence[Block],
                  conflicts: Conflicts) -> list[int]:
    """`_place_in_order` without streams: the placed blocks a block conflicts with
    are those alive during its [first, last], which `_Occupancy` answers in bytes."""
    offsets = [0] * len(blocks)
    taken = _Occupancy(max((b.last for b in blocks), default=0) + 1)
    if conflicts.occupancy_keys is None:      # the same for every greedy strategy
        conflicts.occupancy_keys = _occupancy_keys(taken, blocks)
    for i in order:
        size = blocks[i].size
        if size == 0:
            continue
        add, ask = conflicts.occupancy_keys[i]
        offsets[i] = _best_fit_runs(size, taken.taken(ask))
        taken.add(add, offsets[i], offsets[i] + size)
    return offsets


def naive(blocks: Sequence[Block], conflicts: Conflicts) -> list[int]:
    """Every block its own bytes, one after the other: no reuse at all."""
    offsets, top = [], 0
    for block in blocks:
        offsets.append(top)
        top += block.size
    return offsets


def _free_candidates(free: list[tuple[int, int]], size: int) -> Iterable[int]:
    """Indices into the size-sorted free list in NNVM's order of preference: the
    smallest storage block of at least `size` bytes and upwards, then the smaller
    ones from the largest down; all within MATCH_RANGE of `size`."""
    start = bisect.bisect_left(free, (size, -1))
    for k in range(start, len(free)):
        if free[k][0] > size * MATCH_RANGE:
            break
        yield k
    for k in range(start - 1, -1, -1):
        if free[k][0] < size // MATCH_RANGE:
            break
        yield k


def refcount(blocks: Sequence[Block], conflicts: Conflicts) -> list[int]:
    """NNVM/MXNet: walk the schedule with a free list of storage blocks.

    At each block's first step, take a free storage block: the smallest one at
    least as big, else the biggest smaller one (which grows), but only among
    blocks within MATCH_RANGE of the size (a scalar should not pin a megabyte).
    When a block's last reader has run, its storage returns to the free list
    (kept sorted by size, NNVM's multimap). Storage blocks are laid end to end, so
    the arena is the sum of their sizes. With streams, storage whose last user may
    still be running elsewhere is passed over.
    """
    by_define = sorted(range(len(blocks)), key=lambda i: (blocks[i].define, i))
    by_last = sorted(range(len(blocks)), key=lambda i: (blocks[i].last, i))
    storage_size: list[int] = []
    last_user: list[int] = []          # the latest block in each storage block
    storage_of = [-1] * len(blocks)
    free: list[tuple[int, int]] = []   # (size, storage), sorted
    released = 0
    for i in by_define:
        size = blocks[i].size
        while released < len(by_last) and blocks[by_last[released]].last < blocks[i].define:
            j = by_last[released]
            if storage_of[j] >= 0 and last_user[storage_of[j]] == j:
                bisect.insort(free, (storage_size[storage_of[j]], storage_of[j]))
            released += 1
        if size == 0:
            continue
        k = next((k for k in _free_candidates(free, size)
                  if not conflicts.clash(i, last_user[free[k][1]])), None)
        if k is None:
            s = len(storage_size)
            storage_size.append(size)
            last_user.append(i)
        else:
            s = free.pop(k)[1]
            storage_size[s] = max(storage_size[s], size)    # grow a smaller one
            last_user[s] = i
        storage_of[i] = s
    starts = np.concatenate([[0], np.cumsum(storage_size, dtype=np.int64)])
    return [int(starts[s]) if s >= 0 else 0 for s in storage_of]


def greedy_by_size(blocks: Sequence[Block], conflicts: Conflicts) -> list[int]:
    """TFLite / Pisarchyk & Lee: largest first (earlier first among equals), each at
    the best-fitting gap among the already placed blocks alive at the same time."""
    order = sorted(range(len(blocks)), key=lambda i: (-blocks[i].size, blocks[i].first))
    return _place_in_order(order, blocks, conflicts)


def greedy_by_breadth(blocks: Sequence[Block], conflicts: Conflicts) -> list[int]:
    """Pisarchyk & Lee's greedy by breadth: visit steps from the most bytes alive
    to the least; at each, place its still unplaced blocks largest first. (A block
    is placed at the first visited step it is alive at: we sort by that.)"""
    if not blocks:
        return []
    alive = _bytes_alive(blocks)
    visit = np.empty(len(alive), dtype=np.int64)
    visit[np.argsort(-alive, kind="stable")] = np.arange(len(alive))
    first_visit = _range_min(visit, np.array([b.first for b in blocks]),
                             np.array([b.last for b in blocks])).tolist()
    order = sorted(range(len(blocks)),
                   key=lambda i: (first_visit[i], -blocks[i].size, blocks[i].first))
    return _place_in_order(order, blocks, conflicts)


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(values[lo[k]:hi[k] + 1]) for every k, in numpy (one slice per block was
    a third of greedy_by_breadth): a "sparse table" holds the minimum of every
    stretch of 2^j values, and a range is the union of two such stretches, one
    from each end, of the largest 2^j that fits in it."""
    table = [values]                  # table[j][i] = min(values[i:i + 2**j])
    while 2 ** len(table) <= len(values):
        span = 2 ** (len(table) - 1)
        table.append(np.minimum(table[-1][:-span], table[-1][span:]))
    level = np.frexp(hi - lo + 1)[1] - 1       # the largest j with 2^j <= length
    out = np.empty(len(lo), dtype=values.dtype)
    for j in np.unique(level).tolist():
        k = level == j
        out[k] = np.minimum(table[j][lo[k]], table[j][hi[k] - 2 ** j + 1])
    return out


def greedy_by_conflicts(blocks: Sequence[Block], conflicts: Conflicts) -> list[int]:
    """Hardest first: order blocks by the bytes of every block they overlap in time
    (plus their own), so the blocks that live through the busiest stretches are
    placed while the arena is still empty; each at its best fit. (Our variant of
    Pisarchyk & Lee's breadth idea, keyed per tensor instead of per step.)"""
    crowd = conflicts.crowd()
    order = sorted(range(len(blocks)),
                   key=lambda i: (-crowd[i], -blocks[i].size, blocks[i].first))
    return _place_in_order(order, blocks, conflicts)


Strategy = Callable[[Sequence[Block], Conflicts], list[int]]
STRATEGIES: dict[str, Strategy] = {
    "naive": naive,
    "refcount": refcount,
    "greedy_by_size": greedy_by_size,
    "greedy_by_breadth": greedy_by_breadth,
    "greedy_by_conflicts": greedy_by_conflicts,
}


def _bytes_alive(blocks: Sequence[Block]) -> np.ndarray:
    """Bytes alive at each step (in-place chains counted once)."""
    delta = np.zeros(max(b.last for b in blocks) + 2, dtype=np.int64)
    for b in blocks:
        delta[b.first] += b.size
        delta[b.last + 1] -= b.size
    return np.cumsum(delta)[:-1]


def lower_bound(blocks: Sequence[Block]) -> int:
    """The most bytes alive at one step: no arena can be smaller."""
    return int(_bytes_alive(blocks).max()) if blocks else 0
