"""Errors are part of the interface: each names the op or placeholder, the shapes,
and the line of *this* file that built the offending node, whether the mistake is
caught when the graph is built or only when a feed fixes the shapes."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import eager as E
from tinyflow.errors import ArgumentError
from tinyflow.ops import make
from tinyflow.graph import FeedError, ShapeError, TinyFlowError

HERE = os.path.basename(__file__)


def where(marker: str) -> str:
    """``test_errors.py:<line>`` of the line of this file that holds `marker`."""
    lines = inspect.getsource(inspect.getmodule(where)).splitlines()
    line = next(i for i, text in enumerate(lines, 1)
                if text.rstrip().endswith(f"# {marker}"))
    return f"{HERE}:{line}"


# ----------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------

def test_matmul_mismatch_at_construction_names_op_shapes_and_line():
    a = tf.placeholder(tf.float32, (3, 4))
    b = tf.placeholder(tf.float32, (5, 6))
    with pytest.raises(ShapeError) as info:
        tf.matmul(a, b)  # matmul built
    message = str(info.value)
    assert "matmul" in message
    assert "(3, 4)" in message and "(5, 6)" in message
    assert where("matmul built") in message


def test_operator_sugar_reports_the_users_line():
    a = tf.placeholder(tf.float32, (2, 3))
    b = tf.placeholder(tf.float32, (4,))
    with pytest.raises(ShapeError) as info:
        a + b  # the plus
    message = str(info.value)
    assert message.startswith("add:") and "(2, 3)" in message and "(4,)" in message
    assert where("the plus") in message


def test_layer_functions_report_the_users_line_not_tinyflows():
    x = tf.placeholder(tf.float32, (2, 3, 8, 8))
    w = tf.placeholder(tf.float32, (4, 5, 3, 3))
    with pytest.raises(ShapeError) as info:
        tf.nn.conv2d(x, w, strides=[1, 1, 1, 1], padding="SAME")  # conv built
    message = str(info.value)
    assert "conv2d" in message and "(2, 3, 8, 8)" in message and "(4, 5, 3, 3)" in message
    assert "3 channels" in message
    assert where("conv built") in message


def test_reshape_to_a_wrong_size_names_both():
    x = tf.placeholder(tf.float32, (2, 3))
    with pytest.raises(ShapeError) as info:
        tf.reshape(x, (4, 2))  # reshape built
    message = str(info.value)
    assert "reshape" in message and "(2, 3)" in message and "6 elements" in message
    assert where("reshape built") in message


@pytest.mark.parametrize("build, words", [
    (lambda x: tf.expand_dims(x, 3), "axis 3 is out of range"),
    (lambda x: tf.expand_dims(x, -4), "axis -4 is out of range"),
    (lambda x: tf.squeeze(x, 2), "axis 2 is out of range"),
    (lambda x: x[::0], "step cannot be zero"),
    (lambda x: x[0, 0, 0], "too many indices"),
    (lambda x: tf.transpose(x, (0, 0)), "not a permutation"),
    (lambda x: tf.reduce_sum(x, 2), "axis 2 is out of range"),
    (lambda x: tf.concat([x, tf.transpose(x)], 0), "dimension 1 differs (3 vs 2)"),
    (lambda x: tf.broadcast_to(x, (3,)), "cannot broadcast"),
])
def test_bad_axes_and_indices_are_shape_errors_at_construction(build, words):
    x = tf.placeholder(tf.float32, (2, 3))
    with pytest.raises(ShapeError) as info:
        build(x)
    message = str(info.value)
    assert words in message and "(2, 3)" in message and f"{HERE}:" in message


@pytest.mark.parametrize("build, words", [
    # Coerced before, so each built a different op than the one asked for:
    (lambda x: tf.reduce_sum(x, 1.5), "reduce_sum: axis must be an int, got 1.5"),
    (lambda x: tf.reduce_sum(x, "1"), "axis must be an int, got '1'"),
    (lambda x: tf.reduce_sum(x, True), "axis must be an int, got True"),
    (lambda x: tf.reduce_mean(x, [0.0, 1.0]), "axis must be a sequence of ints"),
    (lambda x: tf.reduce_sum(x, 0, keepdims="no"), "keepdims must be True or False, got 'no'"),
    (lambda x: tf.reduce_max(x, 0, keep_dims=2), "keepdims must be True or False, got 2"),
    (lambda x: tf.argmax(x, 1.5), "argmax: axis must be an int, got 1.5"),
    (lambda x: tf.expand_dims(x, 0.5), "expand_dims: axis must be an int"),
    (lambda x: tf.concat([x, x], 1.5), "concat: axis must be an int, got 1.5"),
    (lambda x: tf.pad(x, 1.5, 1), "pad: dim must be an int, got 1.5"),
    (lambda x: tf.reshape(x, (2.5, 3)), "reshape: shape must be a sequence of ints"),
    (lambda x: tf.broadcast_to(x, (2.5, 3)), "broadcast_to: shape must be a sequence of ints"),
    (lambda x: tf.transpose(x, (1.0, 0.0)), "transpose: axes must be a sequence of ints"),
    (lambda x: tf.zeros((2.5,)), "zeros: shape must be a sequence of ints"),
    (lambda x: tf.placeholder(tf.float32, (2.5, 3)), "placeholder: shape must be"),
    (lambda x: tf.Variable(shape=(2.5,)), "Variable: shape must be"),
    (lambda x: tf.Variable(1.0, trainable="no"), "Variable: trainable must be True or False"),
    (lambda x: tf.Variable(1.0, trainable=0), "trainable must be True or False, got 0"),
    (lambda x: x[True], "not True"),
    (lambda x: tf.constant(1.5, tf.int32), "cannot be held exactly in int32"),
    # Escaped as Python's or numpy's own errors from inside tinyflow:
    (lambda x: tf.reduce_sum(x, "a"), "axis must be an int, got 'a'"),
    (lambda x: tf.argmax(x, [0, 1]), "axis must be an int, got [0, 1]"),
    (lambda x: tf.reshape(x, (None, 3)), "shape must be a sequence of ints, got (None, 3)"),
    (lambda x: tf.transpose(x, "ab"), "axes must be a sequence of ints, got 'ab'"),
    (lambda x: tf.concat([], 0), "concat: needs at least one value"),
    (lambda x: tf.concat(x, 0), "values must be a list of tensors"),
    (lambda x: x[0:1.5], "slice bounds must be ints or None"),
    (lambda x: x[1.5], "not 1.5"),
    (lambda x: tf.placeholder("floaty", (2,)), "dtype 'floaty' is not a dtype numpy knows"),
    (lambda x: tf.placeholder(object, (2,)), "is not a numeric dtype"),
    (lambda x: tf.cast(x, str), "cast: dtype <class 'str'> is not a numeric dtype"),
    (lambda x: tf.zeros((2,), "nope"), "zeros: dtype 'nope'"),
    (lambda x: tf.random_normal((2,), stddev="a"), "stddev must be a finite number, got 'a'"),
    (lambda x: tf.random_normal((2,), stddev=-1), "random_normal: stddev must be >= 0, got -1"),
    (lambda x: tf.normal((2,), -0.5), "random_normal: stddev must be >= 0, got -0.5"),
    (lambda x: tf.random_normal((2,), mean=float("nan")), "mean must be a finite number, got nan"),
    (lambda x: tf.random_uniform((2,), 1.0, 0.0), "minval must be <= maxval, got minval=1.0"),
    (lambda x: tf.random_uniform((2,), -1e308, 1e308), "maxval - minval must be a finite"),
    (lambda x: tf.constant([[1.0], [2.0, 3.0]]), "constant: value is not an array"),
    (lambda x: tf.Variable(np.array([object()], dtype=object)), "needs numbers"),
    (lambda x: tf.Variable(["a", "b"]), "needs numbers or an array of numbers, got ['a', 'b']"),
])
def test_bad_arguments_are_argument_errors_naming_op_value_and_line(build, words):
    """Arguments no input could make valid are refused when the op is built, not
    coerced (int(1.5), bool("no")) into another op and not left to numpy."""
    x = tf.placeholder(tf.float32, (2, 3))
    with pytest.raises(ArgumentError) as info:
        build(x)
    message = str(info.value)
    assert words in message and f"{HERE}:{build.__code__.co_firstlineno}" in message
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("build, words", [
    # Built a different layer than the one asked for:
    (lambda x: tf.nn.max_pool(x, ksize=[1, 2, 2]), "ksize must be an int or (h, w)"),
    (lambda x: tf.nn.max_pool(x, ksize=[1, 1, 2, 2]), "must be [1, h, w, 1]"),
    (lambda x: tf.nn.conv2d(x, W(), strides=[1, 2, 2]), "strides must be an int or (h, w)"),
    (lambda x: tf.nn.conv2d(x, W(), strides=[1, 1.5, 1.5, 1]), "sequence of ints"),
    (lambda x: tf.nn.conv2d(x, W(), padding=1.5), "padding must be 'SAME', 'VALID' or an int"),
    (lambda x: tf.nn.conv2d(x, W(), padding=True), "got True"),
    (lambda x: tf.nn.conv2d(x, num_filter=-3, ksize=3), "num_filter must be >= 1, got -3"),
    (lambda x: tf.nn.conv2d(x, num_filter=3, ksize=[1, 0, 0, 1]),
     "conv2d: ksize must be >= 1, got [1, 0, 0, 1]"),
    (lambda x: tf.nn.conv2d(x, num_filter=3, ksize=-2), "conv2d: ksize must be >= 1, got -2"),
    (lambda x: tf.nn.linear(tf.reshape(x, (2, -1)), num_hidden=2.5), "num_hidden must be an int"),
    # Escaped as Python's own errors from inside tinyflow:
    (lambda x: tf.nn.max_pool(x, ksize=[2]), "max_pool: ksize must be an int or (h, w), got [2]"),
    (lambda x: tf.nn.avg_pool(x, ksize=1.5), "ksize must be an int or (h, w), got 1.5"),
    (lambda x: tf.nn.max_pool2d(x, [2, 2, 2]), "max_pool2d: ksize must be an int or (h, w)"),
    (lambda x: tf.nn.conv2d(x, W(), padding=None), "padding must be 'SAME', 'VALID' or an int"),
    (lambda x: tf.nn.conv2d(x, W(), data_format="NHWC"), "data_format 'NHWC'"),
    (lambda x: tf.nn.dropout(x, "a"), "dropout: keep_prob must be a finite number, got 'a'"),
    (lambda x: tf.nn.dropout(x, float("nan")), "keep_prob must be a finite number, got nan"),
    (lambda x: tf.nn.dropout(x, 0.0), "dropout: keep_prob must be in (0, 1], got 0.0"),
    (lambda x: tf.nn.dropout(x, rate="a"), "dropout: rate must be a finite number, got 'a'"),
    (lambda x: tf.nn.dropout(x, rate=1.0), "dropout: rate must be in [0, 1), got 1.0"),
    (lambda x: tf.nn.dropout(x, 0.5, rate=0.5), "give exactly one of keep_prob"),
    (lambda x: tf.nn.Linear(-1, 3), "Linear: in_features must be >= 1, got -1"),
    (lambda x: tf.nn.Conv2d(2, 3, 0), "Conv2d: kernel_size must be >= 1, got 0"),
    (lambda x: tf.nn.layer_norm(x, G(), G(), eps="a"), "layer_norm: eps must be a finite number"),
    (lambda x: tf.nn.layer_norm(x, G(), G(), eps=-1e-5), "layer_norm: eps must be >= 0"),
    (lambda x: tf.nn.layer_norm(x, G(), G(), float("nan")), "eps must be a finite number, got nan"),
    (lambda x: tf.nn.LayerNorm(6, eps=-1.0), "LayerNorm: eps must be >= 0, got -1.0"),
    # batch_normalization's epsilon was taken unchecked: a negative one NaN'd the output
    (lambda x: tf.nn.batch_normalization(x, *tf.nn.moments(x, [0]), None, None, -1e-3),
     "batch_normalization: variance_epsilon must be >= 0, got -0.001"),
    (lambda x: tf.nn.batch_normalization(x, *tf.nn.moments(x, [0]), None, None, float("nan")),
     "batch_normalization: variance_epsilon must be a finite number, got nan"),
    (lambda x: tf.nn.batch_normalization(x, *tf.nn.moments(x, [0]), None, None, float("inf")),
     "variance_epsilon must be a finite number, got inf"),
    (lambda x: tf.nn.batch_normalization(x, *tf.nn.moments(x, [0]), None, None, "a"),
     "variance_epsilon must be a finite number, got 'a'"),
    (lambda x: tf.nn.batch_normalization(x, variance_epsilon=-1.0),
     "batch_normalization: variance_epsilon must be >= 0, got -1.0"),
    # ... and so was the layer's momentum: 1.5 made the moving averages diverge
    (lambda x: tf.nn.batch_normalization(x, momentum=1.5),
     "batch_normalization: momentum must be <= 1, got 1.5"),
    (lambda x: tf.nn.batch_normalization(x, momentum=float("nan")),
     "batch_normalization: momentum must be a finite number, got nan"),
    (lambda x: tf.nn.batch_normalization(x, momentum=-0.1),
     "batch_normalization: momentum must be >= 0, got -0.1"),
    (lambda x: tf.nn.batch_normalization(x, training="no"),
     "batch_normalization: training must be True or False"),
    (lambda x: tf.nn.LayerNorm(0), "LayerNorm: dim must be >= 1, got 0"),
    (lambda x: tf.nn.MLP([4, 3], activation="foo"),
     "MLP: activation must be one of ['gelu', 'relu', 'tanh'], got 'foo'"),
    (lambda x: tf.nn.MLP([4, 3, 2], activation=None), "MLP: activation must be one of"),
    (lambda x: tf.nn.Embedding(0, 3), "Embedding: num_embeddings must be >= 1, got 0"),
    (lambda x: tf.nn.Embedding(5, 2.5), "Embedding: dim must be an int, got 2.5"),
])
def test_bad_window_and_layer_arguments_are_argument_errors(build, words):
    x = tf.placeholder(tf.float32, (1, 2, 6, 6))
    with pytest.raises(ArgumentError) as info:
        build(x)
    message = str(info.value)
    assert words in message and f"{HERE}:{build.__code__.co_firstlineno}" in message


@pytest.mark.parametrize("build, words", [
    (lambda: tf.train.GradientDescentOptimizer(float("nan")), "learning_rate must be a finite"),
    (lambda: tf.train.GradientDescentOptimizer(float("inf")), "finite number, got inf"),
    (lambda: tf.train.GradientDescentOptimizer(-0.1), "learning_rate must be >= 0, got -0.1"),
    (lambda: tf.train.GradientDescentOptimizer("a"), "learning_rate must be a finite number"),
    (lambda: tf.train.GradientDescentOptimizer(None), "got None"),
    (lambda: tf.train.GradientDescentOptimizer(0.1, weight_decay="a"), "weight_decay"),
    (lambda: tf.train.MomentumOptimizer(0.1, momentum=float("nan")), "momentum must be"),
    (lambda: tf.train.AdamOptimizer(0.1, beta1=1.0), "beta1 must be [0, 1), got 1.0"),
    (lambda: tf.train.AdamOptimizer(0.1, epsilon=-1.0), "epsilon must be >= 0"),
])
def test_bad_optimizer_hyperparameters_are_refused_where_the_optimizer_is_built(build, words):
    """Before, NaN, inf or beta1 = 1 trained every weight to NaN without a word."""
    with pytest.raises(ArgumentError) as info:
        build()
    message = str(info.value)
    assert words in message and f"{HERE}:{build.__code__.co_firstlineno}" in message
    assert "Optimizer" in message


@pytest.mark.parametrize("build, words", [
    (lambda: tf.train.GradientDescentOptimizer(0.1).minimize(3.0),
     "GradientDescentOptimizer.minimize: loss must be a graph node (built with tf ops), got 3.0"),
    (lambda: tf.train.AdamOptimizer().minimize(None), "AdamOptimizer.minimize: loss must be"),
    (lambda: tf.train.MomentumOptimizer(0.1, 0.9).compute_gradients(np.float32(2)),
     "MomentumOptimizer.compute_gradients: loss must be a graph node"),
    # tf.gradients said "'float' object is not iterable", or took a number among the
    # xs for a tensor nothing depends on (gradient None)
    (lambda: tf.gradients(3.0, [tf.Variable(np.ones(3))]),
     "gradients: ys must be a graph node or a list of them, got 3.0"),
    (lambda: tf.gradients(tf.Variable(np.ones(3)) * 2, 3.0),
     "gradients: xs must be a graph node or a list of them, got 3.0"),
    (lambda: tf.gradients(tf.Variable(np.ones(3)) * 2, [3.0]),
     "gradients: xs must be a graph node or a list of them, got [3.0]"),
])
def test_a_loss_that_is_not_a_node_is_refused_naming_the_method(build, words):
    """Before, an AttributeError from inside the graph walk ('float' has no 'inputs')."""
    with pytest.raises(ArgumentError) as info:
        build()
    message = str(info.value)
    assert words in message and f"{HERE}:{build.__code__.co_firstlineno}" in message


def W():
    return tf.placeholder(tf.float32, (3, 2, 3, 3))


def G():
    return tf.placeholder(tf.float32, (6,))


def test_well_typed_arguments_still_build():
    x = tf.placeholder(tf.float32, (2, 3))
    assert tf.reduce_sum(x, np.int64(1)).shape == (2,)
    assert tf.reduce_sum(x, np.array([0, 1])).shape == ()
    assert tf.reduce_sum(x, 0, keepdims=np.bool_(True)).shape == (1, 3)
    assert tf.reduce_sum(x, 0, keepdims=None).shape == (3,)
    assert tf.reshape(x, 6).shape == (6,)
    assert tf.placeholder(tf.float32, 3).shape == (3,)
    assert x[np.int64(1), ::np.int32(2)].shape == (2,)
    assert tf.constant(2.0, tf.int32).dtype == np.int32
    assert tf.Variable(1.0, trainable=None) in tf.trainable_variables()  # TF1's default
    assert tf.Variable(1.0, trainable=np.bool_(False)) not in tf.trainable_variables()
    image = tf.placeholder(tf.float32, (1, 2, 6, 6))
    assert tf.nn.max_pool(image, ksize=[1, 3, 2, 1]).shape == (1, 2, 2, 3)
    assert tf.nn.conv2d(image, W(), strides=np.int64(2), padding="same").shape == (1, 3, 3, 3)
    mean, variance = tf.nn.moments(image, [0, 2, 3], keepdims=True)
    assert tf.nn.batch_normalization(image, mean, variance, None, None, 0).shape == image.shape


def test_the_same_error_when_the_feed_fixes_the_shapes():
    """Built with unknown dims, the matmul cannot be checked; the first run that
    feeds (3, 4) and (5, 6) raises the error construction would have raised, pointing
    at the line that built the matmul, not at the line that ran it."""
    a = tf.placeholder(tf.float32, (None, None))
    b = tf.placeholder(tf.float32, (5, 6))
    product = tf.matmul(a, b)  # deferred matmul
    sess = tf.Session()
    with pytest.raises(ShapeError) as at_run:
        sess.run(product, feed_dict={a: np.ones((3, 4)), b: np.ones((5, 6))})
    message = str(at_run.value)
    assert where("deferred matmul") in message

    known = tf.placeholder(tf.float32, (3, 4))
    with pytest.raises(ShapeError) as at_build:
        tf.matmul(known, b)  # eager matmul
    expected = str(at_build.value).replace(where("eager matmul"), where("deferred matmul"))
    assert message == expected

    # A feed that fits runs, on the same Session, with the same graph.
    result = sess.run(product, feed_dict={a: np.ones((3, 5)), b: np.ones((5, 6))})
    np.testing.assert_allclose(result, np.full((3, 6), 5.0))


def test_unknown_rank_placeholders_fail_at_feed_time_with_op_shapes_and_line():
    x = tf.placeholder(tf.float32)
    y = tf.placeholder(tf.float32)
    total = x + y  # rankless add
    with pytest.raises(ShapeError) as info:
        tf.Session().run(total, {x: np.ones((3, 4)), y: np.ones((5, 6))})
    message = str(info.value)
    assert message.startswith("add:") and "(3, 4)" in message and "(5, 6)" in message
    assert where("rankless add") in message


def test_feed_time_error_deep_in_a_graph_names_the_op_that_fails():
    x = tf.placeholder(tf.float32, (None, 4))
    hidden = tf.nn.relu(tf.matmul(x, tf.ones((4, 3))))
    labels = tf.placeholder(tf.int64, (None,))
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(hidden, labels)  # the loss
    with pytest.raises(ShapeError) as info:
        tf.Session().run(loss, {x: np.ones((2, 4)), labels: np.zeros(5, np.int64)})
    message = str(info.value)
    assert message.startswith("softmax_cross_entropy:")
    assert "(2, 3)" in message and "(5,)" in message
    assert where("the loss") in message


def test_index_past_an_unknown_dim_fails_when_the_feed_is_too_small():
    x = tf.placeholder(tf.float32, (None, 3))
    row = x[4]  # the index
    sess = tf.Session()
    np.testing.assert_array_equal(sess.run(row, {x: np.ones((5, 3))}), np.ones(3))
    with pytest.raises(ShapeError) as info:
        sess.run(row, {x: np.ones((2, 3))})
    message = str(info.value)
    assert message.startswith("getitem:") and "(2, 3)" in message
    assert "index 4 is out of bounds" in message and where("the index") in message


class Inputs:
    """Makes a helper op's inputs, each zeros of the given shape: as placeholders of
    that shape ("build"), as placeholders of unknown dims fed that shape ("feed"),
    or as eager Tensors ("eager")."""

    def __init__(self, mode: str) -> None:
        self.mode, self.feed = mode, {}

    def __call__(self, *shape: int, dtype=np.float32):
        value = np.zeros(shape, dtype)
        if self.mode == "eager":
            return E.tensor(value)
        x = tf.placeholder(dtype, shape if self.mode == "build" else (None,) * len(shape))
        self.feed[x] = value
        return x


# Each gradient helper given a g that does not fit its other inputs (the shape the
# forward op gives them). Before, the shape rule took its output shape from one
# input and checked nothing: numpy failed inside the kernel at run time, or the
# result came back silently wrong (scatter_rows reshaped a (4, 3) g into (3, 4)).
MISMATCHED_G = [
    ("conv2d_grad_input", lambda P: make("conv2d_grad_input", P(2, 4, 5, 5), P(4, 3, 3, 3), P(2, 3, 8, 8), stride=(1, 1), padding=0)),  # noqa: E501
    ("conv2d_grad_input", lambda P: make("conv2d_grad_input", P(2, 5, 6, 6), P(4, 3, 3, 3), P(2, 3, 8, 8), stride=(1, 1), padding=0)),  # noqa: E501
    ("conv2d_grad_filter", lambda P: make("conv2d_grad_filter", P(2, 4, 5, 5), P(2, 3, 8, 8), P(4, 3, 3, 3), stride=(1, 1), padding=0)),  # noqa: E501
    ("conv2d_grad_filter", lambda P: make("conv2d_grad_filter", P(2, 4, 3, 3), P(2, 3, 8, 8), P(4, 3, 3, 3), stride=(2, 2), padding="SAME")),  # noqa: E501
    ("max_pool2d_grad", lambda P: make("max_pool2d_grad", P(1, 2, 4, 4), P(1, 2, 6, 6), ksize=(2, 2), stride=(2, 2), padding=0)),  # noqa: E501
    ("max_pool2d_grad", lambda P: make("max_pool2d_grad", P(1, 2, 3, 3), P(1, 2, 6, 6), P(1, 2, 4, 4), ksize=(2, 2), stride=(2, 2), padding=0)),  # noqa: E501
    ("max_pool2d_pick", lambda P: make("max_pool2d_pick", P(1, 2, 5, 5), P(1, 2, 6, 6), ksize=(2, 2), stride=(2, 2), padding=0)),  # noqa: E501
    ("avg_pool2d_grad", lambda P: make("avg_pool2d_grad", P(1, 2, 4, 4), P(1, 2, 6, 6), ksize=(2, 2), stride=(2, 2), padding=0)),  # noqa: E501
    ("sum_to_like", lambda P: make("sum_to_like", P(2, 3), P(4,))),
    ("sum_to_like", lambda P: make("sum_to_like", P(2, 3), P(3, 3))),
    ("broadcast_like", lambda P: make("broadcast_like", P(3,), P(2, 4))),
    ("reshape_like", lambda P: make("reshape_like", P(2, 3), P(4, 2))),
    ("slice_grad", lambda P: make("slice_grad", P(3, 5), P(4, 5), index=(("slice", 0, 2, None),))),  # noqa: E501
    ("scatter_rows", lambda P: make("scatter_rows", P(4, 3), P(3, dtype=np.int64), P(10, 4))),
    ("concat_part", lambda P: make("concat_part", P(2, 5), P(2, 3), P(2, 3), axis=1, part=0)),
    ("one_hot_like", lambda P: make("one_hot_like", P(3, dtype=np.int64), P(4, 5))),
]


@pytest.mark.parametrize("mode", ["build", "feed", "eager"])
@pytest.mark.parametrize("op, build", MISMATCHED_G)
def test_a_gradient_helper_given_a_g_that_does_not_fit_is_a_shape_error(op, build, mode):
    """Where the shapes are known (at build, in eager mode, or when the feed fixes
    the unknown dims) the helper's rule refuses them, naming the op and the user's
    line; unknown dims are accepted at build."""
    inputs = Inputs(mode)
    if mode == "feed":
        node = build(inputs)
        with pytest.raises(ShapeError) as info:
            tf.Session().run(node, inputs.feed)
    else:
        with pytest.raises(ShapeError) as info:
            build(inputs)
    message = str(info.value)
    assert message.startswith(f"{op}:") and f"{HERE}:{build.__code__.co_firstlineno}" in message


def test_bias_grad_of_a_g_without_a_channel_axis_is_a_shape_error():
    g = tf.placeholder(tf.float32, (3,))
    with pytest.raises(ShapeError, match="bias_grad:") as info:
        make("bias_grad", g)  # the bias grad
    assert where("the bias grad") in str(info.value)


# ----------------------------------------------------------------------------------
# Feeds
# ----------------------------------------------------------------------------------

def test_feed_of_the_wrong_shape_names_the_placeholder_and_both_shapes():
    images = tf.placeholder(tf.float32, (None, 64), name="images")  # images placeholder
    with pytest.raises(FeedError) as info:
        tf.Session().run(images * 2.0, {images: np.ones((8, 65))})
    message = str(info.value)
    assert "'images'" in message and "(8, 65)" in message and "64)" in message
    assert where("images placeholder") in message


def test_feed_of_the_wrong_rank_names_the_placeholder():
    labels = tf.placeholder(tf.int64, (None,), name="labels")
    with pytest.raises(FeedError, match=r"'labels'.*shape \(4, 1\)"):
        tf.Session().run(labels + 1, {labels: np.zeros((4, 1), np.int64)})


@pytest.mark.parametrize("value, dtype_word", [
    (np.array([["a", "b"]]), "<U1"),
    (np.array([[object(), None]], dtype=object), "object"),
])
def test_feed_of_strings_or_objects_names_the_placeholder(value, dtype_word):
    x = tf.placeholder(tf.float32, (1, 2), name="pixels")
    with pytest.raises(FeedError) as info:
        tf.Session().run(x * 1.0, {x: value})
    message = str(info.value)
    assert "'pixels'" in message and dtype_word in message and "float32" in message


def test_feed_of_floats_into_an_int_placeholder_is_refused():
    ids = tf.placeholder(tf.int32, (3,), name="token_ids")
    with pytest.raises(FeedError, match=r"'token_ids'.*float64.*int32"):
        tf.Session().run(ids + 1, {ids: np.array([1.5, 2.0, 3.0])})


def test_ragged_feed_is_a_feed_error():
    x = tf.placeholder(tf.float32, name="ragged")  # ragged placeholder
    with pytest.raises(FeedError, match="placeholder 'ragged'") as info:
        tf.Session().run(x * 1.0, {x: [[1.0, 2.0], [3.0]]})
    assert where("ragged placeholder") in str(info.value)  # as the other feed errors


@pytest.mark.parametrize("feed, words", [
    (np.ones(4), "feed for variable 'w' (created at {}) has shape (4,)"),
    (np.array(["a", "b", "c"]), "feed for variable 'w' (created at {}) has dtype <U1"),
    (np.array([1e300, 0, 0]), "feed for variable 'w' (created at {}) has value 1e+300"),
])
def test_a_fed_variable_is_not_called_a_placeholder(feed, words):
    w = tf.Variable(np.ones(3, np.float32), name="w")  # fed variable
    with pytest.raises(FeedError) as info:
        tf.Session().run(w * 2.0, {w: feed})
    assert words.format(where("fed variable")) in str(info.value)


def test_a_fed_intermediate_node_is_not_called_a_placeholder():
    x = tf.placeholder(tf.float32, (3,))
    hidden = x * 2.0  # fed node
    with pytest.raises(FeedError) as info:
        tf.Session().run(hidden + 1.0, {hidden: np.ones(4)})
    message = str(info.value)
    assert f"feed for mul node {hidden.name!r} (created at {where('fed node')})" in message
    assert "placeholder" not in message


def test_missing_feed_names_the_placeholder_and_its_line():
    x = tf.placeholder(tf.float32, (2,), name="inputs")  # needed placeholder
    y = tf.placeholder(tf.float32, (2,), name="other")
    total = x + y
    with pytest.raises(FeedError) as info:
        tf.Session().run(total, {y: np.ones(2)})
    message = str(info.value)
    assert "'inputs'" in message and "must be fed" in message
    assert where("needed placeholder") in message


def test_feed_dict_keys_must_be_nodes():
    x = tf.placeholder(tf.float32, (2,), name="x")
    with pytest.raises(FeedError, match="feed_dict keys must be graph nodes"):
        tf.Session().run(x * 1.0, {"x": np.ones(2)})


# ----------------------------------------------------------------------------------
# State and Python semantics
# ----------------------------------------------------------------------------------

def test_uninitialized_variable_names_it_and_says_what_to_do():
    weights = tf.Variable(tf.zeros((2, 2)), name="weights")  # the variable
    with pytest.raises(TinyFlowError) as info:
        tf.Session().run(weights * 2.0)
    message = str(info.value)
    assert "'weights'" in message and "global_variables_initializer" in message
    assert where("the variable") in message


def test_a_node_in_an_if_raises_type_error():
    x = tf.placeholder(tf.float32, (2,), name="flag")
    with pytest.raises(TypeError, match="truth value of graph node flag"):
        if x:
            pass
    with pytest.raises(TypeError, match="tf.where"):
        if x > 0.0:
            pass
    with pytest.raises(TypeError):
        while x:
            break


def test_equality_is_identity_and_builds_nothing():
    x = tf.placeholder(tf.float32, (2,))
    y = tf.placeholder(tf.float32, (2,))
    assert (x == x) is True and (x == y) is False
    assert len({x: 1, y: 2}) == 2


def test_assign_to_a_non_variable_is_a_type_error():
    x = tf.placeholder(tf.float32, (2,))
    with pytest.raises(TypeError, match="Variable"):
        tf.assign(x * 2.0, tf.zeros((2,)))


def test_fetching_a_non_node_is_a_type_error():
    with pytest.raises(TypeError, match="cannot fetch"):
        tf.Session().run([tf.zeros((1,)), "loss"])


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------

def test_label_out_of_range_names_the_node_and_line_not_numpy():
    logits = tf.placeholder(tf.float32, (2, 3))
    labels = tf.placeholder(tf.int64, (2,))
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(logits, labels)  # the xent
    with pytest.raises(TinyFlowError) as info:
        tf.Session().run(loss, {logits: np.zeros((2, 3)), labels: np.array([0, 7])})
    message = str(info.value)
    assert "softmax_cross_entropy" in message and loss.name in message
    assert where("the xent") in message
    assert "[0, 3)" in message and "7" in message


def test_gather_index_out_of_range_names_the_node_and_line():
    table = tf.placeholder(tf.float32, (4, 2))
    ids = tf.placeholder(tf.int64, (3,))
    rows = tf.gather(table, ids)  # the gather
    with pytest.raises(TinyFlowError) as info:
        tf.Session().run(rows, {table: np.zeros((4, 2)), ids: np.array([0, 9, 1])})
    message = str(info.value)
    assert rows.name in message and "gather" in message
    assert where("the gather") in message
    assert "(4, 2)" in message and "(3,)" in message


def test_label_out_of_range_in_a_gradient_only_run_names_the_gradients_call():
    """With an explicit seed (grad_ys) the gradient of cross entropy needs only the
    softmax and the one-hot labels, not the loss kernel: the one-hot kernel must
    refuse bad labels too, and the error points at the tf.gradients line."""
    logits = tf.placeholder(tf.float64, (2, 3))
    labels = tf.placeholder(tf.int64, (2,))
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(logits, labels)
    seed = tf.constant(np.ones(2), tf.float64)
    (grad,) = tf.gradients(loss, [logits], grad_ys=[seed])  # the gradient call
    sess = tf.Session()
    good = sess.run(grad, {logits: np.zeros((2, 3)), labels: np.array([0, 2])})
    np.testing.assert_allclose(good, np.full((2, 3), 1 / 3) - np.eye(3)[[0, 2]])
    assert all(s.node.op != "softmax_cross_entropy" for s in sess.last_program.steps)
    for bad in ([-1, 0], [0, 3]):
        with pytest.raises(TinyFlowError) as info:
            sess.run(grad, {logits: np.zeros((2, 3)), labels: np.array(bad)})
        message = str(info.value)
        assert where("the gradient call") in message
        assert "[0, 3)" in message
