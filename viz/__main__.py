"""`python -m viz FILE` opens the debugger; `python -m viz export ...` exports.

Exit status: 0 on success, 1 when the record could not be opened or exported
(the message says why), 2 for a wrong command line.
"""

from __future__ import annotations

import argparse
import sys

from viz import export


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "export":
        return export.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m viz",
        description="Open a TinyFlow DebugRecord in the terminal debugger "
                    "(or: python -m viz export FILE --dot OUT.svg | --perfetto OUT.json).")
    parser.add_argument("file", help="a DebugRecord (.json or .json.gz)")
    parser.add_argument("--view", choices=("graph", "timeline", "memory"), default="graph",
                        help="the view to open on (default: graph)")
    parser.add_argument("--theme", choices=("dark", "light"), default=None)
    args = parser.parse_args(argv)

    import os
    if not os.path.exists(args.file):  # before the screen opens: a plain message
        print(f"python -m viz: {args.file}: no such file", file=sys.stderr)
        return 1
    from viz.app import DebuggerApp
    app = DebuggerApp(args.file, view=args.view, theme=args.theme)
    app.run()
    if app.error:
        print(f"python -m viz: {app.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
