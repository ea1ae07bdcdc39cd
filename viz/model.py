"""What the debugger knows about a record: indexes built once, questions answered fast.

A DebugRecord (tinyflow/trace.py) is plain data. The views ask it the same questions
over and over while the user moves the cursor: which step ran this node, which
timeline event, which tensor holds it, what a pass added and removed, which events
lie on the critical path, which tensors shared this block of the arena. `RecordModel`
builds the indexes for those questions once, in the loading worker, so moving the
cursor never scans the record. Nothing here imports Textual: it is tested on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tinyflow import trace
from tinyflow.memory import format_bytes


RANK_LANE = re.compile(r"^rank(\d+)/")   # a parallel run's lanes: rank2/compute


@dataclass
class PassInfo:
    """One pipeline stage: its graph, what changed, and the rewrites that changed it."""

    index: int                 # position in record["graphs"]
    name: str
    seconds: float
    changed: bool
    nodes_before: int
    nodes_after: int
    added: list[str] = field(default_factory=list)     # ids new in this graph
    removed: list[str] = field(default_factory=list)   # ids of the previous graph gone
    rewrites: list[dict] = field(default_factory=list)


@dataclass
class Blame:
    """Why a tensor sits where it does in the arena (the memory view's answer)."""

    tensor: dict
    took_from: dict | None           # the freed tensor whose space it took, if any
    inplace_of: dict | None          # the input it overwrites in place, if any
    sharers: list[dict]              # every other tensor that used any of its bytes


class RecordModel:
    """Indexes over one record. Cheap to query; built once per loaded record."""

    def __init__(self, record: dict, source: str = "") -> None:
        self.record = record
        self.source = source
        self.meta = record["meta"]
        self.graphs: list[dict] = record["graphs"]
        self._nodes: dict[int, dict[str, dict]] = {}
        self._consumers: dict[int, dict[str, list[str]]] = {}
        self.streams: dict[int, str] = {s["id"]: s["name"] for s in record["streams"]}
        self.schedule: list[dict] = record["schedule"]
        self.step_of: dict[str, int] = {e["node"]: e["step"] for e in self.schedule}
        self.entry_of_step: dict[int, dict] = {e["step"]: e for e in self.schedule}
        self.plan: dict | None = record["memory_plan"]
        self.tensors: list[dict] = self.plan["tensors"] if self.plan else []
        # (a node's value; the scratch of its kernel, also named by the node, is a
        # block of the arena map but not the node's tensor)
        self.tensor_of: dict[str, dict] = {t["node"]: t for t in self.tensors
                                           if t["kind"] != "scratch"}
        self.scratch_of: dict[str, dict] = {t["node"]: t for t in self.tensors
                                            if t["kind"] == "scratch"}
        self.timelines: list[dict] = record["timelines"]
        for timeline in self.timelines:
            for event in timeline["events"]:
                self.streams.setdefault(event["stream"], f"stream{event['stream']}")
        self._events_of: dict[int, dict[str, dict]] = {}
        self._lanes: dict[int, dict[int, list[dict]]] = {}
        self._critical: dict[int, set[int]] = {}
        self._chains: dict[int, dict[int, tuple[dict, float]]] = {}
        self._received: dict[int, dict[int, list[dict]]] = {}
        self._repeats: dict[int, bool] = {}
        self._spans: dict[int, tuple[float, float]] = {}
        self._nonfinite: dict[int, set[str]] = {}
        self.passes = self._pass_infos()
        self._provenance: dict[str, str] | None = None
        self._changes: dict[str, dict[str, tuple[PassInfo, str | None]]] = {}
        self.live = live_bytes(record)

    # -- graphs and passes -----------------------------------------------------------

    @property
    def last(self) -> int:
        """Index of the graph that ran (the last pass's output)."""
        return len(self.graphs) - 1

    def nodes(self, index: int | None = None) -> dict[str, dict]:
        """{id: node} of graph `index` (default: the last), in topological order."""
        index = self.last if index is None else index
        if not 0 <= index < len(self.graphs):   # (a record may hold no graph at all)
            return {}
        if index not in self._nodes:
            self._nodes[index] = {n["id"]: n for n in self.graphs[index]["nodes"]}
        return self._nodes[index]

    def consumers(self, index: int | None = None) -> dict[str, list[str]]:
        """{id: ids of the nodes that read it} in graph `index`."""
        index = self.last if index is None else index
        if index not in self._consumers:
            users: dict[str, list[str]] = {n: [] for n in self.nodes(index)}
            for node in self.nodes(index).values():
                for inp in node["inputs"]:
                    users[inp].append(node["id"])
            self._consumers[index] = users
        return self._consumers[index]

    def _pass_infos(self) -> list[PassInfo]:
        infos = []
        by_pass: dict[str, list[dict]] = {}
        for rw in self.record["rewrites"]:
            by_pass.setdefault(rw["pass"], []).append(rw)
        previous: list[str] = []
        for k, graph in enumerate(self.graphs):
            ids = [n["id"] for n in graph["nodes"]]
            if k == 0:
                added, removed = [], []
            else:
                now, before = set(ids), set(previous)
                added = [i for i in ids if i not in before]
                removed = [i for i in previous if i not in now]
            infos.append(PassInfo(k, graph["pass"], graph["seconds"], graph["changed"],
                                  len(previous) if k else len(ids), len(ids), added, removed,
                                  by_pass.get(graph["pass"], []) if k else []))
            previous = ids
        return infos

    def changed_passes(self) -> list[int]:
        """Indexes of the graphs worth stepping to: the input and every pass that
        changed something (the no-op passes are folded away)."""
        return [p.index for p in self.passes if p.index == 0 or p.changed]

    def find_in(self, node_id: str, index: int) -> str | None:
        """The id in graph `index` that stands for `node_id` (itself, or the node
        whose provenance lists it, e.g. the fused node it became)."""
        nodes = self.nodes(index)
        if node_id in nodes:
            return node_id
        if index == self.last:
            return self.final_id(node_id)
        for node in nodes.values():
            if node_id in node["provenance"]:
                return node["id"]
        return None

    def locate(self, node_id: str, index: int) -> str | None:
        """The id to show in the drawing of graph `index` for the cursor `node_id`:
        the node itself (also when pass `index` removed it: the drawing shows it
        struck through), the node that took it over (fused, rewritten), or, for a
        node that only exists later, the first of its provenance found here."""
        if not 0 <= index < len(self.graphs):
            return None
        if node_id in self.nodes(index) or node_id in self.passes[index].removed:
            return node_id
        found = self.find_in(node_id, index)
        if found:
            return found
        for k in range(len(self.graphs) - 1, -1, -1):
            node = self.nodes(k).get(node_id)
            if node is not None:
                for origin in node["provenance"]:
                    if origin != node_id and (origin in self.nodes(index)):
                        return origin
                break
        return None

    def final_id(self, node_id: str) -> str | None:
        """The node of the program that ran which stands for `node_id`."""
        final = self.nodes()
        if node_id in final:
            return node_id
        if self._provenance is None:
            self._provenance = {}
            for node in final.values():
                for p in node["provenance"]:
                    self._provenance.setdefault(p, node["id"])
            # A node that a rewrite removed maps to what the rewrite added.
            for rw in self.record["rewrites"]:
                for gone in rw["removed"]:
                    for new in rw["added"]:
                        if new in final:
                            self._provenance.setdefault(gone, new)
        return self._provenance.get(node_id)

    def _changed_by(self, side: str) -> dict[str, tuple[PassInfo, str | None]]:
        """{id: (the first pass whose `side` ("added" or "removed") lists it, the
        reason of its first rewrite that does)}: built once, since the inspector asks
        on every cursor move and a big record's passes remove thousands of nodes."""
        if side not in self._changes:
            index: dict[str, tuple[PassInfo, str | None]] = {}
            for p in self.passes:
                mine = {i for i in getattr(p, side) if i not in index}
                reasons: dict[str, str] = {}
                for rw in p.rewrites:
                    for i in rw[side]:
                        if i in mine:
                            reasons.setdefault(i, rw["reason"])
                index.update((i, (p, reasons.get(i))) for i in mine)
            self._changes[side] = index
        return self._changes[side]

    def fate(self, node_id: str) -> str | None:
        """One line: which pass removed `node_id` and why (None if it survived)."""
        found = self._changed_by("removed").get(node_id)
        if found is None:
            return None
        p, reason = found
        into = self.final_id(node_id)
        text = f"removed by {p.name}"
        if reason is not None:
            text += f": {reason}"
        if into and into != node_id:
            text += f" (now {into})"
        return text

    def origin(self, node_id: str) -> str | None:
        """One line: which pass added `node_id` and why (None for input nodes)."""
        found = self._changed_by("added").get(node_id)
        if found is None:
            return None
        p, reason = found
        return f"added by {p.name}" + (f": {reason}" if reason is not None else "")

    def search(self, query: str, index: int | None = None) -> list[str]:
        """Ids of graph `index` whose id, op or source line contains `query`
        (case-insensitive), or whose block in the memory map is labelled with it
        ("conv2d_12 (scratch)": a search for "scratch" finds the nodes whose
        kernels used scratch memory); ids that match exactly first."""
        query = query.strip().lower()
        if not query:
            return []
        nodes = self.nodes(index)
        labelled = {t["node"] for t in self.tensors
                    if query in f"{t['node']} ({t['kind']})".lower()}
        hits = [n["id"] for n in nodes.values()
                if query in n["id"].lower() or query in n["op"].lower()
                or query in n["where"].lower() or n["id"] in labelled]
        return sorted(hits, key=lambda i: i.lower() != query)

    def op_table(self, runs: list[int]) -> list[dict]:
        """The profiler's summary over timelines `runs`: per op its total time,
        count, mean, share of the total and bytes, sorted by total time; and the
        slowest step of that op with how many times its mean it took (the outlier)."""
        rows: dict[str, dict] = {}
        for run in runs:
            for event in self.timelines[run]["events"]:
                row = rows.setdefault(event["op"], {"op": event["op"], "total": 0.0,
                                                    "count": 0, "bytes": 0, "worst": None})
                seconds = event["end"] - event["start"]
                row["total"] += seconds
                row["count"] += 1
                row["bytes"] += event["bytes"]
                if row["worst"] is None or seconds > row["worst"][0]:
                    row["worst"] = (seconds, self.event_name(event, run), run)
        grand = sum(r["total"] for r in rows.values()) or 1e-12
        for row in rows.values():
            row["mean"] = row["total"] / row["count"]
            row["share"] = row["total"] / grand
            row["outlier"] = row["worst"][0] / row["mean"] if row["mean"] else 0.0
        return sorted(rows.values(), key=lambda r: -r["total"])

    # -- runs and the timeline -------------------------------------------------------

    def events_of(self, run: int) -> dict[str, dict]:
        """{node id: its step's event} in timeline `run` (events with a step only)."""
        if not self.timelines:
            return {}
        if run not in self._events_of:
            self._events_of[run] = {e["node"]: e for e in self.timelines[run]["events"]
                                    if e["step"] is not None}
        return self._events_of[run]

    def lanes(self, run: int) -> dict[int, list[dict]]:
        """{stream: its events sorted by start} of timeline `run`; every stream of
        the record gets a lane, also an empty one."""
        if run not in self._lanes:
            lanes: dict[int, list[dict]] = {s: [] for s in sorted(self.streams)}
            if self.timelines:
                for event in self.timelines[run]["events"]:
                    lanes.setdefault(event["stream"], []).append(event)
            for events in lanes.values():
                events.sort(key=lambda e: (e["start"], e["end"]))
            self._lanes[run] = lanes
        return self._lanes[run]

    def timeline_at_step(self, step: int) -> int | None:
        """Index of the timeline the record ties to training step `step`, or None.

        Scalars are logged by training step; tinyflow numbers a compiled program's
        timelines by that program's own runs ("run 1319"). The two are not the same
        count: an epoch's short last batch compiles and runs another program, so
        after 30 epochs run 1319 of the batch-32 program is step ~1349. Only a
        timeline carrying the step it ran for (a "step" key, which the record
        format allows as an extension) is linked; equal numbers are not."""
        for k, timeline in enumerate(self.timelines):
            if timeline.get("step") == step and isinstance(step, int):
                return k
        return None

    def span(self, run: int) -> tuple[float, float]:
        """(first start, last end) of timeline `run` (the inspector asks per move)."""
        if run not in self._spans:
            events = self.timelines[run]["events"] if self.timelines else []
            self._spans[run] = (min(e["start"] for e in events),
                                max(e["end"] for e in events)) if events else (0.0, 1e-6)
        return self._spans[run]

    def nonfinite(self, run: int) -> set[str]:
        """Ids of the nodes whose value held a NaN or Inf in timeline `run` (the graph
        drawing colours them), found once per run."""
        if run not in self._nonfinite:
            self._nonfinite[run] = {
                i for i, e in self.events_of(run).items()
                if e.get("summary") and (e["summary"]["nan"] or e["summary"]["inf"])}
        return self._nonfinite[run]

    def critical_path(self, run: int) -> set[int]:
        """ids (Python id()) of the events on the critical path of timeline `run`.

        Walk back from the event that ends last; at each event, step to whichever
        predecessor finished last (an input's step, the previous event on the same
        stream, the step it waited on, or, in a parallel run, the event on another
        rank it received data from: see `received`): that is what it was waiting
        for. The result is the chain of work that decided the run's length.

        Events are told apart by identity, never by name: in a parallel run every
        rank has its own "F0" and its own "all-gather[0]".
        """
        if run not in self._critical:
            self._chains[run] = self._walk_critical(run)
            self._critical[run] = set(self._chains[run])
        return self._critical[run]

    def critical_busy(self, run: int) -> float:
        """Seconds of work on the critical path of timeline `run`: each event counts
        from its start, or from the end of what it waited for if that came later (a
        ring step that received its chunk halfway was waiting until then). The rest
        of the run's length is time the path spent waiting: transfers, idle ranks."""
        self.critical_path(run)
        return sum(event["end"] - max(event["start"], waited)
                   for event, waited in self._chains[run].values())

    def _walk_critical(self, run: int) -> dict[int, tuple[dict, float]]:
        """{id(event): (event, end of what it waited for)} along the critical path."""
        events = self.timelines[run]["events"] if self.timelines else []
        chain: dict[int, tuple[dict, float]] = {}
        if not events:
            return chain
        previous = self._lane_predecessors(run)
        received = self.received(run)
        event = max(events, key=lambda e: e["end"])
        while event is not None and id(event) not in chain:
            # Work that had to finish before this event started ...
            before = [previous.get(id(event)), *self._producers(event, run)]
            candidates = [c for c in before
                          if c is not None and c["end"] <= event["start"] + 1e-9]
            # ... and data received from another rank, which may arrive while the
            # event runs (the event ends only once it has): it must have ended
            # before this event did, and started earlier (so the walk goes back).
            candidates += [c for c in received.get(id(event), ())
                           if c["end"] <= event["end"] + 1e-9 and c["start"] < event["start"]]
            waited_for = max(candidates, key=lambda e: e["end"]) if candidates else None
            chain[id(event)] = (event, waited_for["end"] if waited_for else event["start"])
            event = waited_for
        return chain

    def _lane_predecessors(self, run: int) -> dict[int, dict | None]:
        """{id(event): the event before it on its lane (None for a lane's first)}."""
        previous: dict[int, dict | None] = {}
        for lane in self.lanes(run).values():
            before = None
            for event in lane:
                previous[id(event)] = before
                before = event
        return previous

    def _producers(self, event: dict, run: int) -> list[dict | None]:
        """The events of a program step's producers: its inputs' steps and the steps
        its stream waited on (an event that is no program step has none)."""
        node = self.nodes().get(event["node"]) if event["step"] is not None else None
        if node is None:
            return []
        by_node = self.events_of(run)
        found = [by_node.get(i) for i in node["inputs"]]
        entry = self.entry_of_step.get(event["step"])
        for wait in entry["waits"] if entry else ():
            producer = self.entry_of_step.get(wait["step"])
            if producer:
                found.append(by_node.get(producer["node"]))
        return found

    # -- parallel records: events that are not steps of one program ----------------

    def rank_of(self, event: dict) -> int | None:
        """The rank that ran `event`: from its lane's name (``rank2/compute``, how
        tinyflow/rank_trace.py names the streams of a parallel run), else its args."""
        found = RANK_LANE.match(self.streams.get(event["stream"], ""))
        if found:
            return int(found.group(1))
        rank = event_args(event).get("rank")
        return rank if isinstance(rank, int) and not isinstance(rank, bool) else None

    def received(self, run: int) -> dict[int, list[dict]]:
        """{id(event): events of other ranks it received data from} in timeline `run`.

        A parallel run's record holds no dependencies between ranks, only what each
        event's args say; two schemes say enough to rebuild them:

        * a pipeline's F and B per microbatch (tinyflow/pipeline.py): stage r's
          forward of microbatch m reads the activation stage r-1's F of m sent; its
          backward reads the gradient stage r+1's B of m sent (the last stage: its
          own F of m);
        * a ring collective's steps (``all-gather[k]`` with args ``dst``, from
          rank_trace.collective_events): in step k each rank sends to dst and
          receives from the rank that sends to it, which sent when it began its
          step k, so the receiver waited on whatever that rank did just before.

        The n-th event of a name on one rank pairs with the n-th of the same name on
        another (one pipeline step, one collective call after another).
        """
        if run in self._received:
            return self._received[run]
        events = self.timelines[run]["events"] if self.timelines else []
        nth: dict[tuple, dict] = {}      # (rank, name, n) -> event
        keyed: list[tuple[dict, int, int]] = []
        counts: dict[tuple, int] = {}
        for event in sorted(events, key=lambda e: e["start"]):
            rank = self.rank_of(event)
            if rank is None:
                continue
            n = counts[(rank, event["node"])] = counts.get((rank, event["node"]), -1) + 1
            nth[(rank, event["node"], n)] = event
            keyed.append((event, rank, n))
        found: dict[int, list[dict]] = {}
        senders = self._ring_senders(keyed)
        for event, rank, n in keyed:
            args = event_args(event)
            sources = []
            kind, micro = args.get("kind"), args.get("microbatch")
            if kind == "F" and micro is not None:
                sources.append(nth.get((rank - 1, event["node"], n)))
            elif kind == "B" and micro is not None:
                later = nth.get((rank + 1, event["node"], n))
                sources.append(later if later is not None else
                               nth.get((rank, f"F{micro}", n)))
            elif isinstance(args.get("dst"), int):
                sources.append(senders.get((event["node"], n, rank)))
            sources = [s for s in sources if s is not None and s is not event]
            if sources:
                found[id(event)] = sources
        self._received[run] = found
        return found

    def _ring_senders(self, keyed: list[tuple[dict, int, int]]) -> dict[tuple, dict]:
        """{(name, n, receiving rank): what the sender ran just before its own n-th
        event of that name}, for events with a "dst" arg (ring steps)."""
        run_lanes: dict[int, list[dict]] = {}
        for event, _, _ in keyed:
            run_lanes.setdefault(event["stream"], []).append(event)
        before: dict[int, dict | None] = {}
        for lane in run_lanes.values():   # already in start order
            for k, event in enumerate(lane):
                before[id(event)] = lane[k - 1] if k else None
        out: dict[tuple, dict] = {}
        for event, _, n in keyed:
            dst = event_args(event).get("dst")
            if isinstance(dst, int) and before.get(id(event)) is not None:
                out[(event["node"], n, dst)] = before[id(event)]
        return out

    def lane_busy(self, run: int) -> dict[int, float]:
        """{stream: seconds it was busy} in timeline `run`: the union of its events'
        intervals (overlapping events on one lane count once)."""
        busy = {}
        for stream, lane in self.lanes(run).items():
            total, reach = 0.0, float("-inf")
            for event in lane:   # sorted by start
                start = max(event["start"], reach)
                if event["end"] > start:
                    total += event["end"] - start
                reach = max(reach, event["end"])
            busy[stream] = total
        return busy

    def event_name(self, event: dict, run: int) -> str:
        """How the views name an event: its node; where names repeat across lanes,
        an event of a parallel run's rank lane or one that is no program step (a
        ring chunk named after the gradient it carries) also names its lane's rank,
        or the lane: "F0@rank1", "matmul_56@comm"."""
        lane = self.streams.get(event["stream"], str(event["stream"]))
        rank = RANK_LANE.match(lane)
        if self._names_repeat(run) and (rank or event["step"] is None):
            return f"{event['node']}@{lane.split('/')[0] if rank else lane}"
        return event["node"]

    def _names_repeat(self, run: int) -> bool:
        if run not in self._repeats:
            seen: dict[str, int] = {}
            repeat = False
            for event in self.timelines[run]["events"] if self.timelines else ():
                if seen.setdefault(event["node"], event["stream"]) != event["stream"]:
                    repeat = True
                    break
            self._repeats[run] = repeat
        return self._repeats[run]

    def event_facts(self, event: dict) -> list[str]:
        """What the record says about an event beyond its bar: its rank and the
        args the scheme recorded (microbatch, logical clock, destination, ...)."""
        facts = []
        rank = self.rank_of(event)
        args = dict(event_args(event))
        args.pop("rank", None)
        if rank is not None:
            facts.append(f"rank {rank}")
        if "microbatch" in args:
            facts.append(f"microbatch {args.pop('microbatch')}")
        if "logical_start" in args and "logical_end" in args:
            facts.append(f"logical clock {args.pop('logical_start'):g} → "
                         f"{args.pop('logical_end'):g}")
        if "dst" in args:
            facts.append(f"sends to rank {args.pop('dst')}")
        if args.get("kind") == event["op"]:
            args.pop("kind")   # "F" already shown as the op
        facts += [f"{k}={v}" for k, v in args.items()]
        return facts

    def waits_of(self, node_id: str, run: int) -> list[str]:
        """Plain sentences: which events the step of `node_id` waited on, and how
        long the gap before it on its own stream was."""
        step = self.step_of.get(node_id)
        if step is None:
            return []
        entry = self.entry_of_step[step]
        events = self.events_of(run)
        lines = []
        for wait in entry["waits"]:
            producer = self.entry_of_step.get(wait["step"], {})
            name = producer.get("node", "?")
            text = (f"waits on event {wait['event']}: {name} (step {wait['step']}) "
                    f"on {self.streams.get(wait['stream'], wait['stream'])}")
            done, mine = events.get(name), events.get(node_id)
            if done and mine:
                text += f", ready {fmt_time(max(0.0, mine['start'] - done['end']))} before start"
            lines.append(text)
        mine = events.get(node_id)
        if mine:
            lane = self.lanes(run)[mine["stream"]]
            k = next(i for i, e in enumerate(lane) if e is mine)
            if k:
                gap = mine["start"] - lane[k - 1]["end"]
                if gap > 0:
                    lines.append(f"idle {fmt_time(gap)} on "
                                 f"{self.streams[mine['stream']]} before it started")
        return lines

    def first_nonfinite(self, run: int) -> str | None:
        """The first node whose value held a NaN or Inf: the check's answer if the
        run stopped at one, else the earliest such step of timeline `run`."""
        check = self.record.get("check")
        if check:
            return check["node"]
        if not self.timelines:
            return None
        bad = [e for e in self.timelines[run]["events"] if e["step"] is not None
               and e.get("summary") and (e["summary"]["nan"] or e["summary"]["inf"])]
        return min(bad, key=lambda e: (e["start"], e["step"]))["node"] if bad else None

    # -- memory ----------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return len(self.schedule)

    def arena_tensors(self) -> list[dict]:
        """The blocks of the arena map: tensors with an offset and at least a byte."""
        return [t for t in self.tensors if t["offset"] is not None and t["nbytes"] > 0]

    def blame(self, node_id: str) -> Blame | None:
        """Why the tensor of `node_id` sits where it does: the freed tensor whose
        space it took, the input it overwrote in place, and all that shared its
        bytes over the run. None when the node has no tensor in the arena."""
        tensor = self.tensor_of.get(node_id)
        if tensor is None:
            return None
        inplace = self.tensor_of.get(tensor["inplace_of"]) if tensor["inplace_of"] else None
        if tensor["offset"] is None or tensor["nbytes"] == 0:
            return Blame(tensor, None, inplace, [])
        lo, hi = tensor["offset"], tensor["offset"] + tensor["nbytes"]
        sharers = [t for t in self.arena_tensors() if t is not tensor
                   and t["offset"] < hi and lo < t["offset"] + t["nbytes"]]
        earlier = [t for t in sharers if t["last_step"] < tensor["first_step"]]
        took = max(earlier, key=lambda t: (t["last_step"], t["nbytes"])) if earlier else None
        sharers.sort(key=lambda t: (t["first_step"], t["offset"]))
        return Blame(tensor, took, inplace, sharers)

    def stats(self) -> dict[str, Any]:
        """Arena, naive and lower-bound bytes, the reuse ratio (naive / arena), and
        what the drawn blocks themselves say: their peak ("listed_peak", the most
        bytes alive at once, sizes aligned as the plan aligns them) and how many
        bytes the record's bound counts beyond it ("unlisted").

        A compiled program's plan lists every tensor of its arena, so its lower
        bound is the listed peak. A caching allocator's record (an eager run, see
        tinyflow/eager_record.py) lists only the blocks its recorded ops allocated
        and reports the allocator's allocated peak as the bound, which also counts
        blocks allocated before (parameters, optimizer state): those bytes are
        "unlisted", and the view must not pretend to know where they are."""
        if not self.plan:
            return {}
        arena = self.plan["arena_bytes"]
        bound = self.plan["lower_bound_bytes"]
        listed = max(self.live.values(), default=0)
        slack = max(self.plan.get("alignment") or 1, 1)
        unlisted = bound - listed if self.live and bound - listed > slack else 0
        # The record's name for its bound where it gives one (a strategy of that
        # size, "allocated peak"), else the usual one.
        bound_name = "lower bound"
        if unlisted:
            bound_name = next((name for name, size in self.plan["strategies"].items()
                               if size == bound), "record's lower bound")
        return {"strategy": self.plan["strategy"], "arena": arena,
                "naive": self.plan["naive_bytes"], "lower_bound": bound,
                "reuse": self.plan["naive_bytes"] / arena if arena else 0.0,
                "strategies": self.plan["strategies"], "listed_peak": listed,
                "unlisted": unlisted, "bound_name": bound_name}


def live_bytes(record: dict) -> dict[int, int]:
    """{schedule step: arena bytes in use}, each tensor counted at its size rounded
    up to the plan's alignment, as the planner places it and as its lower bound
    counts it (trace.live_bytes_per_step counts raw sizes: "peak live 320.0 KiB"
    under "lower bound 320.1 KiB" looked like a contradiction)."""
    plan = record.get("memory_plan")
    if not plan:
        return {}
    align = max(plan.get("alignment") or 1, 1)
    tensors = [{**t, "nbytes": -(-t["nbytes"] // align) * align} for t in plan["tensors"]]
    return trace.live_bytes_per_step({"memory_plan": {**plan, "tensors": tensors},
                                      "schedule": record.get("schedule", [])})


def event_args(event: dict) -> dict:
    """An event's args, flat. tinyflow/rank_trace.py's `scheme_record` files an
    event's own "args" dict (a collective step's rank and dst) under the key "args"
    of the record's args, one level down; both levels are read here."""
    args = dict(event.get("args") or {})
    inner = args.pop("args", None)
    if isinstance(inner, dict):
        args = {**inner, **args}
    return args


def held_per_rank(stats: dict[str, Any]) -> dict[str, int] | None:
    """{"rank 0": bytes, ...} when the plan is a parallel run's, else None.

    A parallel run's record (tinyflow/rank_trace.py, `scheme_record`) has no plan of
    one program: its "plan" is the arrays each rank holds, laid end to end, and the
    plan's "strategies" slot (the only per-name sizes the format has) holds each
    rank's total, named "rank <r>". Those are not arena sizes of other strategies,
    so the memory view must not label them as such.
    """
    sizes = stats.get("strategies") or {}
    rank = lambda name: int(name[5:]) if name.startswith("rank ") and \
        name[5:].isdigit() else None
    if not sizes or any(rank(name) is None for name in sizes):
        return None
    return dict(sorted(sizes.items(), key=lambda kv: rank(kv[0])))   # rank 2 before 10


def fmt_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB' (tinyflow's format_bytes); '-' for a size not known."""
    return "-" if n is None else format_bytes(n)


def fmt_time(seconds: float) -> str:
    """Seconds as a short human unit: '12.3µs', '4.56ms', '1.20s'."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds:.2f}s"


def fmt_shape(shape: list | None) -> str:
    if shape is None:
        return "?"
    return "x".join(str(d) for d in shape) if shape else "scalar"
