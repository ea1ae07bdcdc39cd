"""Colors of the debugger, one set for dark terminals and one for light ones.

Views draw with style *names* ("added", "edge", "crit", ...); this module maps the
names to Rich styles for the current theme, so every view stays readable when the
user switches themes (``d``). Colors are chosen to keep contrast on both
backgrounds, and meaning never rests on color alone: the selected node is also
reversed, removed nodes are struck through, the critical path has its own marker.
"""

from __future__ import annotations

DARK = {
    "node": "#7aa2f7", "back": "#bb9af7", "added": "bold #9ece6a",
    "removed": "strike #f7768e", "scope": "#7dcfff", "nan": "bold #ff5f5f",
    "edge": "#6b7394", "edge_sel": "bold #e0af68", "near": "bold #c0caf5",
    "sel": "bold reverse #e0af68", "dim": "#7a7f99", "crit": "bold #ff9e64",
    "axis": "#7a7f99", "title": "bold #c0caf5", "ok": "#9ece6a", "warn": "bold #ff9e64",
    "wait": "#e0af68", "key": "bold #7dcfff",
}
LIGHT = {
    "node": "#1f4fa8", "back": "#6b3fa0", "added": "bold #2e7d32",
    "removed": "strike #c62828", "scope": "#00695c", "nan": "bold #b00020",
    "edge": "#8a8a8a", "edge_sel": "bold #b25f00", "near": "bold #1a1a1a",
    "sel": "bold reverse #b25f00", "dim": "#6e6e6e", "crit": "bold #d84315",
    "axis": "#6e6e6e", "title": "bold #1a1a1a", "ok": "#2e7d32", "warn": "bold #c62828",
    "wait": "#9a5b00", "key": "bold #00695c",
}
# Bar colors for the timeline and the memory map: foreground on the terminal's
# background for blocks drawn with "█", picked by op (timeline) or tensor (memory).
BARS_DARK = ["#7aa2f7", "#9ece6a", "#bb9af7", "#7dcfff", "#e0af68", "#f7768e",
             "#73daca", "#ff9e64", "#c3e88d", "#82aaff"]
BARS_LIGHT = ["#1f4fa8", "#2e7d32", "#6b3fa0", "#00838f", "#9a5b00", "#c62828",
              "#00695c", "#d84315", "#558b2f", "#3949ab"]


def styles(dark: bool) -> dict[str, str]:
    return DARK if dark else LIGHT


def bar_color(key: str, dark: bool) -> str:
    """A stable color for `key` (an op name, a tensor id): the same on every run."""
    colors = BARS_DARK if dark else BARS_LIGHT
    return colors[sum(key.encode()) * 2654435761 % 2**32 % len(colors)]


class TextLines:
    """Mixin for a view that draws one Rich Text (from `render`) but paints it with
    Textual's line API: the Text is cut into rows and turned into strips once per
    refresh, skipping Textual's text wrapping and formatting, which is most of the
    cost of redrawing a full-screen view on every cursor move.

    A row wider than the view ends in "…": cut silently, "refcount 388.0 KiB" read
    as "refcount 38". Views wrap the rows whose numbers matter (`wrap_parts`)."""

    _strips: list | None = None

    def refresh(self, *args, **kwargs):  # type: ignore[override]
        self._strips = None
        return super().refresh(*args, **kwargs)  # type: ignore[misc]

    def render_line(self, y: int):
        from textual.strip import Strip

        width = self.size.width  # type: ignore[attr-defined]
        base = self.rich_style  # type: ignore[attr-defined]
        if self._strips is None or (self._strips and self._strips[0].cell_length != width):
            console = self.app.console  # type: ignore[attr-defined]
            rows = self.render().split("\n", allow_blank=True)  # type: ignore[attr-defined]
            self._strips = [
                Strip(list(elide(row, width).render(console, end=""))).apply_style(base)
                .crop_extend(0, width, base) for row in rows]
        if y < len(self._strips):
            return self._strips[y]
        return Strip.blank(width, base)


def elide(row, width: int):
    """`row` (a Rich Text of one line) cut to `width` cells with "…" as its last
    cell when it is wider, so the reader sees that something was cut."""
    if row.cell_len <= width or width < 1:
        return row
    row = row.copy()
    row.truncate(width, overflow="ellipsis")
    return row


def wrap_parts(text, groups: list[list[tuple[str, str | None]]], width: int,
               sep: str = " · ", sep_style: str | None = None, indent: str = "  ") -> int:
    """Append `groups` to the Rich Text `text`, joined by `sep`. A group is a list of
    (text, style) pieces that stay on one line ("arena", "2.0 MiB"); a new line
    (with `indent`) starts before a group that would not fit in `width` cells, so a
    header of sizes wraps between its figures, never inside one. Ends with a
    newline; returns the number of lines written."""
    lines, column = 1, 0
    for group in groups:
        size = sum(len(chunk) for chunk, _ in group)
        lead = sep if column else ""
        if column and column + len(lead) + size > width:
            text.append("\n" + indent)
            lines, column, lead = lines + 1, len(indent), ""
        text.append(lead, sep_style)
        for chunk, style in group:
            text.append(chunk, style)
        column += len(lead) + size
    text.append("\n")
    return lines
