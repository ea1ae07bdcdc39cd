"""The compare view (``5``): two records side by side, `tinyflow debug A B`.

The sections come from viz/compare.py (the same text `tinyflow diff A B` prints):
pass by pass node counts and the nodes that exist in one record only, with the
rewrite record that explains each; the memory plans (arena, tensors that moved);
the timelines per matched node (which steps got slower); the scalars. The curves
view (``4``) overlays both records' series; the other views show record A.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from viz import palette
from viz.compare import compare

if TYPE_CHECKING:
    from viz.app import DebuggerApp


class CompareView(Widget):
    DEFAULT_CSS = """
    CompareView #compare-scroll { height: 1fr; padding: 0 1; }
    CompareView #compare-text { width: auto; text-wrap: nowrap; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._key: tuple | None = None
        self.sections: list = []

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="compare-scroll"):
            yield Static(id="compare-text")

    @property
    def tapp(self) -> DebuggerApp:
        return self.app  # type: ignore[return-value]

    def sync(self) -> None:
        app = self.tapp
        if app.model is None or app.other is None:
            return
        key = (id(app.model), id(app.other), app.dark)
        if key == self._key:
            return
        self._key = key
        styles = palette.styles(app.dark)
        self.sections = compare(app.model, app.other)
        text = Text(end="")
        text.append("A ", styles["key"])
        text.append(f"{app.model.source or app.model.meta['title']}\n", styles["title"])
        text.append("B ", styles["key"])
        text.append(f"{app.other.source}\n", styles["title"])
        for section in self.sections:
            text.append(f"\n{section.title}\n", styles["title"])
            for line in section.lines:
                style = styles["added"] if "only B" in line else styles["removed"].replace(
                    "strike ", "") if "only A" in line else None
                text.append(line + "\n", style)
        self.query_one("#compare-text", Static).update(text)

    def scroll_by(self, direction: str) -> None:
        scroll = self.query_one("#compare-scroll", VerticalScroll)
        dy = {"up": -1, "down": 1}.get(direction, 0)
        dx = {"left": -4, "right": 4}.get(direction, 0)
        scroll.scroll_relative(x=dx, y=dy, animate=False)
