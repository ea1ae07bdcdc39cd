"""Recording an eager run for the debugger: `tf.debug.record` around eager code.

The static half records a compiled Program (its graphs per pass, schedule, plan and
timelines). Eager code has no Program, so `EagerLog` builds the same DebugRecord
from the ops as they run: each op a node of a graph (the tape, drawn), its time an
event on the timeline, and its output's block in the caching allocator the memory
view's "plan", so the debugger shows an eager run with the views it already has.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from tinyflow.allocator import ROUND, Block, CachingAllocator
from tinyflow.graph import user_source_line


class EagerLog:
    """What `tf.debug.record` keeps of eager ops: each op as a node of a graph (the
    tape, drawn), its time on the timeline, and its output's block in the caching
    allocator as the memory view's "plan" (segments laid end to end, each block's
    reason taken from the allocator: a block waiting in the fast bin of its size, the
    best-fitting free block, or a new segment).
    """

    MAX_OPS = 20_000   # a record is for reading; a longer run keeps its first ops

    def __init__(self, alloc: CachingAllocator, state: Any) -> None:
        """`state`: the recording thread's eager state (eager._State), read for
        whether an op runs in a backward pass or an optimizer step (passed in:
        eager.py imports this module, not the reverse)."""
        self.alloc = alloc
        self.state = state
        self.was_recording, alloc.record = alloc.record, True
        self.first_event = len(alloc.events)
        # The allocator's peaks are its lifetime's; the record's are this recording's,
        # from what was held when it began and the figures each event carries.
        self.start_allocated, self.start_reserved = alloc.allocated, alloc.reserved
        self.nodes: list[dict] = []
        self.events: list[dict] = []
        self.tensors: list[dict] = []
        # Tensor -> node name, while the Tensor lives: keyed by id(), a dead Tensor's
        # name went to the next Tensor given its id (a new input read as `relu_0`)
        self.names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.inputs_named = 0
        self.by_block: dict[int, dict] = {}          # live block id -> tensor entry
        self.born: set[int] = set()   # blocks allocated since recording began
        self.seen_events = self.first_event
        self.start = None

    def name_of(self, t: Any) -> str:
        name = self.names.get(t)
        if name is None:  # made before recording began (a parameter, an input)
            name = self.names[t] = f"input_{self.inputs_named}"
            self.inputs_named += 1
            self.nodes.append({"id": name, "op": "placeholder", "inputs": [],
                               "shape": list(t.shape), "dtype": t.dtype.name,
                               "bytes": t.data.nbytes, "where": "<before recording>",
                               "attrs": {}, "provenance": [name], "phase": "forward"})
            self._add_earlier_block(name, t)
        return name

    def _add_earlier_block(self, name: str, t: Any) -> None:
        """The block of a Tensor no recorded op made: one made before recording (a
        parameter, optimizer state), alive from the first step, or one made since by
        `tensor()` (an input batch), alive from now. The memory view then shows what
        holds those bytes instead of a gap the allocator's peak counts."""
        block = getattr(t, "_block", None)
        if (block is None or getattr(t, "_alloc", None) is not self.alloc
                or block.id in self.by_block or not block.allocated):
            # (a literal outside the allocator, a block of another allocator, another
            # thread's: block ids and segments are each allocator's own; or a block
            # already listed)
            return
        here = block.id in self.born
        entry = {"node": name, "block": block, "nbytes": block.size,
                 "kind": "feed" if here else "variable",
                 "first_step": len(self.events) if here else 0, "last_step": None,
                 "reason": "made by tensor(), outside the recorded ops" if here else
                           "allocated before recording began"}
        self.tensors.append(entry)
        self.by_block[block.id] = entry

    def add(self, op: str, inputs: Sequence[Any], out: Any, block: Block,
            began: float, ended: float, scratch: tuple[Block, int] | None = None) -> None:
        """An op whose result `out` went into a new `block` of the allocator, and whose
        kernel had `scratch` = (block, bytes) during its step (`_run_with_scratch`)."""
        step = self._add_op(op, inputs, out, began, ended, {})
        if step is None:
            return
        name = self.names[out] = f"{op}_{step}"
        entry = {"node": name, "block": block, "nbytes": block.size, "kind": "intermediate",
                 "first_step": step, "last_step": None, "reason": self._reason(block)}
        self.tensors.append(entry)
        self.by_block[block.id] = entry
        if scratch is not None:
            self._add_scratch(name, step, scratch)

    def _add_scratch(self, name: str, step: int, scratch: tuple[Block, int]) -> None:
        # (already given back: alive at this step only)
        block, nbytes = scratch
        self.tensors.append({"node": name, "block": block, "nbytes": nbytes,
                             "kind": "scratch", "first_step": step, "last_step": step,
                             "reason": self._reason(block)})

    def add_inplace(self, op: str, inputs: Sequence[Any], target: Any,
                    began: float, ended: float, attrs: dict | None = None,
                    scratch: tuple[Block, int] | None = None) -> None:
        """An update written into `target`'s own block (`Tensor.sub_` and the like):
        a node and a timeline event but no new block (beside the `scratch` it may
        have used during its step). `target` keeps its name: a parameter updated
        in place is still the input the next step's forward reads (the debugger's
        overview tells forward from optimizer by that)."""
        step = self._add_op(op, inputs, target, began, ended,
                            {"in_place": True, **(attrs or {})})
        if step is not None and scratch is not None:
            self._add_scratch(f"{op}_{step}", step, scratch)

    def _add_op(self, op: str, inputs: Sequence[Any], out: Any, began: float,
                ended: float, attrs: dict) -> int | None:
        """The op as a node named `<op>_<step>` and a timeline event; its step, or
        None once the record is full."""
        if len(self.events) >= self.MAX_OPS:
            return None
        if self.start is None:
            self.start = began
        step = len(self.events)
        self._note_frees(step)
        name = f"{op}_{step}"
        phase = "backward" if self.state.in_backward else "forward"
        # (the record's phases are forward/backward; the overview finds an eager
        # tape's optimizer ops by this attribute, or by their reading a gradient)
        if self.state.in_optimizer:
            attrs = {**attrs, "optimizer_step": True}
        self.nodes.append({"id": name, "op": op, "inputs": [self.name_of(t) for t in inputs],
                           "shape": list(out.shape), "dtype": out.dtype.name,
                           "bytes": out.data.nbytes, "where": user_source_line(),
                           "attrs": attrs, "provenance": [name], "phase": phase})
        self.events.append({"step": step, "node": name, "op": op, "stream": 0,
                            "start": began - self.start, "end": ended - self.start,
                            "bytes": int(out.data.nbytes), "summary": None})
        return step

    def _reason(self, block: Block) -> str:
        # The op's mallocs are among the allocator's last events: its output's, then
        # (for a kernel with scratch) the scratch block's alloc and free, each alloc
        # perhaps after a new segment's event.
        for event in reversed(self.alloc.events[-5:]):
            if event["event"] == "alloc" and event["block"] == block.id:
                return event["reason"]
        return ""

    def _note_frees(self, step: int) -> None:
        events = self.alloc.events
        for event in events[self.seen_events:]:
            if event["event"] == "alloc":
                self.born.add(event["block"])
            elif event["event"] == "free" and event["block"] in self.by_block:
                self.by_block.pop(event["block"])["last_step"] = max(step - 1, 0)
        self.seen_events = len(events)

    def to_record(self, title: str, command: str) -> dict:
        from tinyflow import trace
        self.alloc.record = self.was_recording
        last = max(len(self.events) - 1, 0)
        self._note_frees(last + 1)
        bases, base = {}, 0
        for seg in self.alloc.segments:
            bases[seg.id] = base
            base += seg.buffer.size
        record = trace.empty_record(title, command=command)
        record["graphs"] = [{"pass": "eager", "index": 0, "seconds": 0.0, "changed": False,
                             "nodes": self.nodes,
                             "outputs": [self.nodes[-1]["id"]] if self.nodes else []}]
        record["schedule"] = [{"step": e["step"], "node": e["node"], "op": e["op"],
                               "stream": 0, "waits": [], "records_event": None}
                              for e in self.events]
        events = self.alloc.events[self.first_event:]
        peak_allocated = max([self.start_allocated, *(e["allocated"] for e in events)])
        peak_reserved = max([self.start_reserved, base, *(e["reserved"] for e in events)])
        tensors = [{"node": t["node"], "offset": bases[t["block"].segment] + t["block"].offset,
                    "nbytes": t["nbytes"], "first_step": t["first_step"],
                    "last_step": last if t["last_step"] is None else t["last_step"],
                    "inplace_of": None, "kind": t["kind"], "reason": t["reason"]}
                   for t in self.tensors]
        record["memory_plan"] = {
            "strategy": "caching allocator", "arena_bytes": peak_reserved,
            "naive_bytes": sum(t["nbytes"] for t in tensors),
            "lower_bound_bytes": peak_allocated, "alignment": ROUND,
            "strategies": {"caching allocator (reserved)": peak_reserved,
                           "allocated peak": peak_allocated},
            "tensors": tensors}
        record["timelines"] = [{"run": 0, "label": "eager run", "events": self.events}]
        return record
