"""Random TinyFlow programs for differential tests: a hypothesis strategy and a runner.

Two ways of running the same graph must agree: with and without the graph passes,
with any memory plan, on one stream or several. This module makes the graphs; the
tests choose the two ways. It is shared by the tests of the passes, the memory
planner and the executor::

    from hypothesis import given
    from random_graphs import assert_same_results, random_graph_cases, run_case

    @given(random_graph_cases())
    def test_plans_agree(case):
        expected = run_case(case, passes=[], memory=None)
        assert_same_results(run_case(case, memory="greedy_by_size"), expected, case)

A `Case` is one random program over float64 data, built from a pool of (3, 4)
values by 1 to `max_ops` steps, each drawn from one op family:

    unary       neg, tanh, sigmoid, relu, gelu, abs, exp(tanh x), log(1 + x^2), ...
    binary      add, sub, mul, maximum, minimum, a safe division, where, pow;
                one operand may broadcast: (4,), (1, 4), (3, 1), a scalar, a bias
    identity    x*1, x+0, 0-x, neg(neg x), log(exp x), transpose twice, reshape of
                reshape, cast to the same dtype, zeros_like/ones_like, ... (simplify)
    reduce      sum, mean, max over an axis or all, kept or broadcast back
    matmul      x @ W (+ bias) (+ activation), transposes, a batched matmul
    shape       transpose, reshape, concat + getitem, gather, expand_dims/squeeze
    softmax     softmax, log_softmax, cross entropy, layer norm
    conv        conv2d (SAME / explicit padding), max and average pooling
    constant    a subexpression of constants only (fold), broadcast into the pool
    random      a random_normal draw, dropout (impure: never merged or folded)
    duplicate   the same op on the same inputs again (CSE)
    assign      assign a new value to the variable v, and use it next to a read of v

The fetches are the last values of the pool, every assign, and the gradients of a
scalar loss (a weighted sum of the pool's values that depend on no assign) with
respect to the placeholder x and the variables v, w, b.

Every random op has its own seed, and `run_case` runs each Case in a fresh Session
(whose random streams start at their seeds), so two runs draw the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

import tinyflow as tf
from tinyflow import image_ops, nn_ops, ops
from tinyflow.graph import Node

SHAPE = (3, 4)
F64 = np.float64


@dataclass
class Case:
    """One random program: what to fetch, what to feed, and the variables' start."""

    fetches: list[Node]
    feed_dict: dict[Node, np.ndarray]
    init_values: dict[Node, np.ndarray]
    description: list[str] = field(default_factory=list)
    loss: Node | None = None    # the scalar whose gradients are fetched
    wrt: list[Node] = field(default_factory=list)   # the sources of those gradients

    @property
    def variables(self) -> list[Node]:
        return list(self.init_values)

    def __repr__(self) -> str:
        body = "\n    ".join(self.description)
        return f"Case(\n    {body}\n    fetch: {', '.join(f.name for f in self.fetches)})"


def run_case(case: Case, **compile_options: Any) -> list[np.ndarray]:
    """Run `case.fetches` once in a fresh ``tf.Session(**compile_options)``.

    The variables start from `case.init_values` (copies), and the random generators
    start afresh (as in a new process), so every call draws the same numbers.
    Returns the fetched arrays, then each variable's value after the run (in
    `case.variables` order), so the effect of an assign is compared too.
    """
    # A Session has its own random streams, which start at their seeds; the global
    # ones (used by programs compiled outside a Session) are reset too.
    ops._generators.clear()
    session = tf.Session(**compile_options)
    for var, value in case.init_values.items():
        session.variables[var] = np.array(value, copy=True)
    fetched = session.run(case.fetches, case.feed_dict)
    finals = [np.array(session.variables[v], copy=True) for v in case.variables]
    return [np.asarray(a) for a in fetched] + finals


def assert_same_results(got: list[np.ndarray], expected: list[np.ndarray], case: Case,
                        what: str = "", rtol: float = 1e-5, atol: float = 1e-9) -> None:
    """Every array of `got` equals the one of `expected` (NaN where NaN), naming the
    fetch that differs. atol covers values that should be 0 but are 1e-17."""
    names = [f.name for f in case.fetches] + [f"{v.name} (after the run)"
                                               for v in case.variables]
    assert len(got) == len(expected), f"{what}: {len(got)} results, expected {len(expected)}"
    for name, a, b in zip(names, got, expected):
        assert a.shape == b.shape, f"{what}: {name} has shape {a.shape}, expected {b.shape}"
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol,
                                   err_msg=f"{what}: {name} differs\n{case!r}")


# ----------------------------------------------------------------------------------
# Running a case eagerly: each node's op on eager Tensors (tinyflow/eager.py)
# ----------------------------------------------------------------------------------

def case_sources(case: Case) -> list[Node]:
    """The placeholders, then the variables: the arguments of `eager_program`."""
    return [*case.feed_dict, *case.init_values]


def eager_program(case: Case, outputs: list[Node] | None = None) -> Any:
    """The case as a Python function of eager Tensors (one per `case_sources`), as a
    user would write it eagerly: each node, in `graph.topological_order`, runs its op
    through `eager.apply`. Returns the values of `outputs` (default: the fetches),
    then each variable's value after the run.

    An assign is replayed as the graph means it: every reader of the variable sees
    the old value (topological_order runs readers first, and the gradient rules read
    it too), and the assigned value is the variable's value after the run."""
    from tinyflow import eager
    from tinyflow.graph import topological_order
    from tinyflow.registry import mutated_input, source_kind

    outputs = case.fetches if outputs is None else outputs
    order = topological_order(outputs)
    sources = case_sources(case)

    def program(*tensors: Any) -> list[Any]:
        values = {id(node): t for node, t in zip(sources, tensors)}
        after = {id(var): t for var, t in zip(case.init_values, tensors[len(case.feed_dict):])}
        for node in order:
            if id(node) in values:
                continue
            if source_kind(node) == "constant":
                values[id(node)] = eager.tensor(node.attrs["value"].array)
            elif mutated_input(node) is not None:      # assign(var, value)
                value = values[id(node.inputs[1])]
                values[id(node)] = after[id(node.inputs[0])] = value
            else:
                inputs = [values[id(i)] for i in node.inputs]
                values[id(node)] = eager.apply(node.op, inputs, dict(node.attrs))
        return [values[id(node)] for node in outputs] + list(after.values())

    return program


def eager_arguments(case: Case, requires_grad: bool = False) -> list[Any]:
    """Fresh eager Tensors of the case's feeds and variables' starting values; with
    `requires_grad`, the gradients' sources (`case.wrt`) require grad."""
    from tinyflow import eager
    values = {**case.feed_dict, **case.init_values}
    wrt = {id(n) for n in case.wrt} if requires_grad else set()
    return [eager.tensor(values[n], requires_grad=id(n) in wrt) for n in case_sources(case)]


def run_case_eagerly(case: Case, traced: bool = False) -> list[np.ndarray]:
    """The results `run_case` gives, computed by `eager_program` (under
    `tf.function` when `traced`), without autograd."""
    from tinyflow import eager
    eager._generators.clear()     # the random streams start at their seeds
    program = eager_program(case)
    if traced:
        program = tf.function(program)
    with eager.no_grad():
        results = program(*eager_arguments(case))
    return [np.array(t.numpy(), copy=True) for t in results]


def eager_gradients(case: Case) -> list[np.ndarray | None]:
    """The gradients of `case.loss` with respect to `case.wrt` by eager backward
    (`loss.backward()`, then each source's `.grad`), as the case fetches them."""
    from tinyflow import eager
    if not case.wrt:   # the loss depends on no source (integer casts cut it off)
        return []
    eager._generators.clear()
    arguments = eager_arguments(case, requires_grad=True)
    (loss, *_) = eager_program(case, [case.loss])(*arguments)
    loss.backward()
    by_node = dict(zip(map(id, case_sources(case)), arguments))
    grads = [by_node[id(n)].grad for n in case.wrt]
    return [None if g is None else np.array(g.numpy(), copy=True) for g in grads]


# ----------------------------------------------------------------------------------
# Building a case
# ----------------------------------------------------------------------------------

class _Builder:
    """The pool of (3, 4) values a case grows from, and what each depends on."""

    def __init__(self, draw: Any, rng: np.random.Generator) -> None:
        self.draw, self.rng = draw, rng
        self.x = tf.placeholder(F64, SHAPE)
        self.aux = tf.placeholder(F64, SHAPE)  # fed, never differentiated: masks' input
        self.v = tf.Variable(shape=SHAPE, dtype=F64, trainable=False)
        self.w = tf.Variable(shape=(4, 4), dtype=F64, trainable=False)
        self.b = tf.Variable(shape=(4,), dtype=F64, trainable=False)
        self.feeds = {self.x: self.array(SHAPE, 1.5), self.aux: self.array(SHAPE, 1.5)}
        self.init = {self.v: self.array(SHAPE), self.w: self.array((4, 4), 0.6),
                     self.b: self.array((4,), 0.5)}
        self.pool: list[Node] = [self.x, self.v]
        self.after_assign: set[int] = set()  # pool values that depend on an assign
        self.assigns: list[Node] = []
        self.lines = [f"{self.x.name}, {self.aux.name}: placeholders (3, 4); "
                      f"{self.v.name} (3, 4), {self.w.name} (4, 4), {self.b.name} (4,): "
                      "variables"]

    # -- data -------------------------------------------------------------------------
    def array(self, shape: tuple, scale: float = 1.0) -> np.ndarray:
        return self.rng.uniform(-scale, scale, size=shape).astype(F64)

    def const(self, shape: tuple, scale: float = 1.0) -> Node:
        return tf.constant(self.array(shape, scale), F64)

    def choice(self, options: list | tuple) -> Any:
        return self.draw(st.sampled_from(options))

    # -- the pool -----------------------------------------------------------------------
    def pick(self, count: int = 1) -> list[Node]:
        """`count` values from the pool. A raw read of v next to a value computed
        after v's assign would be a cycle (a reader of v must run before the
        assign), so then v is read through `v * 1`: the read runs first, as the
        user's graph asks (and simplify must not undo it)."""
        picks = [self.pool[self.draw(st.integers(0, len(self.pool) - 1))]
                 for _ in range(count)]
        if any(id(p) in self.after_assign for p in picks):
            picks = [p * 1.0 if p is self.v else p for p in picks]
        return picks

    def add(self, node: Node, used: list[Node], what: str) -> None:
        if any(id(u) in self.after_assign for u in used):
            self.after_assign.add(id(node))
        self.pool.append(node)
        args = ", ".join(u.name for u in used)
        self.lines.append(f"{node.name} = {what}({args})")


def _side_operand(b: _Builder) -> Node:
    """An operand that broadcasts against (3, 4), or the bias variable."""
    kind = b.choice(["row", "row2d", "column", "scalar", "bias"])
    if kind == "bias":
        return b.b
    shape = {"row": (4,), "row2d": (1, 4), "column": (3, 1), "scalar": ()}[kind]
    return b.const(shape)


UNARY = {
    "neg": ops.neg, "tanh": ops.tanh, "sigmoid": ops.sigmoid, "relu": ops.relu,
    "gelu": ops.gelu, "abs": ops.abs,
    "exp_tanh": lambda x: ops.exp(ops.tanh(x)),
    "log_1_plus_square": lambda x: ops.log(x * x + 1.0),
    "sqrt_1_plus_square": lambda x: ops.sqrt(x * x + 1.0),
    "square": lambda x: ops.pow(x, 2.0),
    "sqrt_by_pow": lambda x: ops.pow(ops.abs(x) + 0.5, 0.5),
    "tanh_chain": lambda x: ops.tanh(ops.sigmoid(x) * 2.0 - 1.0) * 3.0,
}


def _unary(b: _Builder) -> None:
    (x,) = b.pick()
    kind = b.choice(sorted(UNARY))
    b.add(UNARY[kind](x), [x], kind)


BINARY = {
    "add": ops.add, "sub": ops.sub, "mul": ops.mul, "maximum": ops.maximum,
    "minimum": ops.minimum,
    "div": lambda a, c: a / (c * c + 1.0),
    "where": lambda a, c: ops.where(a > c, a, c * 0.5),
    "pow": lambda a, c: ops.pow(ops.abs(a) + 0.5, ops.tanh(c) + 1.5),
}


def _binary(b: _Builder) -> None:
    kind = b.choice(sorted(BINARY))
    if b.draw(st.booleans()):
        a, c = b.pick(2)
        used = [a, c]
    else:
        (a,) = b.pick()
        c = _side_operand(b)
        if b.draw(st.booleans()):
            a, c = c, a  # the broadcast operand on the left
        used = [a, c]
    b.add(BINARY[kind](a, c), used, kind)


IDENTITIES = {
    "x*1": lambda x, y: x * 1.0,
    "1*x": lambda x, y: 1.0 * x,
    "x+0": lambda x, y: x + 0.0,
    "x-0": lambda x, y: x - 0.0,
    "0-x": lambda x, y: 0.0 - x,
    "x/1": lambda x, y: x / 1.0,
    "x*-1": lambda x, y: x * -1.0,
    "pow(x,1)": lambda x, y: ops.pow(x, 1.0),
    "neg(neg x)": lambda x, y: ops.neg(ops.neg(x)),
    "log(exp(tanh x))": lambda x, y: ops.log(ops.exp(ops.tanh(x))),
    "exp(log(sigmoid x))": lambda x, y: ops.exp(ops.log(ops.sigmoid(x))),
    "transpose twice": lambda x, y: ops.transpose(ops.transpose(x)),
    "transpose three times": lambda x, y: ops.transpose(ops.transpose(
        ops.transpose(ops.transpose(x, (1, 0)), (1, 0)), (1, 0)) + ops.transpose(y)),
    "reshape of reshape": lambda x, y: ops.reshape(ops.reshape(x, (12,)), SHAPE),
    "reshape to own shape": lambda x, y: ops.reshape(x, SHAPE),
    "expand then squeeze": lambda x, y: ops.squeeze(ops.expand_dims(x, 0), 0),
    "cast to own dtype": lambda x, y: ops.make("cast", x, dtype="float64"),
    "x + zeros_like(y)": lambda x, y: x + ops.zeros_like(y),
    "x * ones_like(y)": lambda x, y: x * ops.ones_like(y),
    "x + neg(y)": lambda x, y: x + ops.neg(y),
    "x - neg(y)": lambda x, y: x - ops.neg(y),
    "where(c, x, x)": lambda x, y: ops.where(y > 0.0, x, x),
    "maximum(x, x)": lambda x, y: ops.maximum(x, x),
    "broadcast_to own shape": lambda x, y: ops.broadcast_to(x, SHAPE),
    "x[:, :]": lambda x, y: x[:, :],
    "concat([x])": lambda x, y: ops.concat([x], 1),
}


def _identity(b: _Builder) -> None:
    x, y = b.pick(2)
    kind = b.choice(sorted(IDENTITIES))
    b.add(IDENTITIES[kind](x, y), [x, y], kind)


def _reduce(b: _Builder) -> None:
    x, y = b.pick(2)
    reducer = b.choice([ops.reduce_sum, ops.reduce_mean, ops.reduce_max])
    axis = b.choice([0, 1, None, (0, 1)])
    keep = b.draw(st.booleans())
    r = reducer(x, axis, keepdims=keep)
    name = f"{reducer.__name__}(axis={axis}, keepdims={keep})"
    if axis == 0 and not keep:
        out = tf.nn.bias_add(y, r) if b.draw(st.booleans()) else y * r
    elif axis == 1 and not keep:
        out = y - ops.expand_dims(r, 1)
    else:
        out = y + r
    b.add(out, [x, y], name + " then combined")


def _matmul(b: _Builder) -> None:
    kind = b.choice(["dense", "constant", "gram", "batched"])
    if kind == "dense":
        (x,) = b.pick()
        transpose = b.draw(st.booleans())
        out = ops.matmul(x, b.w, transpose_b=transpose)
        bias = b.choice(["none", "add", "add_left", "bias_add"])
        if bias == "add":
            out = out + b.b
        elif bias == "add_left":
            out = b.b + out
        elif bias == "bias_add":
            out = tf.nn.bias_add(out, b.b)
        act = b.choice(["none", "relu", "tanh", "sigmoid", "gelu"])
        if act != "none":
            out = getattr(ops, act)(out)
        b.add(out, [x], f"dense(transpose_b={transpose}, bias={bias}, act={act})")
    elif kind == "constant":
        (x,) = b.pick()
        b.add(ops.matmul(x, b.const((4, 4), 0.6)), [x], "matmul by a constant")
    elif kind == "gram":
        x, y, z = b.pick(3)
        gram = ops.matmul(x, y, transpose_a=True) * 0.3   # (4, 4)
        b.add(ops.matmul(z, gram), [x, y, z], "z @ (x^T y)")
    else:
        (x,) = b.pick()
        batched = ops.matmul(ops.reshape(x, (1, 3, 4)), b.w)
        b.add(ops.reshape(batched, SHAPE), [x], "batched matmul")


def _shape(b: _Builder) -> None:
    kind = b.choice(["transpose_reshape", "concat1", "concat0", "reshape_transpose",
                     "rows", "gather", "reverse"])
    x, y = b.pick(2)
    if kind == "transpose_reshape":
        out = ops.reshape(ops.transpose(x), SHAPE)
    elif kind == "concat1":
        out = ops.concat([x, y], 1)[:, 2:6]
    elif kind == "concat0":
        out = ops.concat([x, y], 0)[1:4]
    elif kind == "reshape_transpose":
        out = ops.reshape(ops.transpose(ops.reshape(x, (2, 6))), SHAPE)
    elif kind == "rows":
        out = ops.concat([x[2:3], y[0:2]], 0)
    elif kind == "gather":
        out = ops.gather(x, tf.constant(np.array([2, 0, 1, 0]), np.int64))[1:]
    else:
        out = x[:, ::-1]
    b.add(out, [x, y], kind)


def _softmax(b: _Builder) -> None:
    (x,) = b.pick()
    kind = b.choice(["softmax", "log_softmax", "cross_entropy", "layer_norm"])
    if kind == "softmax":
        out = nn_ops.softmax(x)
    elif kind == "log_softmax":
        out = nn_ops.log_softmax(x)
    elif kind == "cross_entropy":
        labels = tf.constant(b.rng.integers(0, 4, size=3), np.int64)
        out = x + ops.expand_dims(nn_ops.softmax_cross_entropy(x, labels), 1)
    else:
        out = nn_ops.layer_norm(x, b.const((4,)), b.b)
    b.add(out, [x], kind)


def _conv(b: _Builder) -> None:
    (x,) = b.pick()
    image = ops.reshape(x, (1, 1, 3, 4))
    kind = b.choice(["conv_same", "conv_pad", "max_pool", "avg_pool"])
    if kind == "conv_same":
        out = ops.reduce_sum(image_ops.conv2d(image, b.const((2, 1, 2, 2), 0.7), 1, "SAME"),
                             1, keepdims=True)
    elif kind == "conv_pad":
        out = image_ops.conv2d(image, b.const((1, 1, 3, 3), 0.5), 1, 1)
    elif kind == "max_pool":
        out = image_ops.max_pool2d(image, 2, 1, "SAME")
    else:
        out = image_ops.avg_pool2d(image, 2, 1, "SAME")
    b.add(ops.reshape(out, SHAPE), [x], kind)


def _constant(b: _Builder) -> None:
    (x,) = b.pick()
    c1, c2 = b.const(SHAPE), b.const((4,))
    folded = ops.tanh(c1 * c2 + 1.0) - ops.ones(SHAPE, F64) * 0.5
    b.add(x + folded if b.draw(st.booleans()) else x * folded, [x], "constants only, then op")


def _random(b: _Builder) -> None:
    (x,) = b.pick()
    kind = b.choice(["normal", "dropout", "dropout_aux", "dropout_constant"])
    if kind == "normal":
        out = x + ops.random_normal(SHAPE, 0.0, 0.1, F64)
    elif kind == "dropout":
        out = tf.nn.dropout(x, 0.5)
    elif kind == "dropout_aux":
        out = x * ops.make("dropout_mask", b.aux, rate=0.5, seed=ops._next_seed(None))
    else:
        out = x + tf.nn.dropout(b.const(SHAPE), rate=0.3)
    b.add(out, [x], kind)


def _duplicate(b: _Builder) -> None:
    built = [n for n in b.pool if n.inputs and ops.REGISTRY[n.op].pure]
    if not built:
        _unary(b)
        return
    node = built[b.draw(st.integers(0, len(built) - 1))]
    twin = ops.make(node.op, *node.inputs, **node.attrs)
    b.add(node + twin, [node], "duplicate then add")


def _assign(b: _Builder) -> None:
    if b.assigns:  # one assign per case: two writes of v in one run have no order
        _unary(b)
        return
    (x,) = b.pick()
    new_v = tf.assign(b.v, ops.tanh(x) * 0.5 + b.v * 0.5)
    b.assigns.append(new_v)
    b.after_assign.add(id(new_v))
    # The old value (a read of v, which runs before the assign) next to the new one.
    out = b.v * 1.0 + new_v * 2.0
    b.after_assign.add(id(out))
    b.pool.append(out)
    b.lines.append(f"{new_v.name} = assign({b.v.name}, ...{x.name}); "
                   f"{out.name} = {b.v.name} * 1 + {new_v.name} * 2")


FAMILIES = {
    "unary": _unary, "binary": _binary, "identity": _identity, "reduce": _reduce,
    "matmul": _matmul, "shape": _shape, "softmax": _softmax, "conv": _conv,
    "constant": _constant, "random": _random, "duplicate": _duplicate, "assign": _assign,
}


# ----------------------------------------------------------------------------------
# More families, for the bitwise fuzz test (tests/test_bitwise.py): other dtypes,
# Python literals, narrow dtypes and explicitly seeded random ops. Not in FAMILIES, so the tests
# that use the default families keep drawing the same cases.
# ----------------------------------------------------------------------------------

def _integers(b: _Builder) -> None:
    """int32/int64 arithmetic on a value cast to integers: the planner and fusion
    see integer buffers, ufuncs and literals; the result comes back as float64."""
    (x,) = b.pick()
    dtype = b.choice([np.int32, np.int64])
    i = ops.cast(x * 7.0, dtype)
    kind = b.choice(["arith", "minmax", "reduce", "where", "neg_abs", "matmul"])
    if kind == "arith":
        out = (i * 3 + i) - ops.cast(tf.constant(np.arange(4), np.int64), dtype)
    elif kind == "minmax":
        out = ops.maximum(i, ops.minimum(i * 2, ops.cast(tf.constant(5), dtype)))
    elif kind == "reduce":
        out = i + ops.expand_dims(ops.reduce_sum(ops.transpose(i), 0), 1)
    elif kind == "where":
        out = ops.where(i > 0, i, ops.neg(i) * 2)
    elif kind == "neg_abs":
        out = ops.abs(ops.neg(i)) - i
    else:
        out = ops.matmul(i, ops.transpose(i))[:, :1] + i
    b.add(ops.cast(out, F64) * 0.125, [x], f"{np.dtype(dtype).name} {kind}")


def _float32(b: _Builder) -> None:
    """float32 work whose rounding depends on the order of additions: reductions and
    products of transposes (planned and unplanned must still agree bitwise)."""
    (x,) = b.pick()
    f = ops.cast(x, np.float32) * 1000.0
    kind = b.choice(["sum_transpose", "mean_transpose", "matmul_transpose", "tanh_sum"])
    if kind == "sum_transpose":
        out = f + ops.reduce_sum(ops.transpose(f) * 1.001, 1) / 3.0
    elif kind == "mean_transpose":
        out = f - ops.expand_dims(ops.reduce_mean(ops.transpose(f), 0), 1)
    elif kind == "matmul_transpose":
        out = ops.matmul(ops.transpose(f) * 0.01, f)[:3] + f
    else:
        out = ops.tanh(f * 0.001) + ops.reduce_sum(ops.transpose(f))
    b.add(ops.cast(out, F64), [x], f"float32 {kind}")


LITERALS = {
    "x + row list": lambda x: x + [1.5, -2.25, 0.5, 3.0],
    "column list * x": lambda x: [[2.0], [-1.0], [0.5]] * x,
    "x - 3": lambda x: x - 3,
    "x * 0.1": lambda x: x * 0.1,
    "2.5 / (1 + x^2)": lambda x: 2.5 / (x * x + 1),
    "x ** 2": lambda x: x ** 2,
    "maximum(x, 0.25)": lambda x: ops.maximum(x, 0.25),
    "where(x > 0, x, -1)": lambda x: ops.where(x > 0.0, x, -1.0),
    "x + np.float32": lambda x: x + np.float32(0.3),
}


def _literals(b: _Builder) -> None:
    """Python numbers, lists and numpy scalars as operands (they become constants)."""
    (x,) = b.pick()
    kind = b.choice(sorted(LITERALS))
    b.add(LITERALS[kind](x), [x], f"literal {kind}")


_seeds = iter(range(5_000, 10**9))  # explicit seeds, distinct per op


def _seeded_random(b: _Builder) -> None:
    """Random ops with explicit seeds (tf.random_normal(seed=...), dropout(seed=...)),
    each seed used once: every op has its own stream of numbers."""
    (x,) = b.pick()
    seed = next(_seeds)
    kind = b.choice(["normal", "uniform", "dropout", "dropout_of_matmul"])
    if kind == "normal":
        out = x + ops.random_normal(SHAPE, 0.0, 0.1, F64, seed=seed)
    elif kind == "uniform":
        out = x * ops.random_uniform(SHAPE, 0.5, 1.5, F64, seed=seed)
    elif kind == "dropout":
        out = tf.nn.dropout(x, 0.5, seed=seed)
    else:
        out = tf.nn.dropout(ops.matmul(x, b.w), rate=0.3, seed=seed)
    b.add(out, [x], f"seeded {kind} (seed={seed})")


def _shared_seed_random(b: _Builder) -> None:
    """Random ops that share a seed (random_normal and dropout with seed=42 on
    different inputs): each must still get its own numbers, whatever order they run
    in (issue 14 item 1)."""
    x, y = b.pick(2)
    seed = b.choice([7, 42])
    first = ops.random_normal(SHAPE, 0.0, 0.1, F64, seed=seed) + x
    second = tf.nn.dropout(ops.matmul(y, b.w), 0.5, seed=seed)
    b.add(first + second * 2.0, [x, y], f"random_normal and dropout with seed={seed}")


def _narrow(b: _Builder) -> None:
    """float16, int8, uint8 and bool values (x cast, float16 overflowing to +-inf)
    through ops whose answer once depended on the options or the mode: pow(x, 0.5)
    of float16 (simplify made it sqrt: -inf and -0.0 differ), max pooling of ints and
    booleans (padded with -inf), where with a literal branch, means of ints, and
    literals that wrap around in narrow ints. The result comes back as float64."""
    (x,) = b.pick()
    dtype = b.choice([np.float16, np.int8, np.uint8, np.bool_])
    if dtype == np.float16:
        # |x| > 0.66 overflows to -inf or inf, and 0 * -1 is -0.0
        n = ops.cast(x * 1e5, dtype) * ops.cast(ops.abs(x) > 0.2, dtype) * -1.0
    elif dtype == np.bool_:
        n = x > 0.25
    else:
        n = ops.cast(x * 100.0, dtype)                 # wraps around in uint8
    kind = b.choice(["pow_half", "max_pool", "where_literal", "mean", "literal_arith"])
    if kind == "pow_half":
        out = ops.pow(ops.cast(n, np.float16), 0.5)
    elif kind == "max_pool":
        out = image_ops.max_pool2d(ops.reshape(n, (1, 1, 3, 4)), 3, 2, "SAME")
        out = ops.reshape(ops.broadcast_to(ops.reshape(out, (1, 2, 2)), (3, 2, 2)), (3, 4))
    elif kind == "where_literal":
        out = ops.where(n > 0, n, 1) if dtype != np.bool_ else ops.where(n, 0, n)
    elif kind == "mean":
        out = ops.reduce_mean(n, 1, keepdims=True) + ops.reduce_mean(n, 0)
    else:
        out = (n + 1) * 3 - 2 if dtype != np.bool_ else n * 2 + 1
    b.add(ops.cast(out, F64), [x], f"{np.dtype(dtype).name} {kind}")


EXTRA_FAMILIES = {"integers": _integers, "float32": _float32, "literals": _literals,
                  "narrow": _narrow,
                  "seeded_random": _seeded_random, "shared_seed_random": _shared_seed_random}


@st.composite
def random_graph_cases(draw: Any, max_ops: int = 10, families: dict | None = None) -> Case:
    """A hypothesis strategy of `Case`s: 1 to `max_ops` random steps (see the module
    docstring), their outputs, assigns, and gradients of a scalar loss. `families`
    (name -> builder) replaces FAMILIES when given."""
    families = FAMILIES if families is None else families
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b = _Builder(draw, rng)
    for _ in range(draw(st.integers(1, max_ops))):
        families[draw(st.sampled_from(sorted(families)))](b)
    count = draw(st.integers(1, 3))
    outputs = [n for n in b.pool[2:][-count:]] or [b.pool[-1]]
    differentiable = [n for n in b.pool[2:] if id(n) not in b.after_assign][-3:] or [b.x]
    loss = None
    for node in differentiable:
        term = ops.reduce_sum(node * b.const(SHAPE))
        loss = term if loss is None else loss + term
    xs = [b.x, b.v, b.w, b.b]
    pairs = [(x, g) for x, g in zip(xs, tf.gradients(loss, xs)) if g is not None]
    grads = [g for _, g in pairs]
    b.lines.append(f"loss = weighted sum of {', '.join(n.name for n in differentiable)}; "
                   f"{len(grads)} gradients")
    fetches = outputs + b.assigns + [loss] + grads
    return Case(fetches, b.feeds, b.init, b.lines, loss, [x for x, _ in pairs])
