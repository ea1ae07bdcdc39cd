"""Every rank's timeline in one DebugRecord: a lane per rank and stream.

A parallel run is N programs at once; its story (a pipeline's bubbles, ZeRO's gathers,
a tree's rounds, a slow rank everyone waits for) is only visible side by side. This
module builds one DebugRecord (trace.py's schema, unchanged) whose streams are named
``rank<r>/<stream>`` (``rank1/compute0``, ``rank1/comm``), so the debugger's timeline
shows one lane per rank and stream without knowing about ranks.

* `merge_records(records)`: the DebugRecords the ranks wrote (`tinyflow launch -n N
  --trace FILE` makes each rank write FILE.rank<r>.json, then merges them into FILE).
  Graphs, rewrites, schedule and memory plan are rank 0's; timelines are merged run by
  run. A record's event times count from the start of that rank's run, so the ranks'
  runs are lined up at their starts (a step begins on all ranks within the time of a
  collective; the lanes are right to that precision).
* `scheme_record(events)`: a record of events the schemes time themselves, in
  perf_counter seconds (one clock for all processes of a machine): a pipeline's F and
  B per microbatch (`Pipeline.events`), collective steps from `comm.trace`
  (`collective_events`). These line up exactly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tinyflow import trace

__all__ = ["merge_records", "merge_files", "scheme_record", "collective_events",
           "rank_stream_name"]


def rank_stream_name(rank: int, stream: str) -> str:
    return f"rank{rank}/{stream}"


def merge_records(records: Sequence[dict], title: str | None = None) -> dict:
    """One record from the ranks' records (rank order): rank 0's program, every
    rank's streams renamed ``rank<r>/<name>``, timelines merged by run number, scalars
    of rank r > 0 prefixed ``rank<r>/``. Events of ranks > 0 keep their schedule step
    in args["step"] (the schedule is rank 0's)."""
    if not records:
        raise ValueError("merge_records needs at least one record")
    first = records[0]
    merged = {**first, "streams": [], "timelines": [], "scalars": {}}
    merged["meta"] = {**first["meta"], "title": title or first["meta"]["title"]}
    runs: dict[int, dict] = {}
    for rank, record in enumerate(records):
        ids = {}
        for stream in record["streams"]:
            ids[stream["id"]] = len(merged["streams"])
            merged["streams"].append({"id": ids[stream["id"]],
                                      "name": rank_stream_name(rank, stream["name"])})
        for timeline in record["timelines"]:
            run = runs.setdefault(timeline["run"], {"run": timeline["run"],
                                                    "label": timeline["label"], "events": []})
            for event in timeline["events"]:
                moved = {**event, "stream": ids[event["stream"]],
                         "args": {**event.get("args", {}), "rank": rank}}
                if rank:
                    moved["args"]["step"] = event["step"]
                    moved["step"] = None
                run["events"].append(moved)
        for name, points in record["scalars"].items():
            merged["scalars"][name if rank == 0 else f"rank{rank}/{name}"] = points
    merged["timelines"] = [runs[k] for k in sorted(runs)]
    for timeline in merged["timelines"]:
        timeline["events"].sort(key=lambda e: e["start"])
    trace.validate(merged)
    return merged


def merge_files(paths: Sequence[str | os.PathLike], out: str | os.PathLike,
                title: str | None = None) -> dict:
    """Load the ranks' record files, merge them (`merge_records`), save to `out`."""
    record = merge_records([trace.load(p) for p in paths], title)
    trace.save(record, out)
    return record


def collective_events(records: Sequence[dict], rank: int) -> list[dict]:
    """Step records of ring / tree collectives (`comm.trace`, see ring_allreduce and
    tree_allreduce) as scheme events on ``rank<r>/comm``."""
    return [{"node": f"{r['phase']}[{r['step']}]", "op": r["phase"],
             "stream": rank_stream_name(rank, "comm"), "start": r["start"], "end": r["end"],
             "bytes": r["bytes"], "args": {"rank": rank, "dst": r["dst"]}}
            for r in records]


def scheme_record(events: Sequence[dict], title: str, label: str = "step",
                  held: dict[int, dict[str, Any]] | None = None) -> dict:
    """A DebugRecord holding one timeline of `events`: dicts with "node", "stream" (a
    name such as "rank2/compute"), "start" and "end" (perf_counter seconds), and
    optionally "op", "bytes", "args". Times become seconds from the first start.

    `held` ({rank: {name: array}}, e.g. each rank's Session.variables) becomes the
    record's graph and memory view: one node per array named ``rank<r>/<name>`` (the
    overview draws a box per rank), laid end to end rank by rank, and each rank's
    total as a "strategy" beside the others (ZeRO's shards and a pipeline stage's
    layers show as per-rank bytes)."""
    record = trace.empty_record(title)
    if held:
        record["graphs"], record["memory_plan"] = _held_bytes(held)
    names = sorted({e["stream"] for e in events}, key=_stream_order)
    ids = {name: k for k, name in enumerate(names)}
    record["streams"] = [{"id": k, "name": name} for name, k in ids.items()] or \
        record["streams"]
    t0 = min((e["start"] for e in events), default=0.0)
    record["timelines"] = [{"run": 0, "label": label, "events": [
        {"step": None, "node": str(e["node"]), "op": str(e.get("op", e.get("kind", "step"))),
         "stream": ids[e["stream"]], "start": e["start"] - t0, "end": e["end"] - t0,
         "bytes": int(e.get("bytes", 0)), "summary": None,
         "args": trace.json_safe(_event_args(e))}
        for e in sorted(events, key=lambda e: e["start"])]}]
    trace.validate(record)
    return record


def _event_args(event: dict) -> dict:
    """What an event says beyond its bar, in one level: its "args" (the rank and
    destination of a ring step) and any other key (a pipeline's microbatch)."""
    args = {k: v for k, v in event.items()
            if k not in ("node", "op", "stream", "start", "end", "bytes", "args")}
    args.update(event.get("args") or {})
    return args


def _held_bytes(held: dict[int, dict[str, Any]]) -> tuple[list[dict], dict]:
    """(graphs, memory_plan) of the arrays each rank holds (see `scheme_record`)."""
    nodes, tensors, per_rank, offset = [], [], {}, 0
    for rank in sorted(held):
        for name, array in held[rank].items():
            node = rank_stream_name(rank, name)
            nodes.append({"id": node, "op": "variable", "inputs": [],
                          "shape": list(array.shape), "dtype": array.dtype.name,
                          "bytes": int(array.nbytes), "where": f"rank {rank}", "attrs": {},
                          "provenance": [node], "phase": "forward"})
            tensors.append({"node": node, "offset": offset, "nbytes": int(array.nbytes),
                            "first_step": 0, "last_step": 0, "inplace_of": None,
                            "kind": "variable", "reason": f"held by rank {rank}"})
            offset += int(array.nbytes)
            per_rank[f"rank {rank}"] = per_rank.get(f"rank {rank}", 0) + int(array.nbytes)
    graph = {"pass": "held by each rank", "index": 0, "seconds": 0.0, "changed": False,
             "nodes": nodes, "outputs": [nodes[-1]["id"]] if nodes else []}
    plan = {"strategy": "bytes held per rank", "arena_bytes": offset, "naive_bytes": offset,
            "lower_bound_bytes": max(per_rank.values(), default=0), "alignment": 1,
            "strategies": per_rank, "tensors": tensors}
    return [graph], plan


def _stream_order(name: str) -> tuple:
    """rank2/compute before rank10/compute: by rank number, then stream name."""
    head, _, rest = name.partition("/")
    number = head[4:] if head.startswith("rank") else ""
    return (int(number) if number.isdigit() else -1, rest)
