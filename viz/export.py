"""Exports of a DebugRecord: Graphviz (DOT text or SVG) and Perfetto (trace JSON).

    python -m viz export FILE --dot OUT.svg|OUT.dot [--after PASS]
    python -m viz export FILE --perfetto OUT.json [--run N]

The DOT text is built with the `graphviz` package (it quotes names and labels
correctly). Turning it into SVG needs a Graphviz layout program, and a fresh machine
set up with pip alone may have none: Debian's `graphviz` package is not always
installed. So `find_dot` looks, in order, for ``$TINYFLOW_DOT``, a system ``dot``
on the PATH, and the ``graphviz-pure`` program (a dot-compatible build that the
`graphviz-pure` wheel installs next to the Python interpreter, under that name so it
never shadows a system Graphviz), and says what to install when none is there.
The Perfetto export is `tinyflow.trace.to_perfetto`: Chrome's trace-event JSON,
which ui.perfetto.dev opens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from tinyflow import trace
from tinyflow.trace import RecordError
from viz.model import fmt_bytes, fmt_shape

NO_DOT = ("no Graphviz layout program found: install one with `pip install graphviz-pure` "
          "(or your system's graphviz package, which provides `dot`), or set TINYFLOW_DOT "
          "to its path; `--dot OUT.dot` writes the DOT text without one")


class ExportError(RecordError):
    """An export that cannot be made (no layout program, unknown pass, bad path)."""


def find_dot() -> str | None:
    """Path of a program that runs Graphviz's dot layout, or None."""
    explicit = os.environ.get("TINYFLOW_DOT")
    if explicit:
        return explicit if shutil.which(explicit) else None
    for name in ("dot", "graphviz-pure"):
        found = shutil.which(name)
        if found:
            return found
    # A venv's scripts folder is not on the PATH unless the venv is activated.
    beside = os.path.join(os.path.dirname(sys.executable), "graphviz-pure")
    return beside if os.access(beside, os.X_OK) else None


def pass_index(record: dict, after_pass: str | int | None) -> int:
    """Index into record["graphs"] of the graph after pass `after_pass` (a name or
    an index; None: the last graph, the one that ran)."""
    graphs = record["graphs"]
    if not graphs:
        raise ExportError("the record holds no graph")
    if after_pass is None:
        return len(graphs) - 1
    names = [g["pass"] for g in graphs]
    if isinstance(after_pass, int) or str(after_pass).isdigit():
        k = int(after_pass)
        if 0 <= k < len(graphs):
            return k
    elif after_pass in names:
        return len(names) - 1 - names[::-1].index(after_pass)  # the last run of it
    raise ExportError(f"no pass {after_pass!r} in this record; its passes are "
                      + ", ".join(f"{k}:{n}" for k, n in enumerate(names)))


def to_dot(record: dict, after_pass: str | int | None = None) -> str:
    """The graph after `after_pass` as Graphviz DOT text.

    Nodes are boxes labelled id, op, shape and bytes; backward nodes are shaded
    differently from forward ones; nodes the pass added are green, and the nodes it
    removed are kept, dashed red, so the picture shows the rewrite.
    """
    import graphviz

    index = pass_index(record, after_pass)
    graph = record["graphs"][index]
    previous = record["graphs"][index - 1] if index > 0 else None
    now = {n["id"] for n in graph["nodes"]}
    before = {n["id"]: n for n in previous["nodes"]} if previous else {}
    added = now - set(before) if previous else set()
    removed = [n for n in previous["nodes"] if n["id"] not in now] if previous else []
    title = f"{record['meta']['title']}: after {graph['pass']} ({len(now)} nodes)"
    dot = graphviz.Digraph("tinyflow", graph_attr={
        "rankdir": "TB", "label": title, "labelloc": "t", "fontname": "Helvetica"},
        node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                   "fontsize": "10"}, edge_attr={"color": "#666666"})

    def add(node: dict, **attrs: str) -> None:
        label = f"{node['id']}\n{node['op']} {fmt_shape(node['shape'])}"
        if node["bytes"]:
            label += f"\n{fmt_bytes(node['bytes'])}"
        fill = "#e8e0f5" if node["phase"] == "backward" else "#e3ecfa"
        dot.node(node["id"], label, fillcolor=fill, tooltip=node["where"], **attrs)

    for node in graph["nodes"]:
        if node["id"] in added:
            add(node, color="#2e7d32", penwidth="2.5")
        else:
            add(node)
        for inp in node["inputs"]:
            dot.edge(inp, node["id"])
    for node in removed:
        add(node, color="#c62828", fontcolor="#c62828", style="rounded,dashed")
        for inp in node["inputs"]:
            dot.edge(inp, node["id"], style="dashed", color="#c62828")
    return dot.source


def write_dot(record: dict, out: str, after_pass: str | int | None = None,
              all_nodes: bool = False, progress=None) -> str:
    """Write `out`: DOT text for .dot/.gv, SVG (laid out by dot) for .svg. A graph
    of more than OVERVIEW_NODES nodes is drawn as its folded overview unless
    `all_nodes`; `progress(message)` hears what is happening (a big SVG is slow)."""
    say = progress or (lambda message: None)
    nodes = len(record["graphs"][pass_index(record, after_pass)]["nodes"]) \
        if record["graphs"] else 0
    if nodes > OVERVIEW_NODES and not all_nodes:
        say(f"{nodes} nodes: writing the folded overview (layers and phases); "
            "--all-nodes draws every node")
        source = to_overview_dot(record, after_pass)
    else:
        source = to_dot(record, after_pass)
    suffix = os.path.splitext(out)[1].lower()
    if suffix in (".dot", ".gv"):
        with open(out, "w", encoding="utf-8") as f:
            f.write(source)
        return out
    if suffix != ".svg":
        raise ExportError(f"{out}: --dot writes .svg, .dot or .gv files")
    program = find_dot()
    if program is None:
        explicit = os.environ.get("TINYFLOW_DOT")
        raise ExportError(f"TINYFLOW_DOT={explicit!r} is not a program on the PATH"
                          if explicit else NO_DOT)
    say(f"laying out with {os.path.basename(program)} ...")
    start = time.perf_counter()
    try:
        done = subprocess.run([program, "-Tsvg", "-o", out], input=source.encode(),
                              capture_output=True, timeout=300)
    except OSError as err:
        raise ExportError(f"could not run {program}: {err}") from None
    except subprocess.TimeoutExpired:
        raise ExportError(f"{program} took longer than 5 minutes on this graph; "
                          "write --dot OUT.dot instead") from None
    if done.returncode != 0:
        raise ExportError(f"{program} failed: {done.stderr.decode(errors='replace')[:500]}")
    say(f"laid out in {time.perf_counter() - start:.1f} s")
    return out


OVERVIEW_NODES = 400   # --dot of a bigger graph draws the folded overview (--all-nodes: all)


def to_overview_dot(record: dict, after_pass: str | int | None = None) -> str:
    """DOT of the folded overview (viz/overview.py): one node per layer and phase,
    which dot lays out in a second where the full 1,146-node graph takes a minute."""
    import graphviz

    from viz.overview import overview_of
    overview = overview_of(record["graphs"], pass_index(record, after_pass))
    overview.draw(lambda i: "node", None)   # fills last_edges
    dot = graphviz.Digraph("tinyflow", graph_attr={"rankdir": "TB", "fontname": "Helvetica"},
                           node_attr={"shape": "box", "style": "rounded", "fontsize": "10"})
    for group in overview.groups.values():
        dot.node(group.key, f"{overview.title(group)}\\n{overview.label(group)}")
    for a, b in overview.last_edges:
        dot.edge(a, b)
    return dot.source


def perfetto_all_runs(record: dict) -> dict:
    """Chrome trace JSON of every recorded run, one after another on the same
    lanes (each run's slices shifted to start where the previous ended), and the
    record's scalars as counter tracks in their own process ("ts" = training step,
    shown as microseconds: Perfetto has no other x axis)."""
    events: list[dict] = []
    shift = 0.0
    for k in range(len(record["timelines"])):
        data = trace.to_perfetto(record, k)
        run_end = 0.0
        for event in data["traceEvents"]:
            if event["ph"] == "M":
                if k == 0:
                    events.append(event)
                continue
            event = dict(event, ts=event["ts"] + shift)
            if event["ph"] == "X":
                event["args"] = dict(event["args"], run=record["timelines"][k]["run"])
                run_end = max(run_end, event["ts"] + event["dur"])
            events.append(event)
        shift = max(shift, run_end) + 10.0   # 10 µs gap between runs
    scalars_pid = 2
    if record["scalars"]:
        events.append({"ph": "M", "name": "process_name", "pid": scalars_pid, "tid": 0,
                       "args": {"name": "scalars (x axis: training step)"}})
    for name, points in record["scalars"].items():
        for step, value in points:
            if value is not None:
                events.append({"ph": "C", "name": name, "pid": scalars_pid, "ts": step,
                               "args": {name: value}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"title": record["meta"]["title"],
                          "runs": [t["run"] for t in record["timelines"]]}}


def write_perfetto(record: dict, out: str, run: int | None = None) -> str:
    """Write the Chrome trace JSON of timeline `run`, or of every recorded run and
    the scalars when `run` is None (open it in ui.perfetto.dev)."""
    data = perfetto_all_runs(record) if run is None and record["timelines"] else \
        trace.to_perfetto(record, -1 if run is None else run)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
    return out


def main(argv: list[str], prog: str = "python -m viz") -> int:
    """`prog` names the command in messages (`tinyflow` when run through it)."""
    prog = f"{prog} export"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Export a TinyFlow DebugRecord as a Graphviz picture or a Perfetto "
                    "trace.")
    parser.add_argument("file", help="a DebugRecord (.json or .json.gz)")
    parser.add_argument("--dot", metavar="OUT", help="OUT.svg (needs dot or graphviz-pure) "
                        "or OUT.dot: the graph")
    parser.add_argument("--after", metavar="PASS", help="with --dot: the graph after this "
                        "pass (name or index; default: the last)")
    parser.add_argument("--perfetto", metavar="OUT", help="OUT.json: Chrome/Perfetto trace "
                        "of a run")
    parser.add_argument("--run", type=int, default=None, help="with --perfetto: only this "
                        "run (index; default: every recorded run and the scalars)")
    parser.add_argument("--all-nodes", action="store_true", help=f"with --dot: draw every "
                        f"node even past {OVERVIEW_NODES} (slow)")
    args = parser.parse_args(argv)
    if not args.dot and not args.perfetto:
        parser.error("say what to export: --dot OUT.svg|OUT.dot and/or --perfetto OUT.json")
    try:
        record = trace.load(args.file)
        if args.dot:
            progress = lambda message: print(f"{prog}: {message}", file=sys.stderr, flush=True)
            print(f"wrote {write_dot(record, args.dot, args.after, args.all_nodes, progress)}")
        if args.perfetto:
            print(f"wrote {write_perfetto(record, args.perfetto, args.run)} "
                  "(open it in https://ui.perfetto.dev)")
    except RecordError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"{prog}: {err.filename or ''}: {err.strerror}", file=sys.stderr)
        return 1
    return 0
