"""Streams and events: which stream runs each step, and what each step waits for.

A GPU runs work from several *streams*: each stream runs its kernels in order, and an
*event* recorded after a kernel on one stream lets a kernel on another stream wait
for it. Independent branches of a graph put on different streams overlap. TinyFlow
uses the same model on the CPU, where a stream is a worker thread and an event a
`threading.Event`; numpy releases the GIL inside BLAS and large ufuncs, so two
matmul chains on two streams really do run at once on two cores.

This module is three small pieces, each a plain function or class:

1. `assign_streams`: the stream-assignment pass. List scheduling on estimated costs
   (a step goes to the stream where it can start earliest; leaving its producer's
   stream costs a hand-off), the critical-path heuristic of HEFT (Topcuoglu et al.
   2002) and of TensorFlow's and MXNet's GPU stream assignment, in a dozen lines.
2. `build_schedule`: the events. Each step carries a *vector clock* (Lamport 1978;
   Fidge/Mattern 1988): for every stream, the last step on it known to be finished
   when this step starts. A step waits for a producer on another stream only when
   its clock does not already cover it, so transitively implied waits are dropped.
   The same clocks answer `happens_before(a, b)`, which the memory planner needs: a
   buffer may be reused only once every reader on every stream is done.
   `validate_schedule` recomputes the clocks from the waits alone and proves every
   dependency is covered, so a missing event is an error, never a silent race.
3. `CpuStreams` runs a schedule with one worker thread per extra stream (the caller's
   thread runs stream 0). A failing step stops every stream and the error reaches the
   caller; a wait that does not finish within the timeout is an error naming both
   streams and the event. `CudaStreams` runs the same schedule on CuPy streams.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tinyflow.errors import TinyFlowError
from tinyflow.graph import Node
from tinyflow.registry import opdef_of

# Cost model for stream assignment, in "flop equivalents". Only ratios matter.
# A numpy call costs a few microseconds of Python before any arithmetic, roughly
# 2,000 flops at the ~1 GFLOP/s one core sustains on small arrays.
STEP_OVERHEAD = 2_000
# Handing a value to another stream means an event set/wait and a thread wake-up,
# some tens of microseconds: ~50,000 flops. Work smaller than that stays put.
HANDOFF_COST = 50_000

COMM_STREAM_NAME = "comm"


class ScheduleError(TinyFlowError):
    """A schedule whose events do not order a producer before its consumer."""


class StreamError(TinyFlowError, RuntimeError):
    """A stream failed or a wait between streams timed out."""


def estimate_cost(node: Node) -> float:
    """Rough flop count of `node` (its OpDef's `cost` where the arithmetic is not ~
    the output size: matmul, convolution; else the output size), plus the fixed
    per-step overhead."""
    cost = opdef_of(node).cost
    flops = cost(node) if cost is not None else None
    if flops is None:
        flops = 1.0
        for d in node.shape or ():
            flops *= d or 1
    return STEP_OVERHEAD + float(flops)


def assign_streams(nodes: Sequence[Node], deps: Sequence[Sequence[int]],
                   num_streams: int) -> tuple[list[int], list[str]]:
    """Choose a stream for each step.

    nodes        the steps' nodes, in schedule (topological) order
    deps         deps[b]: indices of earlier steps that step b needs
    num_streams  compute streams to use (1 reproduces the serial program)

    Steps whose node has attrs["stream"] == "comm" (allreduce) go to one extra
    stream named "comm". Returns (stream of each step, stream names).
    """
    if num_streams < 1:
        raise ValueError(f"streams must be >= 1, got {num_streams}")
    names = [f"compute{s}" for s in range(num_streams)]
    if any(n.attrs.get("stream") == COMM_STREAM_NAME for n in nodes):
        names.append(COMM_STREAM_NAME)
    if len(names) == 1:     # one stream, no comm steps: nothing to choose or cost
        return [0] * len(nodes), names
    comm = len(names) - 1
    first_consumer, follows = _followers(nodes, deps)
    stream_of: list[int] = [0] * len(nodes)
    finish: list[float] = [0.0] * len(nodes)
    free_at = [0.0] * len(names)          # when each stream runs out of work
    for b, node in enumerate(nodes):
        if b in follows:
            continue
        on_comm = node.attrs.get("stream") == COMM_STREAM_NAME
        candidates = [comm] if on_comm else list(range(num_streams))
        producers = [a for a in deps[b] if a not in follows]
        best_stream, best_start = _earliest_start(candidates, producers, stream_of,
                                                  finish, free_at)
        stream_of[b] = best_stream
        finish[b] = best_start + estimate_cost(node)
        free_at[best_stream] = finish[b]
        for a in deps[b]:
            if a in follows and first_consumer[a] == b:  # (never onto the comm stream)
                stream_of[a] = best_stream if best_stream < num_streams else 0
    return stream_of, names


def _followers(nodes: Sequence[Node], deps: Sequence[Sequence[int]]
               ) -> tuple[dict[int, int], set[int]]:
    """({step: its first consumer}, the steps that follow it). A step with no inputs
    (a constant, a random fill) follows its first consumer onto its stream: placed
    on its own, it would land on an idle stream and cost an event."""
    first_consumer: dict[int, int] = {}
    for b, needed in enumerate(deps):
        for a in needed:
            first_consumer.setdefault(a, b)
    follows = {b for b, needed in enumerate(deps) if not needed and b in first_consumer
               and nodes[b].attrs.get("stream") != COMM_STREAM_NAME}
    return first_consumer, follows


def _earliest_start(candidates: list[int], producers: list[int], stream_of: list[int],
                    finish: list[float], free_at: list[float]) -> tuple[int, float]:
    """The candidate stream on which a step starts first, and when: it is ready when
    every input is done (plus a hand-off from another stream), and starts when the
    stream is free too."""
    best_stream, best_start = candidates[0], None
    for s in candidates:
        ready = max((finish[a] + (0 if stream_of[a] == s else HANDOFF_COST)
                     for a in producers), default=0.0)
        start = max(ready, free_at[s])
        if best_start is None or start < best_start:
            best_stream, best_start = s, start
    return best_stream, best_start


@dataclass
class Schedule:
    """Steps in order, each with its stream, the events it waits for, its clock.

    stream_of[b]   stream of step b
    position[b]    index of step b within its stream
    waits[b]       earlier steps on other streams that b waits for (their events)
    records[b]     True when some step waits for b (b records an event)
    clock[b]       clock[b][s]: the last position on stream s finished before b
                   starts (-1: none)
    """

    names: list[str]
    stream_of: list[int]
    position: list[int]
    waits: list[list[int]]
    records: list[bool]
    clock: list[list[int]]

    def steps_of(self, stream: int) -> list[int]:
        return [b for b, s in enumerate(self.stream_of) if s == stream]

    def happens_before(self, a: int, b: int) -> bool:
        """True when step a is certainly finished before step b starts."""
        return self.position[a] <= self.clock[b][self.stream_of[a]]

    def to_dicts(self, node_names: Sequence[str], ops: Sequence[str]) -> list[dict]:
        """The DebugRecord's "schedule" section."""
        return [{"step": b, "node": node_names[b], "op": ops[b], "stream": self.stream_of[b],
                 "waits": [{"event": a, "stream": self.stream_of[a], "step": a}
                           for a in self.waits[b]],
                 "records_event": b if self.records[b] else None}
                for b in range(len(self.stream_of))]


def _clocks(stream_of: Sequence[int], position: Sequence[int],
            waits: Sequence[Sequence[int]], num_streams: int) -> list[list[int]]:
    """Vector clock at the start of each step, from stream order and waits alone."""
    after: list[list[int]] = []          # clock once step b has finished
    stream_clock = [[-1] * num_streams for _ in range(num_streams)]
    before: list[list[int]] = []
    for b, t in enumerate(stream_of):
        clock = list(stream_clock[t])
        for a in waits[b]:
            clock = [max(x, y) for x, y in zip(clock, after[a])]
        before.append(clock)
        done = list(clock)
        done[t] = position[b]
        after.append(done)
        stream_clock[t] = done
    return before


def build_schedule(stream_of: list[int], names: list[str],
                   deps: Sequence[Sequence[int]]) -> Schedule:
    """Add the events: step b waits for a producer on another stream only when its
    vector clock does not already cover it (latest producers first, since waiting for
    a late step often covers earlier ones)."""
    num = len(names)
    counters = [0] * num
    position = []
    for s in stream_of:
        position.append(counters[s])
        counters[s] += 1
    waits: list[list[int]] = []
    records = [False] * len(stream_of)
    after: list[list[int]] = []          # clock once step b has finished
    before: list[list[int]] = []         # clock at the start of step b (its waits done)
    stream_clock = [[-1] * num for _ in range(num)]
    for b, t in enumerate(stream_of):
        clock = list(stream_clock[t])
        mine = []
        for a in sorted(deps[b], reverse=True):
            s = stream_of[a]
            if s == t or position[a] <= clock[s]:
                continue  # same stream, or already ordered through another wait
            mine.append(a)
            records[a] = True
            clock = [max(x, y) for x, y in zip(clock, after[a])]
        waits.append(mine)
        before.append(clock)
        done = list(clock)
        done[t] = position[b]
        after.append(done)
        stream_clock[t] = done
    # (`before` is what _clocks computes from these waits; validate_schedule
    # recomputes it with _clocks, so as not to trust this loop.)
    return Schedule(names, stream_of, position, waits, records, before)


def validate_schedule(schedule: Schedule, deps: Sequence[Sequence[int]],
                      node_names: Sequence[str] | None = None) -> None:
    """Prove every dependency a -> b is ordered by stream order or events.

    The clocks are recomputed from `schedule.waits` (not trusted from the schedule),
    so a wait removed by mistake is found. Raises ScheduleError naming both steps
    and both streams.
    """
    name = (lambda i: node_names[i]) if node_names else (lambda i: f"step {i}")
    for b, waited in enumerate(schedule.waits):
        for a in waited:
            if not schedule.records[a]:
                raise ScheduleError(f"{name(b)} waits for the event of {name(a)}, "
                                    "which records none")
    clock = _clocks(schedule.stream_of, schedule.position, schedule.waits,
                    len(schedule.names))
    for b, needed in enumerate(deps):
        for a in needed:
            if schedule.position[a] > clock[b][schedule.stream_of[a]]:
                sa, sb = schedule.stream_of[a], schedule.stream_of[b]
                raise ScheduleError(
                    f"{name(b)} on stream {schedule.names[sb]} reads {name(a)} from "
                    f"stream {schedule.names[sa]} with no event between them: it could "
                    "run before its input is ready")


# ----------------------------------------------------------------------------------
# Running a schedule
# ----------------------------------------------------------------------------------

class _Worker:
    """A daemon thread that runs jobs (one job = one stream's part of one run)."""

    def __init__(self, name: str) -> None:
        self.job: Callable[[], None] | None = None
        self.start = threading.Event()
        self.done = threading.Event()
        self.done.set()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.start.wait()
            self.start.clear()
            job, self.job = self.job, None
            if job is _STOP:
                self.done.set()
                return
            try:
                if job is not None:
                    job()
            finally:
                # Drop the job before waiting again: it refers to the program, which
                # could then never be freed (nor this thread stopped with it).
                job = None
                self.done.set()

    def submit(self, job: Callable[[], None]) -> None:
        self.done.clear()
        self.job = job
        self.start.set()

    def stop(self) -> None:
        """Ask the thread to end once its current job (if any) is done."""
        self.job = _STOP
        self.start.set()


def _STOP() -> None:
    """The job that ends a worker's thread."""


def _stop_workers(workers: dict[int, _Worker], join: float = 0.0) -> None:
    """End the workers' threads (waiting up to `join` seconds for each); used by
    CpuStreams.close and when a CpuStreams is garbage collected."""
    stopping = list(workers.values())
    workers.clear()
    for worker in stopping:
        worker.stop()
    for worker in stopping:
        if join and worker.thread is not threading.current_thread():
            worker.thread.join(join)


class CpuStreams:
    """Run a Schedule on threads: the caller's thread is stream 0, each other stream
    has a worker thread, started on the first run and kept until `close()` (or until
    this object is garbage collected, with its Program); a run after `close()`
    starts them again.

    `run(run_step)` calls run_step(b) for every step, each stream in its order,
    waiting on events across streams. The first exception stops all streams and is
    raised to the caller (its node is named by run_step's own error); a wait longer
    than `timeout` seconds raises StreamError naming both streams and the event.
    """

    def __init__(self, schedule: Schedule, node_names: Sequence[str],
                 timeout: float = 120.0) -> None:
        self.schedule = schedule
        self.node_names = list(node_names)
        self.timeout = timeout
        self.stream_steps = [schedule.steps_of(s) for s in range(len(schedule.names))]
        self.workers: dict[int, _Worker] = {}
        # The threads end with this object: a finalizer holds the workers, not self.
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
        self._finalizer.atexit = False

    def _start_workers(self) -> None:
        """A worker per extra stream that has steps (an empty stream costs nothing)."""
        names = self.schedule.names
        self.workers.update({s: _Worker(f"tinyflow-{names[s]}")
                             for s in range(1, len(names)) if self.stream_steps[s]})

    def close(self) -> None:
        """End the worker threads (each after its current step, if one runs)."""
        _stop_workers(self.workers, join=self.timeout)

    def run(self, run_step: Callable[[int], None]) -> None:
        names = self.schedule.names
        if not self.workers:
            self._start_workers()
        for stream, worker in self.workers.items():
            name = names[stream]
            if not worker.done.wait(self.timeout):  # a step of a failed run still going
                raise StreamError(f"stream {name} is still busy with a previous run after "
                                  f"{self.timeout:g} s")
        events = [threading.Event() if r else None for r in self.schedule.records]
        abort = threading.Event()
        errors: list[tuple[int, BaseException]] = []
        current: dict[int, int] = {}           # stream -> the step it is running

        def run_stream(stream: int) -> None:
            try:
                for b in self.stream_steps[stream]:
                    for a in self.schedule.waits[b]:
                        if not events[a].wait(self.timeout):
                            raise self._timeout_error(a, b)
                    if abort.is_set():
                        return
                    current[stream] = b
                    run_step(b)
                    if events[b] is not None:
                        events[b].set()
            except BaseException as err:  # noqa: BLE001 - handed to the caller below
                errors.append((stream, err))
                abort.set()
                for event in events:  # wake every waiter so all streams stop
                    if event is not None:
                        event.set()

        for stream, worker in self.workers.items():
            worker.submit(lambda s=stream: run_stream(s))
        run_stream(0)
        for stream, worker in self.workers.items():
            if not worker.done.wait(self.timeout):
                step = current.get(stream)
                stuck = (f"; it is stuck in {self.node_names[step]} (step {step})"
                         if step is not None else "")
                errors.append((0, StreamError(
                    f"stream {names[0]} waited {self.timeout:g} s for stream "
                    f"{names[stream]} to finish{stuck}")))
                abort.set()
        if errors:
            # The first failure is the cause; later ones are streams that stopped.
            raise min(errors, key=lambda e: isinstance(e[1], StreamError))[1]

    def _timeout_error(self, a: int, b: int) -> StreamError:
        names, s = self.schedule.names, self.schedule.stream_of
        return StreamError(
            f"stream {names[s[b]]} waited {self.timeout:g} s for event {a} (after "
            f"{self.node_names[a]} on stream {names[s[a]]}) before running "
            f"{self.node_names[b]}; stream {names[s[a]]} is stuck or failed")


class CudaStreams:
    """Run a Schedule on CUDA streams through CuPy.

    Kernel launches are asynchronous, so one host thread issues every step in
    schedule order, each inside its stream's context; a step first makes its stream
    wait on the events of its producers on other streams, and a step someone waits
    for records an event after its kernel. Same Schedule, same semantics as the CPU.
    """

    def __init__(self, schedule: Schedule, node_names: Sequence[str],
                 timeout: float = 120.0) -> None:
        import cupy
        self.cupy = cupy
        self.schedule = schedule
        self.timeout = timeout
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in schedule.names]

    def close(self) -> None:
        """Nothing to end: CUDA streams are not threads (CuPy frees them)."""

    def run(self, run_step: Callable[[int], None]) -> None:
        cuda = self.cupy.cuda
        # Our streams are non-blocking: they would not wait for the feed uploads and
        # the arena set-up queued on the default stream. One event makes them wait.
        ready = cuda.Event(disable_timing=True)
        ready.record()
        for stream in self.streams:
            stream.wait_event(ready)
        events = [cuda.Event(disable_timing=True) if r else None
                  for r in self.schedule.records]
        for b, s in enumerate(self.schedule.stream_of):
            stream = self.streams[s]
            for a in self.schedule.waits[b]:
                stream.wait_event(events[a])
            with stream:
                run_step(b)
                if events[b] is not None:
                    events[b].record(stream)
        deadline = time.monotonic() + self.timeout
        for name, stream in zip(self.schedule.names, self.streams):
            while not stream.done:
                if time.monotonic() > deadline:
                    raise StreamError(f"CUDA stream {name} did not finish within "
                                      f"{self.timeout:.0f} s")
                time.sleep(1e-4)
