"""Static memory planning: liveness, in-place reuse, one arena, a proof of safety.

A static graph says, before anything runs, how big every tensor is and which steps
write and read it. So memory can be planned the way a compiler allocates registers:

1. **liveness**: a tensor is alive from the step that writes it to the last step
   that reads it. Fetched outputs live to the end of the run; feeds and variables
   live outside the arena (in the caller's arrays and the Session's store). A
   kernel's scratch memory (``OpDef.scratch``: conv2d's im2col matrix) is a tensor
   too, alive during its own step only, as TVM and XLA plan a kernel's workspace.
2. **in place**: an op whose registry entry names an `inplace` input may write its
   output over that input when the input dies at this very step (``relu(x)`` where
   nothing reads ``x`` afterwards needs no new memory).
3. **arena assignment**: every other tensor gets an offset in one buffer, so that
   two tensors alive at once never share a byte. The smallest arena is NP-hard to
   find (it is strip packing with each rectangle's time span fixed), so we run the
   greedy heuristics real systems use and keep the smallest result:

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

   No single order wins on every graph (in benchmarks/memory_bench.py only
   greedy_by_breadth reaches the lower bound on the transformer, only
   greedy_by_conflicts on the conv net), which is why "auto" tries them all.

4. **validation**: `validate_plan` recomputes liveness from the steps and checks
   every pair of tensors that share bytes: they are never alive at once, or they
   are a declared, legal in-place pair. The executor runs it on every plan.

The lower bound reported with each plan is the most bytes alive at any one step: no
arena can be smaller, so arena / lower bound is what a heuristic wastes.

Concurrency: with several streams, "step 3 is before step 7 in the list" no longer
means step 3 has finished when step 7 starts. The planner then takes a
``happens_before(a, b)`` function (the schedule's vector clocks, streams.py) and lets
two tensors share bytes only if every use of one happens-before the other is
written. (NNVM colours the graph for the same reason.)

The planner packs the lifetimes a schedule gives it. Changing the schedule itself
(a memory-aware order) and recomputing instead of storing (gradient checkpointing)
are the other half of the story, in `sublinear.py`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyflow.graph import Graph, Node, TinyFlowError, tensor_nbytes
from tinyflow.ops import REGISTRY
from tinyflow.registry import mutated_input, source_kind

ALIGNMENT = 64       # bytes; every offset is a multiple (cache lines, SIMD loads)
MATCH_RANGE = 16     # NNVM: a free block is reused for requests within 16x its size
ARENA_KINDS = ("intermediate", "output", "scratch")   # the kinds that live in the arena

HappensBefore = Callable[[int, int], bool]


class PlanError(TinyFlowError):
    """A memory plan that is unsafe or does not fit its steps (names the tensors)."""


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': sizes as a person reads them (TinyFlow's one byte
    formatter; the debugger's too)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _align(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


# ----------------------------------------------------------------------------------
# The planner's input and output
# ----------------------------------------------------------------------------------

@dataclass
class PlanStep:
    """One scheduled step, as the planner sees it.

    The step writes the tensor `name` (`nbytes` bytes) and reads the tensors in
    `inputs`. `inplace_input` is the index in `inputs` that the op may overwrite
    (its OpDef.inplace, already checked by the caller for same shape and dtype);
    the planner decides whether that input really dies here. `stream` is the
    stream the step runs on; with a happens_before function, steps on one stream
    must run in list order (what a stream is). `scratch` is the bytes its kernel
    needs while it runs (OpDef.scratch): a tensor of kind "scratch", named
    `scratch_name(name)`, alive at this step only.
    """

    name: str
    inputs: list[str]
    nbytes: int
    inplace_input: int | None = None
    stream: int = 0
    scratch: int = 0


SCRATCH_SUFFIX = ":scratch"


def scratch_name(step_name: str) -> str:
    """The planner's name for the scratch memory of step `step_name`."""
    return step_name + SCRATCH_SUFFIX


@dataclass
class TensorSpec:
    """One tensor: its lifetime (from `liveness`) and, once planned, its place.

    first_step, last_step  alive over these steps, both included (list positions)
    kind         "intermediate", "output" (fetched: alive to the end), "scratch" (a
                 kernel's working memory, alive during its step only), or "feed" /
                 "variable" / "constant" (outside the arena: offset stays None)
    inplace_of   the input whose bytes this tensor overwrites, if any
    defined_at   the step that writes it (None for a feed that no step writes)
    uses         the steps that read it
    offset       byte offset in the arena (set by plan_memory)
    reason       one line on why it sits there (set by plan_memory)
    """

    name: str
    nbytes: int
    first_step: int
    last_step: int
    kind: str = "intermediate"
    inplace_of: str | None = None
    defined_at: int | None = None
    uses: tuple[int, ...] = ()
    offset: int | None = None
    reason: str = ""

    def to_dict(self) -> dict:
        """The DebugRecord's memory_plan.tensors entry (a scratch tensor names the
        node whose kernel uses it, as the record's entries name nodes)."""
        node = self.name.removesuffix(SCRATCH_SUFFIX) if self.kind == "scratch" else self.name
        return {"node": node, "offset": self.offset, "nbytes": self.nbytes,
                "first_step": self.first_step, "last_step": self.last_step,
                "inplace_of": self.inplace_of, "kind": self.kind, "reason": self.reason}


@dataclass
class MemoryPlan:
    """Where every tensor lives: one arena, an offset per tensor.

    tensors            every tensor the steps name, in order of first appearance
    arena_bytes        size of the arena (what the executor allocates once)
    naive_bytes        sum of all arena tensors: the memory without any reuse
    lower_bound_bytes  the most bytes alive at any one step: no plan beats it
    strategy           the strategy that made this plan
    strategies         arena bytes of every strategy tried (all of them for "auto")
    external, keep     the liveness inputs, kept so the plan can be re-validated
    """

    tensors: list[TensorSpec]
    arena_bytes: int
    naive_bytes: int
    lower_bound_bytes: int
    strategy: str
    strategies: dict[str, int]
    alignment: int = ALIGNMENT
    external: dict[str, str] = field(default_factory=dict)
    keep: frozenset[str] = frozenset()

    @property
    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    def to_dict(self) -> dict:
        """The DebugRecord's "memory_plan" section (contracts.md)."""
        return {"strategy": self.strategy, "arena_bytes": self.arena_bytes,
                "naive_bytes": self.naive_bytes, "lower_bound_bytes": self.lower_bound_bytes,
                "alignment": self.alignment, "strategies": dict(self.strategies),
                "tensors": [t.to_dict() for t in self.tensors]}

    def describe(self, limit: int = 40) -> str:
        """A table for people: steps alive, offset, size, name, reason."""
        lines = [f"arena {format_bytes(self.arena_bytes)} ({self.strategy}); "
                 f"lower bound {format_bytes(self.lower_bound_bytes)}; "
                 f"no reuse {format_bytes(self.naive_bytes)}"]
        for t in self.tensors[:limit]:
            where = "-" if t.offset is None else str(t.offset)
            lines.append(f"  steps {t.first_step:>4}..{t.last_step:<4} @ {where:>10}  "
                         f"{format_bytes(t.nbytes):>10}  {t.name}: {t.reason}")
        if len(self.tensors) > limit:
            lines.append(f"  ... {len(self.tensors) - limit} more")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------
# 1-2. Liveness and in-place decisions
# ----------------------------------------------------------------------------------

def liveness(steps: Sequence[PlanStep],
             external: Iterable[str] | Mapping[str, str] = frozenset(),
             keep: Iterable[str] = frozenset(),
             happens_before: HappensBefore | None = None) -> dict[str, TensorSpec]:
    """Each tensor's lifetime and in-place parent, from the steps in schedule order.

    external  names that live outside the arena (feeds, variables); a dict
              {name: "feed" | "variable"} also gives their kind (a set means "feed").
              They may be written by a step or by nobody (fed before the run).
    keep      names fetched by the caller: alive to the last step.
    happens_before  with several streams, the ordering to trust (default: list order).

    An in-place request (PlanStep.inplace_input) is granted when the input is an
    intermediate of the same size, not fetched, and every other use of it happens
    before this step (so nothing reads it after it is overwritten). Raises PlanError
    for duplicate step names and for inputs nobody wrote earlier.
    """
    kinds = dict(external) if isinstance(external, Mapping) else \
        dict.fromkeys(external, "feed")
    index, uses = _writers_and_uses(steps, kinds)
    specs = _lifetimes(steps, kinds, set(keep), index, uses)
    _grant_inplace(steps, specs, kinds, happens_before or (lambda a, b: a < b))
    return specs


def _writers_and_uses(steps: Sequence[PlanStep], kinds: Mapping[str, str]
                      ) -> tuple[dict[str, int], dict[str, list[int]]]:
    """({tensor: the step that writes it}, {tensor: the steps that read it, ascending}),
    checking that names are unique and every input was written (or is external)."""
    index: dict[str, int] = {}
    uses: dict[str, list[int]] = {}
    for k, step in enumerate(steps):
        if step.name in index:
            raise PlanError(f"steps {index[step.name]} and {k} both write {step.name!r}; "
                            "tensor names must be unique")
        for name in step.inputs:
            read = uses.get(name)
            if read is None:
                # A name's first reader checks it exists; later readers come after.
                if name not in index and name not in kinds:
                    raise PlanError(f"step {k} ({step.name}) reads {name!r}, which no "
                                    "earlier step writes and which is not external")
                uses[name] = [k]
            elif read[-1] != k:        # reading x twice in one step is one use
                read.append(k)
        index[step.name] = k
    return index, uses


def _lifetimes(steps: Sequence[PlanStep], kinds: Mapping[str, str], keep: set[str],
               index: dict[str, int], uses: dict[str, list[int]]) -> dict[str, TensorSpec]:
    """Each tensor's first and last step: an intermediate lives from its writer to
    its last reader, a fetched one to the end, an external one outside the arena
    (a variable to the end: the Session keeps it). (`uses` lists are ascending, so
    a tensor's last reader is the last entry.)"""
    last = len(steps) - 1
    specs: dict[str, TensorSpec] = {}

    def add_external(name: str) -> None:
        kind = kinds[name]
        read = uses.get(name, ())
        end = last if kind == "variable" else (read[-1] if read else index.get(name, 0))
        nbytes = steps[index[name]].nbytes if name in index else 0
        specs[name] = TensorSpec(name, nbytes, 0, end, kind, defined_at=index.get(name),
                                 uses=tuple(read), reason=f"{kind}: lives outside the arena")

    for k, step in enumerate(steps):
        for name in step.inputs:
            if name not in specs:      # not written by an earlier step: external
                add_external(name)
        name = step.name
        if name in kinds:
            add_external(name)
            continue
        read = uses.get(name, ())
        if name in keep:
            specs[name] = TensorSpec(name, step.nbytes, k, last, "output",
                                     defined_at=k, uses=tuple(read))
        else:
            specs[name] = TensorSpec(name, step.nbytes, k, read[-1] if read else k,
                                     defined_at=k, uses=tuple(read))
        if step.scratch:
            _scratch_spec(k, step, specs, index)
    return specs


def _scratch_spec(k: int, step: PlanStep, specs: dict[str, TensorSpec],
                  index: dict[str, int]) -> None:
    """Step k's scratch: written and used by step k alone, so alive at k only."""
    name = scratch_name(step.name)
    if name in specs or name in index:
        raise PlanError(f"step {k} ({step.name}) needs scratch memory, but a tensor is "
                        f"already named {name!r}")
    specs[name] = TensorSpec(name, step.scratch, k, k, "scratch", defined_at=k)


def _grant_inplace(steps: Sequence[PlanStep], specs: dict[str, TensorSpec],
                   kinds: Mapping[str, str], hb: HappensBefore) -> None:
    """Mark the in-place requests that are safe (see `liveness`): each parent is
    overwritten at most once."""
    overwritten: set[str] = set()
    for k, step in enumerate(steps):
        i = step.inplace_input
        if i is None or step.name in kinds:
            continue
        if not 0 <= i < len(step.inputs):
            raise PlanError(f"step {k} ({step.name}) asks to run in place over input {i}, "
                            f"but it has {len(step.inputs)} inputs")
        parent = specs[step.inputs[i]]
        if (parent.kind == "intermediate" and parent.nbytes == step.nbytes > 0
                and parent.name not in overwritten
                and all(u == k or hb(u, k) for u in parent.uses)):
            specs[step.name].inplace_of = parent.name
            overwritten.add(parent.name)


# ----------------------------------------------------------------------------------
# 3. Arena assignment. In-place chains are merged into blocks first; a strategy is
#    a function (blocks, conflicts) -> offsets, registered in STRATEGIES.
# ----------------------------------------------------------------------------------

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


def make_blocks(specs: Iterable[TensorSpec], alignment: int, inplace: bool = True
                ) -> list[Block]:
    """Blocks for the arena tensors of `specs` (in-place chains merged if `inplace`)."""
    blocks: list[Block] = []
    block_of: dict[str, Block] = {}
    for spec in specs:
        if spec.kind not in ARENA_KINDS:
            continue
        touches = {spec.defined_at, *spec.uses}
        parent = block_of.get(spec.inplace_of) if inplace and spec.inplace_of else None
        if parent is not None:
            parent.names.append(spec.name)
            parent.last = max(parent.last, spec.last_step)
            parent.touches |= touches
            parent.to_end |= spec.kind == "output"
            block_of[spec.name] = parent
            continue
        block = Block([spec.name], _align(spec.nbytes, alignment), spec.first_step,
                      spec.last_step, spec.defined_at, touches, spec.kind == "output")
        blocks.append(block)
        block_of[spec.name] = block
    return blocks


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


def peak_alive(steps: Sequence[PlanStep],
               external: Iterable[str] | Mapping[str, str] = frozenset(),
               keep: Iterable[str] = frozenset(), alignment: int = ALIGNMENT) -> int:
    """The most arena bytes alive at one step when `steps` run in list order on one
    stream: ``lower_bound(make_blocks(liveness(steps, external, keep).values(),
    alignment))``, by the same rules, but counted on the fly, with no TensorSpec or
    Block made (`sublinear.memory_order` asks it of several orders of one graph).

    An in-place child is born at the step where its parent dies (its last reader,
    which overwrites it), so counting the child from the step after counts the
    bytes of their chain once. The steps are trusted to be well formed (unique
    names, inputs written before they are read): `liveness` checks that.
    """
    kinds = dict(external) if isinstance(external, Mapping) else \
        dict.fromkeys(external, "feed")
    keep = set(keep)
    last_read: dict[str, int] = {}
    for k, step in enumerate(steps):
        for name in step.inputs:
            last_read[name] = k
    # born[k]: bytes that start to be alive at step k less those dead after k - 1.
    born = [0] * (len(steps) + 1)
    intermediate: dict[str, int] = {}    # not external, not fetched: its bytes
    overwritten: set[str] = set()
    for k, step in enumerate(steps):
        if step.name in kinds:
            continue
        first = k
        last = len(steps) - 1 if step.name in keep else last_read.get(step.name, k)
        i = step.inplace_input
        if i is not None:     # granted as in `_grant_inplace`, serially
            if not 0 <= i < len(step.inputs):
                raise PlanError(f"step {k} ({step.name}) asks to run in place over "
                                f"input {i}, but it has {len(step.inputs)} inputs")
            parent = step.inputs[i]
            if (intermediate.get(parent) == step.nbytes > 0 and parent not in overwritten
                    and last_read[parent] == k):
                overwritten.add(parent)
                first = k + 1
        if step.name not in keep:
            intermediate[step.name] = step.nbytes
        if first <= last:
            born[first] += _align(step.nbytes, alignment)
            born[last + 1] -= _align(step.nbytes, alignment)
        if step.scratch:      # alive at this step only
            born[k] += _align(step.scratch, alignment)
            born[k + 1] -= _align(step.scratch, alignment)
    return max(itertools.accumulate(born[:-1]), default=0)


def _reasons(blocks: Sequence[Block], offsets: Sequence[int], specs: dict[str, TensorSpec]
             ) -> dict[str, str]:
    """Explain each placement: the most recently dead block whose bytes it took, or
    "fresh" when no earlier block ever used those bytes.

    A sweep in definition order over a map of byte ranges to their last occupant
    (as in validate_plan): an earlier block whose bytes were taken over again died
    before its successor did, so the most recently dead of all earlier blocks on
    these bytes is among the current occupants."""
    reasons: dict[str, str] = {}
    starts: list[int] = [0]
    owners: list[int] = [-1]
    for i in sorted(range(len(blocks)), key=lambda k: blocks[k].define):
        block = blocks[i]
        head = block.names[0]
        for parent, child in zip(block.names, block.names[1:]):
            reasons[child] = f"in place over {parent}"
        if block.size == 0:
            reasons[head] = "empty: needs no bytes"
            continue
        lo, hi = offsets[i], offsets[i] + block.size
        _split_segment(starts, owners, lo)
        _split_segment(starts, owners, hi)
        a, b = bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)
        earlier = [j for j in owners[a:b] if j >= 0]
        if earlier:
            # The latest death; among equals the lowest block index, as before.
            j = max(earlier, key=lambda k: (blocks[k].last, -k))
            died = next(n for n in reversed(blocks[j].names)
                        if specs[n].last_step == blocks[j].last)
            reasons[head] = f"took the space of {died}, dead after step {blocks[j].last}"
        else:
            reasons[head] = f"fresh: no free gap of {format_bytes(block.size)}"
        if block.to_end:
            reasons[head] += "; fetched, so alive to the end"
        starts[a:b] = [lo]
        owners[a:b] = [i]
    return reasons


def plan_memory(steps: Sequence[PlanStep],
                external: Iterable[str] | Mapping[str, str] = frozenset(),
                keep: Iterable[str] = frozenset(), strategy: str = "auto",
                happens_before: HappensBefore | None = None,
                alignment: int = ALIGNMENT) -> MemoryPlan:
    """Plan one arena for `steps` (in schedule order).

    external, keep, happens_before  as in `liveness` (with happens_before, steps on
               one stream, PlanStep.stream, must happen in list order)
    strategy   a name in STRATEGIES, or "auto": try them all, keep the smallest arena
    alignment  every offset (and every tensor's footprint) is a multiple of it

    Tensors of 0 bytes get offset 0. External tensors get offset None.
    """
    if strategy != "auto" and strategy not in STRATEGIES:
        raise ValueError(f"unknown memory strategy {strategy!r}; choose 'auto' or one of "
                         f"{sorted(STRATEGIES)}")
    happens_before = _across_streams(steps, happens_before)
    specs = liveness(steps, external, keep, happens_before)
    arena_specs = [s for s in specs.values() if s.kind in ARENA_KINDS]
    shared = make_blocks(arena_specs, alignment, inplace=True)
    separate = make_blocks(arena_specs, alignment, inplace=False)
    conflicts = Conflicts(shared, happens_before, [s.stream for s in steps])

    tried: dict[str, tuple[int, list[int]]] = {}
    for name in (list(STRATEGIES) if strategy == "auto" else [strategy]):
        blocks = separate if name == "naive" else shared
        offsets = STRATEGIES[name](blocks, conflicts)
        arena = max((o + b.size for o, b in zip(offsets, blocks)), default=0)
        tried[name] = (arena, offsets)
    # The smallest arena wins; on a tie, anything that shares beats "naive".
    best = min(tried, key=lambda name: (tried[name][0], name == "naive"))
    blocks = separate if best == "naive" else shared
    tensors = _placed_tensors(specs, blocks, tried[best][1], naive=best == "naive")
    kinds = {s.name: s.kind for s in specs.values() if s.kind not in ARENA_KINDS}
    return MemoryPlan(tensors, tried[best][0], sum(b.size for b in separate),
                      lower_bound(shared), best, {n: a for n, (a, _) in tried.items()},
                      alignment, kinds, frozenset(s.name for s in specs.values()
                                                  if s.kind == "output"))


def _across_streams(steps: Sequence[PlanStep], happens_before: HappensBefore | None
                    ) -> HappensBefore | None:
    """`happens_before`, or None (the serial rules) when every step is on one
    stream: steps on one stream run in list order, so the serial rules are then
    exact, and the serial conflicts are answered in O(log n) per block, the
    general ones in O(n)."""
    return None if len({step.stream for step in steps}) <= 1 else happens_before


def _placed_tensors(specs: dict[str, TensorSpec], blocks: list[Block],
                    offsets: list[int], naive: bool) -> list[TensorSpec]:
    """Every tensor with its offset (arena tensors) and why it got it (new specs:
    the liveness ones stay as they were)."""
    reasons = _reasons(blocks, offsets, specs)
    offset_of = {name: off for block, off in zip(blocks, offsets) for name in block.names}
    tensors = []
    for s in specs.values():
        # The constructor, not dataclasses.replace: the same copy, at a third of
        # the cost (this runs once per tensor of every compile).
        if s.kind not in ARENA_KINDS:
            tensors.append(TensorSpec(s.name, s.nbytes, s.first_step, s.last_step, s.kind,
                                      s.inplace_of, s.defined_at, s.uses, s.offset,
                                      s.reason))
            continue
        reason = "naive: its own bytes, no reuse" if naive else reasons[s.name]
        tensors.append(TensorSpec(s.name, s.nbytes, s.first_step, s.last_step, s.kind,
                                  None if naive else s.inplace_of, s.defined_at, s.uses,
                                  offset_of[s.name], reason))
    return tensors


# ----------------------------------------------------------------------------------
# 4. The validator: a plan is safe when tensors that share bytes are never alive
#    at the same time (in-place pairs aside). It trusts nothing the plan says about
#    lifetimes: it recomputes them from the steps.
# ----------------------------------------------------------------------------------

def validate_plan(plan: MemoryPlan, steps: Sequence[PlanStep],
                  happens_before: HappensBefore | None = None,
                  keep: Iterable[str] | None = None) -> None:
    """Prove `plan` safe for `steps`, or raise PlanError naming the two tensors.

    Checks: every arena tensor has an aligned offset inside the arena and the size
    its step says; its recorded lifetime is the true one; an in-place tensor
    overwrites exactly the input liveness allows, at the same offset; and any two
    tensors sharing a byte are ordered in time (serially: disjoint step ranges;
    with happens_before: every step touching one happens-before the step writing
    the other). `keep` defaults to the plan's fetched outputs.
    """
    specs = liveness(steps, plan.external, plan.keep if keep is None else keep,
                     happens_before)
    placed = plan.by_name
    arena: list[TensorSpec] = []      # the true specs, with the plan's offsets
    for spec in specs.values():
        mine = placed.get(spec.name)
        if mine is None:
            raise PlanError(f"the plan has no entry for {spec.name} (step {spec.defined_at})")
        if spec.kind not in ARENA_KINDS:
            if mine.offset is not None:
                raise PlanError(f"{spec.name} is a {spec.kind} (outside the arena) but the "
                                f"plan puts it at offset {mine.offset}")
            continue
        _check_placement(plan, spec, mine)
        _check_inplace(placed, spec, mine)
        if spec.nbytes:
            # (liveness made `spec` for this check alone: set the plan's place on it)
            spec.offset, spec.inplace_of = mine.offset, mine.inplace_of
            arena.append(spec)
    _check_sharing(arena, happens_before, steps)


def _check_placement(plan: MemoryPlan, spec: TensorSpec, mine: TensorSpec) -> None:
    """The plan's entry `mine` for arena tensor `spec`: an aligned offset inside the
    arena, the step's size, the true lifetime."""
    if mine.offset is None:
        raise PlanError(f"{spec.name} (step {spec.defined_at}) has no offset in the arena")
    if mine.nbytes != spec.nbytes:
        raise PlanError(f"the plan gives {spec.name} {mine.nbytes} bytes, its step "
                        f"writes {spec.nbytes}")
    if mine.offset < 0 or mine.offset % plan.alignment:
        raise PlanError(f"{spec.name} has offset {mine.offset}, not a non-negative "
                        f"multiple of the alignment {plan.alignment}")
    if mine.offset + mine.nbytes > plan.arena_bytes:
        raise PlanError(f"{spec.name} at [{mine.offset}, {mine.offset + mine.nbytes}) "
                        f"runs past the end of the {plan.arena_bytes}-byte arena")
    if (mine.first_step, mine.last_step) != (spec.first_step, spec.last_step):
        raise PlanError(f"the plan says {spec.name} is alive over steps "
                        f"{mine.first_step}..{mine.last_step}, but the steps say "
                        f"{spec.first_step}..{spec.last_step}")


def _check_inplace(placed: Mapping[str, TensorSpec], spec: TensorSpec,
                   mine: TensorSpec) -> None:
    """An in-place entry overwrites exactly the input liveness allows, at its offset."""
    if mine.inplace_of is None:
        return
    if mine.inplace_of != spec.inplace_of:
        why = ("its step declares no such in-place input, or the input is still "
               "read afterwards, fetched, or of another size")
        raise PlanError(f"{spec.name} is planned in place over {mine.inplace_of}, "
                        f"which is not legal: {why}")
    if placed[mine.inplace_of].offset != mine.offset:
        raise PlanError(f"{spec.name} is in place over {mine.inplace_of} but at "
                        f"another offset ({mine.offset} vs "
                        f"{placed[mine.inplace_of].offset})")


def _check_sharing(arena: list[TensorSpec], happens_before: HappensBefore | None,
                   steps: Sequence[PlanStep]) -> None:
    """Any two arena tensors sharing a byte are ordered in time."""
    # Tensors that share bytes must be ordered in time. That relation is transitive
    # (a dead before b is written, b dead before c is written: a dead before c), so
    # each tensor is checked only against the latest earlier tensor(s) on each of
    # its bytes: a sweep in birth order over a map of byte ranges to their last
    # occupant. Each tensor replaces the segments it covers, so the sweep checks
    # O(tensors) pairs, not every pair that ever shares a byte.
    arena.sort(key=lambda t: t.first_step)
    starts: list[int] = [0]                # segment k covers [starts[k], starts[k+1])
    owners: list[TensorSpec | None] = [None]
    for b in arena:
        lo, hi = b.offset, b.offset + b.nbytes
        _split_segment(starts, owners, lo)
        _split_segment(starts, owners, hi)
        i, j = bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)
        checked: set[str] = set()
        for a in owners[i:j]:
            if a is not None and a.name != b.inplace_of and a.name not in checked:
                checked.add(a.name)
                _check_pair(a, b, a.last_step, happens_before, steps)
        starts[i:j] = [lo]
        owners[i:j] = [b]


def _split_segment(starts: list[int], owners: list, at: int) -> None:
    """Make `at` a segment boundary of the byte map (both halves keep the owner)."""
    k = bisect.bisect_right(starts, at) - 1
    if starts[k] != at:
        starts.insert(k + 1, at)
        owners.insert(k + 1, owners[k])


def _check_pair(a: TensorSpec, b: TensorSpec, a_last: int,
                happens_before: HappensBefore | None, steps: Sequence[PlanStep]) -> None:
    """a (born first) and b share bytes: a must be dead before b is written."""
    lo, hi = max(a.offset, b.offset), min(a.offset + a.nbytes, b.offset + b.nbytes)
    where = (f"{a.name} (bytes [{a.offset}, {a.offset + a.nbytes}), steps "
             f"{a.first_step}..{a.last_step}) and {b.name} (bytes [{b.offset}, "
             f"{b.offset + b.nbytes}), steps {b.first_step}..{b.last_step}) share bytes "
             f"[{lo}, {hi})")
    if a_last >= b.first_step:
        raise PlanError(f"unsafe plan: {where} while both are alive at step {b.first_step}")
    if happens_before is None:
        return
    if a.kind == "output":
        raise PlanError(f"unsafe plan: {where}, but {a.name} is fetched and must survive "
                        "to the end of the run")
    last_on_stream: dict[int, int] = {}      # a stream runs in order: its last touch
    for t in set(a.uses) | {a.defined_at}:
        s = steps[t].stream
        last_on_stream[s] = max(t, last_on_stream.get(s, t))
    late = [t for t in sorted(last_on_stream.values())
            if not happens_before(t, b.defined_at)]
    if late:
        verb = "writes" if late[-1] == a.defined_at else "reads"
        raise PlanError(f"unsafe plan: {where}, but step {late[-1]} (which {verb} "
                        f"{a.name}) does not happen before step {b.defined_at} "
                        f"(which writes {b.name})")


# ----------------------------------------------------------------------------------
# Planner input from a graph (used by tests, benchmarks and the debugger)
# ----------------------------------------------------------------------------------

def in_arena(node: Node) -> bool:
    """Whether `node`'s value is an arena tensor. Sources are not (feeds are the
    caller's arrays, variables the Session's store, constants bound once when the
    program is compiled), nor is the value of an op that writes a variable in place
    (OpDef.mutates: an assign's value is the variable's own buffer)."""
    return source_kind(node) is None and mutated_input(node) is None


def node_nbytes(node: Node) -> int:
    """Bytes of a node's value (its shape and dtype must be known)."""
    nbytes = tensor_nbytes(node.shape, node.dtype)
    if nbytes is None:
        raise PlanError(f"{node.name} ({node.op}, created at {node.where}) has no concrete "
                        "shape; plan a specialized graph (compile does that)")
    return nbytes


def node_scratch(node: Node, xp: Any = np) -> int:
    """Bytes of scratch memory `node`'s kernel on array module `xp` needs while it
    runs (OpDef.scratch), 0 for none."""
    scratch = REGISTRY[node.op].scratch
    if scratch is None:
        return 0
    return scratch(xp, [i.shape for i in node.inputs], [i.dtype for i in node.inputs],
                   node.attrs)


def steps_from_graph(graph: Graph, order: Sequence[Node] | None = None, xp: Any = np
                     ) -> tuple[list[PlanStep], dict[str, str], set[str]]:
    """(steps, external, keep) for plan_memory, from a specialized graph.

    The steps follow `order` (default: the graph's topological order); placeholders,
    variables and constants are external (OpDef.source); an assign's value is the
    variable's buffer, so it needs 0 arena bytes (OpDef.mutates). An op's in-place
    input is offered when it has the output's shape and dtype and is not read twice
    by the op. A step's scratch is what its kernel on array module `xp` asks for
    (OpDef.scratch).
    """
    order = graph.nodes if order is None else order
    external: dict[str, str] = {}
    steps: list[PlanStep] = []
    for node in order:
        opdef = REGISTRY[node.op]   # (looked up once: this runs per node, per compile)
        if opdef.source is not None:
            external[node.name] = opdef.source
            continue
        inplace = opdef.inplace
        if inplace is not None:
            source = node.inputs[inplace] if inplace < len(node.inputs) else None
            if (source is None or not in_arena(source)
                    or source.shape != node.shape or source.dtype != node.dtype
                    or node.inputs.count(source) > 1):
                inplace = None
        nbytes = node_nbytes(node) if opdef.mutates is None else 0    # in_arena(node)
        scratch = 0 if opdef.scratch is None else node_scratch(node, xp)
        steps.append(PlanStep(node.name, [i.name for i in node.inputs], nbytes, inplace,
                              scratch=scratch))
    keep = {o.name for o in graph.outputs if source_kind(o) is None}
    return steps, external, keep


def steps_in_order(planned: tuple[list[PlanStep], dict[str, str], set[str]],
                   order: Sequence[Node]) -> tuple[list[PlanStep], dict[str, str], set[str]]:
    """`steps_from_graph(graph, order)`, from `planned` = `steps_from_graph(graph)`:
    a node's step does not depend on the order, so several orders can share them
    (the steps are the same objects, reordered)."""
    steps, external, keep = planned
    step_of = {step.name: step for step in steps}
    return [step_of[node.name] for node in order if node.name in step_of], external, keep
