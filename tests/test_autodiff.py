"""Reverse-mode autodiff (autodiff.py): how contributions are summed, what is None,
deep graphs, ops without gradients, and what the built nodes record.

Per-op gradient values are checked against finite differences in test_ops.py; this
file checks the algorithm around them.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.autodiff import gradients
from tinyflow.graph import Graph, TinyFlowError, next_node_id, reachable, topological_order

F64 = np.float64
HERE = os.path.basename(__file__)


def line_of(marker: str) -> int:
    """The line of this file holding `marker` (a comment next to the call)."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text and "line_of" not in text)


def run(fetches, feed):
    return tf.Session().run(fetches, feed)


def test_a_node_used_twice_gets_both_contributions():
    x = tf.placeholder(F64, (3,))
    a = tf.tanh(x)
    y = a * a + a              # a feeds mul twice and add once
    (g,) = tf.gradients(y, [x])
    xv = np.array([-1.0, 0.2, 0.7])
    t = np.tanh(xv)
    np.testing.assert_allclose(run(g, {x: xv}), (2 * t + 1) * (1 - t**2), rtol=1e-12)


def test_shared_subexpression_in_a_diamond():
    x = tf.placeholder(F64, (2,))
    s = tf.exp(x)
    y = tf.log(s) * s - tf.sqrt(s)    # s reaches y by three paths
    (g,) = tf.gradients(y, [x])
    xv = np.array([0.3, -0.4])
    e = np.exp(xv)
    expected = e + xv * e - 0.5 * np.sqrt(e)
    np.testing.assert_allclose(run(g, {x: xv}), expected, rtol=1e-12)


def test_several_ys_are_summed_and_grad_ys_weights_them():
    x = tf.placeholder(F64, (2,))
    y1, y2 = x * 3.0, x * x
    xv = np.array([1.5, -2.0])
    (g,) = tf.gradients([y1, y2], [x])
    np.testing.assert_allclose(run(g, {x: xv}), 3.0 + 2 * xv)
    w1, w2 = np.array([1.0, 10.0]), np.array([-1.0, 0.5])
    (gw,) = tf.gradients([y1, y2], [x], grad_ys=[tf.constant(w1, F64), tf.constant(w2, F64)])
    np.testing.assert_allclose(run(gw, {x: xv}), 3.0 * w1 + 2 * xv * w2)


def test_one_grad_ys_node_for_one_y_is_taken_bare():
    # TF1 takes tf.gradients(y, x, grad_ys=g) with g a tensor, not a list; it was a
    # TypeError from len() inside autodiff, and a number among them another.
    x = tf.placeholder(F64, (3,))
    seed = tf.constant(np.array([1.0, 2.0, 3.0]))
    (gx,) = tf.gradients(x * 2.0, x, grad_ys=seed)
    with tf.Session() as sess:
        assert sess.run(gx, {x: np.zeros(3)}).tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(tf.ArgumentError, match="grad_ys must be a graph node"):
        tf.gradients(x * 2.0, x, grad_ys=3.0)


def test_grad_ys_must_match_ys_one_to_one():
    x = tf.placeholder(F64, (2,))
    seed = tf.constant(np.ones(2), F64)
    with pytest.raises(TinyFlowError, match="2 ys but 1 grad_ys"):
        tf.gradients([x * 2.0, x * 3.0], [x], grad_ys=[seed])


def test_gradient_with_respect_to_an_intermediate_and_to_y_itself():
    x = tf.placeholder(F64, (2,))
    h = x * 2.0
    y = tf.reduce_sum(h * h)
    gh, gy = tf.gradients(y, [h, y])
    xv = np.array([1.0, -3.0])
    got_h, got_y = run([gh, gy], {x: xv})
    np.testing.assert_allclose(got_h, 2 * (2 * xv))
    assert got_y == 1.0


def test_unreachable_xs_give_none():
    x = tf.placeholder(F64, (2,))
    unrelated = tf.placeholder(F64, (2,))
    also_unrelated = unrelated * 2.0    # depends on a placeholder, not on x's path
    y = tf.reduce_sum(x * x)
    gx, g_unrelated, g_also = tf.gradients(y, [x, unrelated, also_unrelated])
    assert gx is not None
    assert g_unrelated is None and g_also is None
    # A single x (not a list) still gives a list, as TF1's tf.gradients.
    assert tf.gradients(y, unrelated) == [None]


def test_a_downstream_node_is_not_upstream():
    x = tf.placeholder(F64, (2,))
    y = x * 2.0
    z = y + 1.0    # built from y, so y does not depend on it
    assert tf.gradients(y, [z]) == [None]


def test_gradient_blocked_by_integer_cast_is_none():
    x = tf.placeholder(F64, (3,))
    y = tf.cast(tf.cast(x, tf.int32), F64) * 2.0   # no gradient flows through integers
    assert tf.gradients(y, [x]) == [None]


def test_gradients_leave_the_forward_graph_alone():
    x = tf.placeholder(F64, (2,))
    y = tf.reduce_sum(tf.tanh(x) * x)
    before = {id(n): (n.op, tuple(id(i) for i in n.inputs), n.shape, n.phase)
              for n in topological_order([y])}
    tf.gradients(y, [x])
    after = {id(n): (n.op, tuple(id(i) for i in n.inputs), n.shape, n.phase)
             for n in topological_order([y])}
    assert after == before


def test_built_nodes_are_backward_and_point_at_the_gradients_call():
    x = tf.placeholder(F64, (4,))
    h = tf.tanh(x)
    y = tf.reduce_sum(h * h)
    forward = topological_order([y])
    start = next_node_id()
    (g,) = tf.gradients(y, [x])  # MARK: gradients call
    built = [n for n in topological_order([g]) if n.id > start]
    assert built, "gradients built no nodes"
    for node in built:
        assert node.phase == "backward", f"{node} was built by gradients but is {node.phase}"
        assert node.where == f"{HERE}:{line_of('MARK: gradients call')}", node
    assert all(n.phase == "forward" for n in forward)
    # Second order: what the user builds on a gradient is forward; what the second
    # gradients call builds is backward.
    total = tf.reduce_sum(g)
    start = next_node_id()
    (gg,) = tf.gradients(total, [x])
    assert total.phase == "forward"
    second = [n for n in topological_order([gg]) if n.id > start]
    assert second and all(n.phase == "backward" for n in second)


def test_no_gradient_flows_through_a_boolean_mask():
    """Regression: `x * (x > 0)` (relu written with a mask) failed in tf.gradients
    ("op greater has no gradient, but it lies between the variables and the loss"),
    and so in a traced eager step, while eager backward gave the answer: a boolean
    does not move when x moves, so no gradient flows through it (as in PyTorch)."""
    from tinyflow import eager as E
    value = np.array([-1.5, -0.0, 0.0, 2.0, np.inf], F64)
    x = tf.placeholder(F64, value.shape)
    (graph,) = tf.gradients(tf.reduce_sum(x * (x > 0) + (x <= 1) * x), [x])
    with np.errstate(invalid="ignore"):    # the forward's False * inf
        got = tf.Session(passes=[]).run(graph, {x: value})
    w = E.tensor(value, requires_grad=True)

    def step():
        w.grad = None
        (w * (w > 0) + (w <= 1) * w).sum().backward()
        return w.grad

    with np.errstate(invalid="ignore"):
        eager = step().numpy()
        traced = tf.function(step)().numpy()
    np.testing.assert_array_equal(got, [1.0, 1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(eager.view(np.uint64), got.view(np.uint64))
    np.testing.assert_array_equal(traced.view(np.uint64), got.view(np.uint64))


def test_op_without_gradient_on_the_path_names_it_and_its_line():
    x = tf.placeholder(F64, (3, 4))
    index = tf.argmax(x, 1)                  # MARK: argmax
    y = tf.reduce_sum(index * 2.0)           # ints times a float: a float, on x's path
    with pytest.raises(TinyFlowError) as info:
        tf.gradients(y, [x])
    message = str(info.value)
    assert "argmax" in message and index.name in message
    assert f"{HERE}:{line_of('MARK: argmax')}" in message
    assert "no gradient" in message


def test_deep_chain_of_ten_thousand_nodes():
    """5,000 (mul, add) pairs: the order, the gradient and the run are iterative,
    so none of them meets Python's recursion limit (1,000 frames)."""
    x = tf.placeholder(F64, (3,))
    rate, step = tf.constant(1.0001, F64), tf.constant(0.5, F64)
    y = x
    for _ in range(5000):
        y = y * rate + step
    order = topological_order([y])
    assert len(order) == 10_000 + 3   # the chain, x and the two constants
    assert order[0] is x and order[-1] is y
    position = {id(n): k for k, n in enumerate(order)}
    assert all(position[id(i)] < position[id(n)] for n in order for i in n.inputs)
    assert len(Graph([y]).nodes) == len(order)
    assert len(reachable([y])) == len(order)
    (g,) = gradients(y, [x])
    y_value, g_value = run([y, g], {x: np.ones(3)})
    np.testing.assert_allclose(g_value, np.full(3, 1.0001**5000), rtol=1e-9)
    expected = 1.0
    for _ in range(5000):
        expected = expected * 1.0001 + 0.5
    np.testing.assert_allclose(y_value, np.full(3, expected), rtol=1e-9)


def test_gradients_of_a_variable_through_a_session():
    w = tf.Variable(np.array([[1.0, 2.0], [3.0, 4.0]]), dtype=F64)
    x = tf.placeholder(F64, (None, 2))
    loss = tf.reduce_mean(tf.reduce_sum(tf.matmul(x, w) ** 2.0, 1))
    (gw,) = tf.gradients(loss, [w])
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    xv = np.array([[1.0, 0.0], [0.5, -1.0], [2.0, 1.0]])
    wv = np.array([[1.0, 2.0], [3.0, 4.0]])
    expected = 2 * xv.T @ (xv @ wv) / 3
    np.testing.assert_allclose(sess.run(gw, {x: xv}), expected, rtol=1e-12)
    # A different batch size specializes a new program for the same gradient graph.
    np.testing.assert_allclose(sess.run(gw, {x: xv[:1]}), 2 * xv[:1].T @ (xv[:1] @ wv))
