"""CudaStreams (tinyflow/streams.py) run against a model of CUDA's stream and event
ordering, so the GPU executor's synchronization is checked without a GPU.

The model gives every stream a vector clock (Lamport 1978; Mattern 1989), with CUDA's
rules (CUDA C Programming Guide, "Streams" and "Events"):

* work on one stream runs in issue order: a launch ticks its stream's own entry
  and carries a copy of the stream's clock;
* ``event.record(stream)`` snapshots the stream's clock at that point of issue;
* ``stream.wait_event(event)`` makes later work on the stream wait for the last
  record issued *before* the wait call (a later record does not count; an event
  never recorded is no wait at all): the stream's clock takes the maximum;
* launch A is finished before launch B starts exactly when B's clock covers A's
  tick on A's stream.

The non-blocking streams CudaStreams makes do not synchronize with the legacy
default stream, so the model adds no implicit ordering: anything it proves ordered
is ordered on a real GPU. Over random schedules, every dependency must be ordered
(and the feed uploads, queued on the default stream, before every step), and
removing any single wait from a schedule must leave some dependency unordered.
"""

from __future__ import annotations

import copy
import sys
import types

import numpy as np
import pytest

import gpu_tier
from tinyflow.streams import CudaStreams, Schedule, build_schedule


class CudaModel:
    """The `cupy` module, as far as CudaStreams uses it, over vector clocks."""

    def __init__(self) -> None:
        self.streams: list[ModelStream] = []
        self.default = ModelStream(self)           # the legacy default stream
        self.current = [self.default]
        self.launches: dict[object, tuple[int, int, dict[int, int]]] = {}
        self.cuda = types.SimpleNamespace(
            Stream=lambda non_blocking=False: ModelStream(self),
            Event=lambda disable_timing=False: ModelEvent(self),
            get_current_stream=lambda: self.current[-1])

    def launch(self, label: object) -> None:
        """Queue one kernel, `label`, on the current stream."""
        stream = self.current[-1]
        stream.clock[stream.id] = stream.clock.get(stream.id, 0) + 1
        self.launches[label] = (stream.id, stream.clock[stream.id], dict(stream.clock))

    def ordered(self, first: object, then: object) -> bool:
        """True when launch `first` certainly finishes before launch `then` starts."""
        stream, tick, _ = self.launches[first]
        return self.launches[then][2].get(stream, 0) >= tick


class ModelStream:
    def __init__(self, model: CudaModel) -> None:
        self.model = model
        self.id = len(model.streams)
        model.streams.append(self)
        self.clock: dict[int, int] = {}

    def wait_event(self, event: ModelEvent) -> None:
        for stream, tick in event.clock.items():
            self.clock[stream] = max(self.clock.get(stream, 0), tick)

    @property
    def done(self) -> bool:
        return True  # the model runs nothing: all issued work counts as finished

    def __enter__(self) -> ModelStream:
        self.model.current.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.current.pop()


class ModelEvent:
    def __init__(self, model: CudaModel) -> None:
        self.model = model
        self.clock: dict[int, int] = {}   # never recorded: waiting on it waits for nothing

    def record(self, stream: ModelStream | None = None) -> None:
        stream = stream or self.model.current[-1]
        self.clock = dict(stream.clock)


@pytest.fixture
def model(monkeypatch) -> CudaModel:
    """A fresh model installed as `cupy` (CudaStreams imports it when made)."""
    made = CudaModel()
    monkeypatch.setitem(sys.modules, "cupy", made)
    return made


def run_on_model(model: CudaModel, schedule: Schedule) -> None:
    """Queue the feed uploads on the default stream, then run `schedule` with
    CudaStreams, each step one launch."""
    model.launch("uploads")
    CudaStreams(schedule, [f"n{b}" for b in range(len(schedule.stream_of))]).run(
        lambda b: model.launch(b))


def unordered(model: CudaModel, deps) -> list[tuple[object, int]]:
    """(producer, consumer) pairs the model cannot order, uploads included."""
    return ([(a, b) for b, needed in enumerate(deps) for a in needed
             if not model.ordered(a, b)]
            + [("uploads", b) for b in range(len(deps)) if not model.ordered("uploads", b)])


def random_schedule(rng: np.random.Generator) -> tuple[Schedule, list[list[int]]]:
    """A random DAG of 2..24 steps in topological order, each step on a random one
    of 1..4 streams, and its schedule (build_schedule adds the events)."""
    size = int(rng.integers(2, 25))
    density = rng.uniform(0.05, 0.5)
    deps = [sorted(int(a) for a in np.flatnonzero(rng.random(b) < density))
            for b in range(size)]
    streams = int(rng.integers(1, 5))
    stream_of = [int(s) for s in rng.integers(0, streams, size)]
    return build_schedule(stream_of, [f"s{i}" for i in range(streams)], deps), deps


# ----------------------------------------------------------------------------------
# The model itself follows CUDA's rules
# ----------------------------------------------------------------------------------

def test_the_model_orders_one_stream_and_nothing_across_streams(model):
    one, two = model.cuda.Stream(non_blocking=True), model.cuda.Stream(non_blocking=True)
    with one:
        model.launch("a")
        model.launch("b")
    with two:
        model.launch("c")
    assert model.ordered("a", "b") and not model.ordered("b", "a")
    assert not model.ordered("a", "c") and not model.ordered("c", "a")


def test_the_model_waits_for_the_record_before_the_wait_call(model):
    one, two = model.cuda.Stream(non_blocking=True), model.cuda.Stream(non_blocking=True)
    event, never = model.cuda.Event(), model.cuda.Event()
    with one:
        model.launch("a")
    event.record(one)
    with one:
        model.launch("late")
    two.wait_event(event)
    two.wait_event(never)               # never recorded: no wait
    event.record(one)                   # recorded again after the wait: not waited for
    with two:
        model.launch("c")
    assert model.ordered("a", "c") and not model.ordered("late", "c")


# ----------------------------------------------------------------------------------
# CudaStreams on the model
# ----------------------------------------------------------------------------------

def test_cuda_streams_order_every_dependency_of_random_schedules(model):
    rng = np.random.default_rng(21)
    for trial in range(400):
        schedule, deps = random_schedule(rng)
        fresh = CudaModel()
        sys.modules["cupy"] = fresh
        run_on_model(fresh, schedule)
        assert not unordered(fresh, deps), f"trial {trial}: {unordered(fresh, deps)}"
        gpu_tier.add("schedules")


def test_removing_any_single_wait_is_caught(model):
    """Every wait build_schedule adds is needed: without it, the model finds the
    consumer can start before its producer finishes (so the model can tell)."""
    rng = np.random.default_rng(7)
    caught = missed = 0
    for _ in range(400):
        schedule, deps = random_schedule(rng)
        for b, waits in enumerate(schedule.waits):
            for a in waits:
                mutant = copy.deepcopy(schedule)
                mutant.waits[b] = [w for w in waits if w != a]
                fresh = CudaModel()
                sys.modules["cupy"] = fresh
                run_on_model(fresh, mutant)
                if (a, b) in unordered(fresh, deps):
                    caught += 1
                else:
                    missed += 1
    gpu_tier.add("removed waits caught", caught)
    gpu_tier.add("removed waits missed", missed)
    assert caught > 300 and missed == 0
