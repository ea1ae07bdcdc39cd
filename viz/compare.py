"""Comparing two records: what changed between run A and run B, and why.

The questions are the everyday ones: fusion on vs off, checkpoint="sqrt" vs none,
1 vs 2 streams, two learning rates. Node ids are not stable between two runs (they
carry a global counter), so nodes are matched by *where they come from*: their op
and the user's source line (``where``), in order of appearance, and a fused node by
the sorted ops of its provenance. What is left unmatched is the difference; the
rewrite records that added or removed those nodes say why. Memory plans are compared
by arena size and by the offsets of matched tensors; timelines per op and per
matched node (mean over every recorded run), so "which steps got slower" has an
answer; scalar series by their last and best values.

`compare(a, b)` returns sections of plain lines; `tinyflow diff A B` prints them and
the compare view (``5``) shows them beside the overlaid curves. Nothing here imports
Textual.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from viz.model import RecordModel, fmt_bytes, fmt_time

LISTED = 12   # rows listed per section before "... N more"


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)


def signature(node: dict, nodes: dict[str, dict]) -> tuple:
    """What a node is, independent of its id: op, source line, and for a node made
    of others (fused, folded) the ops it was made from."""
    origin = tuple(sorted(nodes[p]["op"] if p in nodes else p.rsplit("_", 1)[0]
                          for p in node["provenance"] if p != node["id"]))
    return (node["op"], node["where"], origin)


def match(a_nodes: dict[str, dict], b_nodes: dict[str, dict]
          ) -> tuple[dict[str, str], list[str], list[str]]:
    """({A id: B id} for matched nodes, ids only in A, ids only in B). Nodes with
    the same signature are paired in topological order."""
    waiting: dict[tuple, list[str]] = {}
    for node in b_nodes.values():
        waiting.setdefault(signature(node, b_nodes), []).append(node["id"])
    for ids in waiting.values():
        ids.reverse()
    pairs: dict[str, str] = {}
    only_a = []
    for node in a_nodes.values():
        same = waiting.get(signature(node, a_nodes))
        if same:
            pairs[node["id"]] = same.pop()
        else:
            only_a.append(node["id"])
    matched_b = set(pairs.values())
    only_b = [i for i in b_nodes if i not in matched_b]
    return pairs, only_a, only_b


def _why(model: RecordModel, node_id: str) -> str:
    return model.origin(node_id) or model.fate(node_id) or "in the input graph"


def name_width(names) -> int:
    """Columns for a table's first column: its longest name, so the columns after
    it line up (ids such as softmax_cross_entropy_29 are longer than most)."""
    return max((len(name) for name in names), default=0)


def _more(lines: list[str], total: int) -> list[str]:
    if total > LISTED:
        lines.append(f"... {total - LISTED} more")
    return lines


def graph_section(a: RecordModel, b: RecordModel) -> tuple[Section, dict[str, str]]:
    section = Section("Graphs (after each pass, nodes matched by op and source line)")
    passes_a = {p.name: p.nodes_after for p in a.passes}
    passes_b = {p.name: p.nodes_after for p in b.passes}
    names = list(dict.fromkeys(list(passes_a) + list(passes_b)))
    width = name_width(names)
    for name in names:
        na, nb = passes_a.get(name, "-"), passes_b.get(name, "-")
        mark = "" if na == nb else "   ≠"
        section.lines.append(f"  {name:<{width}} A {na!s:>6}   B {nb!s:>6}{mark}")
    pairs, only_a, only_b = match(a.nodes(), b.nodes()) if a.graphs and b.graphs \
        else ({}, [], [])
    section.lines.append(f"  matched {len(pairs)} nodes; only in A: {len(only_a)}, "
                         f"only in B: {len(only_b)}")
    for label, model, ids in (("A", a, only_a), ("B", b, only_b)):
        for node_id in ids[:LISTED]:
            node = model.nodes()[node_id]
            section.lines.append(f"  only {label}: {node_id} ({node['op']}, {node['where']})"
                                 f": {_why(model, node_id)}")
        _more(section.lines, len(ids))
    return section, pairs


def memory_section(a: RecordModel, b: RecordModel, pairs: dict[str, str]) -> Section:
    section = Section("Memory plans")
    if not a.plan or not b.plan:
        section.lines.append("  (a record without a memory plan)")
        return section
    sa, sb = a.stats(), b.stats()
    for key in ("arena", "naive", "lower_bound"):
        change = (sb[key] - sa[key]) / sa[key] * 100 if sa[key] else 0.0
        section.lines.append(f"  {key:<12} A {fmt_bytes(sa[key]):>10}   B "
                             f"{fmt_bytes(sb[key]):>10}   {change:+.1f}%")
    section.lines.append(f"  strategy     A {sa['strategy']}   B {sb['strategy']}")
    moved = []
    for a_id, b_id in pairs.items():
        ta, tb = a.tensor_of.get(a_id), b.tensor_of.get(b_id)
        if ta and tb and ta["offset"] != tb["offset"]:
            moved.append((a_id, ta, tb))
    section.lines.append(f"  {len(moved)} matched tensors moved in the arena")
    width = name_width(a_id + ":" for a_id, _, _ in moved[:LISTED])
    for a_id, ta, tb in moved[:LISTED]:
        where = lambda t: "outside" if t["offset"] is None else fmt_bytes(t["offset"])
        section.lines.append(f"  {a_id + ':':<{width}} {where(ta):>10} -> {where(tb):>10} "
                             f"({fmt_bytes(tb['nbytes'])}); B: {tb['reason']}")
    _more(section.lines, len(moved))
    return section


def _mean_time(model: RecordModel) -> dict[str, float]:
    """{node id: mean seconds over every recorded run}."""
    total: Counter = Counter()
    count: Counter = Counter()
    for timeline in model.timelines:
        for event in timeline["events"]:
            if event["step"] is not None:
                total[event["node"]] += event["end"] - event["start"]
                count[event["node"]] += 1
    return {k: total[k] / count[k] for k in total}


def _run_length(model: RecordModel) -> float:
    spans = [model.span(k) for k in range(len(model.timelines))]
    return sum(t1 - t0 for t0, t1 in spans) / len(spans) if spans else 0.0


def timeline_section(a: RecordModel, b: RecordModel, pairs: dict[str, str]) -> Section:
    section = Section("Timelines (mean over the recorded runs)")
    if not a.timelines or not b.timelines:
        section.lines.append("  (a record without timelines)")
        return section
    ra, rb = _run_length(a), _run_length(b)
    section.lines.append(f"  run length   A {fmt_time(ra):>9}   B {fmt_time(rb):>9}   "
                         f"B/A {rb / ra if ra else 0:.2f}x")
    section.lines.append(f"  streams      A {len(a.streams)}   B {len(b.streams)}")
    ta, tb = _mean_time(a), _mean_time(b)
    slower = [(tb[bid] - ta[aid], aid, bid) for aid, bid in pairs.items()
              if aid in ta and bid in tb]
    slower.sort(reverse=True)
    section.lines.append("  matched steps that got slower in B:")
    shown = [s for s in slower if s[0] > 0][:LISTED]
    width = name_width(aid for _, aid, _ in shown)
    for delta, aid, bid in shown:
        section.lines.append(f"  {aid:<{width}} {fmt_time(ta[aid]):>9} -> "
                             f"{fmt_time(tb[bid]):>9}  (+{fmt_time(delta)})")
    if not shown:
        section.lines.append("  (none)")
    return section


def scalars_section(a: RecordModel, b: RecordModel) -> Section:
    section = Section("Scalars (curves view 4 overlays them)")
    names = list(dict.fromkeys(list(a.record["scalars"]) + list(b.record["scalars"])))
    width = name_width(names)
    for name in names:
        row = f"  {name:<{width}}"
        for label, model in (("A", a), ("B", b)):
            values = [v for _, v in model.record["scalars"].get(name, []) if v is not None]
            row += f"   {label} last {values[-1]:.4g} min {min(values):.4g}" if values \
                else f"   {label} -"
        section.lines.append(row)
    if not names:
        section.lines.append("  (no scalars in either record)")
    return section


def compare(a: RecordModel, b: RecordModel) -> list[Section]:
    """Every section of the comparison of record `a` with record `b`."""
    graphs, pairs = graph_section(a, b)
    return [graphs, memory_section(a, b, pairs), timeline_section(a, b, pairs),
            scalars_section(a, b)]


def report(a: RecordModel, b: RecordModel, name_a: str = "A", name_b: str = "B") -> str:
    """The comparison as plain text (`tinyflow diff A B`)."""
    lines = [f"A: {name_a} ({a.meta['title']})", f"B: {name_b} ({b.meta['title']})", ""]
    for section in compare(a, b):
        lines.append(section.title)
        lines.extend(section.lines)
        lines.append("")
    return "\n".join(lines)
