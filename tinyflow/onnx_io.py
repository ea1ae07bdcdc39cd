"""ONNX in and out: export a TinyFlow graph as an ONNX model, import one as TinyFlow nodes.

ONNX is how models move between frameworks. This module is a translator, nothing
more: one table from ONNX operator to registry op (`IMPORTERS`) and one back
(`EXPORTERS`); after `load`, the model is an ordinary TinyFlow graph that the
passes, the memory planner, the executor, autodiff and the debugger handle like
any other. The format is read and written with the `onnx` package (the `onnx`
extra), never by hand; ONNX Runtime is only the oracle of the tests and benchmarks.
The anchors are torch.onnx (export: initializers for weights, symbolic batch
dims), tinygrad's ONNX frontend (import: one small function per operator) and
Netron, which opens the files written here.

    model = tinyflow.onnx_io.load("net.onnx")        # placeholders, outputs, Variables
    sess = model.session()                            # a Session holding the weights
    y = sess.run(model.output, {model.input: x})
    tinyflow.onnx_io.export(logits, [x], "net.onnx", session=sess)

Conventions on the way out: a Variable becomes an initializer (its value read from
the Session), a constant a Constant node, a placeholder a graph input whose `None`
dims are symbolic ("N" for the batch axis); ONNX names keep the TinyFlow node names
and each node's `doc_string` holds the user's file:line. On the way in, every
floating-point initializer becomes a Variable (so an imported model can be
fine-tuned), the rest constants; a node's `where` is "MODEL.onnx:node name" (or its
doc_string, when that is the file:line an export wrote).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyflow import api, image_ops, nn_ops, ops, shape_ops
from tinyflow.graph import Node, TinyFlowError, next_node_id, topological_order

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
# Export: TinyFlow nodes -> ONNX
# ==================================================================================


@dataclass
class _Writer:
    """The ONNX graph being written: nodes, initializers, and unique tensor names."""

    opset: int
    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # id(TinyFlow node) -> tensor
    taken: set[str] = field(default_factory=set)

    def unique(self, name: str) -> str:
        candidate, n = name, 0
        while candidate in self.taken:
            n += 1
            candidate = f"{name}_{n}"
        self.taken.add(candidate)
        return candidate

    def emit(self, op_type: str, inputs: Sequence[str], out: str | None, node: Node,
             **attrs: Any) -> str:
        """Add one ONNX node computing (part of) TinyFlow `node`; returns its output.
        `out` is the final tensor's name; None gives a fresh name for a helper value."""
        onnx = _onnx()
        out = out or self.unique(f"{node.name}/{op_type}")
        self.nodes.append(onnx.helper.make_node(
            op_type, list(inputs), [out], name=out, doc_string=node.where, **attrs))
        return out

    def ints(self, values: Sequence[int], node: Node, what: str) -> str:
        """An int64 initializer (shapes, axes) named after `node`."""
        onnx = _onnx()
        name = self.unique(f"{node.name}/{what}")
        self.initializers.append(onnx.numpy_helper.from_array(
            np.asarray(values, dtype=np.int64), name))
        return name


# -- One function per TinyFlow op: (writer, node, input names, output name) -> name --

_COMPARISONS = frozenset(["Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal"])


def _ex_elementwise(onnx_op: str) -> Callable:
    def write(w: _Writer, n: Node, ins: list[str], out: str) -> str:
        # ONNX wants one input type where numpy promotes (int32 / int32 is float64,
        # float32 ** int64 float64 in TinyFlow): the inputs are cast to the type
        # TinyFlow computes in first, which gives TinyFlow's values exactly.
        first = 1 if onnx_op == "Where" else 0          # (Where's condition stays bool)
        target = np.result_type(*[i.dtype for i in n.inputs[first:]]) \
            if onnx_op in _COMPARISONS else np.dtype(n.dtype)
        ins = ins[:first] + [_cast_to(w, n, name, x.dtype, target)
                             for name, x in zip(ins[first:], n.inputs[first:])]
        return w.emit(onnx_op, ins, out, n)
    return write


def _cast_to(w: _Writer, n: Node, name: str, dtype: Any, target: Any) -> str:
    """Tensor `name` (of `dtype`) cast to `target`, when they differ."""
    if np.dtype(dtype) == np.dtype(target):
        return name
    to = _onnx().helper.np_dtype_to_tensor_dtype(np.dtype(target))
    return w.emit("Cast", [name], None, n, to=to)


def _ex_matmul(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    ta, tb = bool(n.attrs.get("transpose_a")), bool(n.attrs.get("transpose_b"))
    if not (ta or tb):
        return w.emit("MatMul", ins, out, n)
    if n.inputs[0].ndim == 2 and n.inputs[1].ndim == 2:
        return w.emit("Gemm", ins, out, n, transA=int(ta), transB=int(tb))
    swapped = []
    for x, flag, name in zip(n.inputs, (ta, tb), ins):
        perm = list(range(x.ndim - 2)) + [x.ndim - 1, x.ndim - 2]
        swapped.append(w.emit("Transpose", [name], None, n, perm=perm) if flag else name)
    return w.emit("MatMul", swapped, out, n)


def _ex_bias_add(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    # ONNX's Add broadcasts from the right: the (C,) bias gets a 1 for every
    # dimension of x after its axis.
    rank = n.inputs[0].ndim
    axis = nn_ops.bias_axis(n.attrs, rank)
    bias = ins[1]
    if axis < rank - 1:
        bias = w.emit("Unsqueeze", [bias, w.ints(range(1, rank - axis), n, "axes")], None, n)
    return w.emit("Add", [ins[0], bias], out, n)


def _ex_reduce(onnx_op: str) -> Callable:
    def write(w: _Writer, n: Node, ins: list[str], out: str) -> str:
        axis, keep = n.attrs.get("axis"), int(bool(n.attrs.get("keepdims")))
        # numpy's sum of int32 is int64 and its mean of ints a float; ONNX keeps the
        # input's type, so the input is cast to the result's type first.
        ins = [_cast_to(w, n, ins[0], n.inputs[0].dtype, n.dtype)]
        if axis is None:
            return w.emit(onnx_op, ins[:1], out, n, keepdims=keep)
        axes = [axis] if isinstance(axis, int) else list(axis)
        if onnx_op == "ReduceSum" or w.opset >= 18:
            return w.emit(onnx_op, [ins[0], w.ints(axes, n, "axes")], out, n, keepdims=keep)
        return w.emit(onnx_op, ins[:1], out, n, axes=axes, keepdims=keep)
    return write


def _ex_arg(onnx_op: str) -> Callable:
    def write(w: _Writer, n: Node, ins: list[str], out: str) -> str:
        if n.attrs.get("axis") is None:
            flat = w.emit("Reshape", [ins[0], w.ints([-1], n, "shape")], None, n)
            return w.emit(onnx_op, [flat], out, n, axis=0, keepdims=0)
        return w.emit(onnx_op, ins, out, n, axis=int(n.attrs["axis"]), keepdims=0)
    return write


def _ex_last_axis(onnx_op: str) -> Callable:
    return lambda w, n, ins, out: w.emit(onnx_op, ins, out, n, axis=-1)


def _ex_layer_norm(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    return w.emit("LayerNormalization", ins, out, n, axis=-1,
                  epsilon=float(n.attrs.get("eps", 1e-5)))


def _ex_gelu(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    if w.opset >= 20:
        return w.emit("Gelu", ins, out, n, approximate="tanh")
    raise OnnxError(f"gelu ({n.name}, {n.where}) needs opset 20 or later (ONNX's Gelu); "
                    f"export with opset=20")


def _window_attrs(n: Node) -> dict:
    padding = n.attrs.get("padding", 0)
    attrs: dict[str, Any] = {"strides": list(n.attrs.get("stride", (1, 1)))}
    if padding == "SAME":
        attrs["auto_pad"] = "SAME_UPPER"   # TF's SAME puts the odd pixel after
    elif padding not in ("VALID", 0):
        attrs["pads"] = [int(padding)] * 4
    return attrs


def _ex_conv(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    return w.emit("Conv", ins, out, n, kernel_shape=list(n.inputs[1].shape[2:]),
                  **_window_attrs(n))


def _ex_pool(onnx_op: str) -> Callable:
    def write(w: _Writer, n: Node, ins: list[str], out: str) -> str:
        attrs = _window_attrs(n)
        if onnx_op == "AveragePool" and n.attrs.get("padding", 0) not in (0, "VALID"):
            attrs["count_include_pad"] = 1  # TinyFlow averages over the zeros too
        return w.emit(onnx_op, ins, out, n, kernel_shape=list(n.attrs["ksize"]), **attrs)
    return write


def _ex_reshape(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    # TinyFlow's reshape reads 0 as "copy this dim", as ONNX's Reshape does.
    return w.emit("Reshape", [ins[0], w.ints(n.attrs["shape"], n, "shape")], out, n)


def _ex_transpose(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    axes = n.attrs.get("axes")
    if axes is None:
        return w.emit("Transpose", ins, out, n)
    rank = n.inputs[0].ndim   # (ONNX's perm has no negative axes)
    return w.emit("Transpose", ins, out, n, perm=[int(a) % rank for a in axes])


def _ex_broadcast_to(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    return w.emit("Expand", [ins[0], w.ints(n.attrs["shape"], n, "shape")], out, n)


def _ex_expand_dims(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    axis = n.attrs["axis"]
    axes = [axis] if isinstance(axis, int) else list(axis)
    return w.emit("Unsqueeze", [ins[0], w.ints(axes, n, "axes")], out, n)


def _ex_squeeze(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    axis = n.attrs.get("axis")
    if axis is None:
        return w.emit("Squeeze", ins, out, n)
    axes = [axis] if isinstance(axis, int) else list(axis)
    return w.emit("Squeeze", [ins[0], w.ints(axes, n, "axes")], out, n)


def _ex_concat(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    return w.emit("Concat", ins, out, n, axis=int(n.attrs["axis"]))


def _ex_getitem(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    """x[ints and slices] -> one Slice, then a Squeeze of the int-indexed axes."""
    index = n.attrs["index"]
    if any(item[0] in ("newaxis", "ellipsis") for item in index):
        raise OnnxError(f"getitem {n.name} ({n.where}): indexes with None or ... have no "
                        "ONNX translation here; use expand_dims or full slices")
    starts, ends, steps, dropped = [], [], [], []
    for axis, item in enumerate(index):
        if item[0] == "int":
            i = item[1]
            starts.append(i)
            ends.append(_INT_MAX if i == -1 else i + 1)
            steps.append(1)
            dropped.append(axis)
            continue
        start, stop, step = item[1], item[2], 1 if item[3] is None else item[3]
        starts.append(start if start is not None else (0 if step > 0 else -1))
        ends.append(stop if stop is not None else (_INT_MAX if step > 0 else -_INT_MAX))
        steps.append(step)
    axes = list(range(len(index)))
    sliced = w.emit("Slice", [ins[0], w.ints(starts, n, "starts"), w.ints(ends, n, "ends"),
                              w.ints(axes, n, "axes"), w.ints(steps, n, "steps")],
                    None if dropped else out, n)
    if not dropped:
        return sliced
    return w.emit("Squeeze", [sliced, w.ints(dropped, n, "squeeze_axes")], out, n)


def _ex_gather(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    return w.emit("Gather", ins, out, n, axis=0)


def _ex_cast(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    onnx = _onnx()
    return w.emit("Cast", ins, out, n,
                  to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(n.attrs["dtype"])))


def _ex_constant(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    onnx = _onnx()
    value = onnx.numpy_helper.from_array(np.asarray(n.attrs["value"].array), out)
    return w.emit("Constant", [], out, n, value=value)


def _ex_xent(w: _Writer, n: Node, ins: list[str], out: str) -> str:
    labels, logits = ins[1], ins[0]
    if n.inputs[1].dtype != np.int64:
        labels = w.emit("Cast", [labels], None, n, to=7)  # int64: the labels ONNX takes
    rank = n.inputs[0].ndim
    if rank > 2:   # TinyFlow's classes are the last axis, ONNX's axis 1: (N, C, d1, ...)
        logits = w.emit("Transpose", [logits], None, n,
                        perm=[0, rank - 1, *range(1, rank - 1)])
    return w.emit("SoftmaxCrossEntropyLoss", [logits, labels], out, n, reduction="none")


# The table: TinyFlow op -> how to write it in ONNX.
EXPORTERS: dict[str, Callable[[_Writer, Node, list[str], str], str]] = {
    **{op: _ex_elementwise(onnx_op) for onnx_op, op in ELEMENTWISE.items()},
    "matmul": _ex_matmul, "bias_add": _ex_bias_add,
    "sum": _ex_reduce("ReduceSum"), "mean": _ex_reduce("ReduceMean"),
    "max": _ex_reduce("ReduceMax"), "min": _ex_reduce("ReduceMin"),
    "argmax": _ex_arg("ArgMax"), "argmin": _ex_arg("ArgMin"),
    "softmax": _ex_last_axis("Softmax"), "log_softmax": _ex_last_axis("LogSoftmax"),
    "layer_norm": _ex_layer_norm, "gelu": _ex_gelu, "conv2d": _ex_conv,
    "max_pool2d": _ex_pool("MaxPool"), "avg_pool2d": _ex_pool("AveragePool"),
    "reshape": _ex_reshape, "transpose": _ex_transpose, "broadcast_to": _ex_broadcast_to,
    "expand_dims": _ex_expand_dims, "squeeze": _ex_squeeze, "concat": _ex_concat,
    "getitem": _ex_getitem, "gather": _ex_gather, "cast": _ex_cast,
    "constant": _ex_constant, "softmax_cross_entropy": _ex_xent,
    # (inference has no gradients to stop: the value is all there is)
    "stop_gradient": lambda w, n, ins, out: w.emit("Identity", ins, out, n),
}


def _value_info(name: str, shape: tuple | None, dtype: Any, symbolic: bool) -> Any:
    """A typed tensor; unknown dims get a symbol ("N" for the batch axis) when
    `symbolic`, else stay unnamed (inputs name them; outputs leave them to inference)."""
    onnx = _onnx()
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if shape is None:
        return onnx.helper.make_tensor_value_info(name, elem, None)
    dims = [d if d is not None else (("N" if axis == 0 else f"{name}_{axis}")
                                     if symbolic else None)
            for axis, d in enumerate(shape)]
    return onnx.helper.make_tensor_value_info(name, elem, dims)


def _variable_value(var: Node, session: Any, values: dict | None) -> np.ndarray:
    if values is not None and var in values:
        return np.asarray(values[var])
    stored = getattr(session, "variables", {}) if session is not None else {}
    if var in stored:
        from tinyflow import backend
        return backend.to_host(stored[var])
    raise OnnxError(f"export needs the value of variable {var.name!r} (created at "
                    f"{var.where}): pass session= (a Session that ran its initializer) "
                    "or values={variable: array}, or variables_as='inputs'")


def to_model(fetches: Node | Sequence[Node], feeds: Sequence[Node] | dict,
             opset: int = DEFAULT_OPSET, *, session: Any = None, values: dict | None = None,
             variables_as: str = "initializers", name: str = "tinyflow") -> Any:
    """The ONNX ModelProto of the graph from `feeds` to `fetches` (see `export`)."""
    onnx = _onnx()
    check_opset(opset)
    if variables_as not in ("initializers", "inputs"):
        raise ValueError(f"variables_as must be 'initializers' or 'inputs', got "
                         f"{variables_as!r}")
    fetches = [fetches] if isinstance(fetches, Node) else list(dict.fromkeys(fetches))
    feeds = list(feeds)
    order = topological_order(fetches, frozenset(id(f) for f in feeds))
    _check_exportable(order, feeds)
    w = _Writer(opset)
    graph_inputs = []
    for node in order:
        if node in feeds or node.op == "placeholder":
            graph_inputs.append(_graph_input(w, node, feeds))
        elif node.op == "variable":
            w.names[id(node)] = w.unique(node.name)
            if variables_as == "inputs":
                graph_inputs.append(_value_info(w.names[id(node)], node.shape, node.dtype,
                                                True))
            else:
                value = _variable_value(node, session, values)
                w.initializers.append(onnx.numpy_helper.from_array(value, w.names[id(node)]))
        else:
            out = w.unique(node.name)
            ins = [w.names[id(i)] for i in node.inputs]
            w.names[id(node)] = EXPORTERS[node.op](w, node, ins, out)
    outputs = [_graph_output(w, fetch, feeds) for fetch in fetches]
    graph = onnx.helper.make_graph(w.nodes, name, graph_inputs, outputs, w.initializers)
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", opset)],
        producer_name="tinyflow", producer_version=_version())
    _name_output_dims(model)
    # ONNX Runtime reads IR versions up to its own; the onnx package may write a newer
    # one than the installed runtime knows, and opset 20 needs no more than IR 9.
    model.ir_version = min(model.ir_version, 9)
    return model


def _check_exportable(order: list[Node], feeds: list[Node]) -> None:
    """Raise UnsupportedOpError naming every op (and its nodes) with no exporter."""
    missing: dict[str, list[str]] = {}
    for node in order:
        if node in feeds or node.op in ("placeholder", "variable"):
            continue
        if node.op not in EXPORTERS:
            missing.setdefault(node.op, []).append(f"{node.name} ({node.where})")
    if missing:
        raise _unsupported("TinyFlow", missing, list(EXPORTERS))


def _graph_input(w: _Writer, node: Node, feeds: list[Node]) -> Any:
    """A fed node as an input of the ONNX graph, with the shape it was declared with
    (a placeholder's None dims become symbols)."""
    if node not in feeds:
        raise OnnxError(f"placeholder {node.name!r} ({node.where}) is needed by the "
                        "fetches but is not among the feeds")
    w.names[id(node)] = w.unique(node.name)
    declared = node.attrs.get("shape", node.shape) if node.op == "placeholder" \
        else node.shape
    if declared is None:
        raise OnnxError(f"placeholder {node.name!r} ({node.where}) has no known "
                        "rank; ONNX inputs need one: give it a shape (None for "
                        "a dim of any size)")
    return _value_info(w.names[id(node)], declared, node.dtype, True)


def _graph_output(w: _Writer, fetch: Node, feeds: list[Node]) -> Any:
    """A fetch as an output of the ONNX graph (a fed node or a variable through an
    Identity: an output must be some node's output)."""
    name = w.names[id(fetch)]
    if fetch in feeds or fetch.op == "variable":
        name = w.emit("Identity", [name], w.unique(f"{fetch.name}/output"), fetch)
    return _value_info(name, fetch.shape, fetch.dtype, False)


def _name_output_dims(model: Any) -> None:
    """Give the outputs' unknown dims the symbols ONNX shape inference derives from the
    inputs' ("N" for a batch that flows through), so viewers show N x 10, not ? x 10."""
    onnx = _onnx()
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is a nicety here; the checker reports real problems
        return
    found = {o.name: o for o in inferred.graph.output}
    for output in model.graph.output:
        source = found.get(output.name)
        if source is None:
            continue
        dims = output.type.tensor_type.shape.dim
        for dim, new in zip(dims, source.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value") and new.HasField("dim_param") \
                    and not new.dim_param.startswith("unk__"):
                dim.dim_param = new.dim_param


def _version() -> str:
    from tinyflow.version import VERSION
    return VERSION


def after_passes(fetches: Sequence[Node], feeds: dict, names: Sequence[str],
                 session: Any = None, values: dict | None = None
                 ) -> tuple[list[Node], list[Node], dict[Node, np.ndarray]]:
    """(outputs, feeds, variable values) of the graph after the passes `names`.

    Passes work on a graph specialized to concrete shapes, so `feeds` maps each
    placeholder to an example array (or its shape): the exported dims are those.
    """
    from tinyflow import passes
    from tinyflow.graph import reachable
    variables = [n for n in reachable(fetches, frozenset(id(f) for f in feeds))
                 if n.op == "variable" and n not in feeds]
    known = {v: _variable_value(v, session, values) for v in variables}
    sources = {v: (a.shape, a.dtype) for v, a in known.items()}
    for node, example in feeds.items():
        shape = np.shape(example) if isinstance(example, np.ndarray) else tuple(example)
        sources[node] = (shape, node.dtype)
    graph, clones = passes.specialize(list(fetches), sources, frozenset(id(f) for f in feeds))
    graph = passes.run_pipeline(graph, passes.PassContext(), list(names))
    return (graph.outputs, [clones[f] for f in feeds if f in clones],
            {clones[v]: a for v, a in known.items() if v in clones})


def export(fetches: Node | Sequence[Node], feeds: Sequence[Node] | dict, path: Any,
           opset: int = DEFAULT_OPSET, *, session: Any = None, values: dict | None = None,
           variables_as: str = "initializers", passes: Sequence[str] | None = None,
           check: bool = True) -> Any:
    """Write the forward graph from `feeds` to `fetches` as an ONNX model at `path`.

    fetches       the output node(s)
    feeds         the placeholders that become graph inputs (a feed_dict works too:
                  its keys are used); `None` dims in their declared shapes become
                  symbolic dims ("N" for the batch)
    session       a tf.Session whose Variables' values become initializers (or
    values        {Variable: array})
    variables_as  "inputs" writes the Variables as graph inputs instead (a structure
                  without weights, as `tinyflow export RECORD --onnx` does)
    passes        export the graph after these passes (e.g. ["simplify", "cse",
                  "fold", "dce"]; the fusion passes make ops ONNX has not); they run
                  on shapes fixed by `feeds`, which must then be a dict {placeholder:
                  example array or shape}; None (default) exports the graph as built
    check         run onnx.checker (full check, with shape inference) before writing

    Returns the ModelProto. Raises UnsupportedOpError listing every TinyFlow op in
    the graph that has no ONNX translation (with node names and file:line).
    """
    onnx = _onnx()
    if passes is not None:
        if not isinstance(feeds, dict):
            raise OnnxError("export(passes=...) needs feeds as {placeholder: example array "
                            "or shape}: the passes run on concrete shapes")
        fetches = [fetches] if isinstance(fetches, Node) else list(fetches)
        fetches, feeds, values = after_passes(fetches, feeds, passes, session, values)
        session = None
    model = to_model(fetches, feeds, opset, session=session, values=values,
                     variables_as=variables_as)
    if check:
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception as err:  # checker's ValidationError, inference errors
            raise OnnxError(f"the exported model fails onnx.checker: {err}") from None
    try:
        onnx.save(model, os.fspath(path))
    except OSError as err:  # a missing folder, a folder in the way, no permission
        raise OnnxError(f"cannot write {os.fspath(path)}: {err.strerror or err}") from None
    return model


# ==================================================================================
# The command line's two uses: a DebugRecord out as ONNX, an ONNX model into a record
# ==================================================================================

def _from_json(value: Any) -> Any:
    """A record's attribute value back as the hashable value the op had (lists were
    tuples)."""
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _record_node(entry: dict, inputs: list[Node]) -> Node:
    """One node entry of a DebugRecord as a Node (no shape rule is run: the record's
    shapes are the ones the program ran with)."""
    op, attrs = entry["op"], _from_json(entry["attrs"])
    shape = None if entry["shape"] is None else tuple(entry["shape"])
    value = attrs.get("value")
    if op == "constant":
        if isinstance(value, str):
            # Long constants are kept only as "array(784x10 float32)": an input then.
            op, attrs = "placeholder", {"shape": shape, "dtype": entry["dtype"]}
        else:
            attrs["value"] = ops.ConstValue(np.asarray(value, dtype=entry["dtype"]))
    return Node(op, inputs, attrs, name=entry["id"], shape=shape, dtype=entry["dtype"],
                where=entry["where"])


def graph_from_record(record: dict) -> tuple[list[Node], list[Node]]:
    """(outputs, inputs) of the forward part of a DebugRecord's input graph.

    A record keeps the graph a program ran (shapes fixed by that run's feeds) but not
    the Variables' values, nor constants longer than a few items: those become inputs
    (placeholders), so the export is the model's structure. The outputs are the
    record's fetched nodes that are forward computations (the loss, not the update).
    """
    graph = record["graphs"][0]
    nodes: dict[str, Node] = {}
    for entry in graph["nodes"]:
        if entry["phase"] != "forward" or entry["op"] in ("assign", "group") or \
                entry["attrs"].get("optimizer_step"):   # (an eager optimizer's work)
            continue
        if any(name not in nodes for name in entry["inputs"]):
            continue  # reads a gradient or an update: not part of the forward model
        nodes[entry["id"]] = _record_node(entry, [nodes[n] for n in entry["inputs"]])
    outputs = [nodes[name] for name in graph["outputs"] if name in nodes]
    if graph["pass"] == "eager":
        # An eager tape fetches nothing (its "output" is the last op, an optimizer
        # update): the model's outputs are the forward values nothing else reads.
        read = {name for entry in graph["nodes"] if entry["id"] in nodes
                for name in entry["inputs"]}
        outputs = [n for name, n in nodes.items() if name not in read and n.inputs]
    if not outputs:
        raise OnnxError("the record's fetched nodes are all updates or gradients; record a "
                        "run that also fetches the loss or the model's output")
    inputs = [n for n in nodes.values() if n.op == "placeholder"]
    return outputs, inputs


def export_record(record_path: Any, path: Any, opset: int = DEFAULT_OPSET) -> Any:
    """Write the forward graph of a DebugRecord as ONNX; Variables become inputs."""
    from tinyflow import trace
    outputs, inputs = graph_from_record(trace.load(record_path))
    return export(outputs, inputs, path, opset, variables_as="inputs")


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
