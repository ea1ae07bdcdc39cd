"""Tests of the graph passes (tinyflow/passes.py) and the fused ops (tinyflow/fusion.py).

Small graphs with exact expectations (what each pass removes, merges, folds and
fuses, and the reason it records); impure ops that must never be merged, folded or
removed; idempotence; and the differential test: over 200 random graphs
(tests/random_graphs.py), the optimized program and each pass alone give the same
outputs, variable updates and gradients as the unoptimized one.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from random_graphs import assert_same_results, random_graph_cases, run_case

import tinyflow as tf
from tinyflow import fusion, nn_ops, ops, passes
from tinyflow.graph import Graph, Node, TinyFlowError
from tinyflow.registry import mutated_input

F64 = np.float64
PASS_NAMES = [p.name for p in passes.PIPELINE]


def optimize(fetches, feeds=None, variables=(), only=None):
    """Specialize `fetches` as compile does and run the passes named in `only`
    (default: the whole pipeline). Returns (graph, ctx)."""
    sources = {node: (value.shape, value.dtype) for node, value in (feeds or {}).items()}
    sources.update({v: (v.shape, v.dtype) for v in variables})
    graph, _ = passes.specialize(list(fetches), sources)
    ctx = passes.PassContext()
    return passes.run_pipeline(graph, ctx, passes=only), ctx


def ops_of(graph: Graph) -> Counter:
    return Counter(n.op for n in graph.nodes)


def reasons(ctx, pass_name=None) -> list[str]:
    return [r.reason for r in ctx.records if pass_name in (None, r.pass_name)]


def mlp_training_graph():
    """A small MLP with a cross-entropy loss, its gradients and Adam updates."""
    x = tf.placeholder(tf.float32, (8, 5))
    labels = tf.placeholder(tf.int64, (8,))
    net = tf.nn.MLP([5, 7, 3])
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(net(x), labels))
    train = tf.train.AdamOptimizer(0.01).minimize(loss)
    rng = np.random.default_rng(0)
    feeds = {x: rng.standard_normal((8, 5)).astype(np.float32),
             labels: rng.integers(0, 3, 8)}
    return [train, loss], feeds, tf.global_variables()


# ----------------------------------------------------------------------------------
# simplify
# ----------------------------------------------------------------------------------

def test_simplify_removes_identities_with_their_reasons():
    x = tf.placeholder(F64, (2, 3), name="x")
    one, zero = tf.constant(1.0, F64), tf.constant(-0.0, F64)  # x + -0.0 is x, bitwise
    times_one = x * one
    plus_zero = times_one + zero
    inner = ops.neg(plus_zero)
    outer = ops.neg(inner)
    graph, ctx = optimize([outer], {x: np.zeros((2, 3))}, only=["simplify"])
    assert graph.outputs[0].op == "placeholder" and graph.outputs[0].name == "x"
    assert [(r.reason, r.removed, r.added) for r in ctx.records] == [
        ("mul(x, 1) -> x", [times_one.name], []),
        ("add(x, -0.0) -> x", [plus_zero.name], []),
        ("neg(neg(x)) -> x", [outer.name], []),
        ("no longer used after the rewrites above", [one.name, zero.name, inner.name], [])]
    assert len(graph.nodes) == 1


def test_simplify_keeps_broadcasts_promotions_and_variables():
    x = tf.placeholder(F64, (3, 1))
    f32 = tf.placeholder(tf.float32, (3,))
    v = tf.Variable(np.ones(3, F64))
    broadcast = x * tf.ones((3, 4), F64)                 # x * 1, but the result is 3x4
    promoted = f32 * tf.constant(1.0, F64)               # float32 * 1.0 is float64
    variable = v * 1.0                                   # v stays read through a node
    graph, ctx = optimize([broadcast, promoted, variable],
                          {x: np.zeros((3, 1)), f32: np.zeros(3, np.float32)}, [v],
                          only=["simplify"])
    assert ctx.records == []
    assert [o.op for o in graph.outputs] == ["mul", "mul", "mul"]


def test_simplify_leaves_inexact_identities():
    # log(exp(x)) is inf at x = 200 and 1 ulp off x for many float32 values; exp(log(x))
    # likewise; a float x + 0.0 turns -0.0 into +0.0 (tests/test_rules_exact.py).
    x = tf.placeholder(F64, (4,))
    graph, ctx = optimize([tf.exp(tf.log(tf.sigmoid(x))), tf.log(tf.exp(x)), x + 0.0],
                          {x: np.zeros(4)}, only=["simplify"])
    assert [o.op for o in graph.outputs] == ["exp", "log", "add"]
    assert ctx.records == []


def test_simplify_composes_transposes_and_reshapes():
    x = tf.placeholder(F64, (2, 3, 4))
    once = ops.transpose(ops.transpose(x, (1, 0, 2)), (0, 2, 1))
    back = ops.transpose(ops.transpose(x, (2, 0, 1)), (1, 2, 0))
    flat = ops.reshape(ops.expand_dims(ops.reshape(x, (6, 4)), 0), (24,))
    graph, ctx = optimize([once, back, flat], {x: np.zeros((2, 3, 4))}, only=["simplify"])
    first, second, third = graph.outputs
    assert first.op == "transpose" and first.attrs["axes"] == (1, 2, 0)
    assert first.inputs[0].op == "placeholder"
    assert second.op == "placeholder"
    assert third.op == "reshape" and third.inputs[0].op == "placeholder"
    value = np.arange(24.0).reshape(2, 3, 4)
    for p in (None, []):
        got = tf.Session(passes=p).run([once, back, flat], {x: value})
        np.testing.assert_array_equal(got[0], value.transpose(1, 0, 2).transpose(0, 2, 1))
        np.testing.assert_array_equal(got[1], value)
        np.testing.assert_array_equal(got[2], value.reshape(24))


def test_simplify_shape_only_ops_lose_their_input():
    """Ops that read only their input's shape stop depending on its value: the
    value need not be computed, nor kept alive until then."""
    x = tf.placeholder(F64, (2, 5))
    y = tf.placeholder(F64, (10,))
    z = (tf.zeros_like(tf.tanh(x)) + ops.make("count_ratio", tf.reduce_sum(x, 0), x)
         + ops.reshape_like(y, x) + ops.broadcast_like(tf.reduce_sum(y), x))
    value = np.arange(10.0)
    graph, ctx = optimize([z], {x: np.zeros((2, 5)), y: value}, only=["simplify"])
    assert set(reasons(ctx)) >= {
        "zeros_like(x) -> zeros(shape of x)",
        "count_ratio(y, x) -> constant size(y) / size(x)",
        "reshape_like(x, ref) -> reshape(x, shape of ref)",
        "broadcast_like(x, ref) -> broadcast_to(x, shape of ref)"}
    assert [n.name for n in graph.nodes if n.op == "placeholder"] == [y.name]
    ratio = [n for n in graph.nodes if n.op == "constant"][0]
    assert float(ratio.attrs["value"].array) == pytest.approx(0.5)
    for p in (None, []):
        got = tf.Session(passes=p).run(z, {x: np.zeros((2, 5)), y: value})
        np.testing.assert_allclose(got, 0.5 + value.reshape(2, 5) + value.sum())


def test_simplify_pow_rules():
    x = tf.placeholder(F64, (3,))
    graph, ctx = optimize([x ** 2.0, (x * x) ** 0.5], {x: np.zeros(3)}, only=["simplify"])
    assert [o.op for o in graph.outputs] == ["mul", "sqrt"]
    assert graph.outputs[0].inputs == (graph.outputs[0].inputs[0],) * 2
    assert reasons(ctx) == ["pow(x, 2) -> mul(x, x)", "pow(x, 0.5) -> sqrt(x)",
                            "no longer used after the rewrites above"]


def test_add_rule_extends_the_table(monkeypatch):
    from tinyflow import rules as rule_table  # the table lives in rules.py
    monkeypatch.setattr(rule_table, "RULES", list(rule_table.RULES))
    monkeypatch.setattr(rule_table, "RULES_BY_OP",
                        {op: list(rs) for op, rs in rule_table.RULES_BY_OP.items()})
    rule_table.add_rule(passes.Rule("relu(relu(x)) -> relu(x)", "relu",
                                lambda n: n.inputs[0] if n.inputs[0].op == "relu" else None))
    x = tf.placeholder(F64, (3,))
    outer = tf.nn.relu(tf.nn.relu(x))
    graph, ctx = optimize([outer], {x: np.zeros(3)}, only=["simplify"])
    assert [(r.reason, r.removed) for r in ctx.records] == [("relu(relu(x)) -> relu(x)",
                                                             [outer.name])]
    assert graph.outputs[0].op == "relu" and graph.outputs[0].inputs[0].op == "placeholder"


# ----------------------------------------------------------------------------------
# cse
# ----------------------------------------------------------------------------------

def test_cse_merges_same_op_inputs_and_attrs():
    x = tf.placeholder(F64, (2, 3))
    y = tf.placeholder(F64, (2, 3))
    t1, t2 = tf.tanh(x), tf.tanh(x)
    s1, s2 = x + y, y + x                                # add is commutative
    d1, d2 = x - y, y - x                                # sub is not
    r0, r1 = tf.reduce_sum(x, 0), tf.reduce_sum(x, 1)    # different attrs
    out = [t1 * t2, s1 * s2, d1 * d2, r0, r1]
    graph, ctx = optimize(out, {x: np.zeros((2, 3)), y: np.zeros((2, 3))}, only=["cse"])
    assert reasons(ctx) == [f"same op, inputs and attrs as {t1.name}",
                            f"same op, inputs and attrs as {s1.name}"]
    assert [r.removed for r in ctx.records] == [[t2.name], [s2.name]]
    counts = ops_of(graph)
    assert counts["tanh"] == 1 and counts["add"] == 1 and counts["sub"] == 2
    assert counts["sum"] == 2
    survivor = next(n for n in graph.nodes if n.op == "tanh")
    assert survivor.provenance == (t1.name, t2.name)


def test_cse_merges_equal_constants_by_value():
    x = tf.placeholder(F64, (3,))
    a, b = tf.constant(np.array([1.0, 2.0, 3.0]), F64), tf.constant(np.array([1.0, 2, 3]), F64)
    c = tf.constant(np.array([1.0, 2.0, 4.0]), F64)
    xa, xb = x * a, x * b
    graph, ctx = optimize([xa + xb + c], {x: np.zeros(3)}, only=["cse"])
    assert reasons(ctx) == [f"same op, inputs and attrs as {a.name}",
                            f"same op, inputs and attrs as {xa.name}"]
    assert [r.removed for r in ctx.records] == [[b.name], [xb.name]]
    assert ops_of(graph)["constant"] == 2 and ops_of(graph)["mul"] == 1


def test_cse_never_merges_impure_ops():
    x = tf.placeholder(F64, (2, 2))
    r1 = tf.random_normal((2, 2), dtype=F64, seed=5)
    r2 = tf.random_normal((2, 2), dtype=F64, seed=5)     # same attrs, still two draws
    m1 = ops.make("dropout_mask", x, rate=0.5, seed=9)
    m2 = ops.make("dropout_mask", x, rate=0.5, seed=9)
    graph, ctx = optimize([r1 + r2, x * m1 + x * m2], {x: np.ones((2, 2))}, only=["cse"])
    assert ctx.records == []
    assert ops_of(graph)["random_normal"] == 2 and ops_of(graph)["dropout_mask"] == 2
    first, second = tf.Session().run([r1 + r2, x * m1 - x * m2], {x: np.ones((2, 2))})
    assert not np.allclose(second, 0.0)                  # two masks, two different draws


# ----------------------------------------------------------------------------------
# fold
# ----------------------------------------------------------------------------------

def test_fold_replaces_a_constant_subgraph_by_one_constant():
    x = tf.placeholder(F64, (2, 2))
    a = tf.constant(np.ones((2, 2)), F64)
    folded_part = tf.tanh(a * 2.0) + 1.0                 # 5 nodes: a, 2, mul, tanh, 1, add
    graph, ctx = optimize([x * folded_part], {x: np.zeros((2, 2))}, only=["fold"])
    assert len(ctx.records) == 1
    record = ctx.records[0]
    assert record.reason == "folded 6 constant nodes into one (2x2 float64)"
    assert record.added == [f"folded_{folded_part.name}"]
    assert sorted(record.removed) == sorted(n.name for n in [
        a, folded_part.inputs[0], folded_part.inputs[0].inputs[0],
        folded_part.inputs[0].inputs[0].inputs[1], folded_part, folded_part.inputs[1]])
    const = graph.outputs[0].inputs[1]
    np.testing.assert_allclose(const.attrs["value"].array, np.tanh(2.0) + 1.0)
    assert const.provenance[0] == folded_part.name


def test_fold_respects_the_size_cap():
    x = tf.placeholder(F64, (300, 300))
    big = tf.zeros((300, 300), F64) + 1.0                # 720 kB: too big to bake in
    small = tf.zeros((3,), F64) + 1.0
    graph, ctx = optimize([x * big, small], {x: np.zeros((300, 300))}, only=["fold"])
    assert [r.added for r in ctx.records] == [[f"folded_{small.name}"]]
    assert graph.outputs[0].inputs[1].op == "add"


def test_fold_never_folds_random_ops():
    scaled = tf.random_uniform((3,), dtype=F64, seed=3) * tf.constant(2.0, F64)
    dropped = tf.nn.dropout(tf.constant(np.ones(4), F64), 0.5)
    graph, ctx = optimize([scaled, dropped], only=["fold"])
    assert ctx.records == []
    session = tf.Session()
    first, second = session.run([scaled, dropped]), session.run([scaled, dropped])
    assert not np.array_equal(first[0], second[0])       # a new draw every run
    assert {0.0, 2.0} >= set(np.concatenate([first[1], second[1]]))


def test_fold_leaves_a_failing_kernel_to_the_run():
    logits = tf.constant(np.zeros((2, 3)), F64)
    labels = tf.constant(np.array([0, 7]), np.int64)     # 7 is out of range
    loss = nn_ops.softmax_cross_entropy(logits, labels)
    graph, ctx = optimize([loss], only=["fold"])
    assert ctx.records == []
    with pytest.raises(TinyFlowError, match=r"labels must be in \[0, 3\)"):
        tf.Session().run(loss)


# ----------------------------------------------------------------------------------
# dce
# ----------------------------------------------------------------------------------

def test_dce_keeps_effects_and_drops_pure_group_inputs():
    x = tf.placeholder(F64, (2,))
    v = tf.Variable(np.zeros(2, F64))
    update = tf.assign(v, x + 1.0)
    pure = tf.tanh(x)
    draw = tf.random_normal((2,), dtype=F64, seed=1)
    step = tf.group(update, pure, draw, update)
    graph, ctx = optimize([step], {x: np.zeros(2)}, [v], only=["dce"])
    group = graph.outputs[0]
    assert [i.op for i in group.inputs] == ["assign", "random_normal"]
    assert reasons(ctx) == [f"{step.name} runs {pure.name} only for its effect, and it has none",
                            f"{step.name} listed an input twice"]
    session = tf.Session()
    session.run(tf.global_variables_initializer())
    session.run(step, {x: np.array([1.0, 2.0])})
    np.testing.assert_array_equal(session.run(v), [2.0, 3.0])


# ----------------------------------------------------------------------------------
# fusion
# ----------------------------------------------------------------------------------

def test_fuse_elementwise_builds_the_program():
    x, y, z = (tf.placeholder(F64, (2, 3)) for _ in range(3))
    out = tf.nn.relu(x * y + z)
    graph, ctx = optimize([out], {n: np.zeros((2, 3)) for n in (x, y, z)},
                          only=["fuse_elementwise"])
    (fused,) = [n for n in graph.nodes if n.op == "fused_elementwise"]
    assert fused is graph.outputs[0] and fused.name == f"fused_{out.name}"
    assert fused.attrs["program"] == (("mul", ("x0", "x1"), ()), ("add", ("t0", "x2"), ()),
                                      ("relu", ("t1",), ()))
    assert [i.name for i in fused.inputs] == [x.name, y.name, z.name]
    assert reasons(ctx) == ["fused 3 elementwise ops (mul, add, relu), each read only by "
                            "the next, into one kernel"]
    assert fusion.format_program(fused.attrs["program"]) == \
        "t0 = mul(x0, x1); t1 = add(t0, x2); t2 = relu(t1)"
    assert set(fused.provenance) == {out.name, out.inputs[0].name, out.inputs[0].inputs[0].name}


def test_fuse_elementwise_stops_at_shared_and_fetched_values():
    x = tf.placeholder(F64, (4,))
    shared = tf.tanh(x) * 2.0                            # read twice: a group root
    a, b = tf.exp(shared) + 1.0, tf.sigmoid(shared) - 1.0
    fetched = ops.neg(x)                                 # fetched: must stay a value
    out = a * b + fetched
    graph, ctx = optimize([out, fetched], {x: np.zeros(4)}, only=["fuse_elementwise"])
    programs = sorted(fusion.program_ops(n.attrs["program"])
                      for n in graph.nodes if n.op == "fused_elementwise")
    assert programs == [["exp", "add", "sigmoid", "sub", "mul", "add"], ["tanh", "mul"]]
    assert graph.outputs[1].op == "neg"
    value = np.linspace(-2, 2, 4)
    for p in (None, []):
        got = tf.Session(passes=p).run(out, {x: value})
        s = np.tanh(value) * 2
        np.testing.assert_allclose(got, (np.exp(s) + 1) * (1 / (1 + np.exp(-s)) - 1) - value)


def test_fused_elementwise_reuses_temporaries_and_writes_into_out():
    chain = (("neg", ("x0",), ()), ("exp", ("t0",), ()), ("tanh", ("t1",), ()),
             ("mul", ("t2", "x1"), ()), ("add", ("t3", "x0"), ()))
    plan = fusion._make_plan(chain, [(5, 4), ()], [np.dtype(F64)] * 2)
    assert plan.buffers == [((5, 4), np.dtype(F64))]     # the chain runs in `out` alone
    tree = (("exp", ("x0",), ()), ("tanh", ("x0",), ()), ("add", ("t0", "t1"), ()),
            ("mul", ("x1", "x1"), ()), ("sub", ("t2", "t3"), ()))
    plan = fusion._make_plan(tree, [(5, 4), ()], [np.dtype(F64)] * 2)
    assert plan.buffers[1:] == [((5, 4), np.dtype(F64)), ((), np.dtype(F64))]
    assert [step[3] for step in plan.steps] == [0, 1, 0, 2, 0]  # exp and the sum in `out`
    x, s = np.linspace(-1, 1, 20).reshape(5, 4), np.array(0.7)
    expected = np.exp(x) + np.tanh(x) - s * s
    out = np.empty((5, 4))
    for _ in range(2):                                   # the second run reuses buffers
        result = fusion._fused_elementwise_compute(np, x, s, out=out, program=tree)
        assert result is out
        np.testing.assert_allclose(out, expected)
        fresh = fusion._fused_elementwise_compute(np, x, s, program=tree)
        np.testing.assert_allclose(fresh, expected)
        assert fresh is not out


def test_generated_kernel_lowers_ufuncs_and_matches_the_registry():
    program = (("mul", ("x0", "x1"), ()), ("sigmoid", ("t0",), ()),
               ("cast", ("t1",), (("dtype", "float32"),)))
    source = fusion.generated_source(program, [(3,), ()], [np.dtype(F64)] * 2)
    assert "f0(x0, x1, out=" in source                 # mul: numpy.multiply itself
    assert "c1(xp, " in source and "**a2" in source    # sigmoid, cast: registry computes
    rng = np.random.default_rng(1)
    lowered = {op: d.ufunc for op, d in ops.REGISTRY.items() if d.ufunc is not None}
    assert len(lowered) >= 20
    for op, ufunc in lowered.items():                  # the lowering facts are exact
        opdef = ops.REGISTRY[op]
        args = [rng.uniform(0.5, 2.0, 4) for _ in range(2 if op not in (
            "neg", "exp", "log", "sqrt", "tanh", "abs", "sign") else 1)]
        expected = opdef.compute(np, *args, out=np.empty(4, opdef.infer(
            [(4,)] * len(args), [np.dtype(F64)] * len(args), {})[1]))
        np.testing.assert_array_equal(getattr(np, ufunc)(*args), expected, err_msg=op)


def test_fuse_dense_with_and_without_activation():
    x = tf.placeholder(F64, (4, 3))
    w = tf.Variable(np.linspace(-1, 1, 15).reshape(3, 5))
    b = tf.Variable(np.linspace(0, 1, 5))
    hidden = tf.tanh(tf.matmul(x, w) + b)
    graph, ctx = optimize([hidden], {x: np.zeros((4, 3))}, [w, b], only=["fuse_dense"])
    (dense,) = [n for n in graph.nodes if n.op == "fused_dense"]
    assert dense.attrs == {"transpose_a": False, "transpose_b": False, "activation": "tanh"}
    assert reasons(ctx) == ["matmul + add + tanh -> fused_dense"]
    # In training, gelu's gradient reads the pre-activation sum: gelu stays outside.
    gelu = tf.nn.gelu(tf.nn.bias_add(tf.matmul(x, w), b))
    grads = tf.gradients(tf.reduce_sum(gelu * gelu), [w, b])
    graph, ctx = optimize([gelu, *grads], {x: np.zeros((4, 3))}, [w, b], only=["fuse_dense"])
    assert reasons(ctx) == ["matmul + bias_add -> fused_dense"]
    # relu's reads relu's output (as tanh's does): in training it is fused too.
    relu = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))
    grads = tf.gradients(tf.reduce_sum(relu * relu), [w, b])
    graph, ctx = optimize([relu, *grads], {x: np.zeros((4, 3))}, [w, b], only=["fuse_dense"])
    assert reasons(ctx) == ["matmul + bias_add + relu -> fused_dense"]
    session = tf.Session()
    session.run(tf.global_variables_initializer())
    value = np.linspace(-1, 1, 12).reshape(4, 3)
    wv, bv = np.linspace(-1, 1, 15).reshape(3, 5), np.linspace(0, 1, 5)
    np.testing.assert_allclose(session.run(hidden, {x: value}), np.tanh(value @ wv + bv))
    got = session.run([relu, *grads], {x: value})
    plain = tf.Session(passes=[])
    plain.variables.update(session.variables)
    for a, e in zip(got, plain.run([relu, *grads], {x: value})):
        np.testing.assert_allclose(a, e)


def test_fuse_dense_leaves_a_bias_along_the_batch_axis_alone():
    # fused_dense adds its bias along the product's columns; a bias_add along axis 0
    # of a (4, 4) product adds one value per row: fusing it would be a wrong answer.
    x = tf.placeholder(F64, (4, 4))
    w = tf.Variable(np.eye(4))
    b = tf.Variable(np.arange(4.0))
    y = ops.make("bias_add", tf.matmul(x, w), b, axis=0)
    graph, ctx = optimize([y], {x: np.zeros((4, 4))}, [w, b], only=["fuse_dense"])
    assert "fused_dense" not in {n.op for n in graph.nodes} and reasons(ctx) == []
    session = tf.Session()
    session.run(tf.global_variables_initializer())
    np.testing.assert_array_equal(session.run(y, {x: np.zeros((4, 4))}),
                                  np.arange(4.0)[:, None] + np.zeros((4, 4)))


# ----------------------------------------------------------------------------------
# variables and assign: order and effects survive every pass
# ----------------------------------------------------------------------------------

def test_read_before_assign_keeps_its_meaning():
    """`v * 1` reads v before the assign; simplify must not make the add read v
    directly (a cycle), and fusion must not move the read into a node that runs
    after the assign."""
    v = tf.Variable(np.array([1.0, 2.0]))
    new_v = tf.assign(v, v * 3.0)
    out = tf.tanh(v * 1.0) + new_v * 2.0
    init = tf.global_variables_initializer()
    graph, ctx = optimize([out], variables=[v])
    for node in graph.nodes:
        assert not (any(i.op == "variable" for i in node.inputs)
                    and any(mutated_input(i) is not None for i in node.inputs)), node
    for p in (None, [], ["simplify"], ["fuse_elementwise"]):
        session = tf.Session(passes=p)
        session.run(init)
        np.testing.assert_allclose(session.run(out), np.tanh([1.0, 2.0]) + [6.0, 12.0])
        np.testing.assert_allclose(session.run(v), [3.0, 6.0])


@pytest.mark.parametrize("options", [{}, {"passes": []}, {"streams": 2}, {"memory": None}])
def test_an_assign_reading_another_variable_copies_its_old_value(options):
    """assign(w, v) reads v like any node: it runs before v's update (TF1), and a
    swap, where each assign would have to run first, is an error with the fix."""
    v, w = tf.Variable(np.array([1.0, 2.0, 3.0])), tf.Variable(np.zeros(3))
    init = tf.global_variables_initializer()
    session = tf.Session(**options)
    session.run(init)
    session.run(tf.group(tf.assign(v, v * 2.0 + 1.0), tf.assign(w, v)))
    np.testing.assert_array_equal(session.run(v), [3.0, 5.0, 7.0])
    np.testing.assert_array_equal(session.run(w), [1.0, 2.0, 3.0])
    with pytest.raises(TinyFlowError, match=r"cycle .* swap, copy one first"):
        session.run(tf.group(tf.assign(v, w), tf.assign(w, v)))
    session.run(tf.group(tf.assign(v, w * 1.0), tf.assign(w, v)))
    np.testing.assert_array_equal(session.run(v), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(session.run(w), [3.0, 5.0, 7.0])


@pytest.mark.parametrize("options", [{}, {"passes": []}, {"memory": None}])
def test_a_fed_variable_is_read_from_the_feed(options):
    v = tf.Variable(np.ones(3, np.float32))
    doubled = v * 2.0
    init = tf.global_variables_initializer()
    session = tf.Session(**options)
    session.run(init)
    np.testing.assert_array_equal(session.run(doubled, {v: np.full(3, 5.0, np.float32)}),
                                  [10.0, 10.0, 10.0])
    np.testing.assert_array_equal(session.run(v), [1.0, 1.0, 1.0])   # store untouched
    np.testing.assert_array_equal(session.run(doubled), [2.0, 2.0, 2.0])
    with pytest.raises(tf.FeedError, match="fed in this run and also assigned"):
        session.run([tf.assign(v, v + 1.0), doubled], {v: np.zeros(3, np.float32)})


def test_assigns_are_never_merged_or_removed():
    x = tf.placeholder(F64, (2,))
    u, v = tf.Variable(np.zeros(2)), tf.Variable(np.zeros(2))
    step = tf.group(tf.assign(u, x + 1.0), tf.assign(v, x + 1.0))
    graph, ctx = optimize([step], {x: np.zeros(2)}, [u, v])
    assert ops_of(graph)["assign"] == 2 and ops_of(graph)["add"] == 1   # value merged
    session = tf.Session()
    session.run(tf.global_variables_initializer())
    session.run(step, {x: np.array([1.0, 5.0])})
    np.testing.assert_array_equal(session.run(u), [2.0, 6.0])
    np.testing.assert_array_equal(session.run(v), [2.0, 6.0])


# ----------------------------------------------------------------------------------
# fuse_assign: updates written straight into their variable
# ----------------------------------------------------------------------------------

def test_fuse_assign_writes_every_adam_update_into_its_variable():
    fetches, feeds, variables = mlp_training_graph()
    plain_graph, _ = optimize(fetches, feeds, variables, only=[])
    graph, ctx = optimize(fetches, feeds, variables)
    # m, v and the weight of 4 variables, and Adam's step counter: all fused.
    assert ops_of(plain_graph)["assign"] == 13
    assert ops_of(graph)["fused_assign"] == 13 and ops_of(graph)["assign"] == 0
    assert all("straight into" in r for r in reasons(ctx, "fuse_assign"))
    fused = [n for n in graph.nodes if n.op == "fused_assign"]
    assert all(n.inputs[0].op == "variable" and n.shape == n.inputs[0].shape for n in fused)

    init = tf.global_variables_initializer()
    optimized, plain = tf.Session(), tf.Session(passes=[])
    for session in (optimized, plain):
        session.run(init)
    buffers = {v: optimized.variables[v] for v in variables}
    for _ in range(3):
        loss = optimized.run(fetches, feeds)[1]
        np.testing.assert_allclose(loss, plain.run(fetches, feeds)[1], rtol=1e-5)
    for v in variables:
        assert optimized.variables[v] is buffers[v], f"{v.name} was not updated in place"
        np.testing.assert_allclose(optimized.variables[v], plain.variables[v],
                                   rtol=1e-5, atol=1e-7, err_msg=v.name)


@pytest.mark.parametrize("options", [{}, {"streams": 2}, {"memory": None}])
def test_fuse_assign_runs_after_every_other_reader(options):
    """y reads v; the update is fused into a node that writes v: y must still see
    the value from before the run, on one stream, two, or without a memory plan."""
    v = tf.Variable(np.array([1.0, 2.0, 4.0]))
    y = tf.exp(v) * 2.0
    z = tf.reshape(v, (3, 1))                  # a view of v, if nothing copied it
    update = tf.assign(v, v * 0.5 + 1.0)
    graph, _ = optimize([y, z, update], variables=[v])
    assert ops_of(graph)["fused_assign"] == 1
    session = tf.Session(**options)
    session.run(tf.global_variables_initializer())
    got_y, got_z, got_v = session.run([y, z, update])
    np.testing.assert_allclose(got_y, np.exp([1.0, 2.0, 4.0]) * 2.0)
    np.testing.assert_allclose(got_z, [[1.0], [2.0], [4.0]])
    np.testing.assert_allclose(got_v, [1.5, 2.0, 3.0])
    np.testing.assert_allclose(session.run(v), [1.5, 2.0, 3.0])


def test_fuse_assign_refuses_what_would_change_the_meaning():
    x, x64 = tf.placeholder(tf.float32, (3,)), tf.placeholder(F64, (3,))
    v, w = tf.Variable(np.ones(3, np.float32)), tf.Variable(np.full(3, 2.0, np.float32))
    cases = {
        "fetched value": (lambda: [tf.assign(v, v * 2.0 + x), v * 2.0 + x], 0),
        "reads another variable": (lambda: [tf.assign(v, v * 2.0 + w)], 0),
        "last op cannot overwrite v": (lambda: [tf.assign(v, 1.0 - v)], 0),
        "another dtype": (lambda: [tf.assign(v, x64 * 2.0)], 0),
        "two writers of v": (lambda: [tf.group(tf.assign(v, v + x), tf.assign(v, x * 3.0))], 0),
        "fusable": (lambda: [tf.assign(v, (v + x) * 3.0)], 1),
    }
    for what, (build, expected) in cases.items():
        graph, _ = optimize(build(), {x: np.zeros(3, np.float32), x64: np.zeros(3)}, [v, w])
        assert ops_of(graph)["fused_assign"] == expected, what
    # The refused ones still compute the right thing.
    update = tf.assign(v, 1.0 - v)
    session = tf.Session()
    session.run(tf.global_variables_initializer())
    np.testing.assert_allclose(session.run(update), [0.0, 0.0, 0.0])


def test_fuse_assign_gives_a_write_only_variable_its_first_value():
    x = tf.placeholder(tf.float32, (2, 2))
    v = tf.Variable(np.zeros((2, 2), np.float32))
    update = tf.assign(v, tf.tanh(x) * 2.0)     # never initialized: written first
    session = tf.Session()
    data = np.array([[0.0, 1.0], [2.0, -1.0]], np.float32)
    np.testing.assert_allclose(session.run(update, {x: data}), np.tanh(data) * 2.0, rtol=1e-6)
    assert session.last_program.graph.nodes[-1].op == "fused_assign"
    np.testing.assert_allclose(session.run(v), np.tanh(data) * 2.0, rtol=1e-6)


def test_plan_with_output_as_input_never_uses_it_as_a_temporary():
    """A fused_assign's output buffer is the variable, which the program reads: no
    instruction but the last may write it (the plain plan does use it as scratch)."""
    chain = (("mul", ("x0", "x1"), ()), ("exp", ("t0",), ()), ("tanh", ("t1",), ()),
             ("sub", ("x0", "t2"), ()))
    shapes, dtypes = [(4, 5), ()], [np.dtype(F64)] * 2
    plain = fusion._make_plan(chain, shapes, dtypes)
    aliased = fusion._make_plan(chain, shapes, dtypes, out_is_input=True)
    assert any(buffer == fusion.OUT for *_, buffer in plain.steps[:-1])
    assert all(buffer != fusion.OUT for *_, buffer in aliased.steps[:-1])
    rng = np.random.default_rng(3)
    var, scale = rng.standard_normal((4, 5)), np.array(0.3)
    expected = var - np.tanh(np.exp(var * scale))
    temporaries = [np.empty(s, d) for s, d in aliased.buffers[1:]]
    result = aliased.kernel(np, var, scale, var, *temporaries)
    assert result is var
    np.testing.assert_allclose(var, expected)


def test_row_blocks_cover_the_rows_in_blocks_of_the_budget(monkeypatch):
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 100)
    assert fusion.row_blocks((10, 3), 8) == [(0, 4), (4, 8), (8, 10)]   # 96 bytes a block
    assert fusion.row_blocks((10, 30), 8) == [(k, k + 1) for k in range(10)]  # big rows
    assert fusion.row_blocks((8, 3), 8) is None    # 192 bytes: two blocks' worth at most
    assert fusion.row_blocks((1, 1000), 8) is None and fusion.row_blocks((), 8) is None


@pytest.mark.parametrize("memory", ["auto", None])
def test_fused_programs_in_blocks_give_the_bits_of_one_pass(monkeypatch, memory):
    """Large fused programs run a block of rows at a time (temporaries in cache):
    inputs with the output's rows are cut, the ones broadcast along axis 0 (a scalar,
    a row, a (1, n) array) go whole to each block, and the last block is shorter.
    A fused_assign reading its variable's transpose still reads the old values: the
    executor hands it a copy, never a view of the variable it writes."""
    rng = np.random.default_rng(5)
    x = tf.placeholder(F64, (7, 5))
    row, flat = tf.placeholder(F64, (5,)), tf.placeholder(F64, (1, 5))
    v = tf.Variable(rng.standard_normal((5, 5)))
    y = tf.tanh(x * row + flat) * 3.0 - tf.exp(x)
    update = tf.assign(v, v * 0.5 + tf.transpose(v) * tf.reduce_sum(y))
    feed = {x: rng.standard_normal((7, 5)), row: rng.standard_normal(5),
            flat: rng.standard_normal((1, 5))}

    def run(**options):
        session = tf.Session(**options)
        session.run(tf.global_variables_initializer())
        values = session.run([y, update], feed)
        ops = [step.node.op for step in session.last_program.steps]
        return values + [session.run(v)], ops

    want, _ = run(passes=[], memory=None)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 2 * 8 * 5)   # 2 rows a block, the last 1
    got, ops = run(memory=memory)
    assert {"fused_elementwise", "fused_assign"} <= set(ops)
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case, blocks", [("integer power", True), ("integer power", False),
                                          ("overflow set to raise", True)])
def test_an_update_that_fails_leaves_its_variable_as_it_was(monkeypatch, case, blocks):
    """A fused_assign run in blocks wrote the rows of the blocks before the one that
    raised: 545 of 600 rows updated by a step that failed. In one pass, numpy's
    integer power wrote the elements before a negative exponent (12 of 20). The
    unfused program computes the value first and never assigns it."""
    if blocks:
        monkeypatch.setattr(fusion, "BLOCK_BYTES", 8 * 30 * 10)    # 10 rows a block, of 60
    if case == "integer power":       # numpy refuses an integer to a negative power
        v = tf.Variable(np.zeros((60, 30), np.int64))
        feed = tf.placeholder(tf.int64, (60, 30))
        update = tf.assign(v, v + tf.pow(v + 2, feed) * 3) if blocks else \
            tf.assign(v, tf.pow(v + 2, feed))              # the power writes v itself
        value, errors = np.ones((60, 30), np.int64), {}
        value[-1, -1] = -1
    else:
        v = tf.Variable(np.zeros((60, 30)))
        feed = tf.placeholder(F64, (60, 30))
        update = tf.assign(v, v - 0.1 * tf.exp(feed))
        value, errors = np.zeros((60, 30)), {"over": "raise"}
        value[-1, -1] = 1000.0        # exp overflows in the last block only
    for options in ({}, {"memory": None}, {"passes": []}):
        session = tf.Session(**options)
        session.run(tf.global_variables_initializer())
        with np.errstate(**errors), pytest.raises(TinyFlowError):
            session.run(update, {feed: value})
        assert not session.run(v).any(), options


# ----------------------------------------------------------------------------------
# infer_shapes, the pipeline, explain
# ----------------------------------------------------------------------------------

def test_infer_shapes_names_a_node_whose_shape_is_wrong():
    x = tf.placeholder(F64, (2, 3))
    graph, _ = optimize([tf.tanh(x)], {x: np.zeros((2, 3))}, only=[])
    source = graph.outputs[0].inputs[0]
    broken = Node("tanh", [source], name="broken_tanh", shape=(3, 2), dtype=F64)
    with pytest.raises(TinyFlowError, match="broken_tanh .* holds shape \\(3, 2\\)"):
        passes.infer_shapes(Graph([broken]), passes.PassContext())


def test_pipeline_order_names_and_switches():
    fetches, feeds, variables = mlp_training_graph()
    graph, ctx = optimize(fetches, feeds, variables, only=[])
    assert ctx.records == [] and [name for name, _, _ in ctx.snapshots] == ["input"]
    graph, ctx = optimize(fetches, feeds, variables)
    assert [name for name, _, _ in ctx.snapshots] == ["input"] + PASS_NAMES
    assert len(graph.nodes) < len(ctx.snapshots[0][1].nodes)
    with pytest.raises(ValueError, match="unknown pass 'fusion'"):
        optimize(fetches, feeds, variables, only=["fusion"])
    session = tf.Session(disable=["fuse_elementwise", "fuse_dense", "fuse_assign"])
    session.run(tf.global_variables_initializer())
    session.run(fetches, feeds)
    assert not any(n.op.startswith("fused") for n in session.last_program.graph.nodes)


def test_explain_reports_counts_rewrites_and_fused_nodes():
    fetches, feeds, variables = mlp_training_graph()
    session = tf.Session()
    session.run(tf.global_variables_initializer())
    session.run(fetches, feeds)
    text = passes.explain(session.last_program, max_rewrites=5)
    ctx = session.last_program.ctx
    for name, graph, _ in ctx.snapshots:
        assert any(line.split()[:3] == [name, str(len(graph.nodes)), "nodes"]
                   for line in text.splitlines())
    assert f"rewrites ({len(ctx.records)}):" in text and "... and" in text
    fused = [n for n in session.last_program.graph.nodes if n.op.startswith("fused")]
    assert f"fused nodes ({len(fused)}):" in text
    assert fusion.format_program(next(n for n in fused if n.op == "fused_elementwise")
                                 .attrs["program"]) in text


def test_fused_and_merged_nodes_keep_phase():
    fetches, feeds, variables = mlp_training_graph()
    sources = {n: (a.shape, a.dtype) for n, a in feeds.items()}
    sources.update({v: (v.shape, v.dtype) for v in variables})
    graph, _ = passes.specialize(fetches, sources)
    phase_of = {n.name: n.phase for n in graph.nodes}
    ctx = passes.PassContext()
    for name in PASS_NAMES:
        graph = passes.run_pass(name, graph, ctx)
    fused = [n for n in graph.nodes if n.op.startswith("fused")]
    assert {n.phase for n in fused} == {"forward", "backward"}
    for node in fused:
        root = node.name.removeprefix("fused_")
        assert node.phase == phase_of[root], node.name


# ----------------------------------------------------------------------------------
# idempotence and the differential test
# ----------------------------------------------------------------------------------

def _idempotent(graph: Graph) -> None:
    """Each pass, run twice, rewrites nothing the second time."""
    for name in PASS_NAMES:
        once = passes.run_pass(name, graph)
        ctx = passes.PassContext()
        twice = passes.run_pass(name, once, ctx)
        assert ctx.records == [] and twice is once, (name, reasons(ctx))


def test_every_pass_is_idempotent_on_a_training_graph():
    fetches, feeds, variables = mlp_training_graph()
    graph, _ = optimize(fetches, feeds, variables, only=[])
    _idempotent(graph)


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(random_graph_cases())
def test_passes_keep_outputs_and_gradients_of_random_graphs(case):
    expected = run_case(case, passes=[])
    assert_same_results(run_case(case), expected, case, "the whole pipeline")
    for name in PASS_NAMES:
        assert_same_results(run_case(case, passes=[name]), expected, case, f"{name} alone")
    sources = {n: (a.shape, a.dtype) for n, a in case.feed_dict.items()}
    sources.update({v: (a.shape, a.dtype) for v, a in case.init_values.items()})
    graph, _ = passes.specialize(case.fetches, sources)
    _idempotent(graph)


def test_pipeline_checks_every_need_and_names_the_pass():
    """A pass whose need no earlier pass provides is refused, by name, before any runs."""
    fetches, feeds, variables = mlp_training_graph()
    graph, _ = optimize(fetches, feeds, variables, only=[])
    ran = []

    def pass_fn(g, ctx):
        ran.append(ctx.current_pass)
        return g
    producer = passes.Pass("make_facts", pass_fn, ("shapes",), ("facts",))
    consumer = passes.Pass("use_facts", pass_fn, ("facts",), ())
    passes.run_pipeline(graph, passes.PassContext(), pipeline=[producer, consumer])
    assert ran == ["make_facts", "use_facts"]
    with pytest.raises(passes.PipelineError, match="'use_facts' needs 'facts'"):
        passes.run_pipeline(graph, passes.PassContext(), pipeline=[consumer, producer])
    with pytest.raises(passes.PipelineError, match="'use_facts' needs 'facts'"):
        passes.run_pipeline(graph, passes.PassContext(), passes=["use_facts"],
                            pipeline=[producer, consumer])
    assert ran == ["make_facts", "use_facts"] and issubclass(passes.PipelineError,
                                                             tf.TinyFlowError)
    assert "checkpoint" in [p.name for p in passes.PIPELINE]  # one pipeline


def test_a_channels_last_bias_still_fuses():
    # Review: tf.nn.bias_add on (B, T, C) became a bias_add op with axis 2 (it was an
    # add), which fuse_dense took only for 2-D products and fuse_elementwise not at
    # all: a batched dense layer and tanh(bias_add(x * 2, b)) * 3 stopped fusing.
    x = tf.placeholder(F64, (2, 5, 3))
    w = tf.Variable(np.linspace(-1, 1, 12).reshape(3, 4))
    b = tf.Variable(np.linspace(0, 1, 4))
    dense = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))
    graph, ctx = optimize([dense], {x: np.zeros((2, 5, 3))}, [w, b], only=["fuse_dense"])
    assert "fused_dense" in {n.op for n in graph.nodes}, reasons(ctx)
    c = tf.Variable(np.linspace(0, 1, 3))
    chain = tf.tanh(tf.nn.bias_add(x * 2.0, c)) * 3.0
    graph, ctx = optimize([chain], {x: np.zeros((2, 5, 3))}, [c])
    assert {n.op for n in graph.nodes} - {"placeholder", "variable", "constant"} == {
        "fused_elementwise"}
    session = tf.Session()
    session.run(tf.global_variables_initializer())
    plain = tf.Session(passes=[])
    plain.variables.update(session.variables)
    value = np.random.default_rng(0).standard_normal((2, 5, 3))
    for fetch in (dense, chain):
        np.testing.assert_array_equal(session.run(fetch, {x: value}),
                                      plain.run(fetch, {x: value}))
