"""Pipeline parallelism: a model cut into stages, one stage per rank, fed microbatches.

Rank s holds only stage s's layers. A batch is cut into m microbatches; stage s runs
the forward of each microbatch (F) when stage s-1 sends it the activation, and its
backward (B) when stage s+1 sends the gradient of that activation; the gradients of
its parameters are summed over the microbatches, then the stage's optimizer applies
them once: the same step as one rank on the whole batch (GPipe, Huang et al. 2019).

The **schedule** is the order in which a stage runs its F's and B's:

* GPipe: all m forwards, then all m backwards. Stage s stashes the inputs of all m
  microbatches until their backwards: m activations alive at the peak.
* 1F1B (PipeDream-Flush, Narayanan et al. 2021): p-s-1 warm-up forwards, then one
  forward and one backward alternately, then the remaining backwards. A stage never
  holds more than p-s microbatches' inputs: the peak is p, not m.

Both leave the same **bubble**: a pipeline of p stages and m microbatches (each
stage's F and B take t_f and t_b) runs for (m+p-1)(t_f+t_b) and each stage is busy
m(t_f+t_b), so the idle fraction is (p-1)/(m+p-1); more microbatches shrink it.

What a stage stashes is its *input* activation; its backward runs the stage's forward
again (re-materialization, as GPipe does) inside the same compiled backward program,
so the stash per microbatch is one array per stage.

Each rank records its F's and B's as timeline events twice: in wall-clock seconds,
and in **logical time** (each F costs 1 unit, each B 2, a message carries its
sender's clock; a receiving stage starts no earlier than the message's time, as in
Lamport clocks). Logical time is the schedule itself, free of the machine's noise:
`pipeline_bubble_error_pts` compares its idle fraction with the formula.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tinyflow import api
from tinyflow.autodiff import gradients
from tinyflow.errors import ArgumentError
from tinyflow.graph import Node, TinyFlowError, reachable
from tinyflow.transports import Transport

__all__ = ["Pipeline", "schedule_gpipe", "schedule_1f1b", "bubble_fraction", "SCHEDULES",
           "idle_fraction"]

F_COST, B_COST = 1.0, 2.0  # logical time of a forward and a backward (t_b = 2 t_f)


def schedule_gpipe(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """[("F", 0), ..., ("F", m-1), ("B", 0), ..., ("B", m-1)]: all forwards first."""
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


def schedule_1f1b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Warm-up forwards (p-s-1 of them), then F,B pairs, then the remaining B's."""
    warm = min(stages - stage - 1, microbatches)
    actions = [("F", i) for i in range(warm)]
    for i in range(microbatches - warm):
        actions += [("F", warm + i), ("B", i)]
    return actions + [("B", i) for i in range(microbatches - warm, microbatches)]


SCHEDULES: dict[str, Callable[[int, int, int], list[tuple[str, int]]]] = {
    "gpipe": schedule_gpipe, "1f1b": schedule_1f1b}


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The textbook idle fraction of a GPipe or 1F1B pipeline: (p-1)/(m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def idle_fraction(events_per_rank: Sequence[Sequence[dict]], clock: str = "logical"
                  ) -> float:
    """1 - (busy time summed over ranks) / (ranks x the span from the first start to
    the last end), from each rank's F/B events (`Pipeline.events`); `clock` is
    "logical" (the schedule's units) or "wall" (seconds)."""
    begin, finish = ("logical_start", "logical_end") if clock == "logical" else \
        ("start", "end")
    spans = [e for events in events_per_rank for e in events]
    start = min(e[begin] for e in spans)
    end = max(e[finish] for e in spans)
    busy = sum(e[finish] - e[begin] for e in spans)
    return 1.0 - busy / (len(events_per_rank) * (end - start))


def _check_count(name: str, value: Any) -> None:
    """A count argument must be a whole number >= 1 (0 divided by zero, a negative
    one made a placeholder of negative shape, naming neither)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ArgumentError(f"Pipeline: {name} must be a whole number >= 1, got {value!r}")


def _take_initializers(variables: set[int]) -> list[Node]:
    """Remove the initializers of `variables` (ids) from the global list and return
    them: this stage runs them itself, so a later global initializer on another
    rank's thread does not."""
    taken = [a for a in api._initializers if id(a.inputs[0]) in variables]
    api._initializers[:] = [a for a in api._initializers if id(a.inputs[0]) not in variables]
    return taken


class Pipeline:
    """Stage `comm.rank` of a pipeline over `comm.size` ranks.

    stages        one callable per stage, h -> h (layers whose Variables already
                  exist, e.g. closures over tf.Variable's); the last returns logits
    loss_fn       (logits, labels) -> scalar loss, a mean over the microbatch
    input_shape   one example's features (stage 0's input is (batch/m, *input_shape))
    batch_size    examples per step; microbatches must divide it
    optimizer     a tf.train optimizer for this stage's Variables
    schedule      "gpipe" or "1f1b"
    init          the global initializer's group node: this stage's `init` runs only
                  the initializers of its own Variables (and its optimizer's slots)

    Every rank builds all stages' graphs (cheap: no Variables are created, and it gives
    each stage its input shape) but compiles and runs only its own.
    """

    def __init__(self, stages: Sequence[Callable[[Node], Node]],
                 loss_fn: Callable[[Node, Node], Node], comm: Transport,
                 input_shape: Sequence[int], batch_size: int, microbatches: int,
                 optimizer: Any, schedule: str = "1f1b", init: Node | None = None,
                 dtype: Any = np.float32, label_dtype: Any = np.int64) -> None:
        if len(stages) != comm.size:
            raise TinyFlowError(f"Pipeline: {len(stages)} stages need {len(stages)} ranks, "
                                f"the communicator has {comm.size}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        _check_count("batch_size", batch_size)
        _check_count("microbatches", microbatches)
        if batch_size % microbatches:
            raise ValueError(f"{microbatches} microbatches do not divide the batch of "
                             f"{batch_size}")
        self.comm, self.schedule, self.m = comm, schedule, microbatches
        self.batch_size = batch_size
        self.stage, self.p = comm.rank, comm.size
        mb = batch_size // microbatches
        inputs, outputs = [], []
        h_shape = (mb, *input_shape)
        for build in stages:  # placeholders of each stage's input shape, chained
            x = api.placeholder(dtype, h_shape)
            y = build(x)
            inputs.append(x)
            outputs.append(y)
            h_shape = tuple(y.shape)
        self.x, self.y = inputs[self.stage], outputs[self.stage]
        self.in_shape, self.out_shape = tuple(self.x.shape), tuple(self.y.shape)
        self.dtype = np.dtype(dtype)
        under = {id(n) for n in reachable([self.y])}
        self.variables = [v for v in api.trainable_variables() if id(v) in under]
        self._build_backward(loss_fn, label_dtype, mb)
        known = {id(v) for v in api.global_variables()}
        self.update = optimizer.apply_gradients(list(zip(self.grad_feeds, self.variables)))
        made = {id(v) for v in api.global_variables()} - known  # the optimizer's slots
        mine = [a for a in (init.inputs if init is not None else ())
                if a.inputs and id(a.inputs[0]) in under]
        self.init = api.group(*mine, *_take_initializers(made))
        self.events: list[dict] = []
        self.peak_stash = 0

    def _build_backward(self, loss_fn: Callable, label_dtype: Any, mb: int) -> None:
        last = self.stage == self.p - 1
        if last:
            self.labels = api.placeholder(label_dtype, (mb,))
            self.loss = loss_fn(self.y, self.labels)
            # The step's loss is the mean over microbatches: scale each one by 1/m.
            seed = self.loss * (1.0 / self.m)
            grads = gradients(seed, [self.x, *self.variables])
        else:
            self.grad_y = api.placeholder(self.dtype, self.out_shape)
            grads = gradients(self.y, [self.x, *self.variables], grad_ys=[self.grad_y])
        self.grad_x, self.grad_vars = grads[0], grads[1:]
        if any(g is None for g in self.grad_vars):
            raise TinyFlowError("Pipeline: a stage Variable does not affect the loss")
        self.grad_feeds = [api.placeholder(v.dtype, v.shape) for v in self.variables]

    # -- one training step ------------------------------------------------------------
    def train_step(self, session: Any, x: np.ndarray | None, labels: np.ndarray | None
                   ) -> float | None:
        """Run one step of the schedule; return the batch's mean loss on the last stage
        (None on the others). Stage 0 needs `x`, the last stage `labels`."""
        m, s = self.m, self.stage
        xs = np.split(self._whole_batch("x", x), m) if s == 0 else None
        ys = np.split(self._whole_batch("labels", labels), m) if s == self.p - 1 else None
        stash: dict[int, np.ndarray] = {}
        sums = [np.zeros(v.shape, v.dtype) for v in self.variables]
        losses: list[float] = []
        self.clock, self.peak_stash = 0.0, 0
        self.events = []
        for kind, i in SCHEDULES[self.schedule](s, self.p, m):
            if kind == "F":
                stash[i] = self._forward(session, i, xs, ys, losses)
                self.peak_stash = max(self.peak_stash, len(stash))
            else:
                self._backward(session, i, stash.pop(i), ys, sums)
        session.run(self.update, dict(zip(self.grad_feeds, sums)))
        return float(np.mean(losses)) if losses else None

    def _whole_batch(self, name: str, array: np.ndarray | None) -> np.ndarray:
        """`array` when it holds batch_size rows (it is cut into the microbatches),
        else a TinyFlowError naming it and both sizes (numpy said only "array split
        does not result in an equal division")."""
        shape = None if array is None else np.shape(array)
        if shape is None or shape[:1] != (self.batch_size,):
            got = "is None" if shape is None else f"has shape {shape}"
            raise TinyFlowError(f"Pipeline.train_step: {name} {got}, stage {self.stage} "
                                f"needs batch_size {self.batch_size} rows (cut into "
                                f"{self.m} microbatches)")
        return array

    def _forward(self, session, i, xs, ys, losses) -> np.ndarray:
        if self.stage == 0:
            x = xs[i]
        else:
            x = self._recv(self.stage - 1, self.in_shape, f"pipeline act mb{i}")
        began, start = time.perf_counter(), self.clock
        if self.stage == self.p - 1:
            losses.append(float(session.run(self.loss, {self.x: x, self.labels: ys[i]})))
        else:
            y = session.run(self.y, {self.x: x})
        self._event("F", i, began, start, F_COST)
        if self.stage < self.p - 1:
            self._send(self.stage + 1, y, f"pipeline act mb{i}")
        return x

    def _backward(self, session, i, x, ys, sums) -> None:
        feed = {self.x: x}
        if self.stage == self.p - 1:
            feed[self.labels] = ys[i]
        else:
            feed[self.grad_y] = self._recv(self.stage + 1, self.out_shape,
                                           f"pipeline grad mb{i}")
        began, start = time.perf_counter(), self.clock
        fetched = session.run([self.grad_x, *self.grad_vars], feed)
        for total, g in zip(sums, fetched[1:]):
            total += g
        self._event("B", i, began, start, B_COST)
        if self.stage > 0:
            self._send(self.stage - 1, fetched[0], f"pipeline grad mb{i}")

    # -- messages carry the sender's logical clock -----------------------------------
    def _send(self, dst: int, array: np.ndarray, tag: str) -> None:
        array = np.ascontiguousarray(array, dtype=self.dtype)
        self.comm.exchange([(dst, array), (dst, np.array([self.clock]))], [], tag)

    def _recv(self, src: int, shape: tuple, tag: str) -> np.ndarray:
        out, clock = np.empty(shape, self.dtype), np.empty(1)
        self.comm.exchange([], [(src, out), (src, clock)], tag)
        self.clock = max(self.clock, float(clock[0]))
        return out

    def _event(self, kind: str, i: int, began: float, start: float, cost: float) -> None:
        self.clock = start + cost
        self.events.append({"node": f"{kind}{i}", "kind": kind, "microbatch": i,
                            "stream": f"rank{self.stage}/compute", "start": began,
                            "end": time.perf_counter(), "logical_start": start,
                            "logical_end": self.clock})
