"""Define-by-run: eager Tensors over the same op registry, with a tape for gradients.

The graph half of TinyFlow builds Nodes and runs them later (TF1's define-and-run).
This module is the other half (PyTorch's define-by-run): a `Tensor` holds an array,
and every op runs *at once*. Nothing is written twice: an op applied to Tensors is
routed, by `ops.make`, to `apply` below, which asks the registry for the same facts
the graph executor uses:

* ``OpDef.infer`` checks shapes and dtypes (the same ShapeError, naming the user's
  line), and gives the output's shape and dtype;
* ``OpDef.compute(np, *arrays, out=...)`` writes the result into a block from the
  caching allocator (the eager counterpart of the static plan's arena);
* ``OpDef.gradient`` gives the backward rule. A rule builds graph Nodes (that is how
  the graph half differentiates), so eager backward *interprets* it: it builds the
  rule's little graph once per (op, attrs, shapes) over stand-in leaves for the
  op's inputs, its output and the incoming gradient, and then evaluates that graph
  with `apply` on the concrete Tensors. With ``create_graph=True`` the evaluation is
  itself recorded on the tape, so gradients of gradients work as in the graph half.

Semantics follow PyTorch, so its users feel at home: ``requires_grad``,
``backward()`` accumulates into the ``.grad`` of leaf Tensors, a second backward
through the same graph needs ``retain_graph=True``, ``no_grad()`` stops recording.
The walk over the tape is iterative (a 10,000-op chain works) and sums gradient
contributions in the same order as `autodiff.gradients`, so an eager step and its
traced graph give bitwise-equal results.

Tracing eager code into a graph (`tf.function`) is tracing.py's: while a function
is traced, its thread's `tracer` is set (see _State), Tensors are *symbolic* (a
Node, no array), and the Tensor's methods and `apply` hand their work to the tracer.

Eager memory comes from `CachingAllocator` (allocator.py), after PyTorch's CUDA
caching allocator: blocks carved from larger segments, best-fit reuse, split and
merge (with glibc's fast bins in front for small blocks), every alloc and free
recorded so the debugger and lesson 9 can put it beside the static plan. What the
plan also does, writing an elementwise op's result over an input that dies there,
eager mode cannot find alone (it never knows who else holds a Tensor); where the
code that made the input knows (`apply_over`: nn.Linear's product before its
bias, a gradient only one rule node reads in backward), it says so.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from sys import getrefcount as _getrefcount
from threading import get_ident as _get_ident
from typing import Any, NoReturn

import numpy as np

from tinyflow import api, backend, debug, ops, shape_ops
from tinyflow.allocator import Block, CachingAllocator
from tinyflow.eager_record import EagerLog
from tinyflow.registry import source_kind
from tinyflow.graph import Node, TinyFlowError, topological_order, user_source_line
from tinyflow.ops import REGISTRY
from tinyflow.optim import one_minus

# ----------------------------------------------------------------------------------
# Each thread's state
# ----------------------------------------------------------------------------------

class _State:
    """One thread's eager state. Grad mode is per thread, as PyTorch's is: an
    evaluation loop under no_grad in one thread must not keep another thread's ops
    off the tape, and neither may a backward or an optimizer step, which run under
    no_grad too (two threads training side by side did fail so). Tracing is per
    thread too.

    Each thread also takes memory from its own caching allocator, so two threads
    never change one allocator's lists at once. (A lock around malloc and free
    would do it too, at 65-140 ns a call, 10-20% of a tiny op.) A Tensor that dies
    in another thread does not free its block there: Tensor.__del__ leaves it to
    the allocator's own thread, at its next malloc."""

    def __init__(self) -> None:
        self.grad_enabled = True
        self.in_backward = False    # inside `backward` (the debugger colours those ops)
        self.in_optimizer = False   # inside an optimizer's `step` (its box in the debugger)
        self.tracer: Any = None     # the tracing._Trace of a function being traced
        self.allocator = CachingAllocator(record=False)
        self.allocator.thread = _get_ident()


class _PerThread(threading.local):
    """`_thread.state` is the running thread's _State (threading.local calls
    __init__ once in each thread, at its first use). The hot paths read
    `_thread.state` once per op and then plain attributes: each read of a
    threading.local costs 25-30 ns, a fiftieth of a tiny op."""

    def __init__(self) -> None:
        self.state = _State()


_thread = _PerThread()


def allocator() -> CachingAllocator:
    """The allocator this thread's eager Tensors take their memory from."""
    return _thread.state.allocator


def set_allocator(new: CachingAllocator) -> CachingAllocator:
    """Use `new` for Tensors this thread makes from now on; returns the previous
    allocator. (Tensors made before keep their blocks in the old one, and return
    them there.) An allocator serves one thread at a time: this thread's frees go
    into it at once, other threads' wait for its next malloc."""
    state = _thread.state
    old, state.allocator = state.allocator, new
    new.thread = _get_ident()
    return old


# ----------------------------------------------------------------------------------
# Errors and modes
# ----------------------------------------------------------------------------------

class EagerError(TinyFlowError, RuntimeError):
    """An eager op or a backward pass that cannot run; names the op and the line."""


class GraphBreak(TinyFlowError):
    """A traced function asked for a value that only exists when the graph runs."""


_generators: dict = {}   # eager random streams, by op seed (dropout)


@contextlib.contextmanager
def _optimizer_step() -> Iterator[None]:
    """An optimizer's update: no grad, and recorded ops are marked as the optimizer's."""
    state = _thread.state
    before, state.in_optimizer = state.in_optimizer, True
    try:
        with no_grad():
            yield
    finally:
        state.in_optimizer = before


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Ops inside the block are not recorded for backward (torch.no_grad)."""
    with _grad_mode(False):
        yield


@contextlib.contextmanager
def enable_grad() -> Iterator[None]:
    """Ops inside the block are recorded again, even within no_grad (torch.enable_grad)."""
    with _grad_mode(True):
        yield


@contextlib.contextmanager
def _grad_mode(enabled: bool) -> Iterator[None]:
    state = _thread.state
    before, state.grad_enabled = state.grad_enabled, enabled
    try:
        yield
    finally:
        state.grad_enabled = before


# ----------------------------------------------------------------------------------
# The Tensor
# ----------------------------------------------------------------------------------

class Tensor:
    """An array with an optional history for backward (eager), or, while a
    function is being traced (tracing.py), a symbolic value standing for a graph Node.

    data           the numpy array (eager), None while symbolic
    node           the graph Node (symbolic), None when eager
    requires_grad  whether backward should reach this Tensor
    grad           the accumulated gradient of a leaf after `backward()`
    """

    # No __slots__: every op makes a Tensor, and with the defaults below on the class
    # it sets only the three fields that differ (measured: a third cheaper).
    node: Node | None = None
    requires_grad = False
    _grad: Tensor | None = None
    _op: str | None = None          # the op that made it, its inputs and attributes:
    _inputs: Sequence[Tensor] | None = None   # its place on the tape (None: a leaf)
    _attrs: dict | None = None
    _needed: tuple | None = None    # which inputs required grad when the op ran
    # PyTorch's version counter: bumped by every in-place write. An op on the tape
    # keeps its inputs' versions, so a backward that needs a value that was changed
    # after the op used it says so instead of using the new value.
    _version = 0
    _versions: tuple | None = None  # the inputs' versions when the op ran
    _written_at: str | None = None  # a computed Tensor written in place: where
    _opaque: str | None = None      # a result whose history no backward can follow: why
    _block: Block | None = None     # (None until its memory is taken: see __del__)
    __tinyflow_tensor__ = True   # ops.make routes ops on these to `apply`
    __array_priority__ = 1000    # numpy defers `array + tensor` to our operators

    def __init__(self, value: Any, requires_grad: bool = False, dtype: Any = None) -> None:
        tracer = _thread.state.tracer
        if tracer is not None:
            # Made while a function is traced: a value of the graph, made again on
            # every call as eager code makes it (not a Tensor from outside, which
            # would keep what one call wrote into it for the next); with
            # requires_grad, a leaf of each call (tracing.py: set_requires_grad).
            self.data, self._block, self._alloc = None, None, None
            self.node = tracer.copy_of(value, dtype)
            self.requires_grad, self._grad = False, None
            self._op = self._inputs = self._attrs = None
            if requires_grad:
                self.requires_grad_(True)
            return
        array = ops.number_array("tensor", value.numpy() if isinstance(value, Tensor)
                                 else value, dtype)
        if requires_grad:
            _check_differentiable(array.dtype)
        self.data, self._block, self._alloc = _new_array(array.shape, array.dtype)
        self.data[...] = array
        self.node = None
        self.requires_grad = requires_grad
        self._grad = None
        self._op = self._inputs = self._attrs = None

    def __del__(self) -> None:
        block = self._block
        if block is not None:
            try:
                # The references this Tensor's own array has: self.data, the block's
                # cached view (when it is this array), getrefcount's argument. More
                # means the array, or a view of it (their base is this array: see
                # allocator.BlockMemory), lives on outside, `y = t.data[1:]`: its
                # memory is freed when that dies, not now (PyTorch's rule too: an
                # array over a tensor's storage keeps the storage), or the next op
                # would write into what the user holds.
                own = _OWN_REFS if block.view is self.data else _OWN_REFS - 1
                alloc = self._alloc
                if _getrefcount(self.data) > own:
                    _free_when_unused(self.data, block, alloc)
                elif alloc.thread != _get_ident():
                    # another thread's allocator, perhaps in a malloc right now: it
                    # frees the block itself, at its next malloc (a list append is
                    # one step for CPython: no other thread sees it half done)
                    alloc.free_later(block)
                else:
                    alloc.free(block)
            except Exception:   # interpreter shutdown: the allocator may be gone
                pass

    # -- what it is ----------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self.data.shape if self.node is None else self.node.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype if self.node is None else self.node.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_leaf(self) -> bool:
        return self._op is None

    @property
    def grad(self) -> Tensor | None:
        tracer = _thread.state.tracer
        key = None if tracer is None else tracer.grad_key(self)
        if key is not None:   # while tracing: the Tensor's .grad as the trace sees it
            return tracer.grad_of(key)
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        tracer = _thread.state.tracer
        key = None if tracer is None else tracer.grad_key(self)
        if key is not None:
            tracer.set_grad(key, value)
        else:
            if value is not None:   # (PyTorch checks here; a wrong .grad failed later)
                _check_grad(self, value)
            self._grad = value

    def __repr__(self) -> str:
        if self.node is not None:
            return f"Tensor(symbolic {self.node.name}, shape={self.shape}, dtype={self.dtype})"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({np.array2string(self.data, threshold=20)}, dtype={self.dtype}{grad})"

    # -- values (a graph break while tracing) --------------------------------------
    def numpy(self) -> np.ndarray:
        """A copy of the value (the Tensor's own memory is reused once it dies)."""
        self._need_value("numpy()")
        return self.data.copy()

    def item(self) -> Any:
        self._need_one_value("item()")
        return self.data.item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self._need_value("np.asarray()")
        if self.requires_grad and _thread.state.grad_enabled:
            # numpy functions read a Tensor through here (np.exp(w)) and return a bare
            # array: backward would skip that step and give a wrong gradient silently.
            # PyTorch refuses too; .numpy() stays the explicit way to read the values.
            raise EagerError(f"np.asarray() at {user_source_line()}, which numpy functions "
                             "call (np.exp(x)), on a Tensor that requires grad: numpy "
                             "computes on the bare values and backward would miss that "
                             "step (a wrong gradient; PyTorch refuses too); use the tf op "
                             "(tf.exp(x)), or read the values with x.detach() or x.numpy()")
        return self.data.astype(dtype) if dtype is not None else self.data.copy()

    def __bool__(self) -> bool:
        self._need_one_value("a Python truth test (if / while / and / or)")
        return bool(self.data)

    def __float__(self) -> float:
        self._need_one_value("float()")
        # (.item(): numpy 2 refuses float() of shape (1,); PyTorch takes one element)
        return float(self.data.item())

    def __int__(self) -> int:
        self._need_one_value("int()")
        return int(self.data.item())

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d Tensor")
        return self.shape[0]

    def __iter__(self) -> Iterator[Tensor]:
        """The rows along the first axis (`for row in t`), as PyTorch gives them.
        (Python's fallback loop over __getitem__ stopped only at an IndexError, and
        an index past the end is a ShapeError here.)"""
        if not self.shape:
            raise TypeError("iteration over a 0-d Tensor")
        for i in range(self.shape[0]):
            yield self[i]

    def _need_value(self, what: str) -> None:
        if self.node is not None:
            line = user_source_line()
            message = (f"graph break at {line}: {what} needs the value of {self.node.name}, "
                       "which only exists when the traced graph runs; compute it with "
                       "tensor ops (tf.where instead of if), or call it outside the "
                       "traced function")
            tracer = _thread.state.tracer
            if tracer is not None:
                tracer.breaks.append(message)
            raise GraphBreak(message)

    def _need_one_value(self, what: str) -> None:
        """`_need_value`, for one Python number or truth value: of several elements, or
        none, numpy's own ValueError or TypeError came from this file, naming no line."""
        self._need_value(what)
        if self.data.size != 1:
            raise EagerError(f"{what} needs a Tensor of one element, this one has shape "
                             f"{self.shape} (at {user_source_line()}; PyTorch says so too)")

    # -- autograd --------------------------------------------------------------------
    def backward(self, gradient: Tensor | Any = None, retain_graph: bool = False,
                 create_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires it.

        `gradient` seeds the walk (default ones: the gradient of the sum). The tape is
        freed afterwards unless `retain_graph` (or `create_graph`) is set; with
        `create_graph` the gradients are themselves differentiable.
        """
        if self.node is not None:
            _thread.state.tracer.backward(self, gradient, retain_graph, create_graph)
            return
        backward(self, gradient, retain_graph or create_graph, create_graph)

    def detach(self) -> Tensor:
        """The same value with no history (a new Tensor sharing nothing)."""
        if _thread.state.tracer is None:
            self._need_value("detach()")
        return Tensor(self)    # (while tracing: see tracing._Trace.copy_of)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        if not flag and self.requires_grad and not self.is_leaf:
            # PyTorch's rule: a computed value keeps its history (x.detach() cuts it)
            raise EagerError(f"requires_grad_(False) at {user_source_line()} on a Tensor "
                             "computed by an op that requires grad: only a leaf's flag can "
                             "be turned off; use x.detach() for a value without history")
        if flag:
            _check_differentiable(self.dtype)
        tracer = _thread.state.tracer
        if flag != self.requires_grad and self.node is not None and tracer is not None:
            tracer.set_requires_grad(self, flag)   # symbolic: see tracing.py
        self.requires_grad = flag
        return self

    def zero_(self) -> Tensor:
        return self.assign_(np.zeros(self.shape, self.dtype))

    def assign_(self, value: Tensor | Any) -> Tensor:
        """Overwrite this Tensor's value in place (its memory stays where it is).

        Like PyTorch, an in-place write to a leaf that requires grad is allowed only
        under `no_grad()` (an optimizer step), a result of another dtype kind is
        refused (an int Tensor cannot take a float), and a backward that needs a value
        written after its op used it is an error (the version counter). Unlike
        PyTorch, a write is never recorded on the tape: a computed Tensor that
        requires grad may be written (a forward-only use), but a backward that reaches
        it is an error, and a value that requires grad cannot be written into a
        Tensor that does not (its gradient would be lost).
        """
        state = _thread.state
        if state.grad_enabled and self.requires_grad and self.is_leaf:
            raise EagerError(f"in-place write to a leaf Tensor that requires grad at "
                             f"{user_source_line()}; do it under eager.no_grad()")
        if state.grad_enabled and not self.requires_grad and getattr(value, "requires_grad",
                                                                     False):
            # PyTorch would give this Tensor the value's history; this tape keeps one
            # op per Tensor, and the value's gradient would be silently lost.
            raise EagerError(f"in-place write at {user_source_line()} of a value that "
                             "requires grad into a Tensor that does not: eager mode does "
                             "not record in-place ops for backward; write the result to a "
                             "new Tensor (c = c + x, not c.add_(x)), or under eager.no_grad()")
        # A number or an array is typed as an op types a literal beside this Tensor
        # (`ops.literal_dtype`), so it meets the checks a Tensor meets: 1.5 into an int
        # Tensor was truncated, 1e300 into float32 stored inf, 2**40 into int32 was
        # numpy's OverflowError (now the ShapeError that `x + 2**40` gives).
        new = value if isinstance(value, Tensor) else _constant_tensor("assign_", value,
                                                                         self.dtype)
        if new.dtype != self.dtype and not np.can_cast(new.dtype, self.dtype, "same_kind"):
            raise EagerError(f"in-place write at {user_source_line()}: the value is "
                             f"{new.dtype}, which this {self.dtype} Tensor cannot hold "
                             "(PyTorch refuses too); write it to a new Tensor")
        if state.tracer is not None:
            state.tracer.write(self, value if new is value else new.data)
            return self
        if new.shape != self.shape:
            _check_broadcasts_into(new, self)
        self.data[...] = new.data
        self._version += 1
        if state.grad_enabled and self.requires_grad:
            # Its history is the op that made it, not the write: a backward that
            # reaches it would use the wrong rule, so it is refused (`_tape_order`).
            # A forward-only use (an in-place add in an evaluation) is fine.
            self._written_at = user_source_line()
        return self

    def sub_(self, value: Tensor | Any, alpha: Any = None) -> Tensor:
        """self -= value, or with `alpha`, self -= alpha * value (PyTorch's
        `sub_(other, alpha=)`: SGD's `p.sub_(g, alpha=lr)`)."""
        if alpha is None:
            return self._update_("sub", value)
        return self._scaled_update_("sub", value, alpha)

    def add_(self, value: Tensor | Any, alpha: Any = None) -> Tensor:
        """self += value, or with `alpha`, self += alpha * value."""
        if alpha is None:
            return self._update_("add", value)
        return self._scaled_update_("add", value, alpha)

    def mul_(self, value: Tensor | Any) -> Tensor:
        return self._update_("mul", value)

    def _update_(self, op: str, value: Tensor | Any) -> Tensor:
        """self = self <op> value, in place: `assign_(apply(op, (self, value)))`.

        Under no_grad (an optimizer's step), when the result has this Tensor's shape
        and dtype and the op is one numpy ufunc (OpDef.ufunc), the ufunc writes
        straight into this Tensor's memory: one pass over the weights instead of a
        new block for the result and a copy back (`p.sub_(lr * g)` on a 1024x1024
        layer: 1.2 -> 0.6 ms). The bits are the same, since an elementwise ufunc
        may write over its own input, and so is what backward sees: no_grad records
        nothing either way. Anything else takes the general path."""
        state = _thread.state
        if state.grad_enabled or state.tracer is not None or self.node is not None:
            return self.assign_(apply(op, (self, value), {}))
        inputs, arrays = _with_literals(op, (self, value))
        layout, _, ufunc, _ = _kernel(op, arrays, {})
        if ufunc is None or layout != (self.data.shape, self.data.dtype):
            return self.assign_(apply(op, (self, value), {}))
        recorder, began = _recording(state.allocator) if debug.active else _NOT_RECORDING
        ufunc(arrays[0], arrays[1], out=self.data)
        self._version += 1
        if began is not None:
            recorder.eager_log.add_inplace(op, inputs, self, began, time.perf_counter())
        return self

    def _scaled_update_(self, op: str, value: Tensor | Any, alpha: Any) -> Tensor:
        """self = self <op> alpha * value, in place: `_update_(op, alpha * value)`.

        Under no_grad, when alpha is a number, value a Tensor, and alpha * value is
        elementwise in this Tensor's shape and dtype, and larger than one slice
        (smaller products stay in the cache anyway), the two ufuncs run slice by
        slice through a small scratch block (`_scaled_update`): the product never
        makes a round trip through memory. As in `_update_`, elementwise ufuncs give
        the same bits whatever the slicing, NaNs aside: which NaN an op on two NaNs
        returns (its sign) is the hardware's choice, and numpy's vector loops and
        its scalar loop for a slice's last few elements choose differently. Anything
        else (and floating-point errors set to raise, which could stop the update
        halfway) takes the unfused path."""
        fused = _fusable_update(self, op, value, alpha)
        if fused is None:
            if isinstance(value, Tensor) or isinstance(alpha, Tensor):
                product = apply("mul", (alpha, value), {})
            else:   # numbers and arrays (a list is an array, not repeated)
                product = alpha * np.asarray(value)
            return self._update_(op, product)
        operands, scale, update = fused
        alloc = _thread.state.allocator
        recorder, began = _recording(alloc) if debug.active else _NOT_RECORDING
        scratch = _scaled_update(self.data.reshape(-1), operands, scale, update, alloc)
        self._version += 1
        if began is not None:
            recorder.eager_log.add_inplace(op, [self, value], self, began,
                                           time.perf_counter(), {"alpha": float(alpha)},
                                           scratch)
        return self

    # -- operators: the graph's builders, run at once through `apply` --------------
    # The arithmetic operators go straight to apply's shortcuts (apply_binary,
    # apply_unary; their builders in ops.py are nothing but `make`), which saves two
    # Python calls on the hottest path.
    def __add__(self, other): return apply_binary("add", self, other)
    def __radd__(self, other): return apply_binary("add", other, self)
    def __sub__(self, other): return apply_binary("sub", self, other)
    def __rsub__(self, other): return apply_binary("sub", other, self)
    def __mul__(self, other): return apply_binary("mul", self, other)
    def __rmul__(self, other): return apply_binary("mul", other, self)
    def __truediv__(self, other): return apply_binary("div", self, other)
    def __rtruediv__(self, other): return apply_binary("div", other, self)
    def __pow__(self, other): return apply_binary("pow", self, other)
    def __rpow__(self, other): return apply_binary("pow", other, self)
    def __matmul__(self, other): return ops.matmul(self, other)
    def __rmatmul__(self, other): return ops.matmul(other, self)
    def __neg__(self): return apply_unary("neg", self)
    def __abs__(self): return ops.abs(self)
    def __lt__(self, other): return ops.less(self, other)
    def __le__(self, other): return ops.less_equal(self, other)
    def __gt__(self, other): return ops.greater(self, other)
    def __ge__(self, other): return ops.greater_equal(self, other)
    def __getitem__(self, index): return shape_ops.getitem(self, index)
    __hash__ = object.__hash__   # identity, as for Nodes (`==` stays identity)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return ops.reduce_sum(self, axis, keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return ops.reduce_mean(self, axis, keepdims)

    def reshape(self, *shape: Any) -> Tensor:
        return shape_ops.reshape(self, shape[0] if len(shape) == 1 else shape)

    @property
    def T(self) -> Tensor:  # noqa: N802 - numpy's and PyTorch's name
        return shape_ops.transpose(self)


_new_object = object.__new__


def _check_differentiable(dtype: np.dtype) -> None:
    """Only a float (or complex) Tensor may require grad, as in PyTorch: an int
    Tensor's gradient came back as ints ([2 2 2])."""
    if np.dtype(dtype).kind not in "fc":
        raise EagerError(f"a Tensor of {dtype} cannot require grad (PyTorch: only "
                         "floating point Tensors can); make it a float first")


def _check_grad(t: Tensor, grad: Any) -> None:
    """`t.grad = grad` takes None or a Tensor of t's shape and dtype kind, as PyTorch
    checks: a (2,) grad of a (2, 1) weight was taken, the next backward broadcast into
    it, and SGD then failed with numpy's error."""
    if not isinstance(grad, Tensor):
        why = f"a .grad is a Tensor or None, not {type(grad).__name__}"
    elif grad.shape != t.shape:
        why = f"the gradient has shape {grad.shape}, the Tensor {t.shape}; they must match"
    elif grad.dtype.kind != t.dtype.kind:
        why = f"the gradient is {grad.dtype}, the Tensor {t.dtype}; use a {t.dtype} one"
    else:
        return
    raise EagerError(f".grad set at {user_source_line()}: {why} (PyTorch checks too)")


def _check_broadcasts_into(value: Tensor, target: Tensor) -> None:
    """A value written in place must broadcast to the Tensor's shape (PyTorch's copy_
    rule). numpy's ValueError named no line; a traced write's ShapeError does."""
    try:
        ops.require_broadcastable(value.shape, target.shape, "the value's shape")
    except ops.Mismatch as why:
        raise ops.shape_error("in-place write", [value.shape, target.shape], str(why),
                              user_source_line()) from None


def check_implicit_seed(shape: tuple | None) -> None:
    """backward() without a gradient seeds ones only for one element (PyTorch's rule;
    a traced backward keeps it too)."""
    if shape is not None and math.prod(shape) != 1:
        raise EagerError(f"backward() at {user_source_line()} of a Tensor of shape "
                         f"{shape}: the gradient is implicit (ones) only for one "
                         "element (PyTorch's rule); sum it first, or pass "
                         "backward(gradient=...)")


def _free_when_unused(array: np.ndarray, block: Block, alloc: CachingAllocator) -> None:
    """Free `block` once `array`, the view of it that outlived its Tensor, is gone
    (at the allocator's next malloc: the array may die in a garbage collection
    inside the allocator's own work)."""
    block.view = block.view_key = None   # never hand this array to another Tensor
    weakref.finalize(array, alloc.free_later, block)


def _own_references() -> int:
    """What sys.getrefcount says of an array held by two attributes (a Tensor's
    `data` and its block's `view`), asked as Tensor.__del__ asks: 3 on CPython 3.11
    (the call's argument counts); measured, as newer Pythons may count differently."""
    holder = type("Holder", (), {})()
    holder.data = holder.view = np.empty(0)
    return sys.getrefcount(holder.data)


_OWN_REFS = _own_references()


def _wrap(data: np.ndarray | None, block: Block | None, alloc: CachingAllocator | None = None,
          node: Node | None = None) -> Tensor:
    """A Tensor over `data` (in `block` of `alloc`, when the allocator gave it), or a
    symbolic one for `node`. Not `__init__`, which copies: every op makes one of
    these, so it is a plain module function (a classmethod call costs more) that
    sets only what differs from the class defaults."""
    t = _new_object(Tensor)
    t.data = data
    t._block = block
    t._alloc = alloc
    if node is not None:
        t.node = node
    return t


def tensor(value: Any, requires_grad: bool = False, dtype: Any = None) -> Tensor:
    """A leaf Tensor holding a copy of `value` (torch.tensor)."""
    return Tensor(value, requires_grad=requires_grad, dtype=dtype)


def _new_array(shape: tuple, dtype: Any) -> tuple[np.ndarray, Block | None, Any]:
    alloc = _thread.state.allocator
    array, block = alloc.array(shape, dtype)
    return array, block, alloc


# ----------------------------------------------------------------------------------
# Running one op at once
# ----------------------------------------------------------------------------------

_literals: dict[tuple, Tensor] = {}
MAX_LITERALS = 4096  # distinct numbers remembered; a model uses a handful

# The number types a literal may be remembered for: hashable, and ordered so that
# math.copysign can read their sign (complex numbers are made each time).
_NUMBER_TYPES = frozenset([bool, int, float, np.bool_, np.float16, np.float32, np.float64,
                           np.int8, np.int16, np.int32, np.int64,
                           np.uint8, np.uint16, np.uint32, np.uint64])


def _literal_key(value: Any, like: Any) -> tuple | None:
    """The key a number is remembered by, or None when it is not remembered.

    The sign is part of it: 0.0 == -0.0 in Python (and they hash alike), but
    `x * -0.0` must give -0.0 where `x * 0.0` gives 0.0."""
    if value.__class__ not in _NUMBER_TYPES:
        return None
    return (value.__class__, value, like, _sign(value))


def _sign(number: Any) -> float:
    """1.0 or -1.0, the sign of a number, -0.0's included. (copysign wants a float:
    a Python int beyond float's range, 10**400, would overflow in it.)"""
    if number > 0:
        return 1.0
    if number < 0:
        return -1.0
    return math.copysign(1.0, number)    # a zero: +0.0 or -0.0 (or a NaN's sign)


def _literal(op: str, value: Any, like: Any) -> Tensor:
    """A Python number or array mixed with Tensors, typed as the graph's `make` types
    it (`ops.literal_dtype`: `x * 2` stays float32, `int32 + 1.5` is a float), as a
    Tensor outside the allocator. Numbers are remembered: a loop asks for the same
    `x * 0.5` every step."""
    key = _literal_key(value, like)
    tensor = _literals.get(key) if key is not None else None
    if tensor is None:
        array = ops._literal(op, value, like, user_source_line()).attrs["value"].array
        tensor = _wrap(array, None)   # read-only (ConstValue's copy)
        if key is not None and len(_literals) < MAX_LITERALS:
            _literals[key] = tensor
    return tensor


def _with_literals(op: str, inputs: Sequence[Any]) -> tuple[list[Tensor], list]:
    """`inputs` with each literal (a number, an array, a tf.constant) as a Tensor,
    typed beside the Tensors among them as `make` types them (`ops.literal_like`); and
    their arrays. (Loops, not a generator and a comprehension: half the ops of
    `y = y * 0.5 + 1` come here, and in CPython 3.11 those two cost more than the rest
    of this function.)"""
    if len(inputs) == 2:
        # `x * 0.5` or `1 - x`, a number seen before beside one eager Tensor, spelled
        # out: _literal_key(number, x's dtype) and one lookup. (The general loops
        # below cost this op 7-9% more in benchmarks/eager_bench.py's chain.)
        a, b = inputs
        if isinstance(a, Tensor):
            tensor, number = a, b
        else:
            tensor, number = b, a
        array = tensor.data if isinstance(tensor, Tensor) else None   # (None: symbolic)
        if array is not None and number.__class__ in _NUMBER_TYPES:
            # (_literal_key's sign: it tells only zeros apart, and a call costs)
            sign = 1.0 if number > 0 else _sign(number)
            literal = _literals.get((number.__class__, number, array.dtype, sign))
            if literal is not None:
                if tensor is a:
                    return [a, literal], [a.data, literal.data]
                return [literal, b], [literal.data, b.data]
    like = None
    for i in inputs:
        if isinstance(i, Tensor):
            # (`like is None` first: numpy reads None as float64 in `dtype != None`)
            if like is None:
                like = i.dtype
            elif i.dtype != like:
                like = ops.literal_like((like, i.dtype))
    tensors, arrays = [], []
    for i in inputs:
        if isinstance(i, Tensor):
            t = i
        else:  # a number seen before is one dict lookup; anything else is made
            key = _literal_key(i, like)
            t = _literals.get(key) if key is not None else None
            if t is None:
                t = _constant_tensor(op, i, like)
        tensors.append(t)
        arrays.append(t.data)
    return tensors, arrays


_kernels: dict[tuple, tuple] = {}
_layouts: dict[tuple, tuple] = {}   # (shape, dtype) -> the one tuple standing for it
MAX_KERNELS = 65536  # distinct (op, shapes, dtypes, attrs); a model has a few hundred


def _kernel(op: str, arrays: list, attrs: dict) -> tuple:
    """What running `op` on these arrays needs, remembered: the shape rule is a pure
    function, and an eager loop asks it the same question every step.

    Returns (layout, nbytes, ufunc, opdef): the result's layout = (shape, dtype) and
    size (`opdef.infer`, with its ShapeError naming op, shapes and the user's line),
    and the numpy ufunc to call as `ufunc(*arrays, out=out)` when the registry says the
    op's compute is that ufunc and nothing else (`OpDef.ufunc`), else None. The key is
    (op, shape, dtype of each input, attributes), spelled out for one and two inputs
    (nearly every op): in CPython 3.11 a comprehension is a function call, as dear
    as the lookup.
    """
    try:
        if len(arrays) == 1:
            key = (op, arrays[0].shape, arrays[0].dtype)
        elif len(arrays) == 2:
            key = (op, arrays[0].shape, arrays[0].dtype, arrays[1].shape, arrays[1].dtype)
        else:
            key = (op, *[x for a in arrays for x in (a.shape, a.dtype)])
    except AttributeError:   # (free unless raised) a symbolic Tensor has no array
        if any(a is None for a in arrays):
            raise _symbolic_outside_trace(op) from None
        raise
    if attrs:
        key = (*key, tuple(attrs.items()))
    try:
        kernel = _kernels.get(key)
    except TypeError:  # an attribute that cannot be hashed: just ask
        key = kernel = None
    if kernel is None:
        kernel = _new_kernel(op, arrays, attrs)
        if key is not None and len(_kernels) < MAX_KERNELS:
            _kernels[key] = kernel
    return kernel


def _symbolic_outside_trace(op: str) -> EagerError:
    return EagerError(f"{op} at {user_source_line()} was given a symbolic Tensor, one that "
                      "stands for a node of a traced function (@tf.function) and has no "
                      "value outside it; return it from the function to get its value")


def _new_kernel(op: str, arrays: list, attrs: dict) -> tuple:
    opdef = REGISTRY[op]
    # The graph's checks, with its messages: the attributes (opdef.check: a stride
    # of 0 reached the kernel as a ZeroDivisionError), then the shape rule.
    shape, dtype = ops.infer_node(op, (), attrs, user_source_line(),
                                  [a.shape for a in arrays], [a.dtype for a in arrays])
    shape, dtype = tuple(shape), np.dtype(dtype)
    ufunc = getattr(np, opdef.ufunc) if opdef.ufunc and not attrs else None
    # One tuple object per layout, whichever op asks: a block's kept view is then
    # found by identity (`apply`), though consecutive ops in the block differ.
    layout = _layouts.get((shape, dtype), (shape, dtype))
    if len(_layouts) < MAX_KERNELS:
        _layouts.setdefault(layout, layout)
    return layout, math.prod(shape) * dtype.itemsize, ufunc, opdef


def _run_kernel(compute: Callable, arrays: list, out: np.ndarray, attrs: dict) -> Any:
    """`compute(np, *arrays, out=out, **attrs)`, spelled out for one and two inputs
    without attributes: in CPython 3.11 the starred call builds a tuple and a dict,
    about 0.5 us, as long as a one-element kernel takes."""
    if not attrs:
        if len(arrays) == 1:
            return compute(np, arrays[0], out=out)
        if len(arrays) == 2:
            return compute(np, arrays[0], arrays[1], out=out)
    return compute(np, *arrays, out=out, **attrs)


def apply(op: str, inputs: Sequence[Any], attrs: dict, name: str | None = None) -> Tensor:
    """Run registry op `op` on `inputs` now and return its Tensor.

    The contract every op has: `infer` checks the inputs (a ShapeError naming op,
    shapes and the user's line) and names the result's shape and dtype; `compute`
    writes the result into the block the allocator hands out. When recording is on
    and an input requires grad, the result remembers (op, inputs, attrs) for backward.

    This runs once per op, and on tiny Tensors its Python is the whole cost (see
    benchmarks/eager_bench.py), so it avoids what is dear in CPython: generator
    expressions, starred calls, calls that are not needed (`debug.current()` only
    while some recorder is active; the Tensor made here, not by a helper).
    """
    state = _thread.state   # (one thread-local read: see _PerThread)
    if state.tracer is not None:
        return state.tracer.apply(op, inputs, attrs, name)
    arrays = []
    for i in inputs:
        if not isinstance(i, Tensor):   # a literal among them: make it a Tensor
            inputs, arrays = _with_literals(op, inputs)
            break
        arrays.append(i.data)
    layout, nbytes, ufunc, opdef = _kernel(op, arrays, attrs)
    if opdef.random:  # its compute draws from `generators` (the registry says so)
        attrs = {**attrs, "generators": _generators}
    alloc = state.allocator
    recorder, began = _recording(alloc) if debug.active else _NOT_RECORDING
    block = alloc.malloc(nbytes)
    out = block.view if block.view_key is layout else alloc.view_as(block, layout)
    scratch = None
    try:
        if ufunc is None:
            if opdef.scratch is None:
                result = _run_kernel(opdef.compute, arrays, out, attrs)
            else:
                result, scratch = _run_with_scratch(opdef, arrays, out, attrs, alloc)
            if result is not out:  # the kernel could not write into `out`
                out[...] = result
        elif len(arrays) == 2:  # the op is this numpy ufunc (OpDef.ufunc): call it
            ufunc(arrays[0], arrays[1], out=out)   # (np.maximum refuses out by position)
        elif len(arrays) == 1:  # (spelled out: a starred call costs 0.1 us more)
            ufunc(arrays[0], out)   # (out by position: a keyword costs 20 ns)
        else:
            ufunc(*arrays, out=out)
    except Exception as err:
        alloc.free(block)
        _kernel_failed(op, arrays, err)
    result_tensor = _new_object(Tensor)   # _wrap(out, block, alloc), spelled out
    result_tensor.data = out
    result_tensor._block = block
    result_tensor._alloc = alloc
    if began is not None:  # inside tf.debug.record: the op goes into the record
        recorder.eager_log.add(op, inputs, result_tensor, block, began, time.perf_counter(),
                               scratch)
    if state.grad_enabled and opdef.differentiable:
        _put_on_tape(result_tensor, op, inputs, attrs)
    return result_tensor


# The operators' shortcut. On tiny Tensors an op's Python is its whole cost, and
# most ops are the common case: a numpy ufunc already run on these shapes and dtypes
# (its kernel is remembered), operands that are Tensors or numbers seen before, no
# trace and no recording. That case needs a third of `apply`'s steps, so the
# arithmetic operators (`-y`, `y + 0.5`) and the one-input builders (`tanh(y)`, via
# ops.make) come to these two first; every other case goes on to `apply` itself,
# which also says what is wrong when something is. Two functions, not one with an
# arity test: the tests cost the one-input ops 8% (benchmarks/eager_bench.py).
# A kernel that fails here fails as in apply (_kernel_failed), without running again.

def apply_unary(op: str, a: Any) -> Tensor:
    """`apply(op, (a,), {})`, shortened for the common case (see above)."""
    try:
        kernel = _kernels.get((op, a.data.shape, a.data.dtype))
    except AttributeError:   # not a Tensor with an array: apply says what it is
        kernel = None
    state = _thread.state   # (one thread-local read: see _PerThread)
    if kernel is None or kernel[2] is None or state.tracer is not None or debug.active:
        return apply(op, (a,), {})
    layout, nbytes, ufunc, opdef = kernel
    alloc = state.allocator
    block = alloc.malloc(nbytes)
    out = block.view if block.view_key is layout else alloc.view_as(block, layout)
    try:
        ufunc(a.data, out)   # (out by position: a keyword costs 20 ns)
    except Exception as err:   # (not run again by apply: a numpy error callback
        alloc.free(block)      # or a recording allocator would see it twice)
        _kernel_failed(op, (a.data,), err)
    result = _new_object(Tensor)   # _wrap(out, block, alloc), spelled out
    result.data = out
    result._block = block
    result._alloc = alloc
    if state.grad_enabled and opdef.differentiable:
        _put_on_tape(result, op, (a,), {})
    return result


def apply_binary(op: str, a: Any, b: Any) -> Tensor:
    """`apply(op, (a, b), {})`, shortened for the common case (see above)."""
    state = _thread.state   # (one thread-local read: see _PerThread)
    if state.tracer is not None or debug.active:
        return apply(op, (a, b), {})
    try:
        if a.__class__ is Tensor and b.__class__ is Tensor:
            inputs, x, y = (a, b), a.data, b.data
        elif a.__class__ is Tensor and b.__class__ in _NUMBER_TYPES and (
                literal := _literals.get((b.__class__, b, a.data.dtype,
                                          1.0 if b > 0 else _sign(b)))) is not None:
            # `y + 0.5`, a number seen before beside a Tensor: its Tensor, by the key
            # of _literal_key, looked up here (calling _with_literals costs 15%)
            inputs, x, y = (a, literal), a.data, literal.data
        else:   # any other literal: _with_literals finds or makes its Tensor
            inputs, (x, y) = _with_literals(op, (a, b))
        kernel = _kernels.get((op, x.shape, x.dtype, y.shape, y.dtype))
    except AttributeError:   # an operand with no array: apply says what it is
        return apply(op, (a, b), {})
    if kernel is None or kernel[2] is None:   # first time, or not a ufunc
        return apply(op, inputs, {})
    layout, nbytes, ufunc, opdef = kernel
    alloc = state.allocator
    block = alloc.malloc(nbytes)
    out = block.view if block.view_key is layout else alloc.view_as(block, layout)
    try:
        ufunc(x, y, out)   # (by position: 20 ns less; fine for the operators' ufuncs)
    except Exception as err:   # (as in apply_unary)
        alloc.free(block)
        _kernel_failed(op, (x, y), err)
    result = _new_object(Tensor)   # _wrap(out, block, alloc), spelled out
    result.data = out
    result._block = block
    result._alloc = alloc
    if state.grad_enabled and opdef.differentiable:
        _put_on_tape(result, op, inputs, {})
    return result


# apply_over writes over operands of at least this many bytes. Below, a new block is
# cheap (its lines are soon in the cache) and the checks, 10-20 us of Python, cost
# what the pass saves: a bias add over 128 KiB saves 14 us in place, 256 KiB 28 us,
# 2 MiB 390 us (new blocks taken in turn from a pool, as the allocator's are).
MIN_OVER_BYTES = 256 << 10


def apply_over(op: str, inputs: Sequence[Any], dying: int, attrs: dict | None = None
               ) -> Tensor:
    """`apply(op, inputs, attrs)`, for a caller that made `inputs[dying]` itself and
    drops it after this call: nothing else holds it (ops.make_over: nn.Linear's
    product before its bias, a Linear's output in nn.Sequential before the
    activation after it; backward: a gradient only this rule reads).

    When `op` is one numpy ufunc, or its registry entry says it may write over that
    input (OpDef.inplace: relu), and its result has that input's layout, the result
    is written over it and takes its block: the in-place reuse the static plan
    finds for a graph (memory.py). Eager mode cannot find it alone, as it never
    knows who else holds a Tensor; the caller does. The bits are the same (an
    elementwise ufunc may write over its own input), and the op makes one pass
    over memory instead of two: writing a new block first reads it into the cache
    (the bias add of a 512x1024 float32 layer: 0.8 -> 0.2 ms, cold cache).

    Anything else is `apply`: a small operand (MIN_OVER_BYTES), a trace or a
    recording, a literal, an array that is viewed elsewhere, another layout, and,
    when the result goes on the tape, a gradient rule that would read the
    overwritten value: this op's rule reading that input, or the rule of the op
    that made it reading its own output. A Tensor that someone else still holds
    is the caller's to rule out: it would silently take the result's value.
    """
    target = inputs[dying]
    if (target.__class__ is not Tensor or target.data is None
            or target.data.nbytes < MIN_OVER_BYTES):
        if len(inputs) == 2 and not attrs:   # (`y + b` would take the shortcut)
            return apply_binary(op, inputs[0], inputs[1])
        return apply(op, inputs, attrs or {})
    attrs = attrs or {}
    arrays = _arrays_to_write_over(target, inputs, attrs)
    if arrays is None:
        return apply(op, inputs, attrs)
    layout, _, ufunc, opdef = _kernel(op, arrays, attrs)
    out = target.data
    # A ufunc may write over any of its inputs; another kernel over the one input
    # its registry entry names (OpDef.inplace: relu's), as the static plan allows.
    if (ufunc is None and opdef.inplace != dying) or layout != (out.shape, out.dtype):
        return apply(op, inputs, attrs)
    result = _new_object(Tensor)
    result.data = out
    if _thread.state.grad_enabled and opdef.differentiable:
        _put_on_tape(result, op, inputs, attrs)
        if result._op is not None and _value_read_later(result, dying):
            return apply(op, inputs, attrs)
    try:
        if ufunc is not None:
            ufunc(*arrays, out=out)
        else:
            written = opdef.compute(np, *arrays, out=out)
            if written is not out:   # (as the executor: a kernel that could not)
                out[...] = written
    except Exception as err:   # (the block is still target's: it frees it)
        _kernel_failed(op, arrays, err)
    result._block, result._alloc = target._block, target._alloc
    # The target may live on, on the tape, where nobody reads its value (checked
    # above) but its shape and dtype are asked: it keeps those over one element,
    # not the block's array, which would otherwise outlive the result (and hold
    # its block) as long as the tape holds the target.
    target._block = None
    target.data = np.broadcast_to(np.zeros((), out.dtype), out.shape)
    return result


def _arrays_to_write_over(target: Tensor, inputs: Sequence[Any], attrs: dict
                          ) -> list[np.ndarray] | None:
    """The inputs' arrays, when nothing rules out writing over `target`'s: no trace
    or recording (they take `apply`, which logs each op), no attributes, only
    Tensors with values, and target's block held by target alone."""
    if (_thread.state.tracer is not None or debug.active or attrs or target._block is None
            or target.data is not target._block.view
            or _getrefcount(target.data) > _OWN_REFS):   # a view of it lives on
        return None
    arrays = []
    for i in inputs:
        if i.__class__ is not Tensor or i.data is None:
            return None
        arrays.append(i.data)
    return arrays


def _value_read_later(result: Tensor, dying: int) -> bool:
    """Whether a backward would read the value of `result`'s input `dying`: its
    op's rule reads that input, or the rule of the op that made the input reads
    its own output (tanh's does). `_rule_graph` says which values a rule reads."""
    target = result._inputs[dying]
    try:
        if dying in _rule_graph(result, result._needed, result.dtype).reads:
            return True
        if target._op is None:
            return False
        if target._inputs is None:   # (its tape was freed by a backward: be safe)
            return True
        own_output = len(target._inputs)
        return own_output in _rule_graph(target, target._needed, target.dtype).reads
    except TinyFlowError:   # no rule at all: the backward will say so, not this
        return True


def _kernel_failed(op: str, arrays: Sequence, err: Exception) -> NoReturn:
    """Raise what a kernel's failure `err` becomes: a TinyFlowError as it is, any
    other (numpy's FloatingPointError, a warning turned error) an EagerError naming
    the op, the user's line and the input shapes, caused by `err`."""
    if isinstance(err, TinyFlowError):
        raise err
    raise EagerError(f"{op} failed at {user_source_line()} on inputs of shapes "
                     f"{[a.shape for a in arrays]}: {err}") from err


_NOT_RECORDING = (None, None)
_SCRATCH_DTYPE = np.dtype(np.uint8)

# `_scaled_update` works in slices of this many bytes: the product's slice and the
# slices of the target and of the value (three of them) stay in a core's L2 cache
# (1-2 MiB). Measured on a 1024x1024 float32 update: 256 KiB slices 0.38 ms,
# 64 KiB 0.46 ms, 1 MiB 0.53 ms, the whole product at once 0.63 ms.
SCALED_SLICE_BYTES = 256 << 10


def _fusable_update(target: Tensor, op: str, value: Any, alpha: Any) -> tuple | None:
    """(the operands of alpha * value as `_scaled_update` slices them, the product's
    ufunc, the update's ufunc) when `target.<op>_(value, alpha=alpha)` can run
    fused, else None (see Tensor._scaled_update_)."""
    state = _thread.state
    if (state.grad_enabled or state.tracer is not None or target.node is not None
            or target.data.nbytes <= SCALED_SLICE_BYTES   # fits in L2 anyway: no gain
            or alpha.__class__ not in _NUMBER_TYPES or not isinstance(value, Tensor)
            or value.node is not None or not target.data.flags.c_contiguous
            or backend.errors_may_raise()):   # (halfway, a half-updated Tensor)
        return None
    _, arrays = _with_literals("mul", (alpha, value))
    layout, _, scale, _ = _kernel("mul", arrays, {})
    here = (target.data.shape, target.data.dtype)
    if scale is None or layout != here:
        return None
    # (the product has the target's layout: the update is op(target, target)'s)
    update_layout, _, update, _ = _kernel(op, [target.data, target.data], {})
    operands = [_flat_operand(a, target.data.shape) for a in arrays]
    if update is None or update_layout != here or any(a is None for a in operands):
        return None
    return operands, scale, update


def _flat_operand(array: np.ndarray, shape: tuple) -> np.ndarray | None:
    """`array` as `_scaled_update` slices it: flat when it has `shape`, a scalar
    when it has one element (a number's array); None for any other broadcast."""
    if array.shape == shape:
        return array.reshape(-1)
    if array.size == 1:
        return array.reshape(())
    return None


def _scaled_update(target: np.ndarray, operands: list, scale: Any, update: Any,
                   alloc: CachingAllocator) -> tuple[Block, int]:
    """target = update(target, scale(*operands)), slice by slice: the product goes
    into a scratch block of the caching allocator (taken for the call, as conv2d's
    workspace is), one slice at a time. Returns (the scratch block, its bytes)."""
    per_slice = max(1, SCALED_SLICE_BYTES // target.itemsize)
    nbytes = min(target.size, per_slice) * target.itemsize
    block = alloc.malloc(nbytes)
    try:
        product = alloc.view_as(block, ((nbytes // target.itemsize,), target.dtype))
        for start in range(0, target.size, per_slice):
            stop = min(start + per_slice, target.size)
            part = product[:stop - start]
            scale(*[a if a.ndim == 0 else a[start:stop] for a in operands], out=part)
            update(target[start:stop], part, out=target[start:stop])
        return block, block.size
    finally:
        alloc.free(block)


def _run_with_scratch(opdef: Any, arrays: list, out: np.ndarray, attrs: dict,
                      alloc: CachingAllocator) -> tuple[Any, tuple[Block, int]]:
    """Run a kernel that needs working memory while it runs (OpDef.scratch: conv2d's
    im2col matrix): the memory is a block of the caching allocator, taken for the
    call and given back after it, as PyTorch's cuDNN convolutions take their
    workspace from the CUDA caching allocator (a traced program's plan places the
    same bytes in its arena). Returns the result and (the block, its bytes)."""
    shapes, dtypes = [a.shape for a in arrays], [a.dtype for a in arrays]
    nbytes = opdef.scratch(np, shapes, dtypes, attrs)
    block = alloc.malloc(nbytes)
    try:
        region = alloc.view_as(block, ((nbytes,), _SCRATCH_DTYPE))
        compute = opdef.bind(np, shapes, dtypes, attrs, {}, region) or opdef.compute
        return _run_kernel(compute, arrays, out, attrs), (block, block.size)
    finally:
        alloc.free(block)


def _recording(alloc: CachingAllocator) -> tuple:
    """(the active recorder, the op's start time), or _NOT_RECORDING. The first op
    recorded turns on the allocator's events (an EagerLog)."""
    recorder = debug.current()
    if recorder is None:
        return _NOT_RECORDING
    log = recorder.eager_log
    if log is None:
        if (debug.records_whole_process(recorder)
                and threading.current_thread() is not threading.main_thread()):
            return _NOT_RECORDING   # TINYFLOW_TRACE records the main thread's ops
        recorder.eager_log = EagerLog(alloc, _thread.state)   # now the allocator keeps events
    elif log.alloc is not alloc:
        # Another thread's op (TINYFLOW_TRACE's recorder is every thread's), or one
        # made through another allocator: a record follows one allocator's blocks.
        return _NOT_RECORDING
    return recorder, time.perf_counter()


def _put_on_tape(result: Tensor, op: str, inputs: Sequence[Tensor], attrs: dict) -> None:
    """When an input requires grad, `result` remembers (op, inputs, attrs) for backward,
    and which inputs required grad then: as in PyTorch, a backward sends gradient to
    those, whatever their flags are by the time it runs."""
    for t in inputs:
        if t.requires_grad:
            result.requires_grad = True
            result._op, result._inputs, result._attrs = op, inputs, attrs
            result._needed = tuple(i.requires_grad for i in inputs)
            result._versions = tuple(i._version for i in inputs)
            return


def _constant_tensor(op: str, value: Any, like: Any) -> Tensor:
    # A literal's array is made once and shared (read-only), outside the allocator:
    # the static plan keeps constants outside its arena too.
    if isinstance(value, Node):  # tf.constant(...) beside Tensors: its value
        if source_kind(value) != "constant":
            raise EagerError(f"{op} at {user_source_line()} mixes eager Tensors with the "
                             f"graph node {value.name} ({value.op}); eager ops take "
                             "Tensors, arrays, numbers and tf.constant values")
        return _wrap(value.attrs["value"].array, None)
    return _literal(op, value, like)


ops.set_eager_dispatch(apply, apply_unary, Tensor, apply_over)


# ----------------------------------------------------------------------------------
# Backward: walk the tape, interpret each op's gradient rule
# ----------------------------------------------------------------------------------

def _tape_order(root: Tensor) -> list[Tensor]:
    """Every Tensor on `root`'s tape, each after its inputs.

    The same iterative depth-first post-order as `graph.topological_order` (inputs
    left to right), so gradient contributions are summed in the same order as
    `autodiff.gradients` sums them on the traced graph: bitwise-equal results.
    """
    order: list[Tensor] = []
    done: set[int] = set()
    stack: list[tuple[Tensor, int]] = [(root, 0)]
    on_stack = {id(root)}
    while stack:
        t, i = stack[-1]
        if t._written_at is not None:
            raise EagerError(f"backward reaches a Tensor written in place at "
                             f"{t._written_at}, after an op that requires grad made it: "
                             "eager mode does not record in-place ops for backward (PyTorch "
                             "would); write the result to a new Tensor (y = y * 3, not "
                             "y.mul_(3))")
        if t._opaque is not None:   # (before any .grad is touched: nothing half done)
            raise EagerError(f"backward reaches {t._opaque}")
        inputs = t._inputs or ()
        if i < len(inputs):
            stack[-1] = (t, i + 1)
            child = inputs[i]
            if id(child) not in done and id(child) not in on_stack and child.requires_grad:
                on_stack.add(id(child))
                stack.append((child, 0))
        else:
            stack.pop()
            done.add(id(t))
            order.append(t)
    return order


@dataclass
class _RuleGraph:
    """An op's gradient rule built once over stand-in leaves and kept for reuse."""

    leaves: list[Node]          # the op's inputs, then its output, then the gradient
    grads: list[Node | None]    # the rule's result, one per input
    order: list[Node]           # nodes to evaluate, inputs first
    reads: list[int]            # which of the op's inputs (and, last, output) it reads
    # The one node that reads the incoming gradient, when only one does and the rule
    # does not pass the gradient on as it is (add's does): it may write over the
    # gradient, when nothing outside holds it (`_walk_tape`, `apply_over`).
    over_grad: Node | None = None
    over_grad_at: int = 0       # where the gradient is among over_grad's inputs
    # Whether a result is handed out twice (add's rule gives g to both inputs) or
    # is a value of the forward pass: then no later rule may write over it.
    results_shared: bool = False


_rule_cache: dict[tuple, _RuleGraph] = {}
MAX_RULE_GRAPHS = 4096  # distinct (op, attrs, shapes) seen; plenty for one model


def _rule_graph(t: Tensor, needed: tuple[bool, ...], grad_dtype: np.dtype) -> _RuleGraph:
    """`t`'s op's gradient rule over stand-ins typed as this call's values: the
    inputs, the output, and the incoming gradient (whose dtype may differ from the
    output's when a wider consumer promoted it: the rule's literals are typed by it,
    as in the graph)."""
    inputs = t._inputs
    key = (t._op, tuple(sorted((k, v) for k, v in t._attrs.items() if k != "generators")),
           tuple((i.shape, i.dtype.str) for i in inputs), t.shape, t.dtype.str, needed,
           grad_dtype.str)
    rule = _rule_cache.get(key)
    if rule is not None:
        return rule
    leaves = [Node("placeholder", (), {"shape": i.shape, "dtype": i.dtype.name},
                   shape=i.shape, dtype=i.dtype, where="<eager>") for i in inputs]
    output = Node(t._op, leaves, t._attrs, shape=t.shape, dtype=t.dtype, where="<eager>")
    grad = Node("placeholder", (), {"shape": t.shape, "dtype": grad_dtype.name},
                shape=t.shape, dtype=grad_dtype, where="<eager>")
    opdef = REGISTRY[t._op]
    if opdef.gradient is None:
        raise EagerError(f"op {t._op} has no gradient, but it lies between the Tensors "
                         "that require grad and the one `backward` started from")
    grads = list(opdef.gradient(output, grad))
    wanted = [g for g, need in zip(grads, needed) if need and g is not None]
    stand_ins = frozenset(id(n) for n in [*leaves, output, grad])
    order = topological_order(wanted, leaves=stand_ins)
    # The values the rule reads: inputs of its own nodes (not of the stand-ins: the
    # output's node lists the op's inputs), less those read for their shape only.
    used = {id(i) for n in order if id(n) not in stand_ins for k, i in enumerate(n.inputs)
            if k not in REGISTRY[n.op].shape_inputs} | {id(g) for g in wanted}
    reads = [k for k, leaf in enumerate([*leaves, output]) if id(leaf) in used]
    rule = _RuleGraph([*leaves, output, grad], grads, order, reads,
                      *_only_reader(order, grad, wanted),
                      _results_shared(wanted, [*leaves, output]))
    if len(_rule_cache) < MAX_RULE_GRAPHS:
        _rule_cache[key] = rule
    return rule


def _only_reader(order: list[Node], grad: Node, wanted: list[Node]
                 ) -> tuple[Node | None, int]:
    """(the node of a rule that alone reads the gradient `grad`, once, and the
    input position where it reads it), if the rule does not also hand `grad` on as
    a result; else (None, 0)."""
    if grad in wanted:
        return None, 0
    readers = [(n, k) for n in order for k, i in enumerate(n.inputs) if i is grad]
    return readers[0] if len(readers) == 1 else (None, 0)


def _results_shared(wanted: list[Node], forward_values: list[Node]) -> bool:
    """Whether a rule hands one result to two inputs (add's gives g to both), or
    hands on a value of the forward pass as a gradient."""
    if len({id(g) for g in wanted}) < len(wanted):
        return True
    return any(g is v for g in wanted for v in forward_values)


def _input_grads(t: Tensor, grad: Tensor, shared: set[int] | None = None
                 ) -> list[Tensor | None]:
    """The gradients of `t`'s inputs, by evaluating its op's rule on Tensors.

    `shared` (from `_walk_tape`) holds the ids of gradients that more than the
    backward walk holds. When `grad` is not one of them, the rule's one reader of
    it may write its result over it (`apply_over`): relu's `g * (y > 0)` then
    needs no new block. Results the rule hands out twice, or that are values of
    the forward pass, go into `shared`."""
    needed = t._needed
    rule = _rule_graph(t, needed, grad.dtype)
    _check_versions(t, rule.reads)
    values: dict[Node, Tensor] = dict(zip(rule.leaves, [*t._inputs, t, grad]))
    over = None
    if (shared is not None and rule.over_grad is not None
            and grad.data.nbytes >= MIN_OVER_BYTES and id(grad) not in shared):
        over = rule.over_grad
    for node in rule.order:
        if node not in values:
            inputs = [values[i] for i in node.inputs]
            if node is over:
                values[node] = apply_over(node.op, inputs, rule.over_grad_at, node.attrs)
            else:
                values[node] = apply(node.op, inputs, node.attrs)
    grads = [values[g] if need and g is not None else None
             for g, need in zip(rule.grads, needed)]
    if rule.results_shared and shared is not None:
        shared.update(id(g) for g in grads if g is not None)
    return grads


def _check_versions(t: Tensor, reads: list[int]) -> None:
    """The values `t`'s gradient rule reads must be the ones its op used: an input
    (or the output) written in place since is an error, as in PyTorch, not a
    gradient taken with the new value."""
    inputs = t._inputs
    for k in reads:
        changed = inputs[k]._version != t._versions[k] if k < len(inputs) else t._version
        if changed:
            what = f"its input {k}" if k < len(inputs) else "its result"
            raise EagerError(f"backward: the gradient of {t._op} needs {what} as the op "
                             "saw it, but it was written in place afterwards (PyTorch "
                             "raises here too); write the new value to a new Tensor")


SECOND_BACKWARD = ("backward through a graph a second time: its saved values were freed "
                   "by the first backward; pass retain_graph=True to the first call")


def accumulates_in_place(grad: Tensor, incoming: np.dtype, recording: bool) -> bool:
    """Whether a backward adds into the existing `.grad` Tensor in place, as PyTorch's
    AccumulateGrad does, rather than making `.grad` a new Tensor: unless the sum
    must keep a history (create_graph, or a .grad that has one) or is of a wider
    dtype than the .grad (numpy's promotion, eager and traced alike)."""
    return (not recording and not grad.requires_grad
            and np.result_type(grad.dtype, incoming) == grad.dtype)


def check_seed_shape(seed: tuple, shape: tuple) -> None:
    """backward(gradient): the gradient has the Tensor's shape (broadcast, it would
    give the leaves its shape), in eager and traced backward alike."""
    if tuple(seed) != tuple(shape):
        raise EagerError(f"backward(gradient) at {user_source_line()}: the gradient has "
                         f"shape {tuple(seed)}, the Tensor {tuple(shape)}; they must match "
                         "(PyTorch checks too)")


def backward(root: Tensor, gradient: Any = None, retain_graph: bool = False,
             create_graph: bool = False) -> None:
    """Reverse-mode over the tape from `root` (see `Tensor.backward`)."""
    if not root.requires_grad:
        raise EagerError("backward() on a Tensor that does not require grad (no input "
                         "of its ops had requires_grad=True, or it was made under no_grad)")
    if gradient is None:
        check_implicit_seed(root.shape)
        seed = Tensor(np.ones(root.shape, root.dtype))
    else:
        seed = gradient if isinstance(gradient, Tensor) else Tensor(gradient, dtype=root.dtype)
        check_seed_shape(seed.shape, root.shape)
        if seed.dtype != root.dtype:   # cast, as PyTorch does (the grads keep dtypes)
            seed = Tensor(seed.data, dtype=root.dtype)
    order = _tape_order(root)
    pending: dict[int, list[Tensor]] = {id(root): [seed]}
    # create_graph records the backward's own ops, even inside no_grad (PyTorch too)
    recording = enable_grad() if create_graph else no_grad()
    state = _thread.state
    before, state.in_backward = state.in_backward, True
    try:
        _walk_tape(order, pending, recording, given={id(gradient)})
    finally:
        state.in_backward = before
    if not retain_graph:
        for t in order:
            if not t.is_leaf:
                t._inputs = None


def _walk_tape(order: list[Tensor], pending: dict[int, list[Tensor]],
               recording: Any, given: set[int]) -> None:
    """The reverse sweep: sum each Tensor's gradient contributions, then hand them
    to its op's rule (or, at a leaf, accumulate them into `.grad`).

    A leaf's first `.grad` is a Tensor of its own, as in PyTorch: a rule may hand
    one Tensor to two inputs (add passes g to both), and the caller's `gradient`
    may reach a leaf as it is; `given` holds their ids, and such a Tensor is
    copied, so that `a.grad.mul_(0.5)` cannot change `b.grad` or the caller's."""
    # The gradients that more than this walk holds (the caller's, one handed to two
    # inputs, see _input_grads): a rule must not write over them. Any other is the
    # walk's alone.
    shared = set(given)
    with recording:
        grad_enabled = _thread.state.grad_enabled   # (create_graph's: fixed for the walk)
        for t in reversed(order):
            contributions = pending.pop(id(t), None)
            if not contributions:
                continue
            total = contributions[0]
            for extra in contributions[1:]:
                total = total + extra
            if t.is_leaf:
                _check_differentiable(t.dtype)   # (t.requires_grad = True, set directly)
                if t._grad is None:
                    t._grad = total * 1 if id(total) in given else total
                    given.add(id(t._grad))
                elif accumulates_in_place(t._grad, total.dtype, grad_enabled):
                    t._grad.add_(total)   # PyTorch's way: `g = w.grad` sees the sum
                else:
                    t._grad = t._grad + total
                continue
            if t._inputs is None:
                raise EagerError(SECOND_BACKWARD)
            # (not under create_graph: the gradients are then on a tape of their own)
            grads = _input_grads(t, total, None if grad_enabled else shared)
            for inp, g in zip(t._inputs, grads):
                if g is not None:   # (an input that required grad when the op ran)
                    pending.setdefault(id(inp), []).append(g)


# ----------------------------------------------------------------------------------
# Layers and optimizers, eagerly
# ----------------------------------------------------------------------------------

def to_eager(model: Any, dtype: Any = None) -> Any:
    """Give a model built of graph Variables (a `tf.nn` layer, or any object holding
    Variables in attributes, lists and dicts) eager parameters, in place.

    Each Variable is replaced by a leaf Tensor (requires_grad=True when trainable)
    holding the value its initializer gives (cast to `dtype` if given), so the *same*
    model code runs in both modes from the same initial weights. The Tensors are
    listed, in the order found, in `model.eager_parameters` (see `parameters`).
    """
    from tinyflow.session import Session
    initializers = {var: a.inputs[1] for var, a in api._initializer_of.items()}
    trainable = set(api._trainable_variables)
    replaced: dict[Node, Tensor] = {}
    session = Session()

    def convert(value: Any) -> Any:
        if isinstance(value, Node) and source_kind(value) == "variable":
            if value not in replaced:
                if value not in initializers:
                    raise EagerError(f"variable {value.name} has no initial value to "
                                     "start an eager copy from")
                array = session.run(initializers[value])
                replaced[value] = Tensor(array, requires_grad=value in trainable,
                                         dtype=dtype)
            return replaced[value]
        return value

    stack, seen = [model], set()
    while stack:  # an explicit stack: models nest layers in lists and dicts
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            slots = list(item.items())
        elif isinstance(item, list):
            slots = list(enumerate(item))
        elif hasattr(item, "__dict__") and not isinstance(item, (Node, Tensor, type)):
            slots = list(vars(item).items())
        else:
            continue
        for key, value in reversed(slots):
            new = convert(value)
            if new is not value:
                if isinstance(item, (dict, list)):
                    item[key] = new
                else:
                    setattr(item, key, new)
            elif isinstance(value, (dict, list)) or (
                    hasattr(value, "__dict__") and not isinstance(value, (Node, type))):
                stack.append(value)
    found = sorted(replaced.items(), key=lambda kv: kv[0].id)  # creation order
    model.eager_parameters = [t for _, t in found]
    model.eager_variables = found   # [(the graph Variable, its eager Tensor)]
    return model


def save(model: Any, path: str) -> str:
    """Save a `to_eager` model's parameters as a `tf.train.Saver` checkpoint, under
    their Variables' names: the graph model can restore it, and so can `restore`."""
    from tinyflow.session import Session
    from tinyflow.saver import Saver
    session = Session()
    for var, t in model.eager_variables:
        session.variables[var] = t.numpy()
    return Saver([var for var, _ in model.eager_variables]).save(session, path)


def restore(model: Any, path: str) -> None:
    """Load a checkpoint into a `to_eager` model's parameters, in place, by name."""
    from tinyflow.saver import CheckpointError, read_checkpoint
    values = read_checkpoint(path)
    with no_grad():
        for var, t in model.eager_variables:
            value = values.get(var.name)
            if value is None or value.shape != t.shape:
                found = "missing" if value is None else f"of shape {value.shape}"
                raise CheckpointError(f"{path}: {var.name} is {found}, the model's is "
                                      f"{t.shape}")
            t.assign_(value)


def parameters(module: Any) -> list[Tensor]:
    """The eager parameters of a module converted by `to_eager`, in layer order."""
    return list(module.eager_parameters)


class Optimizer:
    """PyTorch's optimizer protocol: `zero_grad()`, then `backward`, then `step()`.
    Updates are in-place writes under no_grad, so a traced step writes them back."""

    def __init__(self, params: Sequence[Tensor], lr: float) -> None:
        self.params = list(params)
        # (as the graph's optimizers and PyTorch's check: a NaN step poisons every
        # weight, a negative one climbs the loss)
        self.lr = ops.float_attr(type(self).__name__, "lr", lr, low=0.0)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        with _optimizer_step():
            for index, p in enumerate(self.params):
                if p.grad is not None:
                    self._update(index, p, p.grad)

    def _update(self, index: int, p: Tensor, grad: Tensor) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """p -= lr * g, or with momentum: v = momentum * v + g; p -= lr * v."""

    def __init__(self, params: Sequence[Tensor], lr: float, momentum: float = 0.0) -> None:
        super().__init__(params, lr)
        self.momentum = ops.float_attr("SGD", "momentum", momentum, low=0.0)
        self.velocity = [Tensor(np.zeros(p.shape, p.dtype)) for p in self.params] \
            if momentum else []

    def _update(self, index: int, p: Tensor, grad: Tensor) -> None:
        if self.momentum:
            # (in place, one pass per op: the same bits as assigning the sum)
            grad = self.velocity[index].mul_(self.momentum).add_(grad)
        p.sub_(grad, alpha=self.lr)   # p -= lr * g, bit for bit


class Adam(Optimizer):
    """Adam (Kingma & Ba) in the form `tf.train.AdamOptimizer` uses: bias correction
    folded into the step size. The step count (one per dtype) is a Tensor, not a Python
    int, so a traced step counts on each call instead of baking in the count it saw."""

    def __init__(self, params: Sequence[Tensor], lr: float = 1e-3, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8) -> None:
        super().__init__(params, lr)
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= ops.float_attr("Adam", name, beta) < 1.0:
                raise ops.argument_error("Adam", f"{name} must be in [0, 1), got {beta!r}")
        self.beta1, self.beta2 = beta1, beta2
        self.eps = ops.float_attr("Adam", "eps", eps, low=0.0)
        # One step count per dtype, as optim.AdamOptimizer keeps: each parameter's step
        # size is computed in its own dtype (with one count in the first parameter's
        # dtype, a float64 parameter after a float32 one took a float32-rounded step).
        self.t = {dtype: Tensor(np.zeros((), dtype))
                  for dtype in dict.fromkeys(p.dtype for p in self.params)}
        self.m = [Tensor(np.zeros(p.shape, p.dtype)) for p in self.params]
        self.v = [Tensor(np.zeros(p.shape, p.dtype)) for p in self.params]

    def step(self) -> None:
        with _optimizer_step():
            self._step_sizes = {}
            for dtype, count in self.t.items():
                t = count.assign_(count + 1.0)
                self._step_sizes[dtype] = self.lr * ops.sqrt(
                    1.0 - ops.power(self.beta2, t)) / (1.0 - ops.power(self.beta1, t))
        super().step()

    def _update(self, index: int, p: Tensor, grad: Tensor) -> None:
        # m = beta1 * m + (1 - beta1) * g, in place (one pass per op, the same bits)
        # (1 - beta in the parameter's dtype: see optim.one_minus)
        m = self.m[index].mul_(self.beta1).add_(grad, alpha=one_minus(self.beta1, p.dtype))
        v = self.v[index].mul_(self.beta2).add_(one_minus(self.beta2, p.dtype) * grad * grad)
        p.sub_(self._step_sizes[p.dtype] * m / (ops.sqrt(v) + self.eps))
