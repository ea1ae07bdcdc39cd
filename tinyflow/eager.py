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

Tracing (`function`, like tf.function / torch.compile) runs the Python function once
on *symbolic* Tensors that build Nodes instead of computing, compiles the Graph with
the ordinary passes, planner and executor, and replays it for later calls whose
inputs have the same shapes and dtypes (the guard). Parameters the function reads
(Tensors from outside) become inputs fed on every call; in-place updates
(``assign_``, optimizers) and ``.grad`` writes become outputs written back after the
run (functionalization, as torch.compile does). Asking a symbolic Tensor for its
value (``if loss > 0``, ``.item()``) is a *graph break*: an error naming the line.

Eager memory comes from `CachingAllocator` (allocator.py), after PyTorch's CUDA
caching allocator: blocks carved from larger segments, best-fit reuse, split and
merge (with glibc's fast bins in front for small blocks), every alloc and free
recorded so the debugger and lesson 9 can put it beside the static plan.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyflow import api, debug, ops, shape_ops
from tinyflow.allocator import ROUND, Block, CachingAllocator
from tinyflow.registry import source_kind
from tinyflow.graph import Node, TinyFlowError, topological_order, user_source_line
from tinyflow.ops import REGISTRY, Mismatch, shape_error

_allocator = CachingAllocator(record=False)


def allocator() -> CachingAllocator:
    """The allocator eager Tensors take their memory from."""
    return _allocator


def set_allocator(new: CachingAllocator) -> CachingAllocator:
    """Use `new` for Tensors made from now on; returns the previous allocator.
    (Tensors made before keep their blocks in the old one, and return them there.)"""
    global _allocator
    old, _allocator = _allocator, new
    return old


# ----------------------------------------------------------------------------------
# Errors and modes
# ----------------------------------------------------------------------------------

class EagerError(TinyFlowError, RuntimeError):
    """An eager op or a backward pass that cannot run; names the op and the line."""


class GraphBreak(TinyFlowError):
    """A traced function asked for a value that only exists when the graph runs."""


class _Mode:
    grad_enabled = True
    in_backward = False     # inside `backward` (the debugger colours those ops)
    in_optimizer = False    # inside an optimizer's `step` (the debugger's optimizer box)
    tracer: _Trace | None = None


_mode = _Mode()
_generators: dict = {}   # eager random streams, by op seed (dropout)


@contextlib.contextmanager
def _optimizer_step() -> Iterator[None]:
    """An optimizer's update: no grad, and recorded ops are marked as the optimizer's."""
    before, _mode.in_optimizer = _mode.in_optimizer, True
    try:
        with no_grad():
            yield
    finally:
        _mode.in_optimizer = before


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Ops inside the block are not recorded for backward (torch.no_grad)."""
    before, _mode.grad_enabled = _mode.grad_enabled, False
    try:
        yield
    finally:
        _mode.grad_enabled = before


# ----------------------------------------------------------------------------------
# The Tensor
# ----------------------------------------------------------------------------------

class Tensor:
    """An array with an optional history for backward (eager), or, while a
    `function` is being traced, a symbolic value standing for a graph Node.

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
    __tinyflow_tensor__ = True   # ops.make routes ops on these to `apply`
    __array_priority__ = 1000    # numpy defers `array + tensor` to our operators

    def __init__(self, value: Any, requires_grad: bool = False, dtype: Any = None) -> None:
        if _mode.tracer is not None and not requires_grad:
            # Made while a function is traced: a value of the graph, made again on
            # every call as eager code makes it (not a Tensor from outside, which
            # would keep what one call wrote into it for the next).
            self.data, self._block, self._alloc = None, None, None
            self.node = _mode.tracer.copy_of(value, dtype)
            self.requires_grad, self._grad = False, None
            self._op = self._inputs = self._attrs = None
            return
        array = np.asarray(value.numpy() if isinstance(value, Tensor) else value,
                           dtype=dtype)
        self.data, self._block, self._alloc = _new_array(array.shape, array.dtype)
        self.data[...] = array
        self.node = None
        self.requires_grad = requires_grad
        self._grad = None
        self._op = self._inputs = self._attrs = None

    def __del__(self) -> None:
        if self._block is not None:
            try:
                self._alloc.free(self._block)
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
        tracer = _mode.tracer
        key = None if tracer is None else tracer.grad_key(self)
        if key is not None:   # while tracing: the Tensor's .grad as the trace sees it
            return tracer.grad_of(key)
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        tracer = _mode.tracer
        key = None if tracer is None else tracer.grad_key(self)
        if key is not None:
            tracer.grad_writes[id(key)] = (key, value)
        else:
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
        self._need_value("item()")
        return self.data.item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self._need_value("np.asarray()")
        return self.data.astype(dtype) if dtype is not None else self.data.copy()

    def __bool__(self) -> bool:
        self._need_value("a Python truth test (if / while / and / or)")
        return bool(self.data)

    def __float__(self) -> float:
        self._need_value("float()")
        return float(self.data)

    def __int__(self) -> int:
        self._need_value("int()")
        return int(self.data)

    def __len__(self) -> int:
        return self.shape[0]

    def _need_value(self, what: str) -> None:
        if self.node is not None:
            line = user_source_line()
            message = (f"graph break at {line}: {what} needs the value of {self.node.name}, "
                       "which only exists when the traced graph runs; compute it with "
                       "tensor ops (tf.where instead of if), or call it outside the "
                       "traced function")
            if _mode.tracer is not None:
                _mode.tracer.breaks.append(message)
            raise GraphBreak(message)

    # -- autograd --------------------------------------------------------------------
    def backward(self, gradient: Tensor | Any = None, retain_graph: bool = False,
                 create_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires it.

        `gradient` seeds the walk (default ones: the gradient of the sum). The tape is
        freed afterwards unless `retain_graph` (or `create_graph`) is set; with
        `create_graph` the gradients are themselves differentiable.
        """
        if self.node is not None:
            _mode.tracer.backward(self, gradient)
            return
        backward(self, gradient, retain_graph or create_graph, create_graph)

    def detach(self) -> Tensor:
        """The same value with no history (a new Tensor sharing nothing)."""
        if _mode.tracer is None:
            self._need_value("detach()")
        return Tensor(self)    # (while tracing: see _Trace.copy_of)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        self.requires_grad = flag
        return self

    def zero_(self) -> Tensor:
        return self.assign_(np.zeros(self.shape, self.dtype))

    def assign_(self, value: Tensor | Any) -> Tensor:
        """Overwrite this Tensor's value in place (its memory stays where it is).

        Like PyTorch, an in-place write to a leaf that requires grad is allowed only
        under `no_grad()` (an optimizer step); it is never recorded on the tape.
        """
        if _mode.grad_enabled and self.requires_grad and self.is_leaf:
            raise EagerError(f"in-place write to a leaf Tensor that requires grad at "
                             f"{user_source_line()}; do it under eager.no_grad()")
        if _mode.tracer is not None:
            _mode.tracer.write(self, value)
            return self
        self.data[...] = value.data if isinstance(value, Tensor) else value
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
        if _mode.grad_enabled or _mode.tracer is not None or self.node is not None:
            return self.assign_(apply(op, (self, value), {}))
        inputs, arrays = _with_literals(op, (self, value))
        layout, _, ufunc, _ = _kernel(op, arrays, {})
        if ufunc is None or layout != (self.data.shape, self.data.dtype):
            return self.assign_(apply(op, (self, value), {}))
        recorder, began = _recording(_allocator) if debug.active else _NOT_RECORDING
        ufunc(arrays[0], arrays[1], out=self.data)
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
        recorder, began = _recording(_allocator) if debug.active else _NOT_RECORDING
        scratch = _scaled_update(self.data.reshape(-1), operands, scale, update, _allocator)
        if began is not None:
            recorder.eager_log.add_inplace(op, [self, value], self, began,
                                           time.perf_counter(), {"alpha": float(alpha)},
                                           scratch)
        return self

    # -- operators: the graph's builders, run at once through `apply` --------------
    # The arithmetic operators go straight to `apply` (their builders in ops.py are
    # nothing but `make`), which saves two Python calls on the hottest path.
    def __add__(self, other): return apply("add", (self, other), {})
    def __radd__(self, other): return apply("add", (other, self), {})
    def __sub__(self, other): return apply("sub", (self, other), {})
    def __rsub__(self, other): return apply("sub", (other, self), {})
    def __mul__(self, other): return apply("mul", (self, other), {})
    def __rmul__(self, other): return apply("mul", (other, self), {})
    def __truediv__(self, other): return apply("div", (self, other), {})
    def __rtruediv__(self, other): return apply("div", (other, self), {})
    def __pow__(self, other): return apply("pow", (self, other), {})
    def __rpow__(self, other): return apply("pow", (other, self), {})
    def __matmul__(self, other): return ops.matmul(self, other)
    def __rmatmul__(self, other): return ops.matmul(other, self)
    def __neg__(self): return apply("neg", (self,), {})
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
    alloc = _allocator
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
    return (value.__class__, value, like, math.copysign(1.0, value))


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
            # (_literal_key's sign: it tells only zeros apart, and copysign is a call)
            sign = 1.0 if number > 0 else math.copysign(1.0, number)
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
    shapes = [a.shape for a in arrays]
    try:
        shape, dtype = opdef.infer(shapes, [a.dtype for a in arrays], attrs)
    except Mismatch as why:
        raise shape_error(op, shapes, str(why), user_source_line()) from None
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
    tracer = _mode.tracer
    if tracer is not None:
        return tracer.apply(op, inputs, attrs, name)
    arrays = []
    for i in inputs:
        if not isinstance(i, Tensor):   # a literal among them: make it a Tensor
            inputs, arrays = _with_literals(op, inputs)
            break
        arrays.append(i.data)
    layout, nbytes, ufunc, opdef = _kernel(op, arrays, attrs)
    if opdef.random:  # its compute draws from `generators` (the registry says so)
        attrs = {**attrs, "generators": _generators}
    alloc = _allocator
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
            ufunc(arrays[0], arrays[1], out=out)
        elif len(arrays) == 1:  # (spelled out: a starred call costs 0.1 us more)
            ufunc(arrays[0], out=out)
        else:
            ufunc(*arrays, out=out)
    except TinyFlowError:
        alloc.free(block)
        raise
    except Exception as err:
        alloc.free(block)
        raise EagerError(f"{op} failed at {user_source_line()} on inputs of shapes "
                         f"{[a.shape for a in arrays]}: {err}") from err
    result_tensor = _new_object(Tensor)   # _wrap(out, block, alloc), spelled out
    result_tensor.data = out
    result_tensor._block = block
    result_tensor._alloc = alloc
    if began is not None:  # inside tf.debug.record: the op goes into the record
        recorder.eager_log.add(op, inputs, result_tensor, block, began, time.perf_counter(),
                               scratch)
    if _mode.grad_enabled and opdef.differentiable:
        _put_on_tape(result_tensor, op, inputs, attrs)
    return result_tensor


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
    if (_mode.grad_enabled or _mode.tracer is not None or target.node is not None
            or target.data.nbytes <= SCALED_SLICE_BYTES   # fits in L2 anyway: no gain
            or alpha.__class__ not in _NUMBER_TYPES or not isinstance(value, Tensor)
            or value.node is not None or not target.data.flags.c_contiguous
            or _errors_may_raise()):
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


def _errors_may_raise() -> bool:
    """Whether a floating-point error (overflow, invalid) could raise in a ufunc
    now: numpy set to "raise" or "call", or RuntimeWarnings turned into errors
    (python -W error). A slice-by-slice update that raised halfway would leave the
    Tensor half updated, so then the update is not sliced."""
    if any(mode in ("raise", "call") for mode in np.geterr().values()):
        return True
    return any(action == "error" and issubclass(RuntimeWarning, category)
               for action, _, category, _, _ in warnings.filters)


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
    if recorder.eager_log is None:
        recorder.eager_log = EagerLog(alloc)   # from now on the allocator keeps events
    return recorder, time.perf_counter()


def _put_on_tape(result: Tensor, op: str, inputs: Sequence[Tensor], attrs: dict) -> None:
    """When an input requires grad, `result` remembers (op, inputs, attrs) for backward."""
    for t in inputs:
        if t.requires_grad:
            result.requires_grad = True
            result._op, result._inputs, result._attrs = op, inputs, attrs
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


ops.set_eager_dispatch(apply, Tensor)


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


_rule_cache: dict[tuple, _RuleGraph] = {}
MAX_RULE_GRAPHS = 4096  # distinct (op, attrs, shapes) seen; plenty for one model


def _rule_graph(t: Tensor, needed: tuple[bool, ...]) -> _RuleGraph:
    inputs = t._inputs
    key = (t._op, tuple(sorted((k, v) for k, v in t._attrs.items() if k != "generators")),
           tuple((i.shape, i.dtype.str) for i in inputs), t.shape, t.dtype.str, needed)
    rule = _rule_cache.get(key)
    if rule is not None:
        return rule
    leaves = [Node("placeholder", (), {"shape": i.shape, "dtype": i.dtype.name},
                   shape=i.shape, dtype=i.dtype, where="<eager>") for i in inputs]
    output = Node(t._op, leaves, t._attrs, shape=t.shape, dtype=t.dtype, where="<eager>")
    grad = Node("placeholder", (), {"shape": t.shape, "dtype": t.dtype.name},
                shape=t.shape, dtype=t.dtype, where="<eager>")
    opdef = REGISTRY[t._op]
    if opdef.gradient is None:
        raise EagerError(f"op {t._op} has no gradient, but it lies between the Tensors "
                         "that require grad and the one `backward` started from")
    grads = list(opdef.gradient(output, grad))
    wanted = [g for g, need in zip(grads, needed) if need and g is not None]
    order = topological_order(wanted, leaves=frozenset(id(n) for n in [*leaves, output, grad]))
    rule = _RuleGraph([*leaves, output, grad], grads, order)
    if len(_rule_cache) < MAX_RULE_GRAPHS:
        _rule_cache[key] = rule
    return rule


def _input_grads(t: Tensor, grad: Tensor) -> list[Tensor | None]:
    """The gradients of `t`'s inputs, by evaluating its op's rule on Tensors."""
    needed = tuple(i.requires_grad for i in t._inputs)
    rule = _rule_graph(t, needed)
    values: dict[Node, Tensor] = dict(zip(rule.leaves, [*t._inputs, t, grad]))
    for node in rule.order:
        if node not in values:
            values[node] = apply(node.op, [values[i] for i in node.inputs], node.attrs)
    return [values[g] if need and g is not None else None
            for g, need in zip(rule.grads, needed)]


def backward(root: Tensor, gradient: Any = None, retain_graph: bool = False,
             create_graph: bool = False) -> None:
    """Reverse-mode over the tape from `root` (see `Tensor.backward`)."""
    if not root.requires_grad:
        raise EagerError("backward() on a Tensor that does not require grad (no input "
                         "of its ops had requires_grad=True, or it was made under no_grad)")
    if gradient is None:
        seed = Tensor(np.ones(root.shape, root.dtype))
    else:
        seed = gradient if isinstance(gradient, Tensor) else Tensor(gradient, dtype=root.dtype)
    order = _tape_order(root)
    pending: dict[int, list[Tensor]] = {id(root): [seed]}
    recording = contextlib.nullcontext() if create_graph else no_grad()
    _mode.in_backward = True
    try:
        _walk_tape(order, pending, recording, given={id(gradient)})
    finally:
        _mode.in_backward = False
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
    with recording:
        for t in reversed(order):
            contributions = pending.pop(id(t), None)
            if not contributions:
                continue
            total = contributions[0]
            for extra in contributions[1:]:
                total = total + extra
            if t.is_leaf:
                if t._grad is None:
                    t._grad = total * 1 if id(total) in given else total
                    given.add(id(t._grad))
                else:
                    t._grad = t._grad + total
                continue
            if t._inputs is None:
                raise EagerError("backward through a graph a second time: its saved "
                                 "values were freed by the first backward; pass "
                                 "retain_graph=True to the first call")
            for inp, g in zip(t._inputs, _input_grads(t, total)):
                if g is not None and inp.requires_grad:
                    pending.setdefault(id(inp), []).append(g)


# ----------------------------------------------------------------------------------
# Tracing: record a Python function of Tensors into a Graph, compile it, replay it
# ----------------------------------------------------------------------------------

@dataclass
class _Capture:
    """A value from outside the traced function, fed on every call."""

    placeholder: Node
    read: Callable[[tuple], np.ndarray]   # its value in a call with these arguments
    what: str


class _Trace:
    """What one trace collects while the function runs on symbolic Tensors."""

    def __init__(self) -> None:
        self.captures: dict[tuple, _Capture] = {}
        self.writes: dict[int, tuple[Tensor, Node]] = {}        # in-place writes
        self.grad_writes: dict[int, tuple[Tensor, Tensor | None]] = {}
        self.grad_guards: dict[int, tuple[Tensor, bool]] = {}   # (t, t.grad is None)
        self.leaves: dict[int, Tensor] = {}                     # requires_grad leaves seen
        self.breaks: list[str] = []
        # Aliases the trace must follow: a Tensor passed as an argument and also used
        # from outside is its argument's stand-in; a `.grad` read has one stand-in,
        # and a write into it goes into the Tensor that was that .grad when the call
        # started (see _write_target); a .grad reached under another name as well is
        # an error (_grad_alias_error).
        self.arguments: dict[int, Tensor] = {}      # id(argument) -> its stand-in
        self.outside: dict[int, Tensor] = {}        # Tensors used from outside
        self.unified: dict[int, Tensor] = {}        # arguments also used from outside
        self.grad_reads: dict[int, Tensor] = {}     # id(t) -> stand-in of t.grad
        self.grad_owner: dict[int, Tensor] = {}     # id(stand-in) -> t
        # An argument's stand-in keys its .grad; the .grad read, written and guarded
        # is args[index].grad at each call (the trace-time argument gives shapes).
        self.argument_index: dict[int, int] = {}    # id(argument stand-in) -> index
        self.real: dict[int, Tensor] = {}           # id(stand-in) -> trace-time argument
        # Nodes with no history in eager terms (made under no_grad, or written in
        # place), and the stop_gradient put in front of each (see input_of).
        self.no_history: dict[int, Node] = {}
        self.stopped: dict[int, Node] = {}

    # -- values of the trace -----------------------------------------------------------
    def node_of(self, value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value                     # a literal: `make` types it as usual
        if id(value) in self.writes:         # read after an in-place write
            return self.writes[id(value)][1]
        if value.node is not None:
            return value.node
        if id(value) in self.arguments:      # an argument, used from outside too
            self.unified[id(value)] = value
            return self.node_of(self.arguments[id(value)])
        if any(self._trace_time(owner)._grad is value for owner in self.grad_owner.values()):
            raise _grad_alias_error(value)
        if value.requires_grad and value.is_leaf:
            self.leaves[id(value)] = value
        self.outside[id(value)] = value
        return self._capture(("tensor", id(value)), value.shape, value.dtype,
                             lambda args, t=value: t.data, "a Tensor from outside")

    def copy_of(self, value: Any, dtype: Any) -> Node:
        """The node of `Tensor(value, dtype=dtype)` made inside the trace, which has
        no history: a constant, or the Tensor's value as the trace sees it behind a
        stop_gradient (cast to `dtype` when given)."""
        if isinstance(value, Tensor):
            node = ops.stop_gradient(self.node_of(value))
        else:
            node = ops.constant(np.asarray(value, dtype=dtype))
        if dtype is not None and node.dtype != np.dtype(dtype):
            node = ops.cast(node, np.dtype(dtype))
        return node

    def input_of(self, value: Any) -> Any:
        """`value` as an input of an op recorded with grad enabled. A value made
        under no_grad, or written in place into a Tensor that is not a leaf needing
        grad, has no history in eager mode, so here it stands behind a stop_gradient:
        a backward in the trace does not reach through it, as eager backward does not.
        (A leaf that needs grad is a gradient target whatever was written into it.)"""
        node = self.node_of(value)
        if (not isinstance(value, Tensor) or id(node) not in self.no_history
                or (value.requires_grad and value.is_leaf)):
            return node
        stopped = self.stopped.get(id(node))
        if stopped is None:
            stopped = self.stopped[id(node)] = ops.stop_gradient(node)
        return stopped

    def grads_read(self) -> list[Tensor | int]:
        """The Tensors (or argument indices) whose .grad the trace read."""
        return [self.resolve(t) for t in self.grad_owner.values()]

    def grad_key(self, t: Tensor) -> Tensor | None:
        """The Tensor that `t.grad` is keyed by in the trace: `t` (from outside), its
        argument's stand-in (an argument, also when reached from outside), or None
        for a value made inside the trace (its plain `_grad`)."""
        if t.node is None:
            if id(t) not in self.arguments:
                return t
            self.unified[id(t)] = t          # an argument, reached from outside
            t = self.arguments[id(t)]
        real = self.real.get(id(t))
        return t if isinstance(real, Tensor) else None

    def _trace_time(self, key: Tensor) -> Tensor:
        """The eager Tensor behind a grad key, as it is at trace time."""
        return self.real.get(id(key), key)

    def resolve(self, key: Tensor) -> Tensor | int:
        """A grad key as a run finds it: an argument's index, or the Tensor."""
        return self.argument_index.get(id(key), key)

    def grad_of(self, t: Tensor) -> Tensor | None:
        """`t.grad` as seen inside the trace (t is a grad key, see `grad_key`): the
        pending gradient, or the current `.grad` fed at each call (the guard
        remembers whether it was None)."""
        if id(t) in self.grad_writes:
            return self.grad_writes[id(t)][1]
        real, where = self._trace_time(t), self.resolve(t)
        if not isinstance(where, int):
            self.outside[id(t)] = t          # reached from outside through its .grad
        self.grad_guards.setdefault(id(t), (where, _grad_layout(real)))
        if real._grad is None:
            return None
        stand_in = self.grad_reads.get(id(t))
        if stand_in is None:
            if id(real._grad) in self.arguments or id(real._grad) in self.outside:
                raise _grad_alias_error(real._grad)
            read = ((lambda args, i=where: args[i]._grad.data) if isinstance(where, int)
                    else (lambda args, t=t: t._grad.data))
            node = self._capture(("grad", id(t)), real._grad.shape, real._grad.dtype, read,
                                 "the .grad of a Tensor")
            stand_in = self.grad_reads[id(t)] = _wrap(None, None, node=node)
            self.grad_owner[id(stand_in)] = t
        return stand_in

    def _capture(self, key: tuple, shape: tuple, dtype: Any, read: Callable,
                 what: str) -> Node:
        capture = self.captures.get(key)
        if capture is None:
            placeholder = api.placeholder(dtype, shape, name=f"captured_{len(self.captures)}")
            capture = self.captures[key] = _Capture(placeholder, read, what)
        return capture.placeholder

    # -- what Tensor methods do while tracing ------------------------------------------
    def apply(self, op: str, inputs: Sequence[Any], attrs: dict, name: str | None) -> Tensor:
        if _mode.grad_enabled:
            nodes = [self.input_of(i) for i in inputs]
        else:
            nodes = [self.node_of(i) for i in inputs]
        node = ops.make(op, *nodes, name=name, **attrs)
        if not _mode.grad_enabled:
            self.no_history[id(node)] = node
        out = _wrap(None, None, node=node)
        out.requires_grad = (_mode.grad_enabled and REGISTRY[op].differentiable and any(
            isinstance(i, Tensor) and i.requires_grad for i in inputs))
        return out

    def write(self, t: Tensor, value: Any) -> None:
        node = self.node_of(value) if isinstance(value, Tensor) else ops.constant(
            np.asarray(value, t.dtype))
        if node.dtype != t.dtype:
            node = ops.cast(node, t.dtype)
        if node.shape != t.shape:
            node = shape_ops.broadcast_to(node, t.shape)
        if t.node is None and id(t) in self.arguments:   # an argument: its stand-in
            self.unified[id(t)] = t
            t = self.arguments[id(t)]
        if t.node is None:
            self.outside[id(t)] = t
        self.writes[id(t)] = (t, node)
        self.no_history[id(node)] = node

    def backward(self, root: Tensor, gradient: Any) -> None:
        if not root.requires_grad:
            raise EagerError("backward() on a Tensor that does not require grad")
        for stand_in_id, real in self.real.items():
            if isinstance(real, Tensor) and real.requires_grad and not real.is_leaf:
                raise EagerError(
                    f"backward() at {user_source_line()} in a traced function given "
                    f"argument {self.argument_index[stand_in_id]}, a Tensor with a history "
                    "outside it: the trace cannot reach back through that history; pass "
                    "a leaf (x.detach().requires_grad_()) or call the function eagerly")
        targets = list(self.leaves.values())
        seeds = None if gradient is None else [self.node_of(gradient)]
        from tinyflow.autodiff import gradients
        grads = gradients(root.node, [self.node_of(t) for t in targets], seeds)
        for t, g in zip(targets, grads):
            if g is None:
                continue
            new = _wrap(None, None, node=g)
            previous = self.grad_of(t)
            self.grad_writes[id(t)] = (t, new if previous is None else previous + new)


@dataclass
class _Concrete:
    """One trace, compiled: the program and how to feed it and read it back."""

    program: Any
    arg_slots: list[tuple[int, Node]]          # (argument index, placeholder)
    captures: list[_Capture]
    outputs: Any                               # the result's structure, fetch indices
    grad_writes: list[tuple[Tensor | int, int | None]]   # (Tensor or argument, fetch)
    writes: list[tuple[Any, int]]     # (Tensor, argument index or ("grad", owner); fetch)
    grad_guards: list[tuple[Tensor | int, Any]]   # (Tensor or argument, its .grad's layout)
    nodes: int
    identities: list[tuple[int, Tensor, bool]]  # (argument, Tensor from outside, same?)
    grads_read: list[Tensor | int]              # Tensors (arguments) whose .grad it read
    outside: list[Tensor]                       # Tensors it used from outside

    def guards_hold(self, args: tuple) -> str | None:
        """None when this trace fits the world as it is now, else why not."""
        for where, layout in self.grad_guards:
            t = args[where] if isinstance(where, int) else where
            if _grad_layout(t) != layout:
                return f"the .grad of a {t.shape} Tensor was " \
                       f"{'None' if layout is None else layout} when traced"
        for index, t, same in self.identities:
            if (args[index] is t) != same:
                return (f"argument {index} is {'no longer' if same else 'now'} a Tensor "
                        "the function also uses from outside")
        if self.grads_read:   # no .grad it reads may be reachable under another name
            grads = {id((args[t] if isinstance(t, int) else t)._grad) for t in self.grads_read}
            if any(id(x) in grads for x in [*args, *self.outside]):
                return "a .grad the function reads is now also an argument or a Tensor " \
                       "it uses from outside"
        return None


class Function:
    """A Python function of Tensors, traced into a compiled graph per input signature.

    Calling it with Tensors (or arrays) whose shapes and dtypes were seen before runs
    the compiled program; new ones trace again (counted in `traces`, with the reason).
    `explain()` says what was traced and why. Options go to `tinyflow.compile`.
    """

    def __init__(self, fn: Callable, **compile_options: Any) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.compile_options = compile_options
        self.cache: dict[tuple, list[_Concrete]] = {}
        self.traces: list[dict] = []
        self.breaks: list[str] = []

    def __call__(self, *args: Any) -> Any:
        key = _call_signature(args)
        reason = "first call"
        for concrete in self.cache.get(key, []):
            reason = concrete.guards_hold(args)
            if reason is None:
                return self._run(concrete, args)
        if key not in self.cache and self.cache:
            reason = _why_new(key, list(self.cache))
        concrete = self._trace(args, key)
        self.traces.append({"signature": key, "reason": reason, "nodes": concrete.nodes})
        self.cache.setdefault(key, []).append(concrete)
        return self._run(concrete, args)

    def _trace(self, args: tuple, key: tuple) -> _Concrete:
        from tinyflow.executor import compile as compile_graph
        trace = _Trace()
        symbolic, arg_slots = [], []
        for index, arg in enumerate(args):
            if id(arg) in trace.arguments:     # the same Tensor again: one stand-in
                symbolic.append(trace.arguments[id(arg)])
            elif isinstance(arg, (Tensor, np.ndarray)):
                placeholder = api.placeholder(arg.dtype, arg.shape, name=f"arg{index}")
                value = _wrap(None, None, node=placeholder)
                value.requires_grad = bool(getattr(arg, "requires_grad", False))
                arg_slots.append((index, placeholder))
                symbolic.append(value)
                trace.arguments[id(arg)] = value
                trace.argument_index[id(value)] = index
                trace.real[id(value)] = arg
                if isinstance(arg, Tensor) and arg.requires_grad and arg.is_leaf:
                    trace.leaves[id(value)] = value   # backward in the trace reaches it
            else:
                symbolic.append(arg)
        before, _mode.tracer = _mode.tracer, trace
        try:
            result = self.fn(*symbolic)
        except GraphBreak as err:
            self.breaks.append(str(err))
            raise
        finally:
            _mode.tracer = before
        fetches: list[Node] = []
        outputs = _collect(result, fetches, trace.node_of)
        grad_writes = []
        for t, g in trace.grad_writes.values():
            grad_writes.append((trace.resolve(t), None if g is None else len(fetches)))
            if g is not None:
                fetches.append(trace.node_of(g))
        writes = []
        argument_of = {id(value): index for index, value in enumerate(symbolic)
                       if isinstance(value, Tensor)}
        for t, node in trace.writes.values():
            target = _write_target(t, argument_of, args, trace)
            if target is not None:
                writes.append((target, len(fetches)))
                fetches.append(node)
        feeds = {p: (p.shape, p.dtype) for _, p in arg_slots}
        feeds.update({c.placeholder: (c.placeholder.shape, c.placeholder.dtype)
                      for c in trace.captures.values()})
        program = compile_graph(fetches, feeds, **self.compile_options) if fetches else None
        nodes = 0 if program is None else len(program.graph.nodes)
        return _Concrete(program, arg_slots, list(trace.captures.values()), outputs,
                         grad_writes, writes, list(trace.grad_guards.values()), nodes,
                         _identities(args, trace), trace.grads_read(),
                         list(trace.outside.values()))

    def _run(self, concrete: _Concrete, args: tuple) -> Any:
        values: list = []
        if concrete.program is not None:
            feeds = {p: _as_array(args[i]) for i, p in concrete.arg_slots}
            feeds.update({c.placeholder: c.read(args) for c in concrete.captures})
            values = concrete.program.run(feeds, {})

        def tensor(where: Tensor | int) -> Tensor:   # an argument's index, or a Tensor
            return args[where] if isinstance(where, int) else where

        # In-place writes first: one into a .grad goes into the Tensor that was the
        # .grad when the call started, before the function's new .grads replace it.
        for target, slot in concrete.writes:
            t = tensor(target[1])._grad if isinstance(target, tuple) else tensor(target)
            t.data[...] = values[slot]
        for where, slot in concrete.grad_writes:
            tensor(where)._grad = None if slot is None else Tensor(values[slot])
        return _rebuild(concrete.outputs, values)

    def explain(self) -> str:
        """What was traced, how often and why; graph breaks with their lines."""
        lines = [f"{self.__name__}: {len(self.traces)} trace(s)"]
        for i, entry in enumerate(self.traces):
            shapes = ", ".join(str(s) for s in entry["signature"])
            lines.append(f"  trace {i}: {entry['reason']}; inputs ({shapes}); "
                         f"{entry['nodes']} nodes after the passes")
        for message in self.breaks:
            lines.append(f"  {message}")
        return "\n".join(lines)


def function(fn: Callable | None = None, **compile_options: Any) -> Any:
    """Decorator: trace `fn` into a graph and run it compiled (tf.function)."""
    if fn is None:
        return lambda f: Function(f, **compile_options)
    return Function(fn, **compile_options)


def _grad_layout(t: Tensor) -> tuple | None:
    """What the guard remembers of t.grad: None, or its shape and dtype."""
    return None if t._grad is None else (t._grad.shape, t._grad.dtype)


def _grad_alias_error(t: Tensor) -> EagerError:
    return EagerError(
        f"at {user_source_line()} a traced function reaches the .grad of a Tensor both "
        "as `.grad` and under another name (an argument, or a Tensor from outside): "
        "the trace cannot follow in-place writes through both; read it one way, or "
        "call the function eagerly")


def _call_signature(args: tuple) -> tuple:
    """The cache key of a call: each argument's signature, or, for a Tensor passed
    again, which argument it is the same as (writes through one name must show
    through the other, so such a call is traced on its own)."""
    first: dict[int, int] = {}
    key = []
    for index, arg in enumerate(args):
        if isinstance(arg, (Tensor, np.ndarray)):
            seen = first.setdefault(id(arg), index)
            if seen != index:
                key.append(("tensor", f"the same as argument {seen}"))
                continue
        key.append(_signature(arg))
    return tuple(key)


def _identities(args: tuple, trace: _Trace) -> list[tuple[int, Tensor, bool]]:
    """For each Tensor argument and each Tensor the function used from outside
    (read, written, or an argument it also reached from outside): whether they were
    the same Tensor when traced. The guard checks it again on every call."""
    used = list(trace.outside.values()) + list(trace.unified.values())
    return [(index, t, arg is t) for index, arg in enumerate(args)
            if isinstance(arg, Tensor) for t in used]


def _signature(arg: Any) -> tuple:
    if isinstance(arg, Tensor):
        return ("tensor", arg.shape, arg.dtype.str, arg.requires_grad, arg.is_leaf)
    if isinstance(arg, np.ndarray):
        return ("array", arg.shape, arg.dtype.str, False)
    try:
        hash(arg)
    except TypeError:
        raise EagerError(f"a traced function takes Tensors, arrays and hashable Python "
                         f"values; got {type(arg).__name__}") from None
    return ("python", type(arg).__name__, _exact(arg))


def _exact(value: Any) -> Any:
    """A Python value as the guard compares it: a float by its repr, which tells
    -0.0 from 0.0 (equal under ==, yet `x * -0.0` differs) and matches NaN to NaN
    of the same sign (NaN is unequal to itself, which would retrace on every call);
    tuples element-wise."""
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if value != value:   # NaN: its sign too (repr says "nan" for both)
            return "-nan" if math.copysign(1.0, value) < 0 else "nan"
        return repr(value)
    if isinstance(value, tuple):
        return tuple(_exact(v) for v in value)
    return value


def _why_new(key: tuple, seen: list[tuple]) -> str:
    """Name the first argument that differs from the closest signature seen."""
    closest = seen[-1]
    if len(key) != len(closest):
        return f"called with {len(key)} arguments, traced with {len(closest)}"
    for index, (now, then) in enumerate(zip(key, closest)):
        if now != then:
            return f"argument {index} is {now[1:]}; traced for {then[1:]}"
    return "new signature"


def _as_array(value: Any) -> np.ndarray:
    return value.data if isinstance(value, Tensor) else np.asarray(value)


def _write_target(t: Tensor, argument_of: dict[int, int], args: tuple,
                  trace: _Trace) -> Any:
    """Where a traced in-place write to `t` goes after each run: into `t` itself (a
    Tensor from outside), into the argument it stands for (its index: the caller's
    Tensor, as torch.compile writes back into mutated inputs), into the `.grad`
    that `t` was read as (("grad", owner): the Tensor that is owner.grad when the
    call starts, even if the function then replaced owner.grad), or nowhere (a
    value made inside the function: later reads in the trace already see it)."""
    if t.node is None:
        return t
    if id(t) in trace.grad_owner:
        return ("grad", trace.resolve(trace.grad_owner[id(t)]))
    index = argument_of.get(id(t))
    if index is None:
        return None
    if not isinstance(args[index], Tensor):
        raise EagerError(f"the traced function writes in place into argument {index}, "
                         "a numpy array; pass an eager Tensor (eager.tensor) to have "
                         "it updated")
    return index


def _collect(result: Any, fetches: list[Node], node_of: Callable[[Tensor], Node]) -> Any:
    """The result's structure, symbolic Tensors replaced by their fetch index (the
    node `node_of` gives: the latest in-place write, if any)."""
    if isinstance(result, Tensor):
        if result.node is None:
            return ("value", result)
        fetches.append(node_of(result))
        return ("fetch", len(fetches) - 1)
    if isinstance(result, (list, tuple)):
        return (type(result).__name__, [_collect(r, fetches, node_of) for r in result])
    if isinstance(result, dict):
        return ("dict", {k: _collect(v, fetches, node_of) for k, v in result.items()})
    return ("value", result)


def _rebuild(structure: Any, values: list) -> Any:
    kind, inner = structure
    if kind == "fetch":
        return Tensor(values[inner])
    if kind == "value":
        return inner
    if kind == "dict":
        return {k: _rebuild(v, values) for k, v in inner.items()}
    items = [_rebuild(v, values) for v in inner]
    return tuple(items) if kind == "tuple" else items


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
    from tinyflow.executor import Session
    initializers = {a.inputs[0]: a.inputs[1] for a in api._pending_initializers}
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
    from tinyflow.executor import Session
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
        self.lr = lr

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
        self.momentum = momentum
        self.velocity = [Tensor(np.zeros(p.shape, p.dtype)) for p in self.params] \
            if momentum else []

    def _update(self, index: int, p: Tensor, grad: Tensor) -> None:
        if self.momentum:
            # (in place, one pass per op: the same bits as assigning the sum)
            grad = self.velocity[index].mul_(self.momentum).add_(grad)
        p.sub_(grad, alpha=self.lr)   # p -= lr * g, bit for bit


class Adam(Optimizer):
    """Adam (Kingma & Ba) in the form `tf.train.AdamOptimizer` uses: bias correction
    folded into the step size. The step count is a Tensor, not a Python int, so a
    traced step counts on each call instead of baking in the count it saw."""

    def __init__(self, params: Sequence[Tensor], lr: float = 1e-3, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8) -> None:
        super().__init__(params, lr)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        dtype = self.params[0].dtype if self.params else np.float32
        self.t = Tensor(np.zeros((), dtype))
        self.m = [Tensor(np.zeros(p.shape, p.dtype)) for p in self.params]
        self.v = [Tensor(np.zeros(p.shape, p.dtype)) for p in self.params]

    def step(self) -> None:
        with _optimizer_step():
            t = self.t.assign_(self.t + 1.0)
            self._step_size = self.lr * ops.sqrt(1.0 - ops.power(self.beta2, t)) / (
                1.0 - ops.power(self.beta1, t))
        super().step()

    def _update(self, index: int, p: Tensor, grad: Tensor) -> None:
        # m = beta1 * m + (1 - beta1) * g, in place (one pass per op, the same bits)
        m = self.m[index].mul_(self.beta1).add_(grad, alpha=1.0 - self.beta1)
        v = self.v[index].mul_(self.beta2).add_((1.0 - self.beta2) * grad * grad)
        p.sub_(self._step_size * m / (ops.sqrt(v) + self.eps))


# ----------------------------------------------------------------------------------
# Three ways to give the same ops memory, side by side
# ----------------------------------------------------------------------------------

def memory_comparison(step: Callable[..., Any], *args: Any) -> dict:
    """Run `step(*args)` once eagerly through a fresh caching allocator and once
    traced, and compare the memory each way needs for the same op sequence:

    static   the traced program's arena (memory.py's plan) and its lower bound
    caching  the allocator's peak reserved (segments) and peak allocated (blocks)
    malloc   plain malloc/free of exactly what each Tensor asks: its peak is the
             most bytes alive at once during the eager run

    `events` is the allocator's log, with `allocated` and `reserved` after every
    event, for a plot; `fragmentation` is 1 - allocated/reserved when the most
    bytes were allocated.
    Parameters and inputs made before the call are not counted by any of the three.
    """
    fresh = CachingAllocator(record=True)
    old = set_allocator(fresh)
    try:
        step(*args)
        live_requested, peak_requested = 0, 0
        requested = {}
        for event in fresh.events:
            if event["event"] == "alloc":
                requested[event["block"]] = event["requested"]
                live_requested += event["requested"]
                peak_requested = max(peak_requested, live_requested)
            elif event["event"] == "free" and event["block"] in requested:
                live_requested -= requested.pop(event["block"])
    finally:
        set_allocator(old)
    traced = Function(step)
    traced(*args)
    plan = traced.cache[next(iter(traced.cache))][0].program.memory_plan
    at_peak = max(fresh.events, key=lambda e: e["allocated"], default=None)
    return {"static_arena": plan.arena_bytes if plan else 0,
            "static_lower_bound": plan.lower_bound_bytes if plan else 0,
            "caching_reserved": fresh.peak_reserved,
            "caching_allocated": fresh.peak_allocated,
            "malloc_peak": peak_requested,
            "fragmentation": 0.0 if at_peak is None or not at_peak["reserved"]
            else 1.0 - at_peak["allocated"] / at_peak["reserved"],
            "events": fresh.events}


# ----------------------------------------------------------------------------------
# Recording an eager run for the debugger
# ----------------------------------------------------------------------------------

class EagerLog:
    """What `tf.debug.record` keeps of eager ops: each op as a node of a graph (the
    tape, drawn), its time on the timeline, and its output's block in the caching
    allocator as the memory view's "plan" (segments laid end to end, each block's
    reason taken from the allocator: a block waiting in the fast bin of its size, the
    best-fitting free block, or a new segment).
    """

    MAX_OPS = 20_000   # a record is for reading; a longer run keeps its first ops

    def __init__(self, alloc: CachingAllocator) -> None:
        self.alloc = alloc
        self.was_recording, alloc.record = alloc.record, True
        self.first_event = len(alloc.events)
        self.nodes: list[dict] = []
        self.events: list[dict] = []
        self.tensors: list[dict] = []
        self.names: dict[int, str] = {}              # id(Tensor) -> node name
        self.by_block: dict[int, dict] = {}          # live block id -> tensor entry
        self.seen_events = self.first_event
        self.start = None

    def name_of(self, t: Tensor) -> str:
        name = self.names.get(id(t))
        if name is None:  # made before recording began (a parameter, an input)
            name = self.names[id(t)] = f"input_{len(self.names)}"
            self.nodes.append({"id": name, "op": "placeholder", "inputs": [],
                               "shape": list(t.shape), "dtype": t.dtype.name,
                               "bytes": t.data.nbytes, "where": "<before recording>",
                               "attrs": {}, "provenance": [name], "phase": "forward"})
        return name

    def add(self, op: str, inputs: Sequence[Tensor], out: Tensor, block: Block,
            began: float, ended: float, scratch: tuple[Block, int] | None = None) -> None:
        """An op whose result `out` went into a new `block` of the allocator, and whose
        kernel had `scratch` = (block, bytes) during its step (`_run_with_scratch`)."""
        step = self._add_op(op, inputs, out, began, ended, {})
        if step is None:
            return
        name = self.names[id(out)] = f"{op}_{step}"
        entry = {"node": name, "block": block, "nbytes": block.size, "kind": "intermediate",
                 "first_step": step, "last_step": None, "reason": self._reason(block)}
        self.tensors.append(entry)
        self.by_block[block.id] = entry
        if scratch is not None:
            self._add_scratch(name, step, scratch)

    def _add_scratch(self, name: str, step: int, scratch: tuple[Block, int]) -> None:
        # (already given back: alive at this step only)
        block, nbytes = scratch
        self.tensors.append({"node": name, "block": block, "nbytes": nbytes,
                             "kind": "scratch", "first_step": step, "last_step": step,
                             "reason": self._reason(block)})

    def add_inplace(self, op: str, inputs: Sequence[Tensor], target: Tensor,
                    began: float, ended: float, attrs: dict | None = None,
                    scratch: tuple[Block, int] | None = None) -> None:
        """An update written into `target`'s own block (`Tensor.sub_` and the like):
        a node and a timeline event but no new block (beside the `scratch` it may
        have used during its step). `target` keeps its name: a parameter updated
        in place is still the input the next step's forward reads (the debugger's
        overview tells forward from optimizer by that)."""
        step = self._add_op(op, inputs, target, began, ended,
                            {"in_place": True, **(attrs or {})})
        if step is not None and scratch is not None:
            self._add_scratch(f"{op}_{step}", step, scratch)

    def _add_op(self, op: str, inputs: Sequence[Tensor], out: Tensor, began: float,
                ended: float, attrs: dict) -> int | None:
        """The op as a node named `<op>_<step>` and a timeline event; its step, or
        None once the record is full."""
        if len(self.events) >= self.MAX_OPS:
            return None
        if self.start is None:
            self.start = began
        step = len(self.events)
        self._note_frees(step)
        name = f"{op}_{step}"
        phase = "backward" if _mode.in_backward else "forward"
        # (the record's phases are forward/backward; the overview finds an eager
        # tape's optimizer ops by this attribute, or by their reading a gradient)
        if _mode.in_optimizer:
            attrs = {**attrs, "optimizer_step": True}
        self.nodes.append({"id": name, "op": op, "inputs": [self.name_of(t) for t in inputs],
                           "shape": list(out.shape), "dtype": out.dtype.name,
                           "bytes": out.data.nbytes, "where": user_source_line(),
                           "attrs": attrs, "provenance": [name], "phase": phase})
        self.events.append({"step": step, "node": name, "op": op, "stream": 0,
                            "start": began - self.start, "end": ended - self.start,
                            "bytes": int(out.data.nbytes), "summary": None})
        return step

    def _reason(self, block: Block) -> str:
        # The op's mallocs are among the allocator's last events: its output's, then
        # (for a kernel with scratch) the scratch block's alloc and free, each alloc
        # perhaps after a new segment's event.
        for event in reversed(self.alloc.events[-5:]):
            if event["event"] == "alloc" and event["block"] == block.id:
                return event["reason"]
        return ""

    def _note_frees(self, step: int) -> None:
        events = self.alloc.events
        for event in events[self.seen_events:]:
            if event["event"] == "free" and event["block"] in self.by_block:
                self.by_block.pop(event["block"])["last_step"] = max(step - 1, 0)
        self.seen_events = len(events)

    def to_record(self, title: str, command: str) -> dict:
        from tinyflow import trace
        self.alloc.record = self.was_recording
        last = max(len(self.events) - 1, 0)
        self._note_frees(last + 1)
        bases, base = {}, 0
        for seg in self.alloc.segments:
            bases[seg.id] = base
            base += seg.buffer.size
        record = trace.empty_record(title, command=command)
        record["graphs"] = [{"pass": "eager", "index": 0, "seconds": 0.0, "changed": False,
                             "nodes": self.nodes,
                             "outputs": [self.nodes[-1]["id"]] if self.nodes else []}]
        record["schedule"] = [{"step": e["step"], "node": e["node"], "op": e["op"],
                               "stream": 0, "waits": [], "records_event": None}
                              for e in self.events]
        tensors = [{"node": t["node"], "offset": bases[t["block"].segment] + t["block"].offset,
                    "nbytes": t["nbytes"], "first_step": t["first_step"],
                    "last_step": last if t["last_step"] is None else t["last_step"],
                    "inplace_of": None, "kind": t["kind"], "reason": t["reason"]}
                   for t in self.tensors]
        record["memory_plan"] = {
            "strategy": "caching allocator", "arena_bytes": self.alloc.peak_reserved,
            "naive_bytes": sum(t["nbytes"] for t in tensors),
            "lower_bound_bytes": self.alloc.peak_allocated, "alignment": ROUND,
            "strategies": {"caching allocator (reserved)": self.alloc.peak_reserved,
                           "allocated peak": self.alloc.peak_allocated},
            "tensors": tensors}
        record["timelines"] = [{"run": 0, "label": "eager run", "events": self.events}]
        return record
