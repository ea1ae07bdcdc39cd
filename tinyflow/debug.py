"""Recording what the system did, for the debugger: DebugRecords from programs.

`trace.py` defines the DebugRecord (the file format, its checks and exports); this
module fills one from a compiled Program and its runs:

    with tf.debug.record("run.tfdbg.json") as rec:     # every Session.run inside is
        for step in range(100):                         # compiled with trace=True
            loss, _ = sess.run([loss, train_op], feed)
            rec.scalar("loss", step, loss)              # or tf.debug.scalar(...)

On leaving the block the record of the program that ran most (the training step) is
written: its graph after every pass with the rewrite records, the schedule and
streams, the memory plan and the timelines of its last runs, plus the scalars.
`compile(..., debug=PATH)` writes the record of one program, and the environment
variable ``TINYFLOW_TRACE=PATH`` records a whole script (``tinyflow debug --run``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tinyflow import executor, trace


class Recorder:
    """Collects the programs a block runs, their timelines, and scalars."""

    def __init__(self, path: str | os.PathLike, title: str | None = None,
                 trace_values: bool = False, check_numerics: bool = False,
                 max_runs: int = 20) -> None:
        self.path = os.fspath(path)
        self.title = title or os.path.basename(sys.argv[0] or "tinyflow")
        self.trace_values = trace_values
        self.check_numerics = check_numerics
        self.max_runs = max_runs
        self.runs: dict[int, int] = {}       # id(program) -> runs seen
        self.programs: dict[int, Any] = {}
        self.scalars: dict[str, list[list[float]]] = {}
        self.check: dict | None = None
        self._main: Any = None               # the program whose check failed
        self.eager_log: Any = None           # eager ops recorded (eager.EagerLog)

    @property
    def compile_options(self) -> dict:
        """The options Session adds to every program compiled while recording."""
        return {"trace": True, "trace_values": self.trace_values,
                "check_numerics": self.check_numerics}

    def add_run(self, program: Any) -> None:
        """Note one run of `program` (called by Session.run, also when it failed)."""
        self.programs[id(program)] = program
        self.runs[id(program)] = self.runs.get(id(program), 0) + 1
        if program.check_failure and self.check is None:
            self.check = program.check_failure
            self._main = program

    def scalar(self, name: str, step: int, value: float) -> None:
        """Log a per-training-step scalar (loss, accuracy) for the debugger."""
        self.scalars.setdefault(str(name), []).append([int(step), float(value)])

    def main_program(self) -> Any:
        """The program to show: the one that failed a check, else the one run most
        often (the training step), ties going to the larger graph."""
        if self.check is not None:
            return self._main
        if not self.programs:
            return None
        key = max(self.runs, key=lambda k: (self.runs[k], len(self.programs[k].steps)))
        return self.programs[key]

    def to_record(self) -> dict:
        program = self.main_program()
        command = " ".join(sys.argv)
        if program is None and self.eager_log is not None:
            record = self.eager_log.to_record(self.title, command)
        elif program is None:
            record = trace.empty_record(self.title, command=command)
        else:
            record = program_record(program, self.title, command, self.max_runs)
        record["scalars"] = self.scalars
        if self.check is not None:
            record["check"] = self.check
        return record

    def save(self) -> str:
        trace.save(self.to_record(), self.path)
        return self.path


_local = threading.local()
_global_recorder: list[Recorder] = []  # the TINYFLOW_TRACE recorder, if any


def current() -> Recorder | None:
    """The recorder of the innermost active `record` block (or TINYFLOW_TRACE's)."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    return _global_recorder[0] if _global_recorder else None


@contextmanager
def record(path: str | os.PathLike, *, title: str | None = None,
           trace_values: bool = False, check_numerics: bool = False,
           max_runs: int = 20) -> Iterator[Recorder]:
    """Record every Session.run in the block; write the DebugRecord at its end
    (also when the block raises, so a NaN found by check_numerics is kept)."""
    recorder = Recorder(path, title, trace_values, check_numerics, max_runs)
    if not hasattr(_local, "stack"):
        _local.stack = []
    _local.stack.append(recorder)
    try:
        yield recorder
    finally:
        _local.stack.pop()
        recorder.save()


def scalar(name: str, step: int, value: float) -> None:
    """Log a scalar to the active recorder; does nothing when none is active."""
    recorder = current()
    if recorder is not None:
        recorder.scalar(name, step, value)


def start_from_environment() -> None:
    """If TINYFLOW_TRACE=PATH is set, record the whole process and write PATH at
    exit (how `tinyflow debug --run SCRIPT` records a script it did not write)."""
    path = os.environ.get("TINYFLOW_TRACE")
    if not path or _global_recorder:
        return
    # Checked now, not at exit: a whole run must not be lost to a typo in the folder.
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise trace.RecordError(
            f"TINYFLOW_TRACE={path}: " + ("is a folder, not a file name" if os.path.isdir(path)
                                          else f"no such folder {folder}")
            + "; set it to a file in an existing folder")
    recorder = Recorder(path, trace_values=os.environ.get("TINYFLOW_TRACE_VALUES") == "1")
    _global_recorder.append(recorder)
    atexit.register(_save_at_exit, recorder)


def _save_at_exit(recorder: Recorder) -> None:
    try:
        recorder.save()
    except (trace.RecordError, OSError) as err:  # say so plainly, not "Exception ignored"
        print(f"tinyflow: could not write TINYFLOW_TRACE={recorder.path}: {err}",
              file=sys.stderr)


def attach(program: Any, path: str) -> None:
    """compile(..., debug=PATH): write this program's record now (graphs, schedule,
    plan) and again at exit, with the timelines of its runs."""
    save_program(program, path)
    atexit.register(save_program, program, path)


def save_program(program: Any, path: str, title: str | None = None) -> None:
    record = program_record(program, title or os.path.basename(path), " ".join(sys.argv))
    trace.save(record, path)


def program_record(program: Any, title: str, command: str = "", max_runs: int = 20) -> dict:
    """The DebugRecord of one Program: graphs per pass, rewrites, streams, schedule,
    memory plan and the timelines of its last `max_runs` traced runs."""
    record = trace.empty_record(title, device=program.device, command=command)
    ctx = program.ctx
    previous = None
    rewriting_passes = {r.pass_name for r in ctx.records}
    for index, (name, graph, seconds) in enumerate(ctx.snapshots):
        changed = index > 0 and (name in rewriting_passes or graph is not previous)
        record["graphs"].append(trace.graph_to_dict(graph, name, index, seconds, changed))
        previous = graph
    record["rewrites"] = [r.to_dict() for r in ctx.records]
    schedule = program.schedule
    record["streams"] = [{"id": i, "name": n} for i, n in enumerate(schedule.names)]
    record["schedule"] = schedule.to_dicts([s.node.name for s in program.steps],
                                           [s.node.op for s in program.steps])
    if program.memory_plan is not None:
        record["memory_plan"] = program.memory_plan.to_dict()
    first_run = max(0, program.runs - len(program.timelines))
    timelines = program.timelines[-max_runs:]
    offset = first_run + len(program.timelines) - len(timelines)
    record["timelines"] = [{"run": offset + i, "label": f"run {offset + i}", "events": events}
                           for i, events in enumerate(timelines)]
    if program.check_failure:
        record["check"] = program.check_failure
    return record


# The executor records through these (it sits below this module and cannot import it).
executor.DEBUG_HOOKS.attach = attach
executor.DEBUG_HOOKS.current = current
