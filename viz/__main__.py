"""`python -m viz FILE [FILE_B]` opens the debugger; `python -m viz export ...` exports;
`python -m viz diff A B` prints what changed between two records.

    python -m viz RECORD [--view V] [--theme dark|light]
    python -m viz RECORD --follow          # a live record, while it is written
    python -m viz A B                      # compare two records (view 5)
    python -m viz diff A B                 # the comparison as text

Exit status: 0 on success, 1 when a record could not be opened or exported
(the message says why), 2 for a wrong command line or a FILE that is not a
DebugRecord (said in one line, before the debugger's screen opens). Messages name the command the
user typed: `tinyflow` sets VIZ_PROG=tinyflow when it runs this module.
"""

from __future__ import annotations

import argparse
import os
import sys

from viz import export

VIEWS = ("graph", "timeline", "memory", "curves", "compare")


def prog_name() -> str:
    return os.environ.get("VIZ_PROG", "python -m viz")


def diff_main(argv: list[str]) -> int:
    """Print the comparison of two records (viz/compare.py) as text."""
    from tinyflow import trace
    from viz.compare import report
    from viz.model import RecordModel
    prog = f"{prog_name()} diff"
    parser = argparse.ArgumentParser(prog=prog, description="What changed between two "
                                     "DebugRecords: graphs after each pass, memory plans, "
                                     "timelines per node, scalars.")
    parser.add_argument("a", metavar="A")
    parser.add_argument("b", metavar="B")
    args = parser.parse_args(argv)
    try:
        a, b = RecordModel(trace.load(args.a), args.a), RecordModel(trace.load(args.b), args.b)
    except trace.RecordError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    print(report(a, b, args.a, args.b))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog_name()
    if argv and argv[0] == "export":
        return export.main(argv[1:], prog)
    if argv and argv[0] == "diff":
        return diff_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Open a TinyFlow DebugRecord in the terminal debugger; with two "
                    "records, compare them (or: export FILE --dot OUT.svg | --perfetto "
                    "OUT.json; diff A B).")
    parser.add_argument("file", help="a DebugRecord (.json or .json.gz)")
    parser.add_argument("other", nargs="?", metavar="FILE_B",
                        help="a second record: compare the two (view 5, curves overlaid)")
    parser.add_argument("--view", choices=VIEWS, default="graph",
                        help="the view to open on (default: graph)")
    parser.add_argument("--theme", choices=("dark", "light"), default=None)
    parser.add_argument("--follow", action="store_true",
                        help="follow a live record (FILE and FILE.live.jsonl) while a run "
                             "writes it; new scalars and runs appear within a second")
    args = parser.parse_args(argv)

    if args.follow and args.other:
        parser.error("--follow takes one record")
    for path in (args.file, args.other):
        # before the screen opens: a plain message (a live record may not exist yet)
        if path and not args.follow and not os.path.exists(path):
            print(f"{prog}: {path}: no such file", file=sys.stderr)
            return 1
    records: list[dict | None] = [None, None]
    if not args.follow:
        # Read here, once, rather than in the app: a file that is not a record is then
        # one line, as a missing one is, not a full screen saying so.
        from tinyflow import trace
        try:
            records = [trace.load(path) if path else None for path in (args.file, args.other)]
        except trace.RecordError as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
    from viz.app import DebuggerApp
    app = DebuggerApp(args.file, record=records[0], view=args.view, theme=args.theme,
                      follow=args.follow, other=args.other, other_record=records[1])
    app.run()
    if app.error:
        print(f"{prog}: {app.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
