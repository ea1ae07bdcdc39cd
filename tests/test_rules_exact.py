"""Every simplification rule is exact: bitwise the value of the unsimplified graph.

A rule may sit in `rules.RULES` only if it holds for every input, including +-0,
+-inf, NaN, subnormals and the largest values (issue 14, item 2: `log(exp(x)) -> x`
made x = 200 finite where the program gives inf, and `x + 0 -> x` kept -0.0 where
the program gives +0.0). Each rule has a case below that makes it fire; the test runs
the case with no passes and with `simplify` alone, on special values and random
ones of every dtype the ops accept, and compares the bits (any NaN equals any NaN:
IEEE leaves a NaN's sign to the hardware). A rule without a case fails the coverage
test, so a new rule comes with its proof.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import ops, passes, rules
from tinyflow.graph import ShapeError

N = 64  # values per case


def _values(dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """Special values first, then ordinary random ones, N in all."""
    if dtype.kind == "f":
        info = np.finfo(dtype)
        special = [0.0, -0.0, np.inf, -np.inf, np.nan, info.smallest_subnormal,
                   -info.smallest_subnormal, info.tiny, info.max, -info.max, 1.0, -1.0,
                   0.5, 2.0, 200.0, -200.0, 1e-30, 88.7, 709.8, 3.0]
        rest = np.concatenate([rng.standard_normal(N // 2) * 10.0,
                               rng.standard_normal(N) * 1e3])
    elif dtype.kind == "b":
        return rng.integers(0, 2, N).astype(bool)
    else:
        info = np.iinfo(dtype)
        special = [v for v in (0, 1, -1, 2, info.max, info.min, info.max - 1, info.min + 1)
                   if info.min <= v <= info.max]   # no -1 in unsigned types
        rest = rng.integers(max(info.min, -1000), min(info.max, 1000), N, endpoint=True)
    return np.concatenate([np.array(special, dtype), np.asarray(rest).astype(dtype)])[:N]


def _masked_pool_gradient(x, y):
    """A ReLU's gradient mask after a 2x2 max pool's gradient, as autodiff builds it
    (x as 4 images of 4x4; y's first 16 values as the pooled gradient): +-0, inf and
    NaN among the values, and ties in the booleans."""
    images = ops.reshape(x, (4, 1, 4, 4))
    peak = tf.nn.max_pool(images, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1])
    grad = ops.make("max_pool2d_grad", ops.reshape(y[:16], (4, 1, 2, 2)), images, peak,
                    ksize=(2, 2), stride=(2, 2), padding=0)
    return grad * tf.greater(images, 0)


# pattern -> builder(x, y) of a graph in which that rule fires; x and y are fed
# placeholders of shape (N,) of the case's dtype (y holds x's values reversed).
CASES: dict[str, Callable] = {
    "add(x, -0.0) -> x": lambda x, y: x + (-0.0),
    "add(x, 0) -> x, x integer": lambda x, y: x + 0,
    "sub(x, +0.0) -> x; sub(x, 0) -> x, x integer": lambda x, y: x - 0,
    "mul(x, 1) -> x": lambda x, y: x * 1,
    "div(x, 1) -> x": lambda x, y: x / 1,
    "pow(x, 1) -> x": lambda x, y: x ** 1,
    "pow(x, 2) -> mul(x, x)": lambda x, y: x ** 2,
    "pow(x, 0.5) -> sqrt(x)": lambda x, y: x ** 0.5,  # numpy's own power calls sqrt
    "sub(0, x) -> neg(x), x integer": lambda x, y: 0 - x,
    "mul(x, -1) -> neg(x)": lambda x, y: x * -1,
    "add(x, neg(y)) -> sub(x, y)": lambda x, y: x + ops.neg(y),
    "sub(x, neg(y)) -> add(x, y)": lambda x, y: x - ops.neg(y),
    "bias_add(x, b) along x's last axis -> add(x, b)":
        lambda x, y: ops.make("bias_add", ops.reshape(x, (N // 4, 4)), y[:4], axis=-1),
    "neg(neg(x)) -> x": lambda x, y: ops.neg(ops.neg(x)),
    "stop_gradient(x) -> x": lambda x, y: ops.stop_gradient(x) * 1,
    "maximum(x, x) -> x": lambda x, y: tf.maximum(x, x),
    "minimum(x, x) -> x": lambda x, y: tf.minimum(x, x),
    "where(c, x, x) -> x": lambda x, y: tf.where(tf.greater(x, y), x, x),
    "cast(x) to x's dtype -> x": lambda x, y: ops.make("cast", x, dtype=x.dtype.name),
    "transpose(transpose(x)) -> one transpose, or x":
        lambda x, y: tf.transpose(tf.transpose(tf.reshape(x, (8, 8)), (1, 0)), (1, 0)),
    "reshape of a reshape -> one reshape; to x's own shape -> x":
        lambda x, y: tf.reshape(tf.reshape(x, (8, 8)), (N,)),
    "reshape_like of a reshape -> one reshape; to x's own shape -> x":
        lambda x, y: ops.reshape_like(tf.reshape(x, (8, 8)), y),
    "expand_dims of a reshape -> one reshape; to x's own shape -> x":
        lambda x, y: tf.expand_dims(tf.reshape(x, (8, 8)), 0),
    "squeeze of a reshape -> one reshape; to x's own shape -> x":
        lambda x, y: tf.squeeze(tf.expand_dims(x, 0), 0),
    "broadcast_to(x) to x's own shape -> x": lambda x, y: tf.broadcast_to(x, (N,)),
    "broadcast_like(x) to x's own shape -> x": lambda x, y: ops.broadcast_like(x, y),
    "sum_to_like(x) to x's own shape -> x": lambda x, y: ops.sum_to_like(x, y),
    "reshape_like(x, ref) -> reshape(x, shape of ref)":
        lambda x, y: ops.reshape_like(x, tf.reshape(y, (8, 8))),
    "broadcast_like(x, ref) -> broadcast_to(x, shape of ref)":
        lambda x, y: ops.broadcast_like(x[:1], y),
    "x[:, ...] (every slice full) -> x": lambda x, y: x[:],
    "concat([x]) -> x": lambda x, y: tf.concat([x], 0),
    "zeros_like(x) -> zeros(shape of x)": lambda x, y: tf.zeros_like(x),
    "ones_like(x) -> ones(shape of x)": lambda x, y: tf.ones_like(x),
    "count_ratio(y, x) -> constant size(y) / size(x)":
        lambda x, y: ops.count_ratio(x[:5], y),
    "mul(max_pool2d_grad(g, y, p), cmp(y, c)) -> "
    "max_pool2d_grad(mul(g, cmp(p, c)), y, p), disjoint windows": _masked_pool_gradient,
}

# The narrow types too: numpy computes float16 in float32 and rounds, through other
# loops than float32's (pow(-inf, 0.5) is +inf there, sqrt(-inf) NaN); int8 and
# uint8 wrap around at other places.
DTYPES = [np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int8, np.uint8,
                                np.int32, np.int64, np.bool_)]


def test_every_rule_has_a_case():
    missing = [r.pattern for r in rules.RULES if r.pattern not in CASES]
    assert not missing, f"rules without a case in tests/test_rules_exact.py: {missing}"
    stale = sorted(set(CASES) - {r.pattern for r in rules.RULES})
    assert not stale, f"cases for rules that are gone: {stale}"


def _fired(fetch, x, y, dtype) -> list[str]:
    graph, _ = passes.specialize([fetch], {x: ((N,), dtype), y: ((N,), dtype)})
    ctx = passes.PassContext()
    passes.run_pipeline(graph, ctx, passes=["simplify"])
    return [r.reason for r in ctx.records]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "f":
        nan = np.isnan(a)
        if not np.array_equal(nan, np.isnan(b)):
            return False
        a, b = np.where(nan, 0, a), np.where(nan, 0, b)
        return np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))
    return np.array_equal(a, b)


@pytest.mark.parametrize("pattern", sorted(CASES))
def test_rule_is_exact_on_special_and_random_values(pattern):
    rng = np.random.default_rng(14)
    fired_somewhere = False
    for dtype in DTYPES:
        x = tf.placeholder(dtype, (N,), name="x")
        y = tf.placeholder(dtype, (N,), name="y")
        try:
            with np.errstate(all="ignore"):
                fetch = CASES[pattern](x, y)
        except ShapeError:  # the op has no kernel for this dtype (neg of booleans)
            continue
        if pattern not in _fired(fetch, x, y, dtype):
            continue
        fired_somewhere = True
        xv = _values(dtype, rng)
        feeds = {x: xv, y: xv[::-1].copy()}
        with np.errstate(all="ignore"):
            plain = tf.Session(passes=[], memory=None).run(fetch, feeds)
            simplified = tf.Session(passes=["simplify"], memory=None).run(fetch, feeds)
        assert _same_bits(np.asarray(plain), np.asarray(simplified)), (
            f"{pattern} changes values for {dtype}: {xv} -> {plain} vs {simplified}")
    assert fired_somewhere, f"the case for {pattern} never makes the rule fire"


@pytest.mark.parametrize("build, dtype", [
    (lambda x: tf.log(tf.exp(x)), np.float32),            # x = 200: inf unsimplified
    (lambda x: tf.exp(tf.log(tf.sigmoid(x))), np.float32),
    (lambda x: x + 0.0, np.float64),                       # -0.0 + 0.0 is +0.0
    (lambda x: 0.0 - x, np.float64),                       # 0 - 0 = +0, neg(0) = -0
])
def test_inexact_identities_are_not_applied(build, dtype):
    x = tf.placeholder(dtype, (N,))
    fetch = build(x)
    xv = _values(np.dtype(dtype), np.random.default_rng(0))
    with np.errstate(all="ignore"):
        plain = tf.Session(passes=[], memory=None).run(fetch, {x: xv})
        optimized = tf.Session().run(fetch, {x: xv})
    assert _same_bits(plain, optimized)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_subtracting_negative_zero_is_not_simplified_away(dtype):
    # Regression: "sub(x, 0) -> x" fired for -0.0 too, but -0.0 - -0.0 is +0.0:
    # the simplified graph gave -0.0 where the program gives +0.0.
    x = tf.placeholder(dtype, (3,), name="x")
    fetch = x - np.array(-0.0, dtype)
    assert not [r for r in _fired(fetch, x, tf.placeholder(dtype, (3,)), np.dtype(dtype))
                if r.startswith("sub(x")]
    xv = np.array([-0.0, 0.0, 1.5], dtype)
    want = tf.Session(passes=[]).run(fetch, {x: xv})
    got = tf.Session().run(fetch, {x: xv})
    assert _same_bits(got, want) and not np.signbit(got[0])


def _every_option_agrees(fetch, feeds, option_sets=({}, {"passes": ["simplify"]},
                                                   {"passes": ["cse"]}, {"passes": ["fold"]})):
    with np.errstate(all="ignore"):
        want = tf.Session(passes=[], memory=None).run(fetch, feeds)
        for options in option_sets:
            got = tf.Session(**options).run(fetch, feeds)
            assert _same_bits(np.asarray(got), np.asarray(want)), (options, got, want)
            assert np.array_equal(np.signbit(got), np.signbit(want)), (options, got, want)


def test_add_of_a_negated_operand_of_another_dtype_is_not_a_subtraction():
    # Review (random-graph differential test): neg(y) wraps in y's dtype before the
    # add promotes, -uint8(1) = 255; sub(x, y) promotes first. int8 + neg(uint8) gave
    # [-1, 3, -203] where the program gives [255, 259, 53].
    x = tf.placeholder(tf.int8, (3,))
    y = tf.placeholder(tf.uint8, (3,))
    z = tf.placeholder(tf.int32, (2,))
    u = tf.placeholder(tf.uint8, (2,))
    f = tf.placeholder(tf.float32, (2,))
    i = tf.placeholder(tf.int8, (2,))
    feeds = {x: np.array([0, 5, -3], np.int8), y: np.array([1, 2, 200], np.uint8),
             z: np.array([9, 10], np.int32), u: np.array([0, 0], np.uint8) + [0, 0],
             f: np.array([0.0, 1.0], np.float32), i: np.array([-128, -1], np.int8)}
    feeds[u] = np.array([1, 0], np.uint8)
    for fetch in (x + ops.neg(y), ops.neg(y) + x, f - ops.neg(i), z + (0 - u)):
        _every_option_agrees(fetch, feeds)


@pytest.mark.parametrize("exponent, dtype", [(2.0, np.float32), (2.0, np.float64),
                                             (0.5, np.float32), (0.5, np.float64),
                                             (1.0, np.float32)])
def test_pow_of_an_array_of_equal_exponents_is_not_rewritten(exponent, dtype):
    # numpy's power takes its exact shortcuts (x*x, sqrt, x) only for a scalar
    # exponent; an array of 2s runs the general pow: x ** full(2) differs from x * x
    # in the last bit (32 of 256 float32 values), ** full(0.5) from sqrt at -0, -inf.
    rng = np.random.default_rng(3)
    values = np.concatenate([[-0.0, -np.inf, 4.0, 9.0, 4.753258],
                             rng.standard_normal(N - 5) * 3]).astype(dtype)
    if exponent == 0.5:
        values = np.where(values < 0, -0.0, values).astype(dtype)
        values[1] = -np.inf
    x = tf.placeholder(dtype, values.shape)
    fetch = x ** tf.constant(np.full(values.shape, exponent, dtype))
    assert not _fired(fetch, x, tf.placeholder(dtype, values.shape), np.dtype(dtype))
    _every_option_agrees(fetch, {x: values})


def test_cse_keeps_maximum_and_minimum_with_swapped_operands_apart():
    # numpy's maximum(+0, -0) is -0 and maximum(-0, +0) is +0: CSE took them as
    # commutative and merged maximum(y, x) into maximum(x, y).
    x = tf.placeholder(tf.float64, (2,))
    y = tf.placeholder(tf.float64, (2,))
    feeds = {x: np.array([0.0, -0.0]), y: np.array([-0.0, 0.0])}
    for op in (tf.maximum, tf.minimum):   # (both in one fetch: what CSE could merge)
        _every_option_agrees(tf.stack([op(x, y), op(y, x)]), feeds)


def test_folded_transpose_is_summed_in_the_order_the_run_sums_it():
    # fold kept a folded transpose in Fortran order; the executor makes every result
    # C-contiguous, so a sum or a product over the folded constant added the same
    # numbers in another order (other last bits).
    rng = np.random.default_rng(0)
    c = tf.constant(rng.standard_normal((50, 40)).astype(np.float32))
    x = tf.placeholder(tf.float32, (50, 5))
    feeds = {x: rng.standard_normal((50, 5)).astype(np.float32)}
    _every_option_agrees(tf.reduce_sum(tf.transpose(c), 1), feeds)
    _every_option_agrees(tf.matmul(tf.transpose(c), x), feeds)


@pytest.mark.parametrize("stride, fires", [(2, True), (1, False)])
def test_relu_mask_before_the_pool_gradient_is_exact_in_a_conv_net(stride, fires):
    # conv -> relu -> 2x2 max pool, and the gradient of x and of the filters: the
    # relu's mask moves before the pool's gradient (a quarter of the elements) only
    # for disjoint windows. Rounded values make ties at 0 (whole windows of relu
    # zeros) and elsewhere; inf, NaN and -0 reach the pool too.
    rng = np.random.default_rng(3)
    x = tf.placeholder(tf.float32, (2, 3, 8, 8))
    w = tf.placeholder(tf.float32, (4, 3, 3, 3))
    h = tf.nn.relu(tf.nn.conv2d(x, w, strides=[1, 1, 1, 1], padding="SAME"))
    pooled = tf.nn.max_pool(h, ksize=[1, 2, 2, 1], strides=[1, stride, stride, 1])
    loss = tf.reduce_sum(pooled * tf.constant(np.round(rng.standard_normal(
        pooled.shape)).astype(np.float32)))
    fetch = tf.stack([tf.reduce_sum(g * g) for g in tf.gradients(loss, [x, w])] +
                     [tf.reduce_sum(tf.gradients(loss, [h])[0])])
    xv = np.round(rng.standard_normal(x.shape)).astype(np.float32)
    xv.flat[:6] = [np.inf, -np.inf, np.nan, -0.0, 1e30, -1e30]
    wv = np.round(rng.standard_normal(w.shape)).astype(np.float32)
    single = np.dtype(np.float32)
    graph, _ = passes.specialize([fetch], {x: (x.shape, single), w: (w.shape, single)})
    ctx = passes.PassContext()
    passes.run_pipeline(graph, ctx, passes=["simplify"])
    assert any(r.reason.startswith("mul(max_pool2d_grad") for r in ctx.records) == fires
    for feeds in ({x: xv, w: wv}, {x: np.abs(xv[::-1].copy()), w: -wv}):
        _every_option_agrees(fetch, feeds, ({}, {"passes": ["simplify"]}))


def test_mask_before_the_pool_gradient_needs_the_pools_own_max_and_a_same_shape_mask():
    # Review: the rule fired (1) for a scalar-sized c of higher rank, which broadcast
    # the mask to 5-D (the default Session then raised a ShapeError building the
    # rewrite), and (2) for a fed peak that is not max_pool2d(x): where no tap
    # equals it the gradient goes to the last tap, masked there by x, not by p.
    attrs = {"ksize": (2, 2), "stride": (2, 2), "padding": 0}
    x = tf.placeholder(tf.float32, (1, 1, 2, 2))
    g = tf.placeholder(tf.float32, (1, 1, 1, 1))
    fed_peak = tf.placeholder(tf.float32, (1, 1, 1, 1))
    pooled = ops.make("max_pool2d", x, **attrs)
    five_d = ops.make("max_pool2d_grad", g, x, pooled, **attrs) * tf.greater(
        x, tf.constant(np.zeros((1, 1, 1, 1, 1), np.float32)))
    wrong_peak = ops.make("max_pool2d_grad", g, x, fed_peak, **attrs) * tf.greater(x, 0.0)
    feeds = {x: np.array([[[[1, -2], [3, -4]]]], np.float32),
             g: np.ones((1, 1, 1, 1), np.float32), fed_peak: np.full((1, 1, 1, 1), 0.5,
                                                                     np.float32)}
    for fetch in (five_d, wrong_peak):
        _every_option_agrees(fetch, feeds, ({}, {"passes": ["simplify"]}))
