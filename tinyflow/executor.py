"""Compile a graph into a Program once; run the Program many times.

`compile(fetches, feeds, variables, **options)` is the whole pipeline of
shared/DESIGN.md; its phases are the functions that follow it, in this order (as
the Setup* methods of tqchen/tinyflow's Session):

1. `_optimize`: specialize the graph to the fed shapes and run the passes
   (passes.py);
2. `_make_steps`: a slot per value, a Step per computed node (sources are bound,
   not run: the registry's `OpDef.source` says which);
3. `_schedule`: a stream for each step and the events between streams
   (streams.py), checked by `validate_schedule`;
4. `_plan_memory`: one arena, each intermediate an offset in it (memory.py), and
   each kernel's scratch memory (`OpDef.scratch`) too, checked by the plan
   validator; each step's output is bound to its view of the arena, and kernels
   write there through `out=` (destination passing, as in CSE 599W's dlsys);
5. `_bind_kernels`: each step's kernel specialized to its static shapes
   (`OpDef.bind`), with its scratch; a variable writer (`OpDef.mutates`) bound to
   its variable;
6. `_make_runner`: with several streams, a runner (threads, or CUDA streams).

Running is one loop over the steps through one kernel runner, `_execute` (the
lesson of TF1's Session: build once, run many times); with several streams, one
loop per stream. Options turn on a timeline, value summaries, NaN checks and
poisoning of freed memory, through one instrumented wrapper, `_run_step`.
Everything the hardware decides (numpy or CuPy, uploads, the stream runner, the
clock) is asked of one `backend.Device`, so this file reads as CPU code.
`Session.run` (session.py) compiles per set of fetches and fed shapes and caches the
Program, so a `None` batch dimension specializes at run time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import operator
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyflow import backend, fusion, memory, sublinear
from tinyflow import passes as passes_mod
from tinyflow.graph import (
    FeedError,
    Graph,
    Node,
    TinyFlowError,
    format_shape,
    ordering_dependencies,
)
from tinyflow.ops import REGISTRY, OpDef
from tinyflow.registry import mutated_input, source_kind, written_variable
from tinyflow.streams import (
    Schedule,
    assign_streams,
    build_schedule,
    validate_schedule,
)


class ExecutionError(TinyFlowError, RuntimeError):
    """A kernel failed; the message names the node and the user's source line."""


def fed_kind(node: Node) -> str:
    """What a fed node is, for messages: TF1 lets a feed replace any node, and a fed
    Variable or intermediate node called a "placeholder" sent the reader looking
    for one that does not exist."""
    kind = source_kind(node)
    return "placeholder" if kind == "feed" else kind or f"{node.op} node"


def check_feed(node: Node, value: Any) -> np.ndarray:
    """Return `value` as an array fit for placeholder `node`, or raise FeedError.

    Values are converted when numpy calls the conversion "same_kind" (float64 data
    into a float32 placeholder, ints into a float placeholder), as the original
    TinyFlow's programs rely on; anything else (floats into an int placeholder,
    strings, objects) is refused. Known dims of the placeholder must match.
    """
    try:
        array = np.asarray(value)
    except Exception as err:  # ragged lists and the like (with the line, as the rest)
        raise FeedError(f"{_feed_of(node)} is not an array: {err}") from None
    want = node.dtype
    if want is not None and array.dtype != want:
        if array.dtype.kind in "OUSV" or not np.can_cast(array.dtype, want, "same_kind"):
            raise FeedError(f"{_feed_of(node)} has dtype {array.dtype}, expected {want}")
        array = _cast_in_range(node, array, np.dtype(want))
    if node.shape is not None:
        ok = len(node.shape) == array.ndim and all(
            d is None or d == s for d, s in zip(node.shape, array.shape))
        if not ok:
            raise FeedError(f"{_feed_of(node)} has shape {array.shape}, expected "
                            f"{format_shape(node.shape)}")
    return array


def _feed_of(node: Node) -> str:
    """How a feed error names the fed node. Made only when there is an error:
    check_feed runs for every feed of every run."""
    return f"feed for {fed_kind(node)} {node.name!r} (created at {node.where})"


def _cast_in_range(node: Node, array: np.ndarray, want: np.dtype) -> np.ndarray:
    """`array` cast to `want`, refusing what the cast would not keep: an integer
    outside `want`'s range (numpy wraps 2**40 + 5 to 5 in int32), or a finite value
    that becomes inf (1e300 into float32). NaN and inf fed as such stay as they are."""
    def refuse(what: str) -> FeedError:
        return FeedError(f"{_feed_of(node)} has {what}, which {want} cannot hold "
                         f"(dtype {array.dtype} -> {want})")
    if want.kind in "iu" and array.dtype.kind in "iub" and array.size:
        info = np.iinfo(want)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise refuse(f"value {bad} outside [{info.min}, {info.max}]")
    with np.errstate(over="ignore", invalid="ignore"):
        cast = array.astype(want)
    if want.kind == "f" and array.size:
        overflowed = np.isinf(cast) & np.isfinite(array)
        if overflowed.any():
            bad = array[overflowed].flat[0]
            raise refuse(f"value {bad} beyond +-{np.finfo(want).max:g}")
    return cast



@dataclass
class DebugHooks:
    """How the executor reaches tf.debug (debug.py, a layer above, which fills these in
    when it loads, so executor.py never imports it): `attach(program, path)` records
    a compiled program, `current()` is the active recorder or None."""

    attach: Callable[[Any, Any], None] = lambda program, path: None
    current: Callable[[], Any] = lambda: None


DEBUG_HOOKS = DebugHooks()

# The compiler's passes (passes.PIPELINE, gradient checkpointing included).
PIPELINE = passes_mod.PIPELINE


class NumericsError(ExecutionError):
    """Check mode: a node produced NaN or Inf (the first such node is named)."""


@dataclass
class Step:
    """One step of a Program: run `node`'s kernel on the values in `inputs` slots.

    index         the step's position in the program (and in its timeline)
    planned       the output lives in the arena: the kernel gets it as `out=`
    free_after    (unplanned runs) slots whose last reader is this step
    copy_views    (unplanned runs) the step reads a variable: a view it returns
                  (reshape, transpose) must be copied, or a later assign in the same
                  run would change it
    poison_after  (poison mode) arena byte ranges dead once this step is done
    nbytes        bytes the step touches (inputs + output), for the timeline
    kernel        `compute` with the array module and the attributes bound (made by
                  `_bind_kernels`): the runner calls kernel(*inputs, out=...). An op
                  whose compute is one ufunc (OpDef.ufunc) gets the ufunc itself.
    gather        values -> the tuple of this step's input values (`_gather_of`)
    scratch       the kernel's scratch memory (OpDef.scratch), a uint8 array: its
                  place in the arena (planned runs) or in its stream's scratch
                  buffer (unplanned runs); None when the kernel needs none
    """

    node: Node
    compute: Any
    inputs: tuple[int, ...]
    output: int
    attrs: dict
    index: int = 0
    stream: int = 0
    planned: bool = False
    free_after: tuple[int, ...] = ()
    copy_views: bool = False
    poison_after: tuple[tuple[int, int], ...] = ()
    nbytes: int = 0
    sources: tuple[tuple[str, str], ...] = ()  # fused: (name, line) per instruction
    kernel: Any = None
    gather: Any = None
    scratch: Any = None


@dataclass
class Program:
    """A compiled graph: steps bound to kernels and memory, a schedule, a plan.

    `compile` makes an empty Program and its phases fill it in, in this order.

    graph          the specialized, optimized graph the steps come from
    target         the Device it runs on (backend.py): array module, uploads, clock
    steps          in schedule order; step k runs on stream schedule.stream_of[k]
    values         slots: one per node of the schedule's order, and `store_slot`,
                   which holds the Session's variable store during a run (the steps
                   that write variables read it, as any step reads its inputs)
    schedule       streams, events (waits) and vector clocks (streams.py)
    memory_plan    the MemoryPlan (memory.py), or None when memory=None
    arena          the one buffer every planned intermediate is a view of
    runner         the multi-stream runner (None: one stream, a plain loop)
    ctx            pass records and per-pass snapshots (passes.py)
    timelines      the timelines of recent traced runs (trace=True); last_timeline
                   is the latest: [{step, node, op, stream, start, end, bytes,
                   summary}] with times in seconds from the run's start
    """

    graph: Graph
    ctx: passes_mod.PassContext
    target: backend.Device
    options: dict
    steps: list[Step] = field(default_factory=list)
    feed_slots: list[tuple[Node, int]] = field(default_factory=list)  # (user node, slot)
    # (user variable, slot, only written: a first tf.assign gives it its value)
    variable_slots: list[tuple[Node, int, bool]] = field(default_factory=list)
    fetch_slots: list[int] = field(default_factory=list)
    slot_template: list = field(default_factory=list)  # values bound before any run
    store_slot: int = 0
    schedule: Schedule | None = None
    memory_plan: Any = None
    arena: Any = None
    runner: Any = None
    timelines: list = field(default_factory=list)
    runs: int = 0
    check_failure: dict | None = None
    fetched_before_writes: tuple[int, ...] = ()  # fetched variables this program writes
    # One run at a time: the arena, the slots and the stream workers are the
    # Program's own, so concurrent callers (Session.run from several threads, which
    # TF1 allows) take turns on it.
    lock: Any = field(default_factory=threading.RLock, repr=False)
    # check mode: slot -> (user node, "feed for placeholder" / "variable") and the
    # graph's node of each such slot
    source_slots: dict = field(default_factory=dict)
    graph_node_of_slot: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.target.name

    @property
    def xp(self) -> Any:
        return self.target.xp

    @property
    def last_timeline(self) -> list[dict] | None:
        return self.timelines[-1] if self.timelines else None

    def run(self, feeds: dict[Node, np.ndarray], store: dict[Node, np.ndarray]) -> list:
        """Execute once. `feeds` maps the user's fed nodes to checked arrays; `store`
        is the Session's variables (updated in place by assigns). Returns the fetched
        arrays (copies: later runs never change what a caller holds). Thread-safe:
        callers from several threads run one after the other."""
        with self.lock:
            return self._run(feeds, store)

    def close(self) -> None:
        """End the stream worker threads (a later run starts them again)."""
        if self.runner is not None:
            with self.lock:
                self.runner.close()

    def _run(self, feeds: dict[Node, np.ndarray], store: dict[Node, np.ndarray]) -> list:
        values = self._bind_inputs(feeds, store)
        reads = {slot: backend.to_host(values[slot]) for slot in self.fetched_before_writes
                 if values[slot] is not None}
        self.runs += 1
        opts = self.options
        if opts["check_numerics"]:
            self._check_sources(values)
        if opts["trace"] or opts["poison"] or opts["check_numerics"]:
            self._run_instrumented(values)
        else:
            self._run_steps(values, self._execute)
        return [reads[s] if s in reads else None if values[s] is None
                else backend.to_host(values[s]) for s in self.fetch_slots]

    def _bind_inputs(self, feeds: dict[Node, np.ndarray], store: dict[Node, np.ndarray]
                     ) -> list:
        """This run's slots: the compiled ones (constants, arena views), the feeds,
        the variables' buffers, and the store itself."""
        values = list(self.slot_template)
        values[self.store_slot] = store
        for node, slot in self.feed_slots:
            values[slot] = self.target.upload(feeds[node])  # (a GPU copies it over)
        for var, slot, write_only in self.variable_slots:
            if var not in store:
                if write_only:  # a first tf.assign gives it a value
                    continue
                raise ExecutionError(f"variable {var.name!r} (created at {var.where}) is "
                                     "used before it has a value; run "
                                     "tf.global_variables_initializer() first")
            value = self.target.resident(store[var])
            if value is not store[var]:  # a value the user set on the host, now on the GPU
                store[var] = value
            values[slot] = value
        return values

    def _run_steps(self, values: list, execute: Any) -> None:
        """The one loop: `execute(step, values)` for every step, in order on one
        stream, or each stream in its order on the runner (threads, CUDA streams)."""
        if self.runner is None:
            for step in self.steps:
                execute(step, values)
        else:
            steps = self.steps
            self.runner.run(lambda k: execute(steps[k], values))

    def _execute(self, step: Step, values: list) -> Any:
        """The kernel runner: run one step's kernel into its slot (or its arena view),
        drop the values it was the last reader of, and return its value. A kernel's
        error comes back naming the node, its line (and its stream, if several)."""
        try:
            args = step.gather(values)
            if step.planned:
                result = values[step.output]
                written = step.kernel(*args, out=result)
                if written is not result:  # the kernel could not write into `out`
                    result[...] = written
            else:
                result = _materialize(self.target.xp, step, step.kernel(*args))
                values[step.output] = result
        except TinyFlowError:
            raise
        except Exception as err:
            stream = self.schedule.names[step.stream] if self.runner is not None else None
            raise _kernel_error(step, err, stream) from err
        for slot in step.free_after:
            values[slot] = None
        return result

    def _run_instrumented(self, values: list) -> None:
        """Run every step through `_run_step`: a timeline, value summaries, NaN
        checks, poisoning, as the options ask."""
        timeline: list[dict] | None = [] if self.options["trace"] else None
        clock = self.target.clock()  # host time on the CPU, CUDA events on a GPU
        clock.start()
        try:
            self._run_steps(values, lambda step, values: self._run_step(step, values,
                                                                         timeline, clock))
        finally:
            # Kept also when a step failed: the steps before a NaN show how it came.
            if timeline is not None:
                clock.resolve(timeline)
                timeline.sort(key=lambda e: e["start"])
                self.timelines.append(timeline)
                del self.timelines[:-MAX_KEPT_TIMELINES]

    def _run_step(self, step: Step, values: list, timeline: list | None, clock: Any) -> None:
        """The instrumented wrapper of `_execute` (any stream)."""
        began = clock.mark()
        # Check mode reports NaN/Inf itself, naming the node: numpy's warnings would
        # only repeat it without saying where.
        with np.errstate(all="ignore" if self.options["check_numerics"] else None):
            result = self._execute(step, values)
        summary = None
        if self.options["trace_values"] or self.options["check_numerics"]:
            summary = value_summary(self.target.xp, result)
            if self.options["check_numerics"] and summary and (summary["nan"] or
                                                               summary["inf"]):
                self._numerics_failure(step, result, summary)
        if timeline is not None:
            timeline.append({"step": step.index, "node": step.node.name,
                             "op": step.node.op, "stream": step.stream, "start": began,
                             "end": clock.mark(), "bytes": step.nbytes,
                             "summary": summary if self.options["trace_values"] else None})
        for offset, nbytes in step.poison_after:
            self.arena[offset:offset + nbytes].fill(POISON_BYTE)

    def _check_sources(self, values: list) -> None:
        """Check mode: a NaN or Inf fed, or held by a variable, is named as such (not
        as the first op that reads it)."""
        for slot, (user, what) in self.source_slots.items():
            summary = value_summary(self.xp, values[slot])
            if summary and (summary["nan"] or summary["inf"]):
                node = self.graph_node_of_slot[slot]
                message = (f"check_numerics: {what} {user.name!r} (created at "
                           f"{user.where}) holds {summary['nan']} NaN and {summary['inf']} "
                           f"Inf values (shape {tuple(values[slot].shape)}); no op made them")
                self.check_failure = {"node": node.name, "where": user.where,
                                      "message": message}
                raise NumericsError(message)

    def _numerics_failure(self, step: Step, result: Any, summary: dict) -> None:
        node = step.node
        origin = (f", standing for {', '.join(node.provenance)}"
                  if node.provenance != (node.name,) else "")
        message = (f"check_numerics: {node.op} {node.name} (created at {node.where}"
                   f"{origin}) produced {summary['nan']} NaN and {summary['inf']} Inf "
                   f"values in its output of shape {tuple(result.shape)}; inputs: " + ", ".join(
                       f"{i.name} {i.shape}" for i in node.inputs))
        self.check_failure = {"node": node.name, "where": node.where, "message": message}
        raise NumericsError(message)


def _materialize(xp: Any, step: Step, result: Any) -> Any:
    """An unplanned step's result as the planned path would hold it: C-contiguous.

    A planned kernel writes into its C-contiguous arena view; unplanned, numpy
    returns views (a transpose) or keeps its inputs' layout (x.T * 2 is Fortran
    ordered), and a later reduction or matmul then adds the same numbers in another
    order: float results would differ in the last bits between `memory=None` and a
    plan. Copying such results to C order makes both paths compute on the same
    layout, hence bitwise equal. A view of a variable (`copy_views`) is copied too:
    a later assign in the same run would change it."""
    if result is None or not hasattr(result, "flags"):
        return result
    if not result.flags.c_contiguous:
        return xp.ascontiguousarray(result)
    if step.copy_views and result.base is not None:
        return result.copy()
    return result


MAX_KEPT_TIMELINES = 20
# Poisoned memory is all 0xFF bytes: NaN for float16/32/64 and -1 for signed ints, so a
# read of a freed buffer (a wrong plan) shows up as a wrong answer, not a lucky one.
POISON_BYTE = 0xFF


def value_summary(xp: Any, value: Any) -> dict | None:
    """min/max/mean over the finite values, and the NaN and Inf counts (floats only;
    None for other dtypes)."""
    if value is None or not hasattr(value, "dtype") or value.dtype.kind != "f":
        return None
    finite_mask = xp.isfinite(value)
    nan = int(xp.isnan(value).sum())
    inf = int(value.size - int(finite_mask.sum()) - nan)
    finite = value[finite_mask]
    if finite.size == 0:
        return {"min": None, "max": None, "mean": None, "nan": nan, "inf": inf}
    return {"min": float(finite.min()), "max": float(finite.max()),
            "mean": float(finite.mean()), "nan": nan, "inf": inf}


def _kernel_error(step: Step | None, err: Exception, stream: str | None = None
                  ) -> ExecutionError:
    node = step.node
    shapes = ", ".join(str(i.shape) for i in node.inputs)
    where = f" on stream {stream}" if stream else ""
    culprit = f"{node.op} {node.name} (created at {node.where})"
    k = fusion.failed_instruction(err) if step.sources else None
    if k is not None and k < len(step.sources):
        # A fused kernel: name the op of the instruction that raised, and its line.
        op, operands, _ = node.attrs["program"][k]
        name, line = step.sources[k]
        culprit = (f"{op} {name} (created at {line}; instruction t{k} = {op}"
                   f"({', '.join(operands)}) of fused node {node.name})")
    return ExecutionError(f"{culprit} failed{where} on inputs of shapes {shapes}: "
                          f"{type(err).__name__}: {err}")


def _variable_writer(kernel: Any, var: Node, node: Node) -> Any:
    """A kernel of an op that writes a variable in place (OpDef.mutates: tf.assign,
    fused_assign), bound to user variable `var`. The Session's store comes in as its
    first input (the program's `store_slot`); `kernel` writes straight into the
    store's buffer of `var`, which keeps its identity across runs (the planner relies
    on it). Should that buffer not exist yet (a variable only written) or not be of
    the compiled shape and dtype (an assign that changes a variable's shape, as
    tf.infer_variable_shapes programs do), the variable gets a new buffer first."""
    shape, dtype = node.shape, node.dtype

    def write_variable(xp: Any, store: dict, current: Any, *arrays: Any, out: Any = None,
                       **attrs: Any) -> Any:
        held = store.get(var)
        if held is None or held.shape != shape or held.dtype != dtype:
            held = store[var] = xp.empty(shape, dtype=dtype)
        return kernel(xp, held, *arrays, **attrs)
    return write_variable


node_nbytes = memory.node_nbytes  # bytes of a node's value (shapes are concrete here)


DEFAULT_OPTIONS = {"passes": None, "disable": (), "streams": 1, "memory": "auto",
                   "poison": False, "checkpoint": None, "trace": False,
                   "trace_values": False, "check_numerics": False, "debug": None,
                   "wait_timeout": 120.0}
class OptionError(TinyFlowError, TypeError, ValueError):
    """A compile/Session option that does not exist or has a value it cannot take;
    the message lists the valid ones. (A TypeError for an unknown name, as Python
    says of an unknown keyword; a ValueError for a bad value.)"""


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_flag(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _is_seconds(value: Any) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating)) and not _is_flag(value)
            and math.isfinite(value) and value > 0)


_FLAG = (_is_flag, "True or False")
# The valid values of each option: (test, what to say). Pass lists are checked apart.
OPTION_RULES: dict[str, tuple[Any, str]] = {
    "streams": (lambda v: _is_int(v) and v >= 1, "a whole number >= 1"),
    "memory": (lambda v: v is None or v is True or v == "auto"
               or (isinstance(v, str) and v in memory.STRATEGIES),
               f"None, True, 'auto' or one of {sorted(memory.STRATEGIES)}"),
    "checkpoint": (lambda v: v is None or v == "sqrt" or (_is_int(v) and v > 0),
                   "None, 'sqrt' or a positive byte budget (int)"),
    "poison": _FLAG, "trace": _FLAG, "trace_values": _FLAG, "check_numerics": _FLAG,
    "debug": (lambda v: v is None or isinstance(v, (str, os.PathLike)), "None or a file path"),
    "wait_timeout": (_is_seconds, "a number of seconds > 0"),
}


def _check_pass_list(where: str, key: str, value: Any) -> None:
    """`passes`/`disable`: a list (tuple, set) of names from the pipeline."""
    names = [p.name for p in PIPELINE]
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise OptionError(f"{where}: {key}={value!r} must be a list of pass names "
                          f"(e.g. {key}=[{names[1]!r}]); passes: {names}")
    bad = [name for name in value if name not in names]
    if bad:
        raise OptionError(f"{where}: {key} names unknown passes {bad}; passes: {names}")


def validate_options(options: dict[str, Any], where: str = "compile()") -> dict[str, Any]:
    """Check compile options, the one place that does; return them over the defaults.

    Called where options come in (`Session(...)` and `compile(...)`), so a wrong one
    fails at once, naming itself and what it may be, never later as a wrong answer
    or a spurious error from the layer that reads it.
    """
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise OptionError(f"{where} got unknown options {unknown}; known: "
                          f"{sorted(DEFAULT_OPTIONS)}")
    opts = {**DEFAULT_OPTIONS, **options}
    if opts["passes"] is not None:
        _check_pass_list(where, "passes", opts["passes"])
    _check_pass_list(where, "disable", opts["disable"])
    for key, (valid, description) in OPTION_RULES.items():
        if not valid(opts[key]):
            raise OptionError(f"{where}: {key}={opts[key]!r} is not valid; {key} must be "
                              f"{description}")
    return opts


def compile(fetches: Sequence[Node], feeds: dict[Node, tuple[tuple, Any]] | None = None,
            variables: dict[Node, tuple[tuple, Any]] | None = None, *,
            device: str = "cpu", generators: dict | None = None,
            **options: Any) -> Program:
    """Compile `fetches` for the given shapes.

    feeds          {fed node: (shape, dtype)} for this program
    variables      {variable: (shape, dtype)}: the variables' current shapes
    device         "cpu" (numpy); "cuda" (cupy) where the GPU backend is installed
    generators     {seed attr: numpy Generator}: the random state of random ops (a
                   Session passes its own, so each Session draws the same values)
    passes         pass names to run (None: the default pipeline; [] none)
    disable        pass names to skip
    streams        compute streams (1: serial); allreduce nodes get a "comm" stream
    memory         None (each step allocates), "auto" (the best planner strategy for
                   this graph) or a strategy name from memory.STRATEGIES
    poison         fill each freed arena region with 0xFF bytes (NaN), to catch plans
                   that free too early
    checkpoint     None, "sqrt" or a byte budget: gradient checkpointing (sublinear.py)
    trace          record a timeline of every run (program.timelines)
    trace_values   also summarize every step's value (min/max/mean/NaN/Inf)
    check_numerics stop at the first step that produces a NaN or Inf (NumericsError);
                   nothing is fused or folded then, so the error names one op and
                   its line, and a NaN/Inf fed or held by a variable names that
    debug          a path: write a DebugRecord of this program there (after each run)
    wait_timeout   seconds a stream may wait for another before it is an error

    Options are checked by `validate_options` (OptionError names the valid values).
    The phases below fill in one Program, as the Setup* methods of tqchen/tinyflow's
    Session do: optimize, make the steps, schedule them, bind their kernels, plan
    memory, make the runner.
    """
    opts = validate_options(options)
    if opts["debug"]:
        opts["trace"] = True
    with _cyclic_gc_paused():
        return _compile(list(fetches), feeds or {}, variables or {}, device, generators,
                        opts)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while compiling, then restore it.

    A compile allocates millions of small objects (steps, specs, lists) and frees
    almost all of them by reference counting; but each few hundred allocations
    wake the cyclic collector, whose older generations scan every object alive,
    the whole graph included. On a 50,000-node graph that was a third of the
    compile, and it grew with the graph. Cyclic garbage made meanwhile is
    collected once the collector runs again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _compile(fetches: list[Node], feeds: dict, variables: dict, device: str,
             generators: dict | None, opts: dict) -> Program:
    """`compile` with its options checked: the phases, in order."""
    target = backend.device(device)
    graph, user_of, ctx = _optimize(fetches, feeds, variables, target.name, opts)
    program = Program(graph, ctx, target, opts)
    # The order of the steps: with a memory plan, the topological order with the
    # lowest peak of live bytes (sublinear.memory_order, as XLA picks among orders).
    # (The planner's steps do not depend on the order: made once, for both.)
    planned = None if opts["memory"] is None else memory.steps_from_graph(graph,
                                                                          xp=program.xp)
    order = graph.nodes if planned is None else sublinear.memory_order(graph, planned)
    _make_steps(program, order, user_of, generators)
    _schedule(program)
    if planned is not None:
        _plan_memory(program, memory.steps_in_order(planned, order))
    else:
        _free_values(program)
    _bind_kernels(program, user_of)
    _make_runner(program)
    if opts["check_numerics"]:
        _name_sources(program, order)
    if opts["debug"]:
        DEBUG_HOOKS.attach(program, opts["debug"])
    return program


def _optimize(fetches: list[Node], feeds: dict, variables: dict, device: str,
              opts: dict) -> tuple[Graph, dict[int, Node], passes_mod.PassContext]:
    """Phase 1: the graph specialized to the fed and held shapes (user nodes are
    cloned; `user_of` maps id(clone) back), then the pass pipeline (passes.py)."""
    sources = {**variables, **feeds}
    sources = {n: (tuple(s), np.dtype(d)) for n, (s, d) in sources.items()}
    graph, clones = passes_mod.specialize(fetches, sources,
                                          fed=frozenset(id(n) for n in feeds))
    ctx = passes_mod.PassContext(device=device, options=opts)
    disable = tuple(opts["disable"])
    if opts["check_numerics"]:
        # Check mode checks every op on its own, so that the first NaN is pinned to
        # one op and its line, not to a fused kernel of several, nor to a constant
        # folded from several ops (tf.log(tf.constant(0.)) must be named, not its
        # first consumer).
        disable += tuple(p.name for p in PIPELINE
                         if p.name.startswith("fuse") or p.name == "fold")
    graph = passes_mod.run_pipeline(graph, ctx, passes=opts["passes"], disable=disable)
    return graph, {id(clone): user for user, clone in clones.items()}, ctx


def _make_steps(program: Program, order: list[Node], user_of: dict[int, Node],
                generators: dict | None) -> None:
    """Phase 2: a slot per node of `order` (and one for the variable store); a
    Step per computed node. Sources are bound, not run: a constant's value once,
    here; feeds and variables at every run (`Program._bind_inputs`)."""
    graph = program.graph
    slot_of = {id(n): i for i, n in enumerate(order)}
    program.store_slot = len(order)
    program.slot_template = [None] * (len(order) + 1)
    users = graph.consumers()
    for node in order:
        slot, opdef = slot_of[id(node)], REGISTRY[node.op]
        if opdef.source == "constant":
            program.slot_template[slot] = opdef.compute(program.xp, **node.attrs)
        elif opdef.source == "feed":
            program.feed_slots.append((user_of[id(node)], slot))
        elif opdef.source == "variable":
            write_only = node not in graph.outputs and all(
                _only_writes(user, node) for user in users[node])
            program.variable_slots.append((user_of[id(node)], slot, write_only))
        else:
            program.steps.append(_make_step(node, opdef, slot_of, program, user_of,
                                            generators))
    program.fetch_slots = [slot_of[id(f)] for f in graph.outputs]
    # A fetched variable that this program also writes is a read like any other: it
    # shows the value from before the run's updates (the buffer changes in place).
    written = {id(v) for s in program.steps if (v := written_variable(s.node)) is not None}
    program.fetched_before_writes = tuple(
        slot_of[id(f)] for f in graph.outputs
        if source_kind(f) == "variable" and id(f) in written)


def _only_writes(user: Node, variable: Node) -> bool:
    """`user` writes `variable` and reads it in no other input (a variable that only
    such users have gets its first value from them: no run needs one before)."""
    target = mutated_input(user)
    return (target is not None and user.inputs[target] is variable
            and all(i is not variable for k, i in enumerate(user.inputs) if k != target))


def _make_step(node: Node, opdef: OpDef, slot_of: dict[int, int], program: Program,
               user_of: dict[int, Node], generators: dict | None) -> Step:
    """The Step of computed `node`: its kernel (not yet bound), its input slots
    (a variable writer first reads the store), its static attributes."""
    inputs = tuple(slot_of[id(i)] for i in node.inputs)
    if opdef.mutates is not None:
        _check_writer(node, node.inputs[opdef.mutates], user_of)
        inputs = (program.store_slot, *inputs)
    attrs = dict(node.attrs)
    if opdef.random:  # its kernel draws from the Session's streams
        attrs["generators"] = generators
    nbytes = node_nbytes(node) + sum(node_nbytes(i) for i in node.inputs)
    return Step(node, opdef.compute, inputs, slot_of[id(node)], attrs,
                index=len(program.steps), nbytes=nbytes,
                sources=program.ctx.sources.get(node.name, ()))


def _check_writer(node: Node, target: Node, user_of: dict[int, Node]) -> None:
    """A writer's target must be a variable, and not one fed in this run."""
    if source_kind(target) == "feed" and source_kind(user_of[id(target)]) == "variable":
        raise FeedError(f"variable {target.name!r} is fed in this run and also "
                        f"assigned (at {node.where}): a fed variable is only "
                        "read; feed it or update it, not both")
    if source_kind(target) != "variable":
        raise TinyFlowError(f"tf.assign at {node.where}: the target must be a "
                            f"Variable, got {target.op}")


def _schedule(program: Program) -> None:
    """Phase 3: dependencies between steps (inputs, and variable readers before
    writers), the stream of each step, and the events between streams; checked."""
    steps = program.steps
    index = {id(s.node): k for k, s in enumerate(steps)}
    ordering = ordering_dependencies([s.node for s in steps])
    deps: list[list[int]] = []
    for step in steps:
        before = list(step.node.inputs) + ordering.get(step.node, [])
        deps.append(sorted({index[id(n)] for n in before if id(n) in index}))
    stream_of, names = assign_streams([s.node for s in steps], deps,
                                      program.options["streams"])
    program.schedule = build_schedule(stream_of, names, deps)
    for step, stream in zip(steps, stream_of):
        step.stream = stream
    validate_schedule(program.schedule, deps, [s.node.name for s in steps])


def _bind_kernels(program: Program, user_of: dict[int, Node]) -> None:
    """Phase 5: each step's kernel specialized to its static shapes, where its op
    can (OpDef.bind, given the step's scratch memory and the plans and buffers its
    stream's steps share, as they never run at once); a variable writer's kernel
    bound to its variable; then what the runner calls, bound once: `Step.kernel`
    and `Step.gather`."""
    workspaces: list[dict] = [{} for _ in program.schedule.names]
    for step in program.steps:
        opdef, inputs = REGISTRY[step.node.op], step.node.inputs
        if opdef.bind is not None:
            step.compute = opdef.bind(program.xp, [i.shape for i in inputs],
                                      [i.dtype for i in inputs], step.attrs,
                                      workspaces[step.stream], step.scratch) or step.compute
        if opdef.mutates is not None:
            var = user_of[id(inputs[opdef.mutates])]
            step.compute = _variable_writer(step.compute, var, step.node)
        step.kernel = _kernel_of(step, opdef, program.xp)
        step.gather = _gather_of(step.inputs)


def _gather_of(slots: tuple[int, ...]) -> Callable[[list], tuple]:
    """values -> the tuple of values in `slots` (operator.itemgetter, a C call, where
    it gives a tuple: for two slots or more)."""
    if len(slots) >= 2:
        return operator.itemgetter(*slots)
    if len(slots) == 1:
        slot = slots[0]
        return lambda values: (values[slot],)
    return lambda values: ()


def _kernel_of(step: Step, opdef: OpDef, xp: Any) -> Callable:
    """What the runner calls for `step`: kernel(*inputs, out=...). Binding the array
    module and the attributes once, here, spares every run a starred call with a
    dict (`compute(xp, *args, out=out, **attrs)`), a third of a tiny step's cost."""
    if opdef.ufunc is not None and not step.attrs and step.compute is opdef.compute:
        return getattr(xp, opdef.ufunc)   # the registry says compute is this ufunc
    return functools.partial(step.compute, xp, **step.attrs)


def _multi_stream(program: Program) -> bool:
    return len(set(program.schedule.stream_of)) > 1


def _make_runner(program: Program) -> None:
    """Phase 6: a runner for several streams (threads on the CPU, CUDA streams on
    a GPU); a chain keeps to one stream, and the plain loop of `_run_steps`."""
    if _multi_stream(program):
        program.runner = program.target.stream_runner(
            program.schedule, [s.node.name for s in program.steps],
            program.options["wait_timeout"])


def _name_sources(program: Program, order: list[Node]) -> None:
    """Check mode: what to call a NaN fed or held by a variable (`_check_sources`)."""
    for user, slot in program.feed_slots:
        what = ("variable (fed)" if source_kind(user) == "variable"
                else f"feed for {fed_kind(user)}")
        program.source_slots[slot] = (user, what)
    for user, slot, _ in program.variable_slots:
        program.source_slots[slot] = (user, "variable")
    program.graph_node_of_slot = {slot: order[slot] for slot in program.source_slots}


def _final_reader(readers: list[int], schedule: Schedule) -> int | None:
    """The reader that every other reader happens-before: after it, the value is
    certainly dead on every stream. None when no reader is ordered after the rest
    (readers still racing on two streams): then nothing may free the value early."""
    last = max(readers)
    if all(r == last or schedule.happens_before(r, last) for r in readers):
        return last
    return None


def _readers(steps: list[Step]) -> dict[int, list[int]]:
    readers: dict[int, list[int]] = {}
    for k, step in enumerate(steps):
        for slot in set(step.inputs):
            readers.setdefault(slot, []).append(k)
    return readers


def _dead_after(program: Program, dead: Any) -> dict[int, list]:
    """{step: [dead(slot)...]} for every value whose final reader is that step and
    for which `dead(slot)` is not None (fetched values are never dead)."""
    keep = set(program.fetch_slots)
    after: dict[int, list] = {}
    for slot, readers in _readers(program.steps).items():
        what = dead(slot) if slot not in keep else None
        final = _final_reader(readers, program.schedule) if what is not None else None
        if final is not None:
            after.setdefault(final, []).append(what)
    return after


def _free_values(program: Program) -> None:
    """Phase 4 without a plan: each step allocates its value; each intermediate is
    dropped after its last reader, so a program holds only what is still needed
    (what the arena does, without the planning). A step that reads a variable
    copies a view it returns (`Step.copy_views`)."""
    steps = program.steps
    for step in steps:
        step.copy_views = (mutated_input(step.node) is None and
                           any(source_kind(i) == "variable" for i in step.node.inputs))
    _stream_scratch(program)
    if _multi_stream(program) and not program.target.frees_across_streams:
        return
    computed = {s.output for s in steps}
    frees = _dead_after(program, lambda slot: slot if slot in computed else None)
    for k, step in enumerate(steps):
        step.free_after = tuple(frees.get(k, ()))


def _stream_scratch(program: Program) -> None:
    """Without a plan, the kernels' scratch (OpDef.scratch) comes from one buffer
    per stream, as large as the most any step of that stream asks: the steps of a
    stream run one at a time, so they can all use it."""
    wanted = {step.index: memory.node_scratch(step.node, program.xp)
              for step in program.steps}
    largest: dict[int, int] = {}
    for step in program.steps:
        largest[step.stream] = max(largest.get(step.stream, 0), wanted[step.index])
    buffers = {stream: backend.zeros_bytes(program.xp, size)
               for stream, size in largest.items() if size}
    for step in program.steps:
        if wanted[step.index]:
            step.scratch = buffers[step.stream][:wanted[step.index]]


def _plan_memory(program: Program, planned: tuple[list[memory.PlanStep], dict[str, str],
                                                   set[str]]) -> None:
    """Phase 4: plan the arena (memory.py) for `planned`, the planner's steps in
    the program's order (`memory.steps_from_graph`), check the plan, and bind each
    planned step's output slot to its view of the arena; set up poisoning when
    asked."""
    steps, schedule = program.steps, program.schedule
    # The planner's steps are the program's steps (feeds and variables are external).
    plan_steps, external, keep_names = planned
    for plan_step, step in zip(plan_steps, steps, strict=True):
        plan_step.stream = step.stream
    happens_before = schedule.happens_before if len(schedule.names) > 1 else None
    strategy = "auto" if program.options["memory"] is True else program.options["memory"]
    plan = memory.plan_memory(plan_steps, external=external, keep=keep_names,
                              strategy=strategy, happens_before=happens_before)
    memory.validate_plan(plan, plan_steps, happens_before=happens_before)
    outside = {s.node.name for s in steps if not memory.in_arena(s.node)}
    for tensor in plan.tensors:  # (0 bytes to the planner; say what they really are)
        if tensor.name in outside:
            tensor.offset = None
            tensor.reason = "the variable's own buffer, written in place: not in the arena"
    arena = backend.zeros_bytes(program.xp, max(plan.arena_bytes, 1))
    placed = {t.name: t for t in plan.tensors}
    for step in steps:
        tensor = placed.get(step.node.name)
        if tensor is not None and tensor.offset is not None:
            node = step.node
            view = arena[tensor.offset:tensor.offset + node_nbytes(node)]
            program.slot_template[step.output] = view.view(node.dtype).reshape(node.shape)
            step.planned = True
    for step, scratch in _scratch_of_steps(program, plan):
        step.scratch = arena[scratch.offset:scratch.offset + scratch.nbytes]
    program.memory_plan, program.arena = plan, arena
    if program.options["poison"]:
        _plan_poison(program, placed)


def _scratch_of_steps(program: Program, plan: memory.MemoryPlan
                      ) -> list[tuple[Step, memory.TensorSpec]]:
    """(step, its scratch tensor in `plan`) for each step whose kernel has scratch."""
    scratch = {t.name: t for t in plan.tensors if t.kind == "scratch"}
    if not scratch:      # (most programs: no name to build per step)
        return []
    return [(step, scratch[name]) for step in program.steps
            if (name := memory.scratch_name(step.node.name)) in scratch]


def _plan_poison(program: Program, placed: dict) -> None:
    """Poison mode: fill the arena, and after each step the bytes of the values it
    was the last reader of, with POISON_BYTE (a plan that frees too early then
    reads NaN, not a lucky leftover)."""
    program.arena.fill(POISON_BYTE)
    has_inplace_child = {t.inplace_of for t in program.memory_plan.tensors if t.inplace_of}
    name_of_slot = {s.output: s.node.name for s in program.steps}

    def dead_bytes(slot: int) -> tuple[int, int] | None:
        name = name_of_slot.get(slot)
        tensor = placed.get(name)
        if (tensor is None or tensor.offset is None or name in has_inplace_child
                or not tensor.nbytes):
            return None
        return tensor.offset, tensor.nbytes
    poison = _dead_after(program, dead_bytes)
    for step, scratch in _scratch_of_steps(program, program.memory_plan):
        # a kernel's scratch is dead once it returns
        poison.setdefault(step.index, []).append((scratch.offset, scratch.nbytes))
    for k, step in enumerate(program.steps):
        step.poison_after = tuple(poison.get(k, ()))
