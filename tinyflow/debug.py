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

Live recording (``record(PATH, live=True)``, or ``TINYFLOW_LIVE=1`` as set by
``tinyflow train NAME --trace PATH --live``) also appends every scalar and, at most
`LIVE_HZ` times a second, the latest timeline to ``PATH.live.jsonl`` (the format is
described in trace.py), and rewrites PATH when the recorded program changes, so
``tinyflow debug --follow PATH`` shows the run while it trains. Lines are written
at the same rate: a step that logs a scalar pays a list append and a clock read;
the lines of the scalars logged since the last tick are formatted and written all
at once, then flushed.
"""

from __future__ import annotations

import atexit
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tinyflow import executor, trace
from tinyflow.graph import TinyFlowError

LIVE_HZ = 10.0   # live mode: timelines and flushes per second, at most


class Recorder:
    """Collects the programs a block runs, their timelines, and scalars."""

    def __init__(self, path: str | os.PathLike, title: str | None = None,
                 trace_values: bool = False, check_numerics: bool = False,
                 max_runs: int = 20, live: bool | None = None) -> None:
        self.path = os.fspath(path)
        self.live = os.environ.get("TINYFLOW_LIVE") == "1" if live is None else live
        self.title = title or os.path.basename(sys.argv[0] or "tinyflow")
        self.trace_values = trace_values
        self.check_numerics = check_numerics
        self.max_runs = max_runs
        self.runs: dict[int, int] = {}       # id(program) -> runs seen
        self.programs: dict[int, Any] = {}
        self.scalars: dict[str, list[list[float]]] = {}
        self.check: dict | None = None
        self._main: Any = None               # the program whose check failed
        self.eager_log: Any = None           # eager ops recorded (eager_record.EagerLog)
        self.memory_references: dict[str, int] = {}  # see `memory_reference`
        # Which training step each run was: the step of the first scalar logged
        # after it (the loss of step N is logged once step N's run returned), for
        # the latest run of each program since the previous scalar (a step may run
        # a training program and an evaluation one before logging). A program
        # counts its own runs; an epoch's short last batch compiles another
        # program, so run N of one program is not step N: the debugger links a
        # timeline to the curves by this instead.
        self._unlogged: dict[int, int] = {}   # id(program) -> its latest run not tied
        self._run_steps: dict[tuple[int, int], int] = {}
        self._live_file: Any = None          # PATH.live.jsonl, open while live
        self._live_lines = 0                 # lines written to it
        self._live_points: list = []         # (name, step, value) logged, not yet written
        self._live_program: Any = None       # the program the document on disk holds
        self._live_due = 0.0                 # next time a timeline/flush is due
        self._live_last = 0.0                # time of the previous run
        self._live_timelines: list = []      # (program, run, events), sampled
        self._live_sent: int | None = None   # run of the last timeline line written
        self._live_sampled = False           # a run was traced since the last tick
        if self.live:
            self._start_live()

    @property
    def compile_options(self) -> dict:
        """The options Session adds to every program compiled while recording."""
        return {"trace": True, "trace_values": self.trace_values,
                "check_numerics": self.check_numerics}

    def add_run(self, program: Any) -> None:
        """Note one run of `program` (called by Session.run, also when it failed)."""
        self.programs[id(program)] = program
        self.runs[id(program)] = self.runs.get(id(program), 0) + 1
        self._unlogged[id(program)] = program.runs - 1
        if program.check_failure and self.check is None:
            self.check = program.check_failure
            self._main = program
        if self._live_file is not None:
            self._live_run(program)

    def scalar(self, name: str, step: int, value: float) -> None:
        """Log a per-training-step scalar (loss, accuracy) for the debugger.

        The order is (name, step, value), as every script since the first
        tutorial calls it; `step` must be a whole number, which catches the
        swapped call ``scalar("loss", 0.42, 7)``.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) and not (
                isinstance(step, numbers.Real) and float(step).is_integer()):
            raise TinyFlowError(f"debug.scalar({name!r}, step, value): step must be a whole "
                                f"number, got {step!r} (the order is name, step, value)")
        value = float(value)
        if not -trace.MAX_VALUE <= value <= trace.MAX_VALUE:   # (NaN too)
            value = math.nan   # null in the record, as NaN and Inf (the schema's bound)
        point = [int(step), value]
        self.scalars.setdefault(str(name), []).append(point)
        for program_id, run in self._unlogged.items():
            self._run_steps[(program_id, run)] = point[0]
        self._unlogged.clear()
        if self._live_file is not None:   # written with the next tick's lines
            self._live_points.append((str(name), point[0], point[1]))
            self._tick_if_due(time.perf_counter())

    # -- live mode -------------------------------------------------------------------
    #
    # Timelines are sampled at LIVE_HZ: a traced run costs the training loop a clock
    # read and a dict per step, so in live mode one run per tick is traced, the one
    # expected to end after the next tick is due (the program's "trace" option is
    # switched per run), and the Recorder keeps those sampled timelines with their
    # run numbers itself.

    def _live_run(self, program: Any) -> None:
        now = time.perf_counter()
        latest = program.timelines[-1] if program.timelines else None
        if latest is not None and not (self._live_timelines and
                                       self._live_timelines[-1][2] is latest):
            self._live_timelines.append((program, program.runs - 1, latest))
            del self._live_timelines[:-self.max_runs]
            self._live_sampled = True      # this tick's timeline is taken
        self._tick_if_due(now)
        step = now - self._live_last if self._live_last else 0.0
        self._live_last = now
        program.options["trace"] = not self._live_sampled and \
            now + 1.5 * step >= self._live_due

    def _start_live(self) -> None:
        """Start the live file empty and the document with nothing yet."""
        self._live_file = open(trace.live_path(self.path), "w", encoding="utf-8",
                               buffering=1 << 16)
        self._write_document()

    def _tick_if_due(self, now: float) -> None:
        if now >= self._live_due:
            self._live_due = now + 1.0 / LIVE_HZ
            self._live_tick()

    def _write_points(self) -> None:
        """Write the scalar lines logged since the last tick, all at once."""
        if self._live_points:
            self._live_file.write(trace.live_scalar_lines(self._live_points))
            self._live_lines += len(self._live_points)
            self._live_points.clear()

    def _live_tick(self) -> None:
        """At most LIVE_HZ times a second: write the scalars logged since the last
        tick; rewrite the document if the program to show changed, else append its
        latest timeline; then flush."""
        self._write_points()
        self._live_sampled = False
        program = self.main_program()
        if program is not None and program is not self._live_program:
            self._write_document()
        elif program is not None and self._live_timelines and \
                self._live_timelines[-1][0] is program and \
                self._live_timelines[-1][1] != self._live_sent:
            _, run, events = self._live_timelines[-1]
            self._live_file.write(trace.live_line("timeline", timeline={
                "run": run, "label": f"run {run}", "events": events}))
            self._live_sent = run
            self._live_lines += 1
        self._live_file.flush()

    def _write_document(self) -> None:
        # The document holds every scalar so far: their lines go first, so that the
        # count it carries (live_lines, the lines a reader skips) includes them.
        self._write_points()
        self._live_file.flush()
        self._live_program = self.main_program()
        record = self.to_record()
        record["live_lines"] = self._live_lines
        trace.save(record, self.path)

    def flush(self) -> None:
        """Live mode: write out what is buffered now (and the latest timeline)."""
        if self._live_file is not None:
            self._live_due = time.perf_counter() + 1.0 / LIVE_HZ
            self._live_tick()

    def close_live(self) -> None:
        """End live mode: the final document holds everything, the lines file stays
        (its lines are all counted in ``live_lines``)."""
        if self._live_file is not None:
            self._write_points()
            self._live_file.flush()
            self._live_file.close()
            self._live_file = None

    def main_program(self) -> Any:
        """The program to show: the one that failed a check, else the one run most
        often (the training step), ties going to the larger graph."""
        if self.check is not None:
            return self._main
        if not self.programs:
            return None
        key = max(self.runs, key=lambda k: (self.runs[k], len(self.programs[k].steps)))
        return self.programs[key]

    def memory_reference(self, name: str, nbytes: int) -> None:
        """Show `nbytes` as strategy `name` beside the recorded plan's in the memory
        view: e.g. the static plan's arena for the same step, next to an eager run's
        caching allocator (train_eager.py --trace does)."""
        self.memory_references[str(name)] = int(nbytes)

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
        if self.live and program is not None:   # the sampled runs, numbered right
            record["timelines"] = [{"run": run, "label": f"run {run}", "events": events}
                                   for prog, run, events in self._live_timelines
                                   if prog is program]
        for timeline in record["timelines"] if program is not None else ():
            step = self._run_steps.get((id(program), timeline["run"]))
            if step is not None:
                timeline["step"] = step
        if self.check is not None:
            record["check"] = self.check
        if self.memory_references and record.get("memory_plan"):
            record["memory_plan"]["strategies"].update(self.memory_references)
        return record

    def save(self) -> str:
        record = self.to_record()
        if self._live_file is not None:
            self._write_points()
            self._live_file.flush()
            record["live_lines"] = self._live_lines
            record["live_finished"] = True    # a follower can say the run ended
        trace.save(record, self.path)
        self.close_live()
        return self.path


_local = threading.local()
_global_recorder: list[Recorder] = []  # the TINYFLOW_TRACE recorder, if any
# Every recorder active in any thread (TINYFLOW_TRACE's too). Eager ops run millions
# of times unrecorded: they call `current()` only when this is not empty.
active: set[Recorder] = set()


def current() -> Recorder | None:
    """The recorder of the innermost active `record` block (or TINYFLOW_TRACE's)."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    return _global_recorder[0] if _global_recorder else None


@contextmanager
def record(path: str | os.PathLike, *, title: str | None = None,
           trace_values: bool = False, check_numerics: bool = False,
           max_runs: int = 20, live: bool | None = None) -> Iterator[Recorder]:
    """Record every Session.run in the block; write the DebugRecord at its end
    (also when the block raises, so a NaN found by check_numerics is kept).
    `live=True` also streams scalars and timelines while the block runs (see the
    module docstring); None means the TINYFLOW_LIVE environment variable decides."""
    recorder = Recorder(path, title, trace_values, check_numerics, max_runs, live)
    if not hasattr(_local, "stack"):
        _local.stack = []
    _local.stack.append(recorder)
    active.add(recorder)
    try:
        yield recorder
    finally:
        _local.stack.pop()
        active.discard(recorder)
        recorder.save()


def scalar(name: str, step: int, value: float) -> None:
    """Log one point of a scalar series (loss, accuracy, learning rate) at training
    step `step` to the active recorder; the debugger's curves view (``4``) draws
    every series. Does nothing when no recorder is active, so scripts can call it
    unconditionally. Example: ``tf.debug.scalar("loss", step, loss_value)``."""
    recorder = current()
    if recorder is not None:
        recorder.scalar(name, step, value)


def records_whole_process(recorder: Recorder) -> bool:
    """Whether `recorder` is TINYFLOW_TRACE's, which every thread sees (a `record`
    block's is its own thread's)."""
    return recorder in _global_recorder


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
    # TINYFLOW_CHECK_NUMERICS=1 (`tinyflow debug --run --check-numerics`) traces
    # values and stops at the first NaN/Inf, so `N` in the debugger can find it.
    check = os.environ.get("TINYFLOW_CHECK_NUMERICS") == "1"
    recorder = Recorder(path, trace_values=check or os.environ.get("TINYFLOW_TRACE_VALUES")
                        == "1", check_numerics=check)
    _global_recorder.append(recorder)
    active.add(recorder)
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
