"""ONNX in: an ONNX model as TinyFlow nodes (`load`), and what both directions share.

`load` reads a model with the `onnx` package and translates it node by node, one
small function per ONNX operator gathered in one table (`IMPORTERS`), as tinygrad's
ONNX frontend does; the result is an ordinary TinyFlow graph that the passes, the
memory planner, the executor, autodiff and the debugger handle like any other.
The errors, the opset bounds, `_onnx` and the elementwise table both directions use
live here too: `onnx_export` imports them from this module, never the reverse.

On the way in, every floating-point initializer becomes a Variable (so an imported
model can be fine-tuned), the rest constants; a node's `where` is "MODEL.onnx:node
name" (or its doc_string, when that is the file:line an export wrote).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyflow import api, image_ops, nn_ops, ops, shape_ops
from tinyflow.graph import Node, TinyFlowError, next_node_id

DEFAULT_OPSET = 20      # Gelu (with its tanh form) is an ONNX operator from opset 20
MIN_OPSET = 17          # LayerNormalization arrived in opset 17
_INT_MAX = np.iinfo(np.int64).max


class OnnxError(TinyFlowError, ValueError):
    """A model that cannot be translated: names the ONNX node (or TinyFlow node) and why."""


class UnsupportedOpError(OnnxError):
    """Operators without a translation; lists every one in the model, with node names."""


def _onnx():
    try:
        import onnx
    except ImportError:
        raise OnnxError("ONNX support needs the onnx package: pip install 'tinyflow[onnx]'"
                        ) from None
    return onnx


def check_opset(opset: int) -> None:
    """Refuse an opset this exporter cannot write (OnnxError, a ValueError).

    The floor is ours (LayerNormalization arrived in opset 17); the ceiling is the
    newest opset the installed onnx package knows: a model claiming a later one
    would be written, then refused by every reader.
    """
    newest = _onnx().defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, (int, np.integer)) or not (
            MIN_OPSET <= opset <= newest):
        raise OnnxError(f"opset {opset!r} is out of range: TinyFlow exports opsets "
                        f"{MIN_OPSET} (LayerNormalization) to {newest} (the newest the "
                        f"installed onnx {_onnx().__version__} knows)")


def _unsupported(kind: str, found: dict[str, list[str]], known: Sequence[str]) -> OnnxError:
    lines = [f"  {op}: {', '.join(names[:8])}" + (f" (+{len(names) - 8} more)"
                                                   if len(names) > 8 else "")
             for op, names in sorted(found.items())]
    return UnsupportedOpError(
        f"{len(found)} {kind} operator type(s) have no translation:\n" + "\n".join(lines)
        + f"\nsupported: {', '.join(sorted(known))}")


# Elementwise operators with the same meaning on both sides: the shared part of the
# two tables. ONNX's Max and Min take any number of inputs; they are folded pairwise.
ELEMENTWISE = {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow",
    "Max": "maximum", "Min": "minimum", "Less": "less", "LessOrEqual": "less_equal",
    "Greater": "greater", "GreaterOrEqual": "greater_equal", "Equal": "equal",
    "Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Tanh": "tanh",
    "Sigmoid": "sigmoid", "Relu": "relu", "Abs": "abs", "Sign": "sign", "Erf": "erf",
    "Where": "where",
}

# ==================================================================================
# Import: ONNX -> TinyFlow nodes
# ==================================================================================


@dataclass
class OnnxModel:
    """An imported model: TinyFlow nodes and the weights' values.

    inputs      {ONNX input name: placeholder}, in the model's order
    outputs     {ONNX output name: node}, in the model's order
    variables   {initializer name: Variable} (floating-point initializers)
    values      {Variable: its initial value}
    initializer one node that assigns every Variable its value (run it once)
    """

    inputs: dict[str, Node]
    outputs: dict[str, Node]
    variables: dict[str, Node]
    values: dict[Node, np.ndarray]
    initializer: Node
    opset: int = DEFAULT_OPSET
    source: str = ""

    @property
    def input(self) -> Node:
        """The only input (an error when there are several)."""
        return _only(self.inputs, "inputs")

    @property
    def output(self) -> Node:
        """The only output (an error when there are several)."""
        return _only(self.outputs, "outputs")

    def session(self, **options: Any) -> Any:
        """A tf.Session (with `options`) whose Variables hold the model's weights."""
        from tinyflow.session import Session
        sess = Session(**options)
        sess.run(self.initializer)
        return sess


def _only(nodes: dict[str, Node], what: str) -> Node:
    if len(nodes) != 1:
        raise OnnxError(f"the model has {len(nodes)} {what} ({', '.join(nodes)}); "
                        f"pick one by name from model.{what}")
    return next(iter(nodes.values()))


class _Importer:
    """The state of one import: ONNX tensor name -> Node, and the static values."""

    def __init__(self, model: Any, source: str, initializers: str) -> None:
        self.graph = model.graph
        self.source = source
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                          DEFAULT_OPSET)
        self.as_variables = initializers == "variables"
        self.env: dict[str, Node] = {}
        self.static: dict[str, np.ndarray] = {
            t.name: _initializer_value(t, source) for t in self.graph.initializer}
        self.variables: dict[str, Node] = {}
        self.values: dict[Node, np.ndarray] = {}
        self.assigns: list[Node] = []
        self.node: Any = None    # the ONNX node being translated, for error messages

    def fail(self, why: str) -> OnnxError:
        node = self.node
        return OnnxError(f"{self.source}: {node.op_type} node {node.name or node.output[0]!r}: "
                         f"{why}")

    def tensor(self, name: str) -> Node:
        """The node holding tensor `name`; initializers become Variables on first use."""
        if name in self.env:
            return self.env[name]
        if name not in self.static:
            raise self.fail(f"input {name!r} is not produced by any node, input or initializer")
        value = self.static[name]
        if self.as_variables and value.dtype.kind == "f":
            node = api.Variable(value, name=name, dtype=value.dtype)
            self.assigns.append(api._initializers[-1])  # the one Variable() made
            self.variables[name] = node
            self.values[node] = value
        else:
            node = ops.constant(value, value.dtype, name=name)
        node.where = f"{os.path.basename(self.source)}:{name}"
        self.env[name] = node
        return node

    def input(self, index: int) -> Node | None:
        """Input `index` of the current node as a Node (None when absent or empty)."""
        names = self.node.input
        if index >= len(names) or not names[index]:
            return None
        return self.tensor(names[index])

    def constant(self, index: int, what: str) -> np.ndarray | None:
        """Input `index` as a numpy value known now (shapes, axes): an initializer or
        a Constant node's output. None when the input is absent."""
        names = self.node.input
        if index >= len(names) or not names[index]:
            return None
        if names[index] not in self.static:
            raise self.fail(f"input {index} ({what}) must be a constant (an initializer or "
                            "a Constant node); computed shapes are not supported")
        return self.static[names[index]]


def _initializer_value(tensor: Any, source: str) -> np.ndarray:
    """An initializer's array; one whose data does not fit its dims (or that lives in
    an external file not found) is an OnnxError naming it."""
    try:
        return _onnx().numpy_helper.to_array(tensor)
    except Exception as err:  # numpy's reshape error, onnx's ValidationError, OSError
        raise OnnxError(f"{source}: initializer {tensor.name!r} of dims {list(tensor.dims)} "
                        f"cannot be read: {err}") from None


def _axis(im: _Importer, axis: int, rank: int, what: str = "axis") -> int:
    """An ONNX axis in [-rank, rank) as a dimension; anything else is an error (ONNX
    Runtime refuses it too), not taken modulo the rank."""
    if not -rank <= axis < rank:
        raise im.fail(f"{what} {axis} is out of range for an input of rank {rank}")
    return axis % rank


def _attrs(node: Any) -> dict[str, Any]:
    onnx = _onnx()
    values = {}
    for attribute in node.attribute:
        value = onnx.helper.get_attribute_value(attribute)
        values[attribute.name] = value.decode() if isinstance(value, bytes) else value
    return values


def _axes(im: _Importer, attrs: dict, index: int = 1) -> tuple[int, ...] | None:
    """Axes given as an attribute (older opsets) or as input `index` (newer ones)."""
    if "axes" in attrs:
        return tuple(int(a) for a in attrs["axes"])
    value = im.constant(index, "axes")
    return None if value is None else tuple(int(a) for a in value.reshape(-1))


def _rank(im: _Importer, x: Node) -> int:
    if x.shape is None:
        raise im.fail("the input's rank must be known (give the model's inputs shapes)")
    return len(x.shape)


# -- One function per ONNX operator: (importer, attributes) -> output node(s) --------

def _elementwise(op: str) -> Callable:
    def translate(im: _Importer, attrs: dict) -> Node:
        inputs = [im.input(i) for i in range(len(im.node.input))]
        if op in ("maximum", "minimum") and len(inputs) != 2:
            result = inputs[0]     # Max and Min of one input (or more than two)
            for x in inputs[1:]:
                result = ops.make(op, result, x)
            return result
        return ops.make(op, *inputs)
    return translate


def _div(im: _Importer, attrs: dict) -> Node:
    # ONNX's Div of integers truncates; TinyFlow's div is numpy's true division (a
    # float). Refused rather than answered with fractions.
    a, b = im.input(0), im.input(1)
    if a.dtype is not None and np.dtype(a.dtype).kind in "iub":
        raise im.fail(f"Div of {np.dtype(a.dtype)} (integer division, truncating) is not "
                      "supported; Cast the inputs to a float type first")
    return ops.div(a, b)


def _pow(im: _Importer, attrs: dict) -> Node:
    # ONNX's Pow has the base's type (float32 ** int64 is float32); numpy promotes.
    base = im.input(0)
    return _as_dtype(ops.power(base, im.input(1)), base.dtype)


def _as_dtype(node: Node, dtype: Any) -> Node:
    """`node` cast to `dtype` when numpy's promotion gave it another (ONNX keeps the
    input's type where numpy widens: Pow, ReduceSum and ReduceMean of ints)."""
    if dtype is None or node.dtype is None or np.dtype(node.dtype) == np.dtype(dtype):
        return node
    return ops.cast(node, dtype)


def _gemm(im: _Importer, attrs: dict) -> Node:
    y = ops.matmul(im.input(0), im.input(1), bool(attrs.get("transA", 0)),
                   bool(attrs.get("transB", 0)))
    if attrs.get("alpha", 1.0) != 1.0:
        y = y * np.float32(attrs["alpha"])
    c = im.input(2)
    if c is not None:
        y = y + (c if attrs.get("beta", 1.0) == 1.0 else c * np.float32(attrs["beta"]))
    return y


def _matmul(im: _Importer, attrs: dict) -> Node:
    a, b = im.input(0), im.input(1)
    if a.ndim == 1 or b.ndim == 1:
        raise im.fail("MatMul of a vector is not supported (reshape it to a matrix)")
    return ops.matmul(a, b)


def _gelu(im: _Importer, attrs: dict) -> Node:
    x = im.input(0)
    if attrs.get("approximate", "none") == "tanh":
        return ops.gelu(x)
    # The exact form, 0.5 x (1 + erf(x / sqrt(2))), as ONNX defines it.
    return 0.5 * x * (1.0 + ops.erf(x * np.float32(1.0 / np.sqrt(2.0))))


def _softmax(op: str) -> Callable:
    def translate(im: _Importer, attrs: dict) -> Node:
        x = im.input(0)
        rank = _rank(im, x)
        axis = _axis(im, int(attrs.get("axis", -1 if im.opset >= 13 else 1)), rank)
        if axis == rank - 1:
            return ops.make(op, x)
        if im.opset < 13:  # old opsets: softmax of x flattened to 2-D at `axis`
            if None in x.shape[axis:]:
                raise im.fail(f"Softmax at axis {axis} (opset {im.opset}) needs the dims "
                              "from that axis on known")
            flat = shape_ops.reshape(x, (-1, int(np.prod(x.shape[axis:]))))
            return shape_ops.reshape_like(ops.make(op, flat), x)
        perm = [i for i in range(rank) if i != axis] + [axis]
        inverse = tuple(int(i) for i in np.argsort(perm))
        return shape_ops.transpose(ops.make(op, shape_ops.transpose(x, tuple(perm))), inverse)
    return translate


def _padding(im: _Importer, attrs: dict, kernel: Sequence[int]) -> int | str:
    """ONNX padding attributes -> TinyFlow's padding (an int for both sides, or "SAME")."""
    auto = attrs.get("auto_pad", "NOTSET")
    if auto == "SAME_UPPER":
        return "SAME"      # TF's SAME: the odd pixel goes after, as SAME_UPPER does
    if auto == "VALID":
        return 0
    if auto not in ("NOTSET", ""):
        raise im.fail(f"auto_pad={auto} is not supported (SAME_UPPER, VALID or pads)")
    pads = list(attrs.get("pads", [0] * 2 * len(kernel)))
    if len(set(pads)) > 1:
        raise im.fail(f"pads {pads} are not the same on every side; TinyFlow pads "
                      "symmetrically")
    return int(pads[0]) if pads else 0


def _check_2d(im: _Importer, attrs: dict, kernel: Sequence[int]) -> None:
    if len(kernel) != 2:
        raise im.fail(f"only 2-D windows are supported, got kernel {list(kernel)}")
    if any(d != 1 for d in attrs.get("dilations", [1, 1])):
        raise im.fail(f"dilations {list(attrs['dilations'])} are not supported")


def _conv(im: _Importer, attrs: dict) -> Node:
    x, w, b = im.input(0), im.input(1), im.input(2)
    kernel = attrs.get("kernel_shape", w.shape[2:] if w.shape else (0, 0))
    _check_2d(im, attrs, kernel)
    if attrs.get("group", 1) != 1:
        raise im.fail(f"group={attrs['group']} (grouped convolution) is not supported")
    stride = tuple(int(s) for s in attrs.get("strides", (1, 1)))
    y = image_ops.conv2d(x, w, stride, _padding(im, attrs, kernel))
    return y if b is None else ops.make("bias_add", y, b)


def _pool(op: str) -> Callable:
    def translate(im: _Importer, attrs: dict) -> Node:
        kernel = tuple(int(k) for k in attrs["kernel_shape"])
        _check_2d(im, attrs, kernel)
        if attrs.get("ceil_mode", 0):
            raise im.fail("ceil_mode=1 is not supported")
        if len(im.node.output) > 1 and im.node.output[1]:
            raise im.fail("the Indices output of MaxPool is not supported")
        padding = _padding(im, attrs, kernel)
        if op == "avg_pool2d" and padding != 0 and not attrs.get("count_include_pad", 0):
            raise im.fail("padded AveragePool must count the padding "
                          "(count_include_pad=1), as TinyFlow's avg_pool2d does")
        stride = tuple(int(s) for s in attrs.get("strides", (1, 1)))
        return image_ops._pool(op, im.input(0), kernel, stride, padding)
    return translate


def _global_avg_pool(im: _Importer, attrs: dict) -> Node:
    x = im.input(0)
    return ops.reduce_mean(x, tuple(range(2, _rank(im, x))), keepdims=True)


def _channel(v: Node, rank: int) -> Node:
    """A (C,) vector shaped (C, 1, ..., 1) to broadcast along axis 1 of a rank-`rank` x."""
    return shape_ops.reshape(v, (-1,) + (1,) * (rank - 2))


def _batch_norm(im: _Importer, attrs: dict) -> Node:
    # Inference form, from elementwise ops so that it differentiates like any graph:
    # y = (x - mean) / sqrt(var + eps) * scale + bias, per channel (axis 1).
    if attrs.get("training_mode", 0) or any(name for name in im.node.output[1:]):
        raise im.fail("training mode (and the running-statistics outputs) is not supported")
    x, scale, bias, mean, var = (im.input(i) for i in range(5))
    rank = _rank(im, x)
    eps = np.asarray(attrs.get("epsilon", 1e-5), dtype=var.dtype)
    rstd = 1.0 / ops.sqrt(var + eps)
    return (x - _channel(mean, rank)) * _channel(rstd * scale, rank) + _channel(bias, rank)


def _layer_norm(im: _Importer, attrs: dict) -> Node:
    if any(name for name in im.node.output[1:]):
        raise im.fail("the Mean and InvStdDev outputs are not supported")
    x, gamma, beta = im.input(0), im.input(1), im.input(2)
    rank = _rank(im, x)
    if attrs.get("axis", -1) % rank != rank - 1 or gamma.ndim != 1:
        raise im.fail("only normalisation over the last axis is supported")
    if beta is None:
        beta = ops.zeros_like(gamma)
    return nn_ops.layer_norm(x, gamma, beta, float(attrs.get("epsilon", 1e-5)))


def _reshape(im: _Importer, attrs: dict) -> Node:
    shape = tuple(int(d) for d in im.constant(1, "shape"))
    if attrs.get("allowzero", 0) and 0 in shape:
        raise im.fail("allowzero=1 with a 0 in the shape is not supported")
    return shape_ops.reshape(im.input(0), shape)


def _flatten(im: _Importer, attrs: dict) -> Node:
    x = im.input(0)
    rank = _rank(im, x)
    axis = int(attrs.get("axis", 1))
    if not -rank <= axis <= rank:   # (axis == rank is allowed: a (size, 1) result)
        raise im.fail(f"axis {axis} is out of range for an input of rank {rank}")
    axis = axis + rank if axis < 0 else axis
    if axis == 0:
        return shape_ops.reshape(x, (1, -1))
    lead = x.shape[:axis]
    if axis == 1:
        return shape_ops.reshape(x, (0, -1))
    if None in lead:
        raise im.fail(f"Flatten at axis {axis} needs the leading dims known, got {lead}")
    return shape_ops.reshape(x, (int(np.prod(lead)), -1))


def _transpose(im: _Importer, attrs: dict) -> Node:
    perm = attrs.get("perm")
    return shape_ops.transpose(im.input(0), None if perm is None else tuple(int(p) for p in perm))


def _concat(im: _Importer, attrs: dict) -> Node:
    return shape_ops.concat([im.input(i) for i in range(len(im.node.input))], int(attrs["axis"]))


def _slice(im: _Importer, attrs: dict) -> Node:
    x = im.input(0)
    rank = _rank(im, x)
    if im.opset < 10:   # opsets 1-9: starts, ends and axes are attributes; no steps
        starts, ends, axes = attrs.get("starts"), attrs.get("ends"), attrs.get("axes")
        steps = None
        if starts is None or ends is None:
            raise im.fail("Slice needs the starts and ends attributes (opset < 10)")
    else:
        starts, ends = im.constant(1, "starts"), im.constant(2, "ends")
        axes = im.constant(3, "axes")
        steps = im.constant(4, "steps")
    axes = range(len(starts)) if axes is None else [_axis(im, int(a), rank) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * rank
    for axis, start, end, step in zip(axes, starts, ends, steps):
        # ONNX clamps out-of-range starts and ends, as Python slices do; only the
        # "to the very end" sentinels need to become None.
        end = None if abs(int(end)) >= _INT_MAX // 2 else int(end)
        index[axis] = slice(int(start), end, int(step))
    return shape_ops.getitem(x, tuple(index))


def _gather(im: _Importer, attrs: dict) -> Node:
    params, indices = im.input(0), im.input(1)
    rank = _rank(im, params)
    axis = _axis(im, int(attrs.get("axis", 0)), rank)
    if axis == 0:
        return shape_ops.gather(params, indices)
    # Bring `axis` to the front, gather rows, then move the index dims back to `axis`.
    front = (axis,) + tuple(i for i in range(rank) if i != axis)
    rows = shape_ops.gather(shape_ops.transpose(params, front), indices)
    k = _rank(im, indices)
    back = tuple(range(k, k + axis)) + tuple(range(k)) + tuple(range(k + axis, k + rank - 1))
    return shape_ops.transpose(rows, back)


def _unsqueeze(im: _Importer, attrs: dict) -> Node:
    return shape_ops.expand_dims(im.input(0), _axes(im, attrs))


def _squeeze(im: _Importer, attrs: dict) -> Node:
    return shape_ops.squeeze(im.input(0), _axes(im, attrs))


def _expand(im: _Importer, attrs: dict) -> Node:
    x, shape = im.input(0), tuple(int(d) for d in im.constant(1, "shape"))
    if x.shape is None or None in x.shape:
        raise im.fail("Expand needs the input's shape known")
    return shape_ops.broadcast_to(x, np.broadcast_shapes(x.shape, shape))


def _reduce(op: str) -> Callable:
    def translate(im: _Importer, attrs: dict) -> Node:
        axes, x = _axes(im, attrs), im.input(0)
        if not axes and attrs.get("noop_with_empty_axes", 0):
            return x      # no axes (empty or not given) with this flag: the identity
        # (ONNX keeps an int input's type: a sum of int32 stays int32 and a mean of
        # ints is truncated; numpy's are int64 and a float)
        return _as_dtype(ops.make(op, x, axis=axes or None,
                                  keepdims=bool(attrs.get("keepdims", 1))), x.dtype)
    return translate


def _arg(op: str) -> Callable:
    def translate(im: _Importer, attrs: dict) -> Node:
        if attrs.get("select_last_index", 0):
            raise im.fail("select_last_index=1 is not supported")
        axis = int(attrs.get("axis", 0))
        y = ops.make(op, im.input(0), axis=axis)
        return shape_ops.expand_dims(y, axis) if attrs.get("keepdims", 1) else y
    return translate


def _cast(im: _Importer, attrs: dict) -> Node:
    onnx = _onnx()
    return ops.cast(im.input(0), onnx.helper.tensor_dtype_to_np_dtype(attrs["to"]))


def _constant(im: _Importer, attrs: dict) -> Node:
    onnx = _onnx()
    if "value" in attrs:
        value = onnx.numpy_helper.to_array(attrs["value"])
    elif "value_float" in attrs or "value_floats" in attrs:
        value = np.asarray(attrs.get("value_float", attrs.get("value_floats")), np.float32)
    elif "value_int" in attrs or "value_ints" in attrs:
        value = np.asarray(attrs.get("value_int", attrs.get("value_ints")), np.int64)
    else:
        raise im.fail(f"Constant with {sorted(attrs)} is not supported")
    im.static[im.node.output[0]] = value
    return ops.constant(value, value.dtype)


def _identity(im: _Importer, attrs: dict) -> Node:
    return im.input(0)


def _dropout(im: _Importer, attrs: dict) -> Node:
    # Inference: the identity. A training_mode input that is true cannot be honoured.
    training = im.constant(2, "training_mode")
    if (training is not None and bool(training)) or (len(im.node.output) > 1
                                                      and im.node.output[1]):
        raise im.fail("Dropout in training mode (or its mask output) is not supported")
    return im.input(0)


def _softmax_xent(im: _Importer, attrs: dict) -> Node:
    if im.input(2) is not None or "ignore_index" in attrs or len(im.node.output) > 1:
        raise im.fail("weights, ignore_index and the log_prob output are not supported")
    scores = im.input(0)
    rank = _rank(im, scores)
    if rank > 2:   # ONNX's classes are axis 1 of (N, C, d1, ...); TinyFlow's the last
        scores = shape_ops.transpose(scores, (0, *range(2, rank), 1))
    loss = nn_ops.softmax_cross_entropy(scores, im.input(1))
    reduction = attrs.get("reduction", "mean")
    return {"none": loss, "mean": ops.reduce_mean(loss), "sum": ops.reduce_sum(loss)}[reduction]


# The table: ONNX operator -> its translation. Everything TinyFlow can import is here.
IMPORTERS: dict[str, Callable[[_Importer, dict], Node]] = {
    **{onnx_op: _elementwise(op) for onnx_op, op in ELEMENTWISE.items()},
    "Div": _div, "Pow": _pow,
    "Gemm": _gemm, "MatMul": _matmul, "Gelu": _gelu,
    "Softmax": _softmax("softmax"), "LogSoftmax": _softmax("log_softmax"),
    "Conv": _conv, "MaxPool": _pool("max_pool2d"), "AveragePool": _pool("avg_pool2d"),
    "GlobalAveragePool": _global_avg_pool,
    "BatchNormalization": _batch_norm, "LayerNormalization": _layer_norm,
    "Reshape": _reshape, "Flatten": _flatten, "Transpose": _transpose, "Concat": _concat,
    "Slice": _slice, "Gather": _gather, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Expand": _expand,
    "ReduceSum": _reduce("sum"), "ReduceMean": _reduce("mean"), "ReduceMax": _reduce("max"),
    "ReduceMin": _reduce("min"), "ArgMax": _arg("argmax"), "ArgMin": _arg("argmin"),
    "Cast": _cast, "Constant": _constant, "Identity": _identity,
    "Dropout": _dropout, "SoftmaxCrossEntropyLoss": _softmax_xent,
}


def _placeholder(value_info: Any) -> Node:
    onnx = _onnx()
    if value_info.type.WhichOneof("value") != "tensor_type":
        raise OnnxError(f"input {value_info.name!r} is a "
                        f"{value_info.type.WhichOneof('value') or 'typeless value'}; "
                        "only tensor inputs are supported")
    tensor = value_info.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    shape = None
    if tensor.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else None
                      for d in tensor.shape.dim)
    return api.placeholder(dtype, shape, name=value_info.name)


def _new_nodes(outputs: Sequence[Node], first_id: int) -> list[Node]:
    """The nodes built since id `first_id` that `outputs` reach (a translation's work)."""
    found, stack, seen = [], list(outputs), set()
    while stack:
        node = stack.pop()
        if id(node) in seen or node.id < first_id or node.op in ("variable", "placeholder"):
            continue
        seen.add(id(node))
        found.append(node)
        stack.extend(node.inputs)
    return found


def _read_model(path: Any) -> tuple[Any, str]:
    """(ModelProto, name for messages) from a path, bytes or a ModelProto."""
    onnx = _onnx()
    if isinstance(path, (str, os.PathLike)):
        source = os.fspath(path)
        try:
            return onnx.load(source), source
        except Exception as err:  # protobuf's DecodeError, OSError: one error for users
            raise OnnxError(f"{source}: not a readable ONNX model ({err})") from None
    if isinstance(path, bytes):
        try:
            return onnx.load_from_string(path), "<model>"
        except Exception as err:
            raise OnnxError(f"not a readable ONNX model ({err})") from None
    if not isinstance(path, onnx.ModelProto):
        raise OnnxError(f"load takes a path, bytes or an onnx.ModelProto, got "
                        f"{type(path).__name__}")
    return path, "<model>"


def _check_model(model: Any, source: str) -> None:
    """What ONNX Runtime refuses before running and the translations assume: a graph
    with outputs (an empty file parses as a model without one), every node with as
    many inputs and outputs as its operator's schema allows, and every tensor
    written once. (Not onnx.checker: it also refuses models ORT runs, e.g. an output
    declared without a shape.)"""
    onnx = _onnx()
    if not model.graph.output:
        raise OnnxError(f"{source}: the model has no graph outputs (an empty or "
                        "truncated file?)")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                 DEFAULT_OPSET)
    written = {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
    for node in model.graph.node:
        label = f"{source}: {node.op_type} node {node.name or node.output[0]!r}"
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        except Exception:    # not a standard operator: _check_supported names it
            continue
        inputs = len(node.input) - _trailing_empty(node.input)
        if not schema.min_input <= inputs <= schema.max_input:
            raise OnnxError(f"{label} has {inputs} inputs; {node.op_type} takes "
                            f"{schema.min_input} to {schema.max_input}")
        for name in node.output:
            if name and name in written:
                raise OnnxError(f"{label} writes tensor {name!r}, which is already "
                                "written (by another node, an input or an initializer)")
            written.add(name)


def _trailing_empty(names: Sequence[str]) -> int:
    """How many of `names` at the end are "" (optional inputs left out)."""
    count = 0
    for name in reversed(names):
        if name:
            break
        count += 1
    return count


def _check_supported(model: Any) -> None:
    """Raise UnsupportedOpError naming every operator type without a translation."""
    missing: dict[str, list[str]] = {}
    for node in model.graph.node:
        standard = node.domain in ("", "ai.onnx")
        if not standard or node.op_type not in IMPORTERS:
            label = node.op_type if standard else f"{node.domain}.{node.op_type}"
            missing.setdefault(label, []).append(node.name or node.output[0])
    if missing:
        raise _unsupported("ONNX", missing, list(IMPORTERS))


def _translate(im: _Importer, onnx_node: Any, base: str) -> None:
    """Translate one ONNX node; name and locate the nodes it made."""
    im.node = onnx_node
    first = next_node_id()
    try:
        result = IMPORTERS[onnx_node.op_type](im, _attrs(onnx_node))
    except OnnxError:
        raise
    except Exception as err:  # a shape rule's error, a missing attribute: name the node
        raise im.fail(f"{type(err).__name__}: {err}") from None
    label = onnx_node.name or onnx_node.output[0]
    where = onnx_node.doc_string if _looks_like_where(onnx_node.doc_string) else \
        f"{base}:{label}"
    for new in _new_nodes([result], first):
        new.where = where
        if new is not result:  # the helper nodes of a translation: "bn1/sqrt"
            new.name = f"{label}/{new.op}"
            new.provenance = (new.name,)
    if result.id >= first and result.op not in ("variable", "placeholder"):
        result.name = onnx_node.output[0]  # the ONNX tensor name, as users know it
        result.provenance = (result.name,)
    im.env[onnx_node.output[0]] = result


def load(path: Any, initializers: str = "variables") -> OnnxModel:
    """Translate an ONNX model (a path, bytes or a ModelProto) into TinyFlow nodes.

    Returns an `OnnxModel`: placeholders for the graph inputs (symbolic dims are
    None), the output nodes, and a Variable for each floating-point initializer
    (``initializers="constants"`` makes them constants instead, which the fold pass
    can then precompute). Raises UnsupportedOpError listing every operator type
    without a translation and the nodes using it, and OnnxError for an attribute
    or input that TinyFlow cannot honour (naming the node).
    """
    if initializers not in ("variables", "constants"):
        raise ValueError(f"initializers must be 'variables' or 'constants', got {initializers!r}")
    model, source = _read_model(path)
    _check_model(model, source)
    _check_supported(model)
    im = _Importer(model, source, initializers)
    base = os.path.basename(source)
    inputs = {}
    for value_info in model.graph.input:
        if value_info.name in im.static:
            continue  # an initializer listed as an input (old exporters): a weight
        node = _placeholder(value_info)
        node.where = f"{base}:{value_info.name}"
        im.env[value_info.name] = inputs[value_info.name] = node
    for onnx_node in model.graph.node:
        _translate(im, onnx_node, base)
    outputs = {o.name: im.tensor(o.name) for o in model.graph.output}
    return OnnxModel(inputs, outputs, im.variables, im.values, api.group(*im.assigns),
                     im.opset, source)


def _looks_like_where(text: str) -> bool:
    """True for "file.py:123", the doc_string `export` writes."""
    head, _, line = text.rpartition(":")
    return bool(head) and line.isdigit() and "\n" not in text


# ==================================================================================
# The command line's use of a model: an ONNX model run into a DebugRecord
# ==================================================================================

def example_feeds(model: OnnxModel, batch: int = 1, seed: int = 0) -> dict[Node, np.ndarray]:
    """A value for every input: unknown dims are `batch`; floats are N(0, 1), integers
    zeros (valid indices for any embedding), booleans False."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, node in model.inputs.items():
        if node.shape is None:
            raise OnnxError(f"input {name!r} has no shape in the model; cannot make an "
                            "example value")
        shape = tuple(batch if d is None else d for d in node.shape)
        if node.dtype.kind == "f":
            feeds[node] = rng.standard_normal(shape).astype(node.dtype)
        else:
            feeds[node] = np.zeros(shape, node.dtype)
    return feeds


def record_model(path: Any, out: Any, batch: int = 1, runs: int = 3, **options: Any) -> str:
    """Import the ONNX model at `path`, compile it for example inputs (unknown dims =
    `batch`), run it `runs` times while recording, and write the DebugRecord to `out`
    (passes, memory plan, schedule, timelines), for `tinyflow debug MODEL.onnx`."""
    from tinyflow import debug
    model = load(path)
    sess = model.session(**options)
    feeds = example_feeds(model, batch)
    fetches = list(model.outputs.values())
    title = f"{os.path.basename(os.fspath(path))} (ONNX, batch {batch})"
    with debug.record(out, title=title):
        for _ in range(runs):
            sess.run(fetches, feeds)
    return os.fspath(out)
