"""ONNX out: a TinyFlow graph written as an ONNX model (`export`, `to_model`).

One function per TinyFlow op gathered in one table (`EXPORTERS`), the mirror of
`onnx_import`'s, from which this module takes the shared pieces (one way only). As
torch.onnx does: a Variable becomes an initializer (its value read from the
Session), a constant a Constant node, a placeholder a graph input whose `None` dims
are symbolic ("N" for the batch axis); ONNX names keep the TinyFlow node names and
each node's `doc_string` holds the user's file:line, which Netron shows. Also the
command line's `tinyflow export RECORD --onnx`: a DebugRecord's forward graph out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyflow import nn_ops, ops
from tinyflow.graph import Node, topological_order, unique_name
from tinyflow.onnx_import import (_INT_MAX, DEFAULT_OPSET, ELEMENTWISE, OnnxError, _onnx,
                                  _unsupported, check_opset)

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
        return unique_name(name, self.taken)

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
# The command line's use of a record: a DebugRecord out as ONNX
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
