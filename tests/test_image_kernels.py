"""The fast conv2d / max_pool2d kernels (image_ops.py) against straightforward loops.

* Every kernel, on a sweep of shapes, strides and paddings that reaches every conv
  path (flat runs for stride-1 windows that keep the width, strided taps
  otherwise; shifted rows for the stride-1 input gradient) and both pooling
  backward paths (write for disjoint windows, masked add for overlapping ones), is
  compared in float64 with the per-window references of test_ops.py, called both
  with and without planned `out=` memory.
* A 20-step float32 training curve of a small CNN equals the one recorded with the
  previous kernels (im2col of 6-D strided views, window argmax) to 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_ops import (
    conv_grad_filter_reference,
    conv_grad_input_reference,
    conv_reference,
    max_pool_grad_reference,
    max_pool_reference,
    pick_reference,
)

import tinyflow as tf
from tinyflow import image_ops
from tinyflow.ops import REGISTRY, make

CONV_CASES = [  # (x shape, w shape, stride, padding)
    ((2, 3, 7, 6), (4, 3, 3, 3), (1, 1), 1),          # width kept: flat runs, x's rows
    ((2, 3, 7, 6), (4, 3, 3, 3), (1, 1), 0),          # narrower: strided taps, wide rows
    ((2, 2, 8, 8), (3, 2, 5, 5), (1, 1), "SAME"),     # LeNet-like
    ((1, 2, 6, 7), (2, 2, 2, 2), (1, 1), "SAME"),     # even kernel: odd pad after
    ((2, 3, 9, 8), (4, 3, 3, 3), (2, 2), "SAME"),     # strided taps
    ((2, 3, 9, 8), (2, 3, 3, 2), (1, 2), "VALID"),    # stride 1 in H only
    ((1, 1, 5, 5), (1, 1, 1, 1), (1, 1), 0),          # 1x1
    ((2, 2, 3, 1), (3, 2, 3, 3), (1, 1), "SAME"),     # one column: every side pads
    ((1, 2, 2, 2), (2, 2, 5, 5), (1, 1), 2),          # padding as wide as the image
    ((1, 1, 2, 1), (1, 1, 7, 7), (1, 1), 3),          # filter rows longer than the image
    ((4, 8, 1, 2), (16, 8, 1, 7), (1, 1), "SAME"),    # a 1-D conv, filter 3.5x wider
]


def _out(shape):
    """Planned-memory stand-in: garbage-filled, so a kernel must overwrite it all."""
    return np.full(shape, np.nan)


@pytest.mark.parametrize("xs, ws, stride, padding", CONV_CASES)
@pytest.mark.parametrize("with_out", [False, True])
def test_conv_kernels_match_loops(xs, ws, stride, padding, with_out):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    want = conv_reference(x, w, stride, padding)
    g = rng.standard_normal(want.shape)
    out = (lambda s: _out(s)) if with_out else (lambda s: None)
    attrs = {"stride": stride, "padding": padding}
    got = image_ops._conv_compute(np, x, w, out(want.shape), **attrs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    got = image_ops._conv_grad_input_compute(np, g, w, x, out(xs), **attrs)
    np.testing.assert_allclose(got, conv_grad_input_reference(g, w, x, stride, padding),
                               rtol=1e-12, atol=1e-12)
    got = image_ops._conv_grad_filter_compute(np, g, x, w, out(ws), **attrs)
    np.testing.assert_allclose(got, conv_grad_filter_reference(g, x, w, stride, padding),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding", [0, 1, 2])
def test_input_gradient_of_an_infinite_filter_is_the_loops(padding):
    # The stride-1 input gradient brings zeros of its own into its GEMM (g's rows
    # widened, or shifted), and those terms add into real columns of dx. With an
    # inf in the filters they gave inf * 0 = NaN there, where the loops (the
    # adjoint's own terms only) give inf or a number; such filters now go tap by tap.
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 5, 5))
    g = rng.standard_normal(conv_reference(x, w, (1, 1), padding).shape)
    w[1, 0, 2, 4], w[3, 2, 0, 0] = np.inf, -np.inf
    want = conv_grad_input_reference(g, w, x, (1, 1), padding)
    with np.errstate(invalid="ignore"):
        got = image_ops._conv_grad_input_compute(np, g, w, x, padding=padding)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding", [0, 1, 2])
def test_input_gradient_of_an_infinite_g_is_the_loops(padding):
    # The stride-1 path shifts g and pads its rows with zeros: finite filters times
    # those zeros add nothing, and g's own inf and NaN reach just the pixels of
    # their windows, as in the loops.
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 5, 5))
    g = rng.standard_normal(conv_reference(x, w, (1, 1), padding).shape)
    g[0, 1, 0, -1], g[1, 2, -1, 0], g[1, 0, -1, -1] = np.inf, -np.inf, np.nan
    want = conv_grad_input_reference(g, w, x, (1, 1), padding)
    with np.errstate(invalid="ignore"):
        got = image_ops._conv_grad_input_compute(np, g, w, x, padding=padding)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_conv_kernels_on_random_shapes_in_garbage_scratch_match_loops(monkeypatch, data):
    """Any shape, window, stride and padding, the batch in chunks of one sample or
    whole: each kernel, in scratch bytes that hold NaN garbage (as planned memory
    may), equals the loops."""
    draw = data.draw
    n, c, o = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    h, w = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    stride = draw(st.sampled_from([(1, 1), (1, 1), (2, 1), (2, 2)]))
    padding = draw(st.sampled_from(["SAME", "VALID", 0, 1, 2, 3]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    x, filters = rng.standard_normal((n, c, h, w)), rng.standard_normal((o, c, kh, kw))
    oh, ow = image_ops._conv_layout(x.shape, kh, kw, stride, padding)[4:]
    assume(oh > 0 and ow > 0)      # (a window larger than the padded image)
    g = rng.standard_normal((n, o, oh, ow))
    monkeypatch.setattr(image_ops, "CHUNK_BYTES", draw(st.sampled_from([1, 1 << 20])))
    attrs = {"stride": stride, "padding": padding}
    for op, inputs, reference in CONV_OPS:
        arrays = inputs(x, filters, g)
        sizes = {"conv2d": image_ops._conv_sizes,
                 "conv2d_grad_input": image_ops._conv_grad_input_sizes,
                 "conv2d_grad_filter": image_ops._conv_grad_filter_sizes}[op](
            [a.shape for a in arrays], [a.dtype for a in arrays], attrs)
        garbage = np.full(image_ops.scratch_bytes(sizes), 255, np.uint8)   # NaN bits
        got = REGISTRY[op].compute(np, *arrays, **attrs,
                                   workspace=image_ops.Scratch(garbage, sizes))
        np.testing.assert_allclose(got, reference(*arrays, stride, padding),
                                   rtol=1e-10, atol=1e-10, err_msg=f"{op} {attrs}")


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("options", [{}, {"passes": [], "memory": None}])
def test_input_gradient_of_a_float32_g_through_float64_filters(stride, options):
    # dx has g's dtype, but the kernel works in g's and w's common type, as its
    # planned scratch is sized: working in g's float32 asked for more chunks' bytes
    # than were planned ("scratch buffer 'shifted': 921600 bytes asked, 614400").
    rng = np.random.default_rng(9)
    x0, w0 = rng.standard_normal((3, 16, 40, 40)), rng.standard_normal((16, 16, 3, 3))
    x = tf.placeholder(tf.float64, x0.shape)
    y = image_ops.conv2d(x, tf.constant(w0), stride=stride, padding="SAME")
    g0 = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    seed = tf.placeholder(tf.float32, g0.shape)
    (dx,) = tf.gradients(y, [x], grad_ys=[seed])
    with tf.Session(**options) as session:
        got = session.run(dx, {x: x0, seed: g0})
    want = conv_grad_input_reference(g0.astype(np.float64), w0, x0, (stride, stride), "SAME")
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_batch_chunks_cover_the_batch_in_near_equal_chunks_of_the_budget():
    budget = image_ops.CHUNK_BYTES
    for n in range(1, 40):
        for per_sample in (1, budget // 7, budget // 2, budget, 3 * budget):
            ranges = image_ops._batch_chunks(np, n, per_sample)
            sizes = [stop - start for start, stop in ranges]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
            assert max(sizes) <= max(1, budget // per_sample)      # within the budget
            assert len(ranges) == -(-n // min(n, max(1, budget // per_sample)))


def _run_bound(op, arrays, attrs, out):
    """`op` on `arrays` through the kernel the executor binds (OpDef.bind), its
    scratch (OpDef.scratch bytes) filled with 0xFF bytes, NaN in every float: a
    kernel must write every scratch byte it reads (planned scratch holds other
    tensors between runs), and must ask for no more than its op declares."""
    opdef = REGISTRY[op]
    shapes, dtypes = [a.shape for a in arrays], [a.dtype for a in arrays]
    region = np.full(opdef.scratch(np, shapes, dtypes, attrs), 0xFF, np.uint8)
    compute = opdef.bind(np, shapes, dtypes, attrs, {}, region)
    return compute(np, *arrays, out=out, **attrs)


CONV_OPS = [("conv2d", lambda x, w, g: (x, w), conv_reference),
            ("conv2d_grad_input", lambda x, w, g: (g, w, x), conv_grad_input_reference),
            ("conv2d_grad_filter", lambda x, w, g: (g, x, w), conv_grad_filter_reference)]


@pytest.mark.parametrize("chunk_bytes", [1, 3000, 20000])
@pytest.mark.parametrize("xs, ws, stride, padding", [CONV_CASES[0], CONV_CASES[2],
                                                      CONV_CASES[4]])
def test_conv_kernels_in_batch_chunks_match_loops(monkeypatch, chunk_bytes, xs, ws,
                                                  stride, padding):
    # A batch of 5 in chunks of one sample (1 B budget), or of two and three sizes
    # (5 = 2+2+1: two buffer shapes in one scratch), bound to poisoned scratch or not.
    monkeypatch.setattr(image_ops, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(3)
    xs = (5,) + xs[1:]
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    g = rng.standard_normal(conv_reference(x, w, stride, padding).shape)
    attrs = {"stride": stride, "padding": padding}
    for op, inputs, reference in CONV_OPS:
        arrays = inputs(x, w, g)
        want = reference(*arrays, stride, padding)
        unbound = REGISTRY[op].compute(np, *arrays, out=_out(want.shape), **attrs)
        np.testing.assert_allclose(unbound, want, rtol=1e-12, atol=1e-12)
        bound = _run_bound(op, arrays, attrs, _out(want.shape))
        np.testing.assert_allclose(bound, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("xs, ws, stride, padding", CONV_CASES)
def test_conv_scratch_is_what_the_kernels_use(xs, ws, stride, padding):
    # OpDef.scratch says how many bytes a conv kernel cuts from its scratch; the
    # kernels must fit in them (Scratch.get refuses more) and should need them all.
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    g = rng.standard_normal(conv_reference(x, w, stride, padding).shape)
    attrs = {"stride": stride, "padding": padding}
    for op, inputs, _ in CONV_OPS:
        arrays = inputs(x, w, g)
        shapes, dtypes = [a.shape for a in arrays], [a.dtype for a in arrays]
        declared = REGISTRY[op].scratch(np, shapes, dtypes, attrs)
        assert declared > 0
        for region_bytes in (declared, declared - 1):
            region = np.zeros(region_bytes, np.uint8)
            if region_bytes < declared:
                with pytest.raises(tf.ShapeError, match="bytes of scratch are needed"):
                    REGISTRY[op].bind(np, shapes, dtypes, attrs, {}, region)
            else:
                _run_bound(op, arrays, attrs, None)


@pytest.mark.parametrize("xs, ws, stride, padding", CONV_CASES)
def test_conv_kernels_take_an_empty_batch(xs, ws, stride, padding):
    # A batch of 0 samples gives empty results and a zero filter gradient (the
    # input gradient's reshapes once failed inside numpy: "cannot reshape array of
    # size 0").
    xs = (0,) + xs[1:]
    x, w = np.zeros(xs), np.ones(ws)
    attrs = {"stride": stride, "padding": padding}
    y = image_ops._conv_compute(np, x, w, **attrs)
    g = np.zeros(y.shape)
    for run in (REGISTRY["conv2d_grad_input"].compute, None):
        if run is None:   # bound, with its (empty) scratch
            dx = _run_bound("conv2d_grad_input", (g, w, x), attrs, _out(xs))
            dw = _run_bound("conv2d_grad_filter", (g, x, w), attrs, _out(ws))
        else:
            dx = run(np, g, w, x, _out(xs), **attrs)
            dw = image_ops._conv_grad_filter_compute(np, g, x, w, _out(ws), **attrs)
        assert y.shape[0] == 0 and dx.shape == xs
        np.testing.assert_array_equal(dw, np.zeros(ws))


def test_a_cnn_step_runs_on_an_empty_batch():
    x = tf.placeholder(tf.float32, (None, 2, 8, 8))
    w = tf.Variable(np.ones((3, 2, 3, 3), np.float32))
    pooled = tf.nn.max_pool(tf.nn.relu(tf.nn.conv2d(x, w, padding=1)), ksize=[1, 2, 2, 1],
                            strides=[1, 2, 2, 1])
    loss = tf.reduce_sum(pooled)
    grad_x, grad_w = tf.gradients(loss, [x, w])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        got = sess.run([loss, grad_x, grad_w], {x: np.ones((0, 2, 8, 8), np.float32)})
    assert got[0] == 0.0 and got[1].shape == (0, 2, 8, 8)
    np.testing.assert_array_equal(got[2], np.zeros((3, 2, 3, 3), np.float32))


def test_an_empty_filter_window_is_a_shape_error():
    # A kernel of width 0 gave an output wider than the input, and its input
    # gradient failed inside numpy ("could not broadcast input array").
    x = tf.placeholder(tf.float32, (1, 2, 4, 4))
    with pytest.raises(tf.ShapeError, match="filters of size 3x0 are empty"):
        tf.nn.conv2d(x, tf.placeholder(tf.float32, (2, 2, 3, 0)))


POOL_CASES = [  # (x shape, ksize, stride, padding)
    ((2, 3, 8, 8), (2, 2), (2, 2), 0),       # tiled: written straight into dx
    ((2, 3, 9, 7), (2, 2), (2, 2), 0),       # disjoint, a leftover row and column
    ((2, 2, 6, 6), (2, 2), (3, 3), 0),       # disjoint with gaps
    ((1, 2, 5, 5), (3, 3), (2, 2), "SAME"),  # overlapping, padded
    ((1, 2, 4, 4), (2, 2), (1, 1), 1),       # overlapping, padding 1
    ((2, 2, 6, 9), (3, 3), (3, 3), 0),       # tiled 3x3: row maxima, then columns
    ((1, 2, 4, 6), (1, 2), (1, 2), "VALID"),  # tiled by one row
]


@pytest.mark.parametrize("xs, ksize, stride, padding", POOL_CASES)
@pytest.mark.parametrize("with_out", [False, True])
def test_max_pool_kernels_match_loops(xs, ksize, stride, padding, with_out):
    rng = np.random.default_rng(2)
    # Rounded values: many ties, which must go to the first max of the window.
    x = np.round(rng.standard_normal(xs), 0)
    want = max_pool_reference(x, ksize, stride, padding)
    g = rng.standard_normal(want.shape)
    out = (lambda s: _out(s)) if with_out else (lambda s: None)
    attrs = {"ksize": ksize, "stride": stride, "padding": padding}
    np.testing.assert_array_equal(
        image_ops._max_pool_compute(np, x, out(want.shape), **attrs), want)
    grad_want = max_pool_grad_reference(g, x, ksize, stride, padding)
    for y in (None, want):  # the 2-input form recomputes the max; the 3-input gets it
        got = image_ops._max_pool_grad_compute(np, g, x, y, out(xs), **attrs)
        np.testing.assert_allclose(got, grad_want, rtol=1e-12, atol=1e-12)
    gx = rng.standard_normal(xs)
    got = image_ops._max_pool_pick_compute(np, gx, x, out(want.shape), **attrs)
    np.testing.assert_allclose(got, pick_reference(gx, x, ksize, stride, padding),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("xs, ksize, stride, padding", POOL_CASES)
def test_bound_max_pool_in_garbage_scratch_matches_loops(monkeypatch, xs, ksize, stride,
                                                         padding):
    # The tiled pool's row maxima live in its planned scratch (OpDef.scratch), which
    # holds anything between runs; in chunks of one sample or whole.
    x = np.round(np.random.default_rng(8).standard_normal(xs), 0)
    attrs = {"ksize": ksize, "stride": stride, "padding": padding}
    for chunk_bytes in (1, 1 << 20):
        monkeypatch.setattr(image_ops, "CHUNK_BYTES", chunk_bytes)
        sizes = image_ops._max_pool_sizes([xs], [x.dtype], attrs)
        garbage = np.full(image_ops.scratch_bytes(sizes), 255, np.uint8)   # NaN bits
        got = image_ops._max_pool_compute(np, x, **attrs,
                                          workspace=image_ops.Scratch(garbage, sizes))
        np.testing.assert_array_equal(got, max_pool_reference(x, ksize, stride, padding))


@pytest.mark.parametrize("ksize, stride, padding", [
    ((2, 2), (2, 2), 0),        # tiled
    ((3, 3), (3, 3), 1),        # disjoint windows shifted by the padding: not tiled
    ((2, 2), (1, 1), 0),        # overlapping windows
])
def test_max_pool_grad_of_inf_and_nan_g_is_zero_off_the_max(ksize, stride, padding):
    # The gradient goes to each window's max and nowhere else: an inf or NaN of g
    # lands on the max, and the window's other elements get 0, as in PyTorch and
    # TF1's MaxPoolGrad. (g * mask gave inf * 0 = NaN over the whole window.)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 6, 6))
    attrs = {"ksize": ksize, "stride": stride, "padding": padding}
    y = image_ops._max_pool_compute(np, x, **attrs)
    g = rng.standard_normal(y.shape)
    g.flat[::3] = np.inf
    g.flat[1::5] = np.nan
    g.flat[2::7] = -np.inf
    with np.errstate(all="ignore"):
        want = max_pool_grad_reference(g, x, ksize, stride, padding)
    # Disjoint windows need no arithmetic, so not even a warning; overlapping
    # windows add, and inf + -inf is NaN there as in the reference.
    disjoint = stride[0] >= ksize[0] and stride[1] >= ksize[1]
    for peak in (None, y):
        with np.errstate(all="raise" if disjoint else "ignore"):
            got = image_ops._max_pool_grad_compute(np, g, x, peak, **attrs)
        np.testing.assert_array_equal(got, want)


def test_max_pool_grad_of_a_nan_window_goes_to_its_first_nan():
    x = np.array([[[[1.0, np.nan], [np.nan, 5.0]]]])
    g = np.array([[[[2.0]]]])
    got = image_ops._max_pool_grad_compute(np, g, x, ksize=(2, 2), stride=(2, 2))
    np.testing.assert_array_equal(got, [[[[0.0, 2.0], [0.0, 0.0]]]])


# Losses of `_train_small_cnn` recorded with the kernels before this rewrite
# (commit a7387d3: 6-D strided windows, argmax per window, per-call scatter).
RECORDED_LOSSES = [
    6.554045677185059, 6.852567195892334, 9.739452362060547, 7.388415336608887,
    3.74411940574646, 2.1124353408813477, 1.475693941116333, 1.1770713329315186,
    1.033389925956726, 0.9180454015731812, 0.8221713900566101, 0.7349404096603394,
    0.6572694182395935, 0.5887112021446228, 0.52565997838974, 0.4713360667228699,
    0.41970184445381165, 0.37327277660369873, 0.3314742147922516, 0.2961951792240143]


def _train_small_cnn(steps: int = 20) -> list[float]:
    """conv3x3 SAME - relu - pool 2 - conv3x3 pad 1 - relu - pool 2 - pool 3x3
    stride 1 SAME - linear; float32, SGD."""
    rng = np.random.default_rng(0)
    x = tf.placeholder(tf.float32, (16, 3, 12, 12))
    y = tf.placeholder(tf.int64, (16,))
    w1 = tf.Variable((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32))
    w2 = tf.Variable((rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32))
    w3 = tf.Variable((rng.standard_normal((16 * 3 * 3, 10)) * 0.1).astype(np.float32))
    pool = dict(ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1])
    h = tf.nn.max_pool(tf.nn.relu(tf.nn.conv2d(x, w1, padding="SAME")), **pool)
    h = tf.nn.max_pool(tf.nn.relu(tf.nn.conv2d(h, w2, padding=1)), **pool)
    h = tf.nn.max_pool(h, ksize=[1, 3, 3, 1], strides=[1, 1, 1, 1], padding="SAME")
    logits = tf.matmul(tf.reshape(h, (16, -1)), w3)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(logits, y))
    train = tf.train.GradientDescentOptimizer(0.03).minimize(loss)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    xs = rng.standard_normal((16, 3, 12, 12)).astype(np.float32)
    ys = rng.integers(0, 10, 16)
    return [float(sess.run([loss, train], {x: xs, y: ys})[0]) for _ in range(steps)]


def test_training_curve_unchanged_by_the_kernel_rewrite():
    # float32 sums in another order differ in the last bits, and the steep early
    # steps (the loss jumps to 9.7 at step 2) amplify that: under numpy 2.4.6 steps 3
    # and 7 differ from the recording by 1.2e-5 relative (the others by < 1e-5) on
    # some machines with the same code and numpy (OpenBLAS picks its sgemm kernel by
    # CPU, DYNAMIC_ARCH, and CI's machines vary). A wrong
    # gradient anywhere moves the curve by more than 1e-2, so 1e-4 still catches it.
    np.testing.assert_allclose(_train_small_cnn(), RECORDED_LOSSES, rtol=1e-4, atol=0)


@pytest.mark.parametrize("memory, poison", [(None, False), ("auto", False), ("auto", True)])
def test_bound_convs_sharing_a_streams_scratch_match_loops(memory, poison):
    # Two convs of one shape on one stream: unplanned, they share their stream's
    # scratch buffer; planned, each step's scratch is a place in the arena that
    # other tensors use at other steps (and that poison mode fills with NaN once
    # the step is done). Each must still see its own input, and the padded copy's
    # zero border must be there for both (and in a second run).
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 6, 5))
    w1, w2 = rng.standard_normal((3, 3, 3, 3)), rng.standard_normal((3, 3, 3, 3))
    xn = tf.placeholder(tf.float64, x.shape)
    w1n, w2n = tf.constant(w1, tf.float64), tf.constant(w2, tf.float64)
    y = tf.nn.conv2d(xn, w1n, padding=1)
    z = tf.nn.conv2d(y, w2n, padding=1)
    g = rng.standard_normal(x.shape)
    grads = tf.gradients(tf.reduce_sum(z * tf.constant(g, tf.float64)), [xn, w1n, w2n])
    program = tf.compile([z] + grads, {xn: (x.shape, np.float64)}, {}, memory=memory,
                         poison=poison)
    if memory:
        scratch = [t for t in program.memory_plan.tensors if t.kind == "scratch"]
        assert len(scratch) == 6     # two forwards, two input and two filter gradients
    y_ref = conv_reference(x, w1, padding=1)
    gy = conv_grad_input_reference(g, w2, y_ref, padding=1)
    want = [conv_reference(y_ref, w2, padding=1),
            conv_grad_input_reference(gy, w1, x, padding=1),
            conv_grad_filter_reference(gy, x, w1, padding=1),
            conv_grad_filter_reference(g, y_ref, w2, padding=1)]
    for _ in range(2):
        for got, expected in zip(program.run({xn: x}, {}), want):
            np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)


def test_bound_convs_whose_padded_buffers_share_a_shape_keep_their_zero_border():
    # A 3x3 conv with padding 1 on 6x6 and a 4x4 SAME conv on 5x5 (padding 1 before,
    # 2 after) pad into buffers of one shape and the same top-left corner, but the
    # first writes one row and column more of its inside: that must not be left in
    # the second's border (their scratch was once keyed by shape and corner only).
    rng = np.random.default_rng(4)
    x1, x2 = rng.standard_normal((1, 2, 6, 6)), rng.standard_normal((1, 2, 5, 5))
    w1, w2 = rng.standard_normal((2, 2, 3, 3)), rng.standard_normal((2, 2, 4, 4))
    x1n, x2n = tf.placeholder(tf.float64, x1.shape), tf.placeholder(tf.float64, x2.shape)
    a = tf.nn.conv2d(x1n, tf.constant(w1, tf.float64), padding=1)
    b = tf.nn.conv2d(x2n, tf.constant(w2, tf.float64), padding="SAME")
    b = b + 0 * tf.reduce_sum(a)         # b's conv runs after a's
    program = tf.compile([a, b], {x1n: (x1.shape, np.float64), x2n: (x2.shape, np.float64)},
                         {})
    for _ in range(2):
        got_a, got_b = program.run({x1n: x1, x2n: x2}, {})
        np.testing.assert_allclose(got_a, conv_reference(x1, w1, padding=1), rtol=1e-12)
        np.testing.assert_allclose(got_b, conv_reference(x2, w2, padding="SAME"),
                                   rtol=1e-12)


def test_a_filter_gradient_sees_a_fed_array_changed_in_place_between_runs():
    # Bound conv kernels share the stream's im2col scratch. Here the filter gradient
    # runs first and the forward after it, in each run, on a fed array changed in
    # place between runs: no scratch filled in run 1 may pass for run 2's windows.
    # (A filter gradient that reused its forward's matrix once got this wrong.)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 6, 5))
    w, g = rng.standard_normal((4, 3, 3, 3)), rng.standard_normal((2, 4, 6, 5))
    xn = tf.placeholder(tf.float64, x.shape)
    wn, gn = tf.constant(w, tf.float64), tf.constant(g, tf.float64)
    dw = make("conv2d_grad_filter", gn, xn, wn, stride=(1, 1), padding=1)
    y = tf.nn.conv2d(xn, wn + 1e-3 * tf.reduce_sum(dw), padding=1)
    program = tf.compile([dw, y], {xn: (x.shape, np.float64)}, {})
    for _ in range(3):
        x[...] = rng.standard_normal(x.shape)      # the same array, new values
        want_dw = conv_grad_filter_reference(g, x, w, padding=1)
        got_dw, got_y = program.run({xn: x}, {})
        np.testing.assert_allclose(got_dw, want_dw, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_y, conv_reference(x, w + 1e-3 * want_dw.sum(),
                                                         padding=1), rtol=1e-12)


def test_a_conv_of_a_variable_just_assigned_makes_its_windows_again():
    # conv(v) fills the scratch from v's buffer; tf.assign then writes new values
    # into that same buffer, and a conv of the assign's value (that very array)
    # must see them, not the windows the first conv left.
    rng = np.random.default_rng(6)
    v0, w = rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((4, 3, 3, 3))
    v = tf.Variable(v0)
    wn = tf.constant(w, tf.float64)
    before = tf.nn.conv2d(v, wn, padding=1)
    after = tf.nn.conv2d(tf.assign(v, v * 2.0), wn, padding=1)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        got_before, got_after = sess.run([before, after])
    np.testing.assert_allclose(got_before, conv_reference(v0, w, padding=1), rtol=1e-12)
    np.testing.assert_allclose(got_after, conv_reference(2.0 * v0, w, padding=1),
                               rtol=1e-12)


@pytest.mark.parametrize("size, ksize", [(3, 3), (6, 3), (8, 4)])
def test_max_pool_gradient_with_padding_that_tiles_lands_on_the_max(size, ksize):
    # Numerics probe: with integer padding 1 and stride == ksize, the windows of a
    # size-divisible input still "tiled" by count, and the fast path wrote each
    # window's gradient as if there were no padding: one row and column off.
    x = np.arange(size * size, dtype=np.float64).reshape(1, 1, size, size)
    xp = tf.placeholder(tf.float64, x.shape)
    y = tf.nn.max_pool2d(xp, ksize, ksize, 1)
    (dx,) = tf.gradients(y, [xp])
    got_y, got_dx = tf.Session().run([y, dx], {xp: x})
    # Each output's max is the largest x in its padded window, whose gradient is 1
    want = np.zeros_like(x)
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    for i in range(got_y.shape[2]):
        for j in range(got_y.shape[3]):
            window = padded[0, 0, i * ksize:(i + 1) * ksize, j * ksize:(j + 1) * ksize]
            r, c = np.unravel_index(np.argmax(window), window.shape)
            want[0, 0, i * ksize + r - 1, j * ksize + c - 1] += 1.0
    np.testing.assert_array_equal(got_dx, want)


def test_a_float16_filter_gradient_sums_over_the_samples_before_rounding():
    # Regression (review of the per-sample filter gradient): in float16 each
    # sample's product was rounded, 300 * 256 = 76800 overflowed to +-inf, and the sum
    # over the two samples was inf - inf = NaN; the exact gradient is 4.
    x = tf.placeholder(tf.float16, (2, 1, 16, 16))
    w = tf.Variable(np.ones((1, 1, 1, 1), np.float16))
    g = np.full((2, 1, 16, 16), 300, np.float16)
    g[1] = -300
    g[1, 0, 0, 0] = -296
    (dw,) = tf.gradients(tf.reduce_sum(tf.nn.conv2d(x, w) * tf.constant(g)), [w])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        got = sess.run(dw, {x: np.ones((2, 1, 16, 16), np.float16)})
    assert got.dtype == np.float16 and got.reshape(-1).tolist() == [4.0]
