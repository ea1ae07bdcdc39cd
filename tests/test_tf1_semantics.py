"""TF1's answers where TinyFlow's differed (issue 14: items 1, 5-8, 10, 20, 21, 25).

Each test names the item it pins down. Where TF1 defines the behaviour (graph and op
seeds, dtypes of constants, None gradients, errors for uninitialized reads), the
expectation is TF1's; where it raises, TinyFlow raises a TinyFlowError naming the
op and the user's line, at build time when the fault is visible then.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import ops
from tinyflow.executor import ExecutionError
from tinyflow.graph import FeedError, ShapeError, TinyFlowError

HERE = os.path.basename(__file__)

# Option sets that must never change an answer.
OPTION_SETS = [dict(passes=[], memory=None), dict(), dict(memory=None), dict(streams=2),
               dict(streams=4), dict(passes=[]), dict(streams=2, memory=None),
               dict(checkpoint="sqrt"), dict(poison=True)]


def _run_everywhere(fetches, feeds=None, init=None):
    results = []
    for opts in OPTION_SETS:
        sess = tf.Session(**opts)
        if init is not None:
            sess.run(init)
        results.append(sess.run(fetches, feeds or {}))
    return results


def _assert_all_equal(results):
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first, other):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------
# 1. each random op its own stream, whatever runs first
# ----------------------------------------------------------------------------------

def test_item1_two_dropouts_with_one_seed_are_independent_of_run_order():
    a = tf.placeholder(tf.float32, (64,))
    b = tf.placeholder(tf.float32, (64,))
    da = tf.nn.dropout(a, 0.5, seed=42)
    db = tf.nn.dropout(tf.exp(tf.tanh(b)), 0.5, seed=42)
    feeds = {a: np.ones(64, np.float32), b: np.zeros(64, np.float32)}
    results = _run_everywhere([da, db], feeds)
    _assert_all_equal(results)
    # Asking for one of them alone gives the same numbers as asking for both.
    alone = tf.Session().run(db, feeds)
    np.testing.assert_array_equal(alone, results[0][1])


def test_item1_dropout_of_matmul_same_under_every_option():
    x = tf.placeholder(tf.float32, (8, 8))
    y = tf.reduce_sum(tf.nn.dropout(tf.matmul(x, x), 0.5, seed=7))
    z = tf.random_normal((8, 8), seed=7)
    feeds = {x: np.arange(64, dtype=np.float32).reshape(8, 8) / 64}
    _assert_all_equal(_run_everywhere([y, z], feeds))


def test_item1_graph_seed_with_op_seeds_reproduces_and_differs_by_op(monkeypatch):
    # (The module's seed state comes back after the test: later tests keep theirs.)
    for name in ("_graph_seed", "_seed_counter"):
        monkeypatch.setattr(ops, name, getattr(ops, name))
    monkeypatch.setattr(ops, "_seed_uses", dict(ops._seed_uses))
    tf.set_random_seed(1234)
    first = tf.random_uniform((5,), seed=3)
    second = tf.random_uniform((5,), seed=3)
    sess = tf.Session()
    one, two = sess.run([first, second])
    assert not np.array_equal(one, two)  # two ops, one op seed: two streams
    # A fresh Session replays the same values (TF1 sessions do).
    again = tf.Session().run([first, second])
    np.testing.assert_array_equal(again[0], one)
    np.testing.assert_array_equal(again[1], two)
    # The graph seed matters: the same program under another one draws otherwise.
    tf.set_random_seed(99)
    other = tf.Session().run(tf.random_uniform((5,), seed=3))
    assert not np.array_equal(other, one)


# ----------------------------------------------------------------------------------
# 5. Python literals are weakly typed; None is a build error
# ----------------------------------------------------------------------------------

def test_item5_float_list_with_int_tensor_promotes_to_float():
    xi = tf.placeholder(tf.int32, (2,))
    out = tf.Session().run(xi + [1.5, 2.5], {xi: np.array([1, 2], np.int32)})
    assert out.dtype.kind == "f"
    np.testing.assert_array_equal(out, [2.5, 4.5])


def test_item5_bool_plus_int_is_int():
    xb = tf.placeholder(tf.bool_, (2,))
    out = tf.Session().run(xb + 1, {xb: np.array([True, False])})
    assert out.dtype.kind == "i"
    np.testing.assert_array_equal(out, [2, 1])


def test_item5_int_tensor_times_int_literal_stays_int32_and_float_tensor_stays_float32():
    xi = tf.placeholder(tf.int32, (2,))
    xf = tf.placeholder(tf.float32, (2,))
    assert (xi * 3).dtype == np.int32
    assert (xf * 2.5).dtype == np.float32
    assert (xf + [1.0, 2.0]).dtype == np.float32
    assert (xf * np.float64(2.0)).dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.uint8])
def test_item5_where_literal_takes_the_branch_dtype_not_the_condition_dtype(dtype):
    """where(x > 0, x, 0): the literal is typed beside x, not beside the boolean
    condition (the first input), as numpy does. Beside bool it was int32, and a
    float32 x came out float64 (int8: int32), in graphs, eager and traced alike."""
    x = tf.placeholder(dtype, (3,))
    value = np.array([1, 0, 2], dtype)
    for build, expected in ((lambda x: tf.where(x > 0, x, 0), value),
                            (lambda x: tf.where(x > 0, 1, x), np.minimum(value, 1))):
        node = build(x)
        assert node.dtype == dtype
        graph = tf.Session().run(node, {x: value})
        eager = np.asarray(build(tf.eager.tensor(value)))
        traced = np.asarray(tf.function(build)(tf.eager.tensor(value)))
        for out in (graph, eager, traced):
            assert out.dtype == dtype
            np.testing.assert_array_equal(out, expected)


def test_item5_none_operand_is_a_build_error_naming_op_and_line():
    x = tf.placeholder(tf.float32, (3,))
    with pytest.raises(TinyFlowError, match=rf"add.*None.*{HERE}:\d+"):
        x + None


def test_item5_out_of_range_literal_is_a_clear_error():
    xi = tf.placeholder(tf.int32, (2,))
    with pytest.raises(TinyFlowError, match=rf"add.*1099511627776.*int32.*{HERE}:\d+"):
        xi + 2**40


def test_item5_embedding_of_a_float_list_gives_floats():
    ids = tf.placeholder(tf.int32, (2,))
    out = tf.Session().run(tf.nn.embedding_lookup([[.1, .2]], ids), {ids: np.array([0, 0])})
    assert out.dtype.kind == "f"
    np.testing.assert_allclose(out, [[.1, .2], [.1, .2]], rtol=1e-6)


# ----------------------------------------------------------------------------------
# 6. constants and Variables keep the array's dtype
# ----------------------------------------------------------------------------------

def test_item6_constant_and_variable_keep_array_dtype():
    assert tf.constant(np.zeros(2)).dtype == np.float64
    assert tf.constant(np.zeros(2, np.float16)).dtype == np.float16
    assert tf.Variable(np.zeros(2)).dtype == np.float64
    v = tf.Variable(np.arange(3.0), dtype=tf.float64)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    assert sess.run(v).dtype == np.float64
    # Python floats are float32, as in TF1.
    assert tf.constant([1.0, 2.0]).dtype == np.float32
    assert tf.constant(1.5).dtype == np.float32
    assert tf.constant([1, 2]).dtype == np.int32
    assert tf.constant([1.0, 2.0], tf.float64).dtype == np.float64


# ----------------------------------------------------------------------------------
# 7. Adam in the variable's dtype; a mean's gradient divides by N
# ----------------------------------------------------------------------------------

def test_item7_adam_float64_follows_tf1_formula():
    w0 = np.array([0.3, -1.2, 2.0])
    w = tf.Variable(w0.copy(), dtype=tf.float64)
    loss = tf.reduce_sum(w * w * w)
    step = tf.train.AdamOptimizer(0.01).minimize(loss)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    ref, m, v = w0.copy(), np.zeros(3), np.zeros(3)
    for t in range(1, 6):
        sess.run(step)
        g = 3 * ref * ref
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        lr_t = 0.01 * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        ref = ref - lr_t * m / (np.sqrt(v) + 1e-8)
    got = sess.run(w)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, ref, rtol=1e-13, atol=0)


def test_item7_mean_gradient_is_divided_by_n():
    x = tf.placeholder(tf.float32, (2, 3))
    (g,) = tf.gradients(-tf.reduce_mean(x) * 14, [x])
    out = tf.Session().run(g, {x: np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(out, np.full((2, 3), np.float32(-14) / np.float32(6)))


# ----------------------------------------------------------------------------------
# 8. TF1's answers: uninitialized reads, grad_ys None, casts, pow, fetch with assign
# ----------------------------------------------------------------------------------

def test_item8_uninitialized_variable_read_is_an_error_naming_it():
    w = tf.Variable(tf.zeros((2,)), name="never_set")
    with pytest.raises(ExecutionError, match="never_set"):
        tf.Session().run(w)


def test_item8_grad_ys_none_means_ones():
    x = tf.placeholder(tf.float32, (3,))
    y1, y2 = x * 2.0, x * 3.0
    (g,) = tf.gradients([y1, y2], [x], grad_ys=[None, tf.ones_like(y2) * 2.0])
    out = tf.Session().run(g, {x: np.ones(3, np.float32)})
    np.testing.assert_array_equal(out, [8.0, 8.0, 8.0])


def test_item8_no_gradient_through_a_cast_to_int():
    x = tf.placeholder(tf.float32, (3,))
    y = tf.cast(x, tf.int32)
    assert tf.gradients(y, [x]) == [None]
    assert tf.gradients(tf.reduce_sum(tf.cast(y, tf.float32)), [x]) == [None]


def test_item8_pow_gradient_wrt_exponent_is_finite_at_zero_base():
    x = tf.placeholder(tf.float32, (3,))
    p = tf.placeholder(tf.float32, (3,))
    (gp,) = tf.gradients(tf.reduce_sum(tf.pow(x, p)), [p])
    out = tf.Session().run(gp, {x: np.array([0., 1., 2.], np.float32),
                                p: np.array([2., 2., 2.], np.float32)})
    np.testing.assert_allclose(out, [0.0, 0.0, 4 * np.log(2)], rtol=1e-6)


def test_item8_fetched_variable_beside_its_assign_shows_the_value_read():
    v = tf.Variable(np.array([1.0, 2.0], np.float32))
    up = tf.assign(v, v + 10.0)
    init = tf.global_variables_initializer()
    for opts in OPTION_SETS:
        sess = tf.Session(**opts)
        sess.run(init)
        before, after = sess.run([v, up])
        np.testing.assert_array_equal(before, [1.0, 2.0])
        np.testing.assert_array_equal(after, [11.0, 12.0])
        after2, before2 = sess.run([up, v])
        np.testing.assert_array_equal(before2, [11.0, 12.0])
        np.testing.assert_array_equal(after2, [21.0, 22.0])


# ----------------------------------------------------------------------------------
# 10. negative dimensions
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [
    lambda: tf.placeholder(tf.float32, (-1, 3)),
    lambda: tf.zeros((-1, 3)),
    lambda: tf.ones((2, -2)),
    lambda: tf.random_normal((-3,)),
    lambda: tf.Variable(tf.zeros((2,)), shape=(-2,)),
    lambda: tf.broadcast_to(tf.placeholder(tf.float32, (3,)), (-1, 3)),
])
def test_item10_negative_dimensions_are_build_errors(build):
    with pytest.raises(ShapeError, match=rf"negative.*{HERE}:\d+"):
        build()


# ----------------------------------------------------------------------------------
# 20. attributes checked at build time
# ----------------------------------------------------------------------------------

def _x4():
    return (tf.placeholder(tf.float32, (1, 1, 6, 6)), tf.placeholder(tf.float32, (1, 1, 2, 2)))


@pytest.mark.parametrize("build, words", [
    (lambda: tf.transpose(tf.placeholder(tf.float32, (2, 3)), (2, 1)), "transpose.*axes"),
    (lambda: tf.transpose(tf.placeholder(tf.float32, (2, 3)), (0, 0)), "transpose.*axes"),
    (lambda: tf.nn.conv2d(*_x4(), strides=[1, 0, 0, 1]), "conv2d.*stride"),
    (lambda: tf.nn.max_pool(_x4()[0], ksize=[1, 0, 0, 1]), "max_pool2d.*ksize"),
    (lambda: tf.nn.avg_pool(_x4()[0], ksize=[1, 2, 2, 1], strides=[1, -1, 1, 1]),
     "avg_pool2d.*stride"),
    (lambda: tf.nn.conv2d(*_x4(), padding="FULL"), "conv2d.*padding"),
    (lambda: tf.nn.conv2d(*_x4(), padding=-1), "conv2d.*padding"),
    (lambda: tf.reshape(tf.placeholder(tf.float32, (2, 3)), (-3, -2)), "reshape.*shape"),
    (lambda: tf.reshape(tf.placeholder(tf.float32, (2, 3)), (-1, -1)), "reshape.*-1"),
    (lambda: tf.reduce_sum(tf.placeholder(tf.float32, (2, 3)), [1, -1]), "sum.*axis"),
    (lambda: tf.gather(tf.placeholder(tf.float32, (4, 3)), tf.placeholder(tf.float32, (2,))),
     "gather.*indices.*float32"),
    (lambda: tf.gather(tf.placeholder(tf.float32), tf.placeholder(tf.float32)),
     "gather.*indices.*float32"),  # checked before any shape is known
    (lambda: tf.nn.conv2d(tf.placeholder(tf.float32), tf.placeholder(tf.float32),
                          padding="FULL"), "conv2d.*padding"),
])
def test_item20_bad_attributes_are_build_errors_naming_op_and_line(build, words):
    with pytest.raises(ShapeError, match=rf"{words}.*{HERE}:\d+"):
        build()


def test_item20_float_labels_must_be_whole_numbers():
    # The original TinyFlow's programs feed float labels (a float32 placeholder), so
    # float labels are accepted; a fractional one is an error naming the op and line,
    # not a silent truncation. (TF1 refuses float labels outright.)
    logits = tf.placeholder(tf.float32)
    labels = tf.placeholder(tf.float32)
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(logits, labels)
    out = tf.Session().run(loss, {logits: np.zeros((2, 3)), labels: np.array([0., 2.])})
    np.testing.assert_allclose(out, np.log(3), rtol=1e-6)
    with pytest.raises(ExecutionError, match=rf"softmax_cross_entropy.*{HERE}:\d+.*whole"):
        tf.Session().run(loss, {logits: np.zeros((2, 3)), labels: np.array([0.5, 2.])})


@pytest.mark.parametrize("build", [
    lambda: tf.nn.avg_pool(tf.placeholder(tf.int32, (1, 1, 4, 4))),
    lambda: tf.nn.dropout(tf.placeholder(tf.int32, (4,)), 0.5),
    lambda: tf.nn.avg_pool(tf.placeholder(tf.int32)),
])
def test_item4_integer_avg_pool_and_dropout_are_build_errors(build):
    with pytest.raises(ShapeError, match=rf"float.*{HERE}:\d+"):
        build()


def test_item20_feed_dict_as_a_list_is_a_feed_error():
    x = tf.placeholder(tf.float32, (2,))
    with pytest.raises(FeedError, match="feed_dict.*dict.*list"):
        tf.Session().run(x, [np.zeros(2)])


def test_item20_numpy_array_plus_node_builds_a_node():
    x = tf.placeholder(tf.float32, (3,))
    y = np.ones(3, np.float32) + x
    assert isinstance(y, tf.Node) and y.op == "add"
    z = np.float32(2.0) * x
    assert isinstance(z, tf.Node) and z.dtype == np.float32
    out = tf.Session().run(y, {x: np.arange(3, dtype=np.float32)})
    np.testing.assert_array_equal(out, [1.0, 2.0, 3.0])


# ----------------------------------------------------------------------------------
# 21. shape rules with unknown dims
# ----------------------------------------------------------------------------------

def test_item21_flatten_of_unknown_batch_feeds_a_matmul():
    x = tf.placeholder(tf.float32, (None, 3, 3, 3))
    flat = tf.nn.flatten_layer(x)
    assert flat.shape == (None, 27)
    w = tf.placeholder(tf.float32, (27, 2))
    y = tf.matmul(flat, w)
    out = tf.Session().run(y, {x: np.ones((2, 3, 3, 3)), w: np.ones((27, 2))})
    np.testing.assert_array_equal(out, np.full((2, 2), 27.0))
    assert tf.reshape(tf.placeholder(tf.float32, (None, 4)), (-1, 2)).shape == (None, 2)
    assert tf.reshape(tf.placeholder(tf.float32, (None, 4)), (2, -1)).shape == (2, None)


def test_item21_squeeze_with_unknown_dims_builds_as_tf1():
    x = tf.placeholder(tf.float32, (None, 1, 3))
    y = tf.squeeze(x)
    assert y.shape is None  # TF1: rank unknown until the batch size is known
    out = tf.Session().run(y, {x: np.ones((2, 1, 3))})
    assert out.shape == (2, 3)
    out = tf.Session().run(y, {x: np.ones((1, 1, 3))})
    assert out.shape == (3,)


def test_item21_broadcast_from_unknown_dim():
    x = tf.placeholder(tf.float32, (None, 5))
    y = tf.broadcast_to(x, (1, 1, 5))
    assert y.shape == (1, 1, 5)
    out = tf.Session().run(y, {x: np.ones((1, 5))})
    assert out.shape == (1, 1, 5)
    with pytest.raises(TinyFlowError):
        tf.Session().run(y, {x: np.ones((3, 5))})


# ----------------------------------------------------------------------------------
# 25. optimizer slots take their variable's shape when first run
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", [lambda: tf.train.AdamOptimizer(0.01),
                                       lambda: tf.train.MomentumOptimizer(0.01, 0.9)])
def test_item25_minimize_before_shapes_are_known(optimizer):
    x = tf.placeholder(tf.float32)
    y = tf.nn.linear(x, num_hidden=3, name="late")
    loss = tf.reduce_mean(y * y)
    train = optimizer().minimize(loss)
    sess = tf.Session()
    init = [tf.assign(v, tf.normal(shape, 0.1, seed=1))
            for v, _, shape in tf.infer_variable_shapes(loss, feed_dict={x: [4, 5]})]
    sess.run(init)
    sess.run(tf.initialize_all_variables())
    feed = {x: np.ones((4, 5), np.float32)}
    first = sess.run(loss, feed)
    for _ in range(5):
        sess.run(train, feed)
    assert sess.run(loss, feed) < first


def test_cast_gradient_float_to_float_still_flows():
    x = tf.placeholder(tf.float32, (2,))
    (g,) = tf.gradients(tf.reduce_sum(tf.cast(x, tf.float64) * 2.0), [x])
    np.testing.assert_array_equal(tf.Session().run(g, {x: np.ones(2, np.float32)}), [2, 2])
    assert ops.REGISTRY["cast"].gradient is not None


# ----------------------------------------------------------------------------------
# 26. batch normalization (TF1's function, the original TinyFlow's layer)
# ----------------------------------------------------------------------------------

def test_item26_batch_normalization_gradients_match_finite_differences():
    from test_ops import GradCase, check_gradient
    rng = np.random.default_rng(26)

    def bn(x, s, o):
        mean, variance = tf.nn.moments(x, [0, 2], keepdims=True)
        return tf.nn.batch_normalization(x, mean, variance, tf.reshape(o, (1, -1, 1)),
                                         tf.reshape(s, (1, -1, 1)), 1e-3)

    case = GradCase(bn, [rng.standard_normal((4, 3, 5)), rng.uniform(0.5, 2.0, 3),
                         rng.standard_normal(3)], rtol=1e-4, atol=1e-6)
    check_gradient("mean", case, rng)
    plain = GradCase(lambda x, m, v: tf.nn.batch_normalization(x, m, v, None, None, 1e-3),
                     [rng.standard_normal((4, 3)), rng.standard_normal(3),
                      rng.uniform(0.5, 2.0, 3)], rtol=1e-4, atol=1e-6)
    check_gradient("sqrt", plain, rng)


def test_item26_batch_norm_layer_trains_with_batch_statistics_and_infers_with_moving_ones():
    x = tf.placeholder(tf.float64)  # rank unknown, as in the original's cifar_resnet
    train_out = tf.nn.batch_normalization(x, name="bn_t")
    loss = tf.reduce_mean(train_out * train_out * 0.5 + train_out)
    step = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    shapes = list(tf.infer_variable_shapes(loss, feed_dict={x: [8, 3, 2, 2]}))
    assert shapes == []  # the layer initializes its own Variables
    sess = tf.Session()
    sess.run(tf.initialize_all_variables())
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((8, 3, 2, 2)) * np.array([1.0, 2.0, 3.0])[:, None, None] + 5.0
    out = sess.run(train_out, {x: xv})
    np.testing.assert_allclose(out.mean(axis=(0, 2, 3)), 0.0, atol=1e-12)
    np.testing.assert_allclose(out.var(axis=(0, 2, 3)), xv.var(axis=(0, 2, 3)) /
                               (xv.var(axis=(0, 2, 3)) + 1e-5), rtol=1e-12)
    for _ in range(3):
        sess.run(step, {x: xv})
    variables = {v.name: v for v in tf.global_variables() if v.name.startswith("bn_t_")}
    moving_mean = sess.run(variables["bn_t_moving_mean"])
    np.testing.assert_allclose(moving_mean, (1 - 0.9 ** 3) * xv.mean(axis=(0, 2, 3)))
    # Inference reads the moving statistics, and the trained scale and offset.
    infer_out = tf.nn.batch_normalization(x, name="bn_t", training=False)  # same layer
    scale, offset = (sess.run(variables[f"bn_t_{k}"]) for k in ("scale", "offset"))
    assert not np.allclose(offset, 0.0)  # the offset trained
    moving_var = sess.run(variables["bn_t_moving_variance"])
    expected = (xv - moving_mean[:, None, None]) / np.sqrt(moving_var[:, None, None] + 1e-5) \
        * scale[:, None, None] + offset[:, None, None]
    direct = tf.nn.batch_normalization(
        x, tf.constant(moving_mean[:, None, None]), tf.constant(moving_var[:, None, None]),
        tf.constant(offset[:, None, None]), tf.constant(scale[:, None, None]), 1e-5)
    np.testing.assert_allclose(sess.run(direct, {x: xv}), expected, rtol=1e-12)
    np.testing.assert_allclose(sess.run(infer_out, {x: xv}), expected, rtol=1e-12)


# Test isolation (conftest's `_fresh_random_state`): a test's random streams must not
# depend on the tests that ran before it in the same worker. Regression: an MNIST
# example's accuracy fell to 0.71 (< 0.75) when 240 random ops had been built earlier.
def test_random_ops_built_here_move_the_seed_counter():
    tf.set_random_seed(7)
    for _ in range(5):
        tf.random_normal((2,))
    np.random.uniform(size=3)


def test_each_test_starts_from_the_random_state_of_a_fresh_process():
    assert tf.random_normal((2,)).attrs["seed"] == (0, 1_000_003, 0)
    first = np.random.uniform()
    np.random.seed(0)
    assert first == np.random.uniform()


# ----------------------------------------------------------------------------------
# The initializer lists: each call of global_variables_initializer covers every
# Variable (TF1), so a second Session can initialize with it too
# ----------------------------------------------------------------------------------

def test_second_sessions_global_initializer_sets_the_variables_made_before():
    # It consumed the list (the original TinyFlow's behaviour): the second Session's
    # initializer ran nothing and reading W said "used before it has a value".
    w = tf.Variable(np.array([[1.0, 2.0]], np.float32), name="w")
    x = tf.placeholder(tf.float32, shape=(None, 1))
    y = tf.matmul(x, w)
    for _ in range(2):
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(y, {x: np.ones((1, 1), np.float32)}),
                                          [[1.0, 2.0]])


def test_variables_initializer_runs_only_the_listed_variables():
    a = tf.Variable(np.float32(1.0), name="a")
    b = tf.Variable(np.float32(2.0), name="b")
    sess = tf.Session()
    sess.run(tf.variables_initializer([b]))
    assert sess.run(b) == 2.0
    with pytest.raises(ExecutionError, match="'a'.*before it has a value"):
        sess.run(a)
    unset = tf.Variable(name="unset", shape=(2,))
    with pytest.raises(tf.ArgumentError, match=r"'unset' \(created at .*\) has no "
                                               r"initial value.*test_tf1_semantics.py:"):
        tf.variables_initializer([unset])
    with pytest.raises(tf.ArgumentError, match="is not a Variable"):
        tf.variables_initializer([a + 1.0])


def test_reset_default_graph_forgets_earlier_variables():
    old = tf.Variable(np.float32(1.0), name="old")
    tf.reset_default_graph()
    new = tf.Variable(np.float32(3.0), name="new")
    assert tf.global_variables() == [new] and tf.trainable_variables() == [new]
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    assert sess.run(new) == 3.0
    assert old not in sess.variables


def test_assign_of_another_shape_is_refused_not_written():
    # A value of another rank was written as is: after tf.assign(v, 7.0) the (2,)
    # Variable held a 0-d 7.0 and reduce_sum(v) gave 7, not 14 (TF1 refuses).
    v = tf.Variable(np.array([1.0, 2.0], np.float32), name="v2")
    for value in (7.0, np.ones((1, 2), np.float32), tf.zeros((3,))):
        with pytest.raises(ShapeError, match=r"assign: .*differs from the variable's \(2,\)"
                                             rf".*{HERE}:"):
            tf.assign(v, value)
    free = tf.Variable(name="free", shape=(None, 3))
    assert tf.assign(free, tf.zeros((4, 3))).shape == (4, 3)  # a None dim matches


def test_where_with_a_vector_condition_picks_rows_as_in_tf1():
    # Numpy broadcasting matched the (3,) condition against the last axis: on a 3x3
    # matrix it picked columns, and on (3, 2) values it was a shape error.
    square = tf.constant(np.arange(9.0).reshape(3, 3), tf.float32)
    rows = tf.constant([True, False, True])
    sess = tf.Session()
    np.testing.assert_array_equal(sess.run(tf.where(rows, square, tf.zeros((3, 3)))),
                                  [[0, 1, 2], [0, 0, 0], [6, 7, 8]])
    np.testing.assert_array_equal(sess.run(tf.where(rows, tf.ones((3, 2)), 0.0)),
                                  [[1, 1], [0, 0], [1, 1]])
    with pytest.raises(ShapeError, match=r"picks whole rows \(TF1's rule\), but the values "
                                         rf"have 3 rows.*{HERE}:"):
        tf.where(tf.constant([True, False]), tf.ones((3, 2)), 0.0)
    # Its gradient sends each row's gradient to the branch that row took.
    x = tf.placeholder(tf.float32, (3, 2))
    (gx,) = tf.gradients(tf.reduce_sum(tf.where(rows, x * 3.0, x)), [x])
    np.testing.assert_array_equal(sess.run(gx, {x: np.ones((3, 2), np.float32)}),
                                  [[3, 3], [1, 1], [3, 3]])


def test_gradient_of_pow_with_respect_to_a_constant_exponent():
    # The rule skipped a constant exponent, so asking for it gave None (TF1: x^p ln x).
    x = tf.placeholder(tf.float32, (3,))
    p = tf.constant([2.0, 2.0, 2.0])
    (gp,) = tf.gradients(tf.reduce_sum(tf.pow(x, p)), [p])
    np.testing.assert_allclose(tf.Session().run(gp, {x: [1.0, 2.0, 3.0]}),
                               [0.0, 4 * np.log(2), 9 * np.log(3)], rtol=1e-6)


def test_gather_takes_python_and_numpy_integer_indices():
    # A list of ints was typed beside the float params, float32, and refused:
    # "gather: indices must be integers, got float32".
    params = tf.constant([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    sess = tf.Session()
    for indices in ([2, 0], np.array([2, 0]), (2, 0)):
        np.testing.assert_array_equal(sess.run(tf.gather(params, indices)), [[4, 5], [0, 1]])
    np.testing.assert_array_equal(sess.run(tf.gather(params, 1)), [2, 3])
    np.testing.assert_array_equal(sess.run(tf.nn.embedding_lookup(params, [1])), [[2, 3]])
    with pytest.raises(ShapeError, match="indices must be integers, got float"):
        tf.gather(params, [1.5])


def test_argmax_without_an_axis_takes_tf1s_axis_0():
    # It flattened (numpy's argmax), giving the scalar 1 where TF1 gives [1, 0, 0].
    x = tf.constant(np.array([[1, 3, 3], [2, 2, 0]], np.float32))
    np.testing.assert_array_equal(tf.Session().run(tf.argmax(x)), [1, 0, 0])


def test_optimizer_get_slot_names_the_slots_it_made():
    w = tf.Variable(np.ones(3, np.float32), name="slotted")
    adam = tf.train.AdamOptimizer(0.1)
    adam.minimize(tf.reduce_sum(w * w), [w])
    assert adam.get_slot_names() == ["m", "v"]
    assert adam.get_slot(w, "m").name == "slotted/m" and adam.get_slot(w, "nope") is None
    assert tf.train.GradientDescentOptimizer(0.1).get_slot_names() == []


def test_bias_add_of_a_3d_tensor_adds_along_the_last_axis():
    # It added along dimension 1 for every rank: a (1, 3, 3) tensor got its bias
    # along the time axis, silently (TF1: the last axis, "N...C").
    sess = tf.Session()
    bias = tf.constant([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(sess.run(tf.nn.bias_add(tf.zeros((1, 3, 3)), bias))[0],
                                  [[1, 2, 3]] * 3)
    # 4-D stays TinyFlow's NCHW (the channels), unless told NHWC
    np.testing.assert_array_equal(
        sess.run(tf.nn.bias_add(tf.zeros((1, 3, 2, 2)), bias))[0, :, 1, 1], [1, 2, 3])
    np.testing.assert_array_equal(sess.run(tf.nn.bias_add(
        tf.zeros((1, 2, 2, 3)), bias, data_format="NHWC"))[0, 1, 1], [1, 2, 3])
    with pytest.raises(tf.ArgumentError, match="data_format must be one of"):
        tf.nn.bias_add(tf.zeros((2, 3)), bias, data_format="CN")


def test_cross_entropy_v1_sends_no_gradient_into_labels_and_v2_does():
    logits, labels = tf.placeholder(tf.float32, (1, 3)), tf.placeholder(tf.float32, (1, 3))
    v1 = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(logits=logits, labels=labels))
    v2 = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits_v2(logits=logits,
                                                                   labels=labels))
    assert tf.gradients(v1, [labels]) == [None]      # it was log_softmax's values
    feed = {logits: [[1.0, 2.0, 3.0]], labels: [[0.0, 0.0, 1.0]]}
    sess = tf.Session()
    np.testing.assert_allclose(sess.run(tf.gradients(v2, [labels])[0], feed),
                               -sess.run(tf.nn.log_softmax(logits), feed), rtol=1e-6)
    np.testing.assert_array_equal(*sess.run([tf.gradients(v1, [logits])[0],
                                             tf.gradients(v2, [logits])[0]], feed))


def test_gradient_with_respect_to_an_integer_tensor_is_none():
    # It was an int64 "gradient" (TF1: None; an int cannot move a little).
    x = tf.placeholder(tf.int32, (2,))
    assert tf.gradients(tf.reduce_sum(x * 3), [x]) == [None]


def test_adam_float32_step_is_as_close_to_the_exact_one_as_tf1s():
    # 1 - beta was rounded from Python's float64 while the bias correction's
    # 1 - beta^t was float32: at t = 1 they no longer cancelled, and the step was
    # 7e-6 off the exact one (TF1: 1.3e-6).
    from tinyflow import eager as E
    start = np.array([1.0, -2.0, 0.5], np.float32)
    scale = np.array([1.0, 3.0, 0.25], np.float32)
    grad = 2 * start.astype(np.float64) * scale
    exact = start - np.sqrt(1 - 0.999) / (1 - 0.9) * (0.1 * grad) / (
        np.sqrt(0.001 * grad * grad) + 1e-8)
    w = tf.Variable(start)
    train = tf.train.AdamOptimizer(1.0).minimize(tf.reduce_sum(w * w * scale))
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    sess.run(train)
    np.testing.assert_allclose(sess.run(w), exact, atol=3e-7)
    p = E.tensor(start, requires_grad=True)
    (p * p * E.tensor(scale)).sum().backward()
    E.Adam([p], lr=1.0).step()
    np.testing.assert_allclose(p.data, exact, atol=3e-7)


# ----------------------------------------------------------------------------------
# TF1 spellings TinyFlow lacked, each the expression TF1 defines it as
# ----------------------------------------------------------------------------------

def test_tf1_arithmetic_spellings_and_small_compositions():
    a = np.array([[-1.0, 2.0], [3.0, -4.0]], np.float32)
    x = tf.constant(a)
    sess = tf.Session()
    got = sess.run([tf.add(x, 1.0), tf.subtract(x, 1.0), tf.multiply(x, 2.0),
                    tf.divide(x, 2.0), tf.negative(x), tf.square(x),
                    tf.clip_by_value(x, -2.0, 2.5), tf.add_n([x, x, x]),
                    tf.stack([x, x], axis=1)])
    expected = [a + 1, a - 1, a * 2, a / 2, -a, a * a, np.clip(a, -2, 2.5), 3 * a,
                np.stack([a, a], 1)]
    for g, e in zip(got, expected):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, e)
    assert tf.bool is np.bool_
    with pytest.raises(ShapeError, match=r"add_n: the inputs' shapes differ"):
        tf.add_n([x, tf.zeros((3,))])
    with pytest.raises(tf.ArgumentError, match="non-empty list"):
        tf.add_n([])


def test_one_hot_assign_add_and_truncated_normal():
    sess = tf.Session()
    np.testing.assert_array_equal(sess.run(tf.one_hot([0, 2, -1, 5], 3)),
                                  [[1, 0, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0]])
    labels = tf.placeholder(tf.int64, (None,))
    hot = tf.one_hot(labels, 4, on_value=5, off_value=-1, dtype=tf.int32)
    np.testing.assert_array_equal(sess.run(hot, {labels: [3]}), [[-1, -1, -1, 5]])
    v = tf.Variable(np.float32(1.0), name="counter")
    sess.run(tf.global_variables_initializer())
    assert sess.run(tf.assign_add(v, 2.0)) == 3.0 and sess.run(tf.assign_sub(v, 0.5)) == 2.5
    draw = sess.run(tf.truncated_normal((5000,), stddev=0.1, seed=3))
    assert draw.dtype == np.float32 and np.abs(draw).max() <= 0.2


def test_nn_losses_and_activations_tf1_defines():
    sess = tf.Session()
    z = np.array([1.0, 0.0, 1.0], np.float32)
    x = np.array([2.0, -3.0, -100.0], np.float32)
    loss = sess.run(tf.nn.sigmoid_cross_entropy_with_logits(labels=z, logits=x))
    reference = np.maximum(x, 0) - x * z + np.log1p(np.exp(-np.abs(x)))
    np.testing.assert_allclose(loss, reference, rtol=1e-6)   # finite at -100 too
    np.testing.assert_allclose(sess.run(tf.nn.softplus(tf.constant([-100.0, 0.0, 100.0]))),
                               [0.0, np.log(2.0), 100.0], rtol=1e-6, atol=1e-30)
    np.testing.assert_array_equal(sess.run(tf.nn.leaky_relu(tf.constant([-1.0, 2.0]))),
                                  np.array([-0.2, 2.0], np.float32))
    assert sess.run(tf.nn.l2_loss(tf.constant([3.0, 4.0]))) == 12.5


def test_min_argmin_and_tf1_keyword_spellings():
    a = np.array([[3.0, 1.0, 1.0], [0.0, 2.0, -1.0]], np.float32)
    x = tf.constant(a)
    sess = tf.Session()
    np.testing.assert_array_equal(sess.run(tf.reduce_min(x, reduction_indices=1)), [1, -1])
    np.testing.assert_array_equal(sess.run(tf.argmin(x)), [1, 0, 1])     # axis 0
    np.testing.assert_array_equal(sess.run(tf.argmin(x, 1)), [1, 2])     # first of ties
    (g,) = tf.gradients(tf.reduce_min(x), [x])                            # to the minimum
    np.testing.assert_array_equal(sess.run(g), [[0, 0, 0], [0, 0, 1]])
    np.testing.assert_array_equal(sess.run(tf.transpose(x, perm=[1, 0])), a.T)
    np.testing.assert_array_equal(sess.run(tf.squeeze(tf.zeros((1, 3, 1)), squeeze_dims=[0])),
                                  np.zeros((3, 1)))
    assert sess.run(tf.zeros_like(x, dtype=tf.int32)).dtype == np.int32
    assert sess.run(tf.ones_like(x, dtype=tf.float64)).dtype == np.float64
    assert (tf.int8, tf.int16, tf.uint8, tf.uint16) == (np.int8, np.int16, np.uint8, np.uint16)
    with pytest.raises(ShapeError, match="no element to take the min of"):
        tf.reduce_min(tf.zeros((2, 0)), 1)


def _three_steps(optimizer, start, scale):
    w = tf.Variable(start.copy(), dtype=tf.float64)
    train = optimizer.minimize(tf.reduce_sum(w * w * scale))
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    for _ in range(3):
        sess.run(train)
    return sess.run(w)


def test_nesterov_adagrad_and_rmsprop_follow_tf1s_update_rules():
    start, scale = np.array([1.0, -2.0, 0.5]), np.array([1.0, 3.0, 0.25])
    grad = lambda w: 2 * w * scale   # noqa: E731

    w, velocity = start.copy(), np.zeros(3)     # Nesterov (TF1's ApplyMomentum)
    for _ in range(3):
        g = grad(w)
        velocity = 0.9 * velocity + g
        w = w - (g * 0.1 + velocity * 0.9 * 0.1)
    np.testing.assert_allclose(_three_steps(tf.train.MomentumOptimizer(
        0.1, 0.9, use_nesterov=True), start, scale), w, rtol=1e-14)

    w, accum = start.copy(), np.full(3, 0.1)    # Adagrad
    for _ in range(3):
        g = grad(w)
        accum = accum + g * g
        w = w - 0.1 * g / np.sqrt(accum)
    np.testing.assert_allclose(_three_steps(tf.train.AdagradOptimizer(0.1), start, scale), w,
                               rtol=1e-14)

    for centered in (False, True):               # RMSProp, mean square starting at 1
        w, ms, mg, mom = start.copy(), np.ones(3), np.zeros(3), np.zeros(3)
        for _ in range(3):
            g = grad(w)
            ms = 0.9 * ms + (1 - 0.9) * g * g
            mg = 0.9 * mg + (1 - 0.9) * g
            spread = ms - mg * mg if centered else ms
            mom = 0.5 * mom + 0.01 * g / np.sqrt(spread + 1e-10)
            w = w - mom
        np.testing.assert_allclose(_three_steps(tf.train.RMSPropOptimizer(
            0.01, momentum=0.5, centered=centered), start, scale), w, rtol=1e-14)
    with pytest.raises(tf.ArgumentError, match="initial_accumulator_value must be above 0"):
        tf.train.AdagradOptimizer(0.1, initial_accumulator_value=0.0)


def test_default_session_eval_run_get_shape_and_variable_methods():
    x = tf.placeholder(tf.float32, (None, 3))
    v = tf.Variable(np.ones(3, np.float32), name="methods")
    y = x * v
    assert y.get_shape().as_list() == [None, 3] and y.get_shape().ndims == 2
    assert tf.placeholder(tf.float32).get_shape().ndims is None
    with pytest.raises(ValueError, match="unknown TensorShape"):
        tf.placeholder(tf.float32).get_shape().as_list()
    with tf.Session() as sess:
        assert tf.get_default_session() is sess
        tf.global_variables_initializer().run()
        np.testing.assert_array_equal(y.eval({x: np.ones((2, 3), np.float32)}), np.ones((2, 3)))
        v.assign(v * 2.0).run()
        np.testing.assert_array_equal(v.assign_sub([1.0, 1.0, 1.0]).eval(), [1.0, 1.0, 1.0])
        other = tf.Session()
        with other.as_default():
            assert tf.get_default_session() is other
        assert tf.get_default_session() is sess
    assert tf.get_default_session() is None
    with pytest.raises(TinyFlowError, match=r"eval\(\): no default Session"):
        v.eval()
    interactive = tf.InteractiveSession()
    tf.global_variables_initializer().run()
    assert v.assign_add([1.0, 2.0, 3.0]).eval().tolist() == [2.0, 3.0, 4.0]
    interactive.close()
    assert tf.get_default_session() is None


def test_gradient_of_x_to_the_zero_at_zero_is_zero_without_warnings(recwarn):
    # p * x^(p-1) was 0 * inf = NaN at x = 0 (PyTorch and the calculus give 0), with
    # numpy's divide and invalid warnings on the way.
    from tinyflow import eager as E
    x = tf.placeholder(tf.float64, (3,))
    sess = tf.Session()
    for p in (0.0, tf.constant([0.0, 1.0, 2.0], tf.float64)):
        (g,) = tf.gradients(tf.reduce_sum(tf.pow(x, p)), [x])
        expected = [0.0, 0.0, 0.0] if isinstance(p, float) else [0.0, 1.0, 4.0]
        np.testing.assert_array_equal(sess.run(g, {x: [0.0, 1.0, 2.0]}), expected)
    leaf = E.tensor(np.array([0.0, 1.0, 2.0]), requires_grad=True)
    (leaf ** 0.0).sum().backward()
    np.testing.assert_array_equal(leaf.grad.numpy(), [0.0, 0.0, 0.0])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_bias_add_checks_the_bias_length_on_the_last_axis():
    # Review: a 1-entry bias was broadcast over a rank-3 input (TF1 refuses). (An
    # input of unknown rank keeps dimension 1: the original TinyFlow's conv layers
    # give such inputs, and its programs must run unchanged.)
    with pytest.raises(ShapeError, match="bias has 1 entries but dimension 2 of x is 4"):
        tf.nn.bias_add(tf.zeros((2, 3, 4)), tf.constant([1.0]))


def test_bias_add_along_the_last_axis_is_one_bias_add_op_with_its_gradient():
    # It was an `add` that broadcast (the op knew only dimension 1): the bias_add op
    # now has an `axis`, so its gradient is bias_grad along that axis, ONNX export
    # and fuse_dense know it, and the graph says what the user wrote.
    x = tf.placeholder(tf.float32, (2, 3, 3))
    bias = tf.Variable(np.zeros(3, np.float32))
    y = tf.nn.bias_add(x, bias)
    assert (y.op, y.attrs["axis"]) == ("bias_add", 2)
    (grad,) = tf.gradients(tf.reduce_sum(y * tf.constant([1.0, 2.0, 3.0])), [bias])
    assert (grad.op, grad.attrs["axis"]) == ("bias_grad", 2)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    np.testing.assert_array_equal(sess.run(grad, {x: np.zeros((2, 3, 3))}), [6.0, 12.0, 18.0])
    # an input of unknown rank told channels-last counts its axis from the end
    unknown = tf.placeholder(tf.float32)
    z = tf.nn.bias_add(unknown, bias, data_format="NHWC")
    assert z.attrs["axis"] == -1
    np.testing.assert_array_equal(sess.run(z, {unknown: np.zeros((1, 2, 3))})[0, 1], [0, 0, 0])
    with pytest.raises(ShapeError, match="dimension 2 of x is 4"):
        sess.run(z, {unknown: np.zeros((1, 3, 4))})
    with pytest.raises(ShapeError, match="axis 3 is out of range"):
        ops.make("bias_add", x, bias, axis=3)


def test_softplus_and_sigmoid_cross_entropy_have_gradient_sigmoid_at_zero():
    # Numerics probe: built as maximum(x, 0) + log(1 + exp(-|x|)), the gradient at
    # exactly 0 was 1 (maximum's tie sends it all to x, abs's sign(0) is 0), where
    # it is sigmoid(0) = 0.5; logistic regression from zero weights started wrong.
    x = tf.placeholder(tf.float64, (3,))
    z = tf.constant(np.array([0.0, 1.0, 0.5]))
    (d_softplus,) = tf.gradients(tf.reduce_sum(tf.nn.softplus(x)), [x])
    (d_xent,) = tf.gradients(tf.reduce_sum(
        tf.nn.sigmoid_cross_entropy_with_logits(labels=z, logits=x)), [x])
    values = np.array([0.0, -0.0, 2.0])
    sess = tf.Session()
    got_softplus, got_xent = sess.run([d_softplus, d_xent], {x: values})
    sigmoid = 1.0 / (1.0 + np.exp(-values))
    np.testing.assert_allclose(got_softplus, sigmoid, rtol=1e-15)
    np.testing.assert_allclose(got_xent, sigmoid - np.array([0.0, 1.0, 0.5]), rtol=1e-15)
    # and the values are those of the stable form, as before
    np.testing.assert_allclose(sess.run(tf.nn.softplus(x), {x: values}),
                               np.log1p(np.exp(values)), rtol=1e-15)
