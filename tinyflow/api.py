"""The TensorFlow-1 surface: placeholders, Variables, assign/group, reductions.

Programs written for the original TinyFlow (tqchen/tinyflow) run on this one
unchanged: `import tinyflow as tf`, then `tf.placeholder`, `tf.Variable`,
`tf.Session().run(...)`, `tf.gradients`, `tf.train.*Optimizer(...).minimize(loss)`.
Everything here is a thin builder over ops.py; nothing computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tinyflow import ops, shape_ops
from tinyflow.graph import (OPERATOR_BUILDERS, Node, ShapeError, topological_order,
                            user_source_line)
from tinyflow.ops import (argument_error, bool_attr, constant, dtype_attr, infer_node, int_attr,
                          int_like, make)
from tinyflow.registry import source_kind

float16, float32, float64 = np.float16, np.float32, np.float64
int32, int64, bool_ = np.int32, np.int64, np.bool_
int8, int16, uint8, uint16 = np.int8, np.int16, np.uint8, np.uint16

# Assign nodes that initialize the Variables created so far, one per Variable that has
# an initial value (what TF1's global_variables_initializer runs).
_initializers: list[Node] = []
# Every Variable's initializer, by Variable: a pipeline stage takes its own out of the
# list above (another rank's global initializer must not run them), not out of here.
_initializer_of: dict[Node, Node] = {}
# Variables created so far, in creation order (TF1's GLOBAL_VARIABLES collection).
_global_variables: list[Node] = []
_trainable_variables: list[Node] = []
# Variables whose shape is only known once their layer's input shape is known
# (tf.nn.linear(x, num_hidden=...)): variable -> (input node, rule on its shape).
deferred_shapes: dict[Node, tuple[Node, Callable[[tuple], tuple]]] = {}
# Variables of a deferred shape that a layer initializes itself (batch normalization's
# scale, offset and moving statistics): variable -> fill value. Once
# `infer_variable_shapes` knows the shape, their initializer joins the pending list
# (run by tf.initialize_all_variables), and they are not handed to the user's loop.
deferred_fills: dict[Node, float] = {}
# Updates that layers ask to run with every training step (TF1's UPDATE_OPS
# collection): (assign node, the layer's input). `minimize` runs those whose input
# its loss depends on.
update_ops: list[tuple[Node, Node]] = []


def placeholder(dtype: Any = np.float32, shape: Sequence[int | None] | None = None,
                name: str | None = None) -> Node:
    """A value fed at run time. `None` dims (or a None shape) are fixed by the feed."""
    shape = _source_shape("placeholder", shape)
    dtype = dtype_attr("placeholder", dtype)
    return Node("placeholder", (), {"shape": shape, "dtype": dtype.name},
                name=name, shape=shape, dtype=dtype)


def _source_shape(op: str, shape: Any) -> tuple | None:
    """A placeholder's or Variable's shape: None (rank unknown), an int (a vector),
    or a sequence of ints and Nones. A float or string dim is refused, not rounded
    (int(2.5) was 2) or, for a Variable, kept as a float dim."""
    if shape is None:
        return None
    if int_like(shape):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)) \
            or not all(d is None or int_like(d) for d in shape):
        raise argument_error(op, f"shape must be a sequence of ints and Nones, got "
                                 f"{shape!r}")
    shape = tuple(None if d is None else int(d) for d in shape)
    _check_source_shape(op, shape)
    return shape


def _check_source_shape(op: str, shape: tuple | None) -> None:
    """A negative dimension is a build error (None is the way to say "unknown")."""
    if shape is not None and any(d is not None and d < 0 for d in shape):
        raise ShapeError(f"{op}: negative dimension in shape {shape}; use None for a "
                         f"dimension fixed by the feed (at {user_source_line()})")


def Variable(initial_value: Any = None, name: str | None = None, dtype: Any = None,
             trainable: bool = True, shape: Sequence[int] | None = None) -> Node:
    """State that lives in the Session across runs, set by an initializer.

    `initial_value` is a node (tf.zeros(...), tf.random_normal(...)) or an array;
    `tf.global_variables_initializer()` runs it. A Variable without one (used by
    `tf.nn.linear`) must be assigned before use (see `infer_variable_shapes`).
    """
    init = None
    # trainable="no" (or 0.0, a string from a config) was truthy and trained the
    # Variable; None is TF1's "not given", True.
    trainable = trainable is None or bool_attr("Variable", "trainable", trainable)
    shape = _source_shape("Variable", shape)
    if dtype is not None:
        dtype = dtype_attr("Variable", dtype)
    if initial_value is not None:
        # An array keeps its dtype, Python numbers take TF1's (float32, int32).
        init = initial_value if isinstance(initial_value, Node) else constant(
            initial_value, dtype)
        shape = init.shape if shape is None else shape
        dtype = dtype or init.dtype
    dtype = np.dtype(dtype or np.float32)
    var = Node("variable", (), {"shape": shape, "dtype": dtype.name},
               name=name, shape=shape, dtype=dtype)
    _global_variables.append(var)
    if trainable:
        _trainable_variables.append(var)
    if init is not None:
        _add_initializer(var, init)
    return var


def _add_initializer(var: Node, value: Node) -> None:
    """Record the assign that gives `var` its initial value."""
    _initializer_of[var] = assign(var, value)
    _initializers.append(_initializer_of[var])


def assign(ref: Node, value: Any) -> Node:
    """Write `value` into Variable `ref` when run; its value is the new value."""
    if not isinstance(ref, Node) or source_kind(ref) != "variable":
        raise TypeError(f"tf.assign needs a Variable as its target, got {ref!r}")
    return make("assign", ref, value)


def group(*inputs: Node | Sequence[Node]) -> Node:
    """One node that runs all `inputs` for their effects (a list is accepted too)."""
    flat: list[Node] = []
    for item in inputs:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    return make("group", *flat)


def global_variables_initializer() -> Node:
    """Run the initializers of every Variable created so far (TF1's meaning).

    Every call covers all of them, so each new Session can run it: a second Session
    that runs `tf.global_variables_initializer()` starts from the initial values
    too. `tf.variables_initializer(var_list)`
    initializes a chosen few; `tf.reset_default_graph()` forgets the Variables made
    so far, so the next model's initializer covers only its own.
    """
    return group(*_initializers)


def variables_initializer(var_list: Sequence[Node]) -> Node:
    """TF1's tf.variables_initializer: run the initializers of the Variables in
    `var_list` only (an optimizer's slots, say, after the weights were restored)."""
    chosen = []
    for var in var_list:
        if not isinstance(var, Node) or source_kind(var) != "variable":
            raise argument_error("variables_initializer", f"{var!r} is not a Variable")
        if var not in _initializer_of:
            raise argument_error("variables_initializer", f"variable {var.name!r} "
                                 f"(created at {var.where}) has no initial value to run; "
                                 "assign it")
        chosen.append(_initializer_of[var])
    return group(*chosen)


def reset_default_graph() -> None:
    """TF1's tf.reset_default_graph: forget every Variable, initializer and update
    op made so far, so the next model's `global_variables_initializer()` and
    `trainable_variables()` cover only what is built after this call. Nodes already
    built still work; they are just no longer in the lists."""
    for collection in (_initializers, _initializer_of, _global_variables,
                       _trainable_variables, update_ops):
        collection.clear()
    deferred_shapes.clear()
    deferred_fills.clear()


initialize_all_variables = global_variables_initializer


def global_variables() -> list[Node]:
    return list(_global_variables)


def trainable_variables() -> list[Node]:
    return list(_trainable_variables)


def infer_variable_shapes(net: Node, feed_dict: dict[Node, Sequence[int]]
                          ) -> Iterator[tuple[Node, str, tuple]]:
    """Yield (variable, name, shape) for every Variable under `net`, given input shapes.

    Shape inference runs forward from the shapes in `feed_dict`; a Variable made by a
    layer with a deferred shape (tf.nn.linear, tf.nn.conv2d with num_filter) gets
    its shape from its layer's input. The variable nodes learn their shapes too.
    """
    known: dict[Node, tuple | None] = {}
    dtypes: dict[Node, Any] = {}
    for node in topological_order([net]):
        if node in feed_dict:
            known[node], dtypes[node] = tuple(feed_dict[node]), node.dtype
            continue
        kind = source_kind(node)
        if kind == "variable":
            shape = node.shape
            if (shape is None or None in shape) and node in deferred_shapes:
                source, rule = deferred_shapes[node]
                if known.get(source) is not None:
                    shape = rule(known[source])
            known[node], dtypes[node] = shape, node.dtype
            continue
        if kind == "feed":
            known[node], dtypes[node] = node.shape, node.dtype
            continue
        known[node], dtypes[node] = infer_node(
            node.op, node.inputs, node.attrs, node.where,
            shapes=[known[i] for i in node.inputs], dtypes=[dtypes[i] for i in node.inputs])
    _initialize_fills(known)
    for node in topological_order([net]):
        if source_kind(node) != "variable" or node in deferred_fills:
            continue
        shape = known[node]
        if shape is None or None in shape:
            raise ShapeError(f"infer_variable_shapes: not enough shapes in feed_dict to "
                             f"infer variable {node.name!r} (created at {node.where})")
        node.shape = tuple(shape)
        node.attrs["shape"] = tuple(shape)
        yield node, node.name, tuple(shape)


def _initialize_fills(known: dict[Node, tuple | None]) -> None:
    """Give every self-initialized layer variable whose input shape is now known its
    shape and its initializer (see `deferred_fills`)."""
    for var, fill in deferred_fills.items():
        if var not in deferred_shapes:
            continue
        source, rule = deferred_shapes[var]
        if var.shape is not None or known.get(source) is None or None in known[source]:
            continue  # initialized already, or not inferable yet
        shape = tuple(rule(known[source]))
        var.shape, var.attrs["shape"] = shape, shape
        _add_initializer(var, ops.make(
            "ones" if fill == 1.0 else "zeros", shape=shape, dtype=var.dtype.name))


def gradients(ys: Node | Sequence[Node], xs: Node | Sequence[Node],
              grad_ys: Sequence[Node] | None = None) -> list[Node | None]:
    """tf.gradients: d(sum of ys)/dx for each x, as graph nodes (see autodiff.py)."""
    from tinyflow.autodiff import gradients as _gradients
    return _gradients(ys, xs, grad_ys)


def _axis(axis: Any, reduction_indices: Any) -> Any:
    return reduction_indices if axis is None else axis


def _keepdims(keepdims: Any, keep_dims: Any) -> Any:
    """TF1's deprecated keep_dims, when given, instead of keepdims (ops checks it is
    a bool: `keepdims or keep_dims` passed a truthy string through)."""
    return keepdims if keep_dims is None else keep_dims


def reduce_sum(x, axis=None, keepdims=False, reduction_indices=None, keep_dims=None):
    return ops.reduce_sum(x, _axis(axis, reduction_indices), _keepdims(keepdims, keep_dims))


def reduce_mean(x, axis=None, keepdims=False, reduction_indices=None, keep_dims=None):
    return ops.reduce_mean(x, _axis(axis, reduction_indices), _keepdims(keepdims, keep_dims))


def reduce_max(x, axis=None, keepdims=False, reduction_indices=None, keep_dims=None):
    return ops.reduce_max(x, _axis(axis, reduction_indices), _keepdims(keepdims, keep_dims))


def reduce_min(x, axis=None, keepdims=False, reduction_indices=None, keep_dims=None):
    return ops.reduce_min(x, _axis(axis, reduction_indices), _keepdims(keepdims, keep_dims))


def argmax(x, axis=None, dimension=None):
    """tf.argmax: the index of the largest value along `axis` (TF1's default: 0)."""
    axis = axis if axis is not None else dimension
    return ops.argmax(x, 0 if axis is None else axis)


def argmin(x, axis=None, dimension=None):
    """tf.argmin: the index of the smallest value along `axis` (TF1's default: 0)."""
    axis = axis if axis is not None else dimension
    return ops.argmin(x, 0 if axis is None else axis)


def equal(a, b):
    return ops.equal(a, b)


def normal(shape, stdev=1.0, mean=0.0, dtype=np.float32, seed=None):
    """The original TinyFlow's initializer: tf.normal(shape, stdev)."""
    return ops.random_normal(shape, mean=mean, stddev=stdev, dtype=dtype, seed=seed)


def random_normal(shape, mean=0.0, stddev=1.0, dtype=np.float32, seed=None, name=None):
    return ops.random_normal(shape, mean, stddev, dtype, seed, name)


def random_uniform(shape, minval=0.0, maxval=1.0, dtype=np.float32, seed=None, name=None):
    return ops.random_uniform(shape, minval, maxval, dtype, seed, name)


def zeros(shape, dtype=np.float32, name=None):
    return ops.zeros(shape, dtype, name)


set_random_seed = ops.set_random_seed


def ones(shape, dtype=np.float32, name=None):
    return ops.ones(shape, dtype, name)


def truncated_normal(shape, mean=0.0, stddev=1.0, dtype=np.float32, seed=None, name=None):
    return ops.truncated_normal(shape, mean, stddev, dtype, seed, name)


# ----------------------------------------------------------------------------------
# TF1's other spellings of arithmetic, and small compositions of existing ops. Each
# is exactly the expression it names (no new kernel, so no new rounding).
# ----------------------------------------------------------------------------------

def add(x, y, name=None):
    return make("add", x, y, name=name)


def subtract(x, y, name=None):
    return make("sub", x, y, name=name)


def multiply(x, y, name=None):
    return make("mul", x, y, name=name)


def divide(x, y, name=None):
    """x / y, true division (ints give a float, as numpy's and TF1's divide)."""
    return make("div", x, y, name=name)


def negative(x, name=None):
    return make("neg", x, name=name)


def square(x, name=None):
    """x * x (TF1's tf.square: the same product, bit for bit)."""
    return make("mul", x, x, name=name)


def clip_by_value(t, clip_value_min, clip_value_max, name=None):
    """TF1's definition: minimum(maximum(t, min), max)."""
    return make("minimum", ops.maximum(t, clip_value_min), clip_value_max, name=name)


def add_n(inputs, name=None):
    """The sum of a list of tensors of one shape, added left to right."""
    inputs = list(inputs) if isinstance(inputs, (list, tuple)) else None
    if not inputs:
        raise argument_error("add_n", "inputs must be a non-empty list of tensors")
    shapes = {tuple(i.shape) for i in inputs
              if getattr(i, "shape", None) is not None and None not in i.shape}
    if len(shapes) > 1:   # TF1 adds only equal shapes; broadcasting would hide a slip
        raise ShapeError(f"add_n: the inputs' shapes differ: {sorted(shapes)} (at "
                         f"{user_source_line()})")
    total = inputs[0]
    for term in inputs[1:-1]:
        total = make("add", total, term)
    return total if len(inputs) == 1 else make("add", total, inputs[-1], name=name)


def stack(values, axis=0, name=None):
    """tf.stack: the tensors of one shape along a new axis `axis`."""
    if not isinstance(values, (list, tuple)) or not values:
        raise argument_error("stack", "values must be a non-empty list of tensors")
    axis = int_attr("stack", "axis", axis)
    expanded = [ops.expand_dims(v, axis) for v in values]
    return make("concat", *expanded, axis=axis, name=name)


def one_hot(indices, depth, on_value=1.0, off_value=0.0, axis=-1, dtype=np.float32,
            name=None):
    """tf.one_hot along a new last axis: on_value where the index equals the
    position, off_value elsewhere (an index outside [0, depth) gives a row of
    off_value, as in TF1)."""
    depth = int_attr("one_hot", "depth", depth)
    if depth < 0:
        raise argument_error("one_hot", f"depth must be >= 0, got {depth}")
    if axis != -1:
        raise argument_error("one_hot", f"only axis=-1 (a new last axis) is supported, "
                                        f"got {axis!r}")
    indices = shape_ops.index_operand(indices)
    kind = np.dtype(indices.dtype).kind if getattr(indices, "dtype", None) is not None else "i"
    if kind not in "iu":   # (TF1 too: 0.5 would silently match no position)
        raise argument_error("one_hot", f"indices must be integers, got {indices.dtype} "
                                        "(cast them first)")
    dtype = dtype_attr("one_hot", dtype)
    hit = ops.equal(ops.expand_dims(indices, -1), constant(np.arange(depth, dtype=np.int64)))
    return make("where", hit, constant(on_value, dtype), constant(off_value, dtype),
                name=name)


def assign_add(ref, value):
    """tf.assign_add: ref + value written into Variable ref."""
    return assign(ref, ref + value)


def assign_sub(ref, value):
    """tf.assign_sub: ref - value written into Variable ref."""
    return assign(ref, ref - value)


# v.assign(x), v.assign_add(x), v.assign_sub(x) on a Variable node (graph.Node's methods)
OPERATOR_BUILDERS.update(assign=assign, assign_add=assign_add, assign_sub=assign_sub)
