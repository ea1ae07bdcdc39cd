"""The node inspector: everything the record knows about the node under the cursor.

Op, shape, dtype, bytes and the user's source line; the stream and step it ran on
and how long it took in the selected run; where the memory plan put its result;
its provenance (the user-level nodes a fused or rewritten node stands for); its
attributes; and, when the run traced values, the summary of its result (min, max,
mean, count of NaN and Inf). A node that a later pass removed says which pass and
why.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from rich.text import Text
from textual.widgets import Static

from viz import palette
from viz.memory_view import where_text
from viz.model import fmt_bytes, fmt_shape, fmt_time
from viz.timeline_view import TimelineView

if TYPE_CHECKING:
    from viz.app import DebuggerApp


def _num(v) -> str:
    return "nan" if v is None else f"{v:.4g}"


class Inspector(Static):
    DEFAULT_CSS = """
    Inspector { padding: 0 1; }
    """

    @property
    def tapp(self) -> DebuggerApp:
        return self.app  # type: ignore[return-value]

    def sync(self) -> None:
        # Its size is set by the app's CSS (a column, or 7 rows when narrow), never by
        # its text: a cursor move repaints it without a layout pass of the screen.
        self.update(self.describe(), layout=False)

    def describe(self) -> Text:
        app = self.tapp
        model = app.model
        styles = palette.styles(app.dark)
        text = Text(end="")
        if model is None or app.selected is None:
            return text
        node = self._node(model)
        if node is None:
            return self._event(text, model, styles) or \
                Text(f"{app.selected}: not in this record", styles["dim"], end="")
        text.append(node["id"], styles["edge_sel"])
        text.append(f"  {node['op']}", styles["title"])
        if node["phase"] == "backward":
            text.append("  backward", styles["dim"])
        text.append("\n")
        text.append("shape ", styles["dim"])
        text.append(f"{fmt_shape(node['shape'])} {node['dtype'] or '?'} "
                    f"{fmt_bytes(node['bytes'])}")
        text.append("  at ", styles["dim"])
        text.append(node["where"], styles["key"])
        text.append("\n")
        final = model.final_id(node["id"])
        self._history(text, model, node, final, styles)
        if final:
            self._memory(text, model.tensor_of.get(final), styles)
            event = model.events_of(app.run_index).get(final)
            self._summary(text, event.get("summary") if event else None, styles)
        self._graph_facts(text, node, styles)
        check = model.record.get("check")
        if check and check["node"] == final:
            text.append(check["message"], styles["nan"])
        return text

    def _node(self, model) -> dict | None:
        """The selected node as the current pass's graph has it, else the graph
        before (a node this pass removed), else the last graph that holds it."""
        app = self.tapp
        index = app.pass_index
        node_id = model.locate(app.selected, index) or app.selected
        node = model.nodes(index).get(node_id)
        if node is None and index > 0:
            node = model.nodes(index - 1).get(node_id)
        for k in range(len(model.graphs) - 1, -1, -1):
            if node is not None:
                break
            node = model.nodes(k).get(node_id)
        return node

    def _history(self, text: Text, model, node: dict, final: str | None,
                 styles: dict) -> None:
        """What the passes did to the node (removed by, made by), and where and
        when it ran in the selected run, or that it did not run."""
        app = self.tapp
        fate = model.fate(node["id"])
        if fate:
            text.append(fate + "\n", styles["removed"].replace("strike ", ""))
        origin = model.origin(node["id"])
        if origin:
            text.append(origin + "\n", styles["added"])
        step = model.step_of.get(final) if final else None
        if step is None:
            if final is None and not fate:
                text.append("not run (removed or never scheduled)\n", styles["dim"])
            return
        entry = model.entry_of_step[step]
        text.append("ran ", styles["dim"])
        text.append(f"step {step} on {model.streams.get(entry['stream'])}")
        event = model.events_of(app.run_index).get(final)
        if event:
            text.append(f" · {fmt_time(event['end'] - event['start'])}")
            if event["start"] >= 0:
                text.append(f" at {fmt_time(event['start'] - model.span(app.run_index)[0])}",
                            styles["dim"])
        if final != node["id"]:
            text.append(f" (as {final})", styles["dim"])
        text.append("\n")

    @staticmethod
    def _memory(text: Text, tensor: dict | None, styles: dict) -> None:
        """Where the memory plan put the node's result."""
        if not tensor:
            return
        text.append("memory ", styles["dim"])
        if tensor["offset"] is None:
            text.append(tensor.get("reason") or f"outside the arena ({tensor['kind']})")
        else:
            text.append(f"{where_text(tensor)} +{fmt_bytes(tensor['nbytes'])}"
                        f" steps {tensor['first_step']}–{tensor['last_step']}")
        if tensor["inplace_of"]:
            text.append(f" in place of {tensor['inplace_of']}", styles["dim"])
        text.append("\n")

    @staticmethod
    def _summary(text: Text, summary: dict | None, styles: dict) -> None:
        """The traced value of the node's result: min, max, mean, NaN and Inf."""
        if not summary:
            return
        bad = summary["nan"] or summary["inf"]
        text.append("value ", styles["dim"])
        text.append(f"min {_num(summary['min'])} max {_num(summary['max'])} "
                    f"mean {_num(summary['mean'])}")
        text.append(f" nan {summary['nan']} inf {summary['inf']}",
                    styles["nan"] if bad else styles["dim"])
        text.append("\n")

    @staticmethod
    def _graph_facts(text: Text, node: dict, styles: dict) -> None:
        """The user-level nodes it stands for, its attributes and its inputs."""
        if node["provenance"] != [node["id"]]:
            text.append("from ", styles["dim"])
            text.append(", ".join(node["provenance"][:12]))
            if len(node["provenance"]) > 12:
                text.append(f" +{len(node['provenance']) - 12}")
            text.append("\n")
        if node["attrs"]:
            attrs = ", ".join(f"{k}={json.dumps(v)}" for k, v in node["attrs"].items())
            text.append("attrs ", styles["dim"])
            text.append(attrs[:300] + "\n")
        if node["inputs"]:
            text.append("inputs ", styles["dim"])
            text.append(", ".join(node["inputs"][:8]) + "\n")

    def _event(self, text: Text, model, styles: dict) -> Text | None:
        """A bar of the timeline that is no node of the graph (a parallel run's F0 on
        rank 1, a ring step): what the record says about that event."""
        event = self.tapp.query_one(TimelineView).current_event()
        if event is None:
            return None
        run = self.tapp.run_index
        t0 = model.span(run)[0]
        text.append(model.event_name(event, run), styles["edge_sel"])
        text.append(f"  {event['op']}", styles["title"])
        text.append("  event, not a graph node\n", styles["dim"])
        text.append("ran ", styles["dim"])
        text.append(f"on {model.streams.get(event['stream'])} · "
                    f"{fmt_time(event['end'] - event['start'])}")
        text.append(f" at {fmt_time(event['start'] - t0)}\n", styles["dim"])
        if event["bytes"]:
            text.append("bytes ", styles["dim"])
            text.append(f"{fmt_bytes(event['bytes'])}\n")
        facts = model.event_facts(event)
        if facts:
            text.append(" · ".join(facts) + "\n")
        for source in model.received(run).get(id(event), []):
            text.append("received from ", styles["dim"])
            text.append(model.event_name(source, run) + "\n")
        if id(event) in model.critical_path(run):
            text.append("on the critical path\n", styles["crit"])
        return text
