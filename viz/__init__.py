"""viz: TinyFlow's terminal debugger and exporters. It reads DebugRecords; it never
runs a program, and tinyflow never imports it (the `tinyflow debug` and `tinyflow
export` commands start ``python -m viz`` as a subprocess).

    python -m viz FILE                    open the debugger (Textual app)
    python -m viz export FILE --dot OUT.svg|OUT.dot [--after PASS]
    python -m viz export FILE --perfetto OUT.json [--run N]

Modules: `model` (indexes over a record), `layout` (graphs on a character grid),
`graph_view`, `timeline_view`, `memory_view`, `inspector` (the views), `app` (the
app and its shared cursor), `export` (Graphviz DOT/SVG and Perfetto JSON).
"""

from viz.app import DebuggerApp

__all__ = ["DebuggerApp"]
