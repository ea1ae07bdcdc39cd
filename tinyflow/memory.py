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
   greedy heuristics real systems use (`arena.py`: NNVM's refcount free list,
   TensorFlow Lite's greedy by size and by breadth, and our greedy by conflicts)
   and keep the smallest result.
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyflow.arena import STRATEGIES, Block, Conflicts, HappensBefore, lower_bound
from tinyflow.graph import Graph, Node, TinyFlowError, tensor_nbytes
from tinyflow.ops import REGISTRY
from tinyflow.registry import mutated_input, source_kind

ALIGNMENT = 64       # bytes; every offset is a multiple (cache lines, SIMD loads)
ARENA_KINDS = ("intermediate", "output", "scratch")   # the kinds that live in the arena



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
# 3. Arena assignment. In-place chains are merged into blocks here; arena.py
#    places the blocks (a strategy is a function (blocks, conflicts) -> offsets).
# ----------------------------------------------------------------------------------



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
