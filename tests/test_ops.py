"""Every op against numpy, and every gradient against central finite differences.

Two tables drive the file:

* GRAD_CASES maps each differentiable op to small random inputs (float64). The check
  builds ``loss = sum(w * op(inputs))`` with random weights w, asks `tf.gradients`
  for d loss / d input, and compares every element with the central difference
  ``(loss(x + h) - loss(x - h)) / 2h``. A test fails when a registered op with a
  gradient has no row here, so a new op cannot arrive without its check.
* FORWARD_CASES compares each op's value with a numpy reference (comparisons, argmax,
  cast and where included), and checks that the shape and dtype the op's rule
  inferred are the ones the kernel produced.

Everything runs through `tf.Session`, so the executor (and whatever passes it runs)
is on the tested path. Sizes are tiny: a gradient check costs two runs per element.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyflow as tf
from tinyflow import eager as E
from tinyflow import image_ops, ops
from tinyflow.executor import ExecutionError
from tinyflow.gradcheck import GradientCheckError, check_gradients
from tinyflow.graph import Node, topological_order
from tinyflow.ops import REGISTRY, make
from tinyflow.shape_ops import _encode_index
from tinyflow.transports import ThreadTransport, register_communicator

F64 = np.float64
# Sessions here run the default pass pipeline: ops are tested as users run them.
SESSION_OPTIONS: dict = {}


def session() -> tf.Session:
    return tf.Session(**SESSION_OPTIONS)


# ----------------------------------------------------------------------------------
# The gradient check
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fixed:
    """An input that is fed but not perturbed: labels, indices, conditions."""

    value: np.ndarray


@dataclass
class GradCase:
    """One gradient check: `build(*placeholders) -> Node` applied to `args`.

    args     float64 arrays (checked element by element) or Fixed values
    eps      the finite-difference step
    rtol, atol  how close autodiff and finite differences must be
    needs_known_dims  the op needs every dim at build time (squeeze without an
             axis): the unknown-dims variant of the check skips the case
    """

    build: Callable[..., Node]
    args: list
    label: str = ""
    eps: float = 1e-6
    rtol: float = 1e-5
    atol: float = 1e-7
    needs_known_dims: bool = False


def _values(args: list) -> list[np.ndarray]:
    return [a.value if isinstance(a, Fixed) else a for a in args]


def _placeholders(values: list[np.ndarray], unknown_dims: bool = False) -> list[Node]:
    """One placeholder per input; with `unknown_dims` its first dim is None."""
    phs = []
    for v in values:
        shape = v.shape
        if unknown_dims and v.ndim:
            shape = (None,) + shape[1:]
        phs.append(tf.placeholder(v.dtype, shape))
    return phs


def _weighted_loss(y: Node, weights: np.ndarray) -> Node:
    """sum(w * y): a scalar whose gradient sees every output element differently."""
    return tf.reduce_sum(tf.cast(y, F64) * tf.constant(weights, F64))


def _label(case: GradCase) -> str:
    return f" (case {case.label!r})" if case.label else ""


def check_gradient(op: str, case: GradCase, rng: np.random.Generator) -> None:
    """Compare tf.gradients with central differences for every checked element, with
    the library's checker (tinyflow/gradcheck.py). A failure names the op, the case,
    the argument index, the element index, the finite-difference value (expected)
    and the autodiff value (got).
    """
    def build(*phs):
        y = case.build(*phs)
        used = {n.op for n in topological_order([y])}
        assert op in used, (f"GRAD_CASES[{op!r}]{_label(case)} builds no {op} node; "
                            f"it builds {sorted(used)}")
        return y
    fixed = [i for i, a in enumerate(case.args) if isinstance(a, Fixed)]
    try:
        check_gradients(build, _values(case.args), fixed=fixed, eps=case.eps,
                        rtol=case.rtol, atol=case.atol, rng=rng, op=op, label=case.label,
                        session_options=SESSION_OPTIONS)
    except GradientCheckError as err:
        pytest.fail(str(err), pytrace=False)


# ----------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------

def normal(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def positive(rng, *shape):
    return rng.uniform(0.5, 2.0, shape)


def away_from_zero(rng, *shape):
    """Values at least 0.2 from 0, where |x|, relu and 1/x have a kink or a pole."""
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.2, 1.5, shape)


def distinct(rng, *shape):
    """Values 0.1 or more apart, so a max (or max-pool window) has no near-tie."""
    size = int(np.prod(shape))
    return (rng.permutation(size).reshape(shape) - size / 2) * 0.1 + rng.uniform(0, 0.01,
                                                                                 shape)


def ints(values, dtype=np.int64):
    return Fixed(np.array(values, dtype=dtype))


# A communicator of one rank, for the collective ops' gradient checks.
_ONE_RANK = register_communicator(ThreadTransport.group_of(1, 60.0)[0])


def C(build, *args, **options):  # noqa: N802 - reads as a table row
    return GradCase(build, list(args), **options)


def _conv(stride, padding):
    return lambda x, w: image_ops.conv2d(x, w, stride, padding)


def _pool(op, ksize, stride, padding):
    return lambda x: make(op, x, ksize=ksize, stride=stride, padding=padding)


# Each row: op name -> rng -> cases. The label says which variant a case covers.
GRAD_CASES: dict[str, Callable[[np.random.Generator], list[GradCase]]] = {
    # Gradient helpers (reference inputs only give shapes: their gradient is zero)
    "sum_to_like": lambda r: [
        C(ops.sum_to_like, normal(r, 2, 3, 4), normal(r, 3, 1), label="(2,3,4) to (3,1)"),
        C(ops.sum_to_like, normal(r, 2, 3), normal(r, 2, 3), label="same shape")],
    "broadcast_like": lambda r: [
        C(ops.broadcast_like, normal(r, 3, 1), normal(r, 2, 3, 4), label="(3,1) to (2,3,4)")],
    "zeros_like": lambda r: [C(lambda x: ops.zeros_like(x) + x, normal(r, 2, 3))],
    "ones_like": lambda r: [C(lambda x: ops.ones_like(x) * x, normal(r, 2, 3))],
    "count_ratio": lambda r: [
        C(lambda y, x: ops.count_ratio(y, x) * y, normal(r, 2), normal(r, 2, 3))],
    # Elementwise binary, with broadcasting and Python scalars
    "add": lambda r: [C(lambda a, b: a + b, normal(r, 2, 3), normal(r, 3), label="(2,3)+(3,)"),
                      C(lambda a, b: a + b, normal(r, 2, 1), normal(r, 1, 3), label="outer"),
                      C(lambda a: 2.5 + a, normal(r, 2, 3), label="scalar + x")],
    "sub": lambda r: [C(lambda a, b: a - b, normal(r, 2, 3), normal(r, 2, 1), label="(2,3)-(2,1)"),
                      C(lambda a: 1.0 - a, normal(r, 3), label="scalar - x")],
    "mul": lambda r: [C(lambda a, b: a * b, normal(r, 2, 3, 1), normal(r, 3, 4), label="3-D"),
                      C(lambda a: a * 3.0, normal(r, 2, 2), label="x * scalar"),
                      C(lambda a: a * a, normal(r, 2, 2), label="x * x")],
    "div": lambda r: [C(lambda a, b: a / b, normal(r, 2, 3), away_from_zero(r, 3), label="a/b"),
                      C(lambda b: 2.0 / b, away_from_zero(r, 2, 3), label="scalar / x")],
    # a = b + (at least 0.2 away from 0): no ties, where max and min have a kink
    "maximum": lambda r: (lambda b: [
        C(ops.maximum, b + away_from_zero(r, 2, 3), b, label="(2,3) vs (3,)")])(normal(r, 3)),
    "minimum": lambda r: (lambda b: [
        C(ops.minimum, b + away_from_zero(r, 2, 3), b, label="(2,3) vs (3,)")])(normal(r, 3)),
    "pow": lambda r: [
        C(lambda x, p: x ** p, positive(r, 2, 3), normal(r, 3, scale=0.7), label="x ** p"),
        C(lambda x: x ** 3.0, normal(r, 2, 3), label="x ** 3 (negative bases)"),
        C(lambda p: 2.0 ** p, normal(r, 3), label="2 ** p")],
    # Elementwise unary
    "neg": lambda r: [C(lambda x: -x, normal(r, 2, 3))],
    "exp": lambda r: [C(ops.exp, normal(r, 2, 3))],
    "log": lambda r: [C(ops.log, positive(r, 2, 3))],
    "sqrt": lambda r: [C(ops.sqrt, positive(r, 2, 3))],
    "tanh": lambda r: [C(ops.tanh, normal(r, 2, 3, scale=2.0))],
    "sigmoid": lambda r: [C(ops.sigmoid, normal(r, 2, 3, scale=4.0))],
    "relu": lambda r: [C(ops.relu, away_from_zero(r, 2, 3))],
    "gelu": lambda r: [C(ops.gelu, normal(r, 2, 3, scale=2.0))],
    "erf": lambda r: [C(ops.erf, normal(r, 2, 3, scale=1.5)),
                      C(ops.erf, np.array([-3.0, -2.6, 2.4, 2.6, 4.0]), label="both sides of 2.5")],
    "abs": lambda r: [C(ops.abs, away_from_zero(r, 2, 3))],
    "sign": lambda r: [C(lambda x: ops.sign(x) * x, away_from_zero(r, 2, 3))],
    "cast": lambda r: [
        C(lambda x: tf.cast(tf.cast(x, np.float32), F64), normal(r, 2, 3),
          label="float64 -> float32 -> float64", eps=1e-2, rtol=1e-4, atol=1e-5)],
    "where": lambda r: [
        C(lambda c, a, b: tf.where(c, a, b), Fixed(r.random((2, 3)) > 0.5), normal(r, 2, 3),
          normal(r, 3), label="b broadcasts")],
    # Matrix products
    "matmul": lambda r: [
        C(tf.matmul, normal(r, 2, 3), normal(r, 3, 4), label="2-D"),
        C(lambda a, b: tf.matmul(a, b, transpose_a=True), normal(r, 3, 2), normal(r, 3, 4),
          label="transpose_a"),
        C(lambda a, b: tf.matmul(a, b, transpose_b=True), normal(r, 2, 3), normal(r, 4, 3),
          label="transpose_b"),
        C(lambda a, b: tf.matmul(a, b, transpose_a=True, transpose_b=True), normal(r, 3, 2),
          normal(r, 4, 3), label="both transposed"),
        C(tf.matmul, normal(r, 2, 2, 3), normal(r, 3, 2), label="batched @ 2-D"),
        C(tf.matmul, normal(r, 2, 1, 2, 3), normal(r, 2, 3, 2), label="batch broadcast")],
    "bias_add": lambda r: [
        C(tf.nn.bias_add, normal(r, 2, 3), normal(r, 3), label="(N, C)"),
        C(tf.nn.bias_add, normal(r, 2, 3, 2, 2), normal(r, 3), label="NCHW"),
        C(tf.nn.bias_add, normal(r, 2, 4, 3), normal(r, 3), label="(B, T, C): last axis"),
        C(lambda x, b: make("bias_add", x, b, axis=-2), normal(r, 2, 3, 4), normal(r, 3),
          label="axis -2")],
    "bias_grad": lambda r: [C(lambda g: make("bias_grad", g), normal(r, 2, 3, 2)),
                            C(lambda g: make("bias_grad", g, axis=2), normal(r, 2, 3, 4),
                              label="axis 2")],
    # Reductions
    "sum": lambda r: [
        C(tf.reduce_sum, normal(r, 2, 3), label="all"),
        C(lambda x: tf.reduce_sum(x, 1), normal(r, 2, 3, 2), label="axis 1"),
        C(lambda x: tf.reduce_sum(x, (0, 2), keepdims=True), normal(r, 2, 3, 2),
          label="axes (0, 2) keepdims"),
        C(lambda x: tf.reduce_sum(x, reduction_indices=[-1]), normal(r, 2, 3),
          label="axis -1")],
    "mean": lambda r: [
        C(tf.reduce_mean, normal(r, 2, 3), label="all"),
        C(lambda x: tf.reduce_mean(x, 0), normal(r, 2, 3, 2), label="axis 0"),
        C(lambda x: tf.reduce_mean(x, (1, 2), keepdims=True), normal(r, 2, 3, 2),
          label="axes (1, 2) keepdims")],
    "max": lambda r: [
        C(tf.reduce_max, distinct(r, 2, 3), label="all"),
        C(lambda x: tf.reduce_max(x, 1), distinct(r, 2, 3, 2), label="axis 1"),
        C(lambda x: tf.reduce_max(x, (0, 2), keepdims=True), distinct(r, 2, 3, 2),
          label="axes (0, 2) keepdims")],
    "min": lambda r: [
        C(tf.reduce_min, distinct(r, 2, 3), label="all"),
        C(lambda x: tf.reduce_min(x, 1), distinct(r, 2, 3, 2), label="axis 1"),
        C(lambda x: tf.reduce_min(x, (0, 2), keepdims=True), distinct(r, 2, 3, 2),
          label="axes (0, 2) keepdims")],
    # Shape ops
    "reshape": lambda r: [
        C(lambda x: tf.reshape(x, (3, -1)), normal(r, 2, 3, 2), label="-1"),
        C(lambda x: tf.reshape(x, (0, -1)), normal(r, 2, 3, 2), label="0 copies a dim")],
    "reshape_like": lambda r: [C(ops.reshape_like, normal(r, 2, 3), normal(r, 3, 2))],
    "transpose": lambda r: [C(tf.transpose, normal(r, 2, 3), label="reverse"),
                            C(lambda x: tf.transpose(x, (1, 2, 0)), normal(r, 2, 3, 2),
                              label="(1, 2, 0)")],
    "broadcast_to": lambda r: [C(lambda x: tf.broadcast_to(x, (2, 3, 4)), normal(r, 3, 1))],
    "expand_dims": lambda r: [C(lambda x: tf.expand_dims(x, 1), normal(r, 2, 3)),
                              C(lambda x: tf.expand_dims(x, -1), normal(r, 2, 3), label="-1")],
    "squeeze": lambda r: [C(tf.squeeze, normal(r, 2, 1, 3, 1), label="all", needs_known_dims=True),
                          C(lambda x: tf.squeeze(x, 1), normal(r, 2, 1, 3), label="axis 1")],
    "concat": lambda r: [
        C(lambda a, b, c: tf.concat([a, b, c], 1), normal(r, 2, 1), normal(r, 2, 3),
          normal(r, 2, 2), label="axis 1"),
        C(lambda a, b: tf.concat([a, b], 0), normal(r, 1, 3), normal(r, 2, 3), label="axis 0")],
    "pad": lambda r: [
        C(lambda x: ops.pad(x, dim=1, pad=2), normal(r, 2, 3), label="after"),
        C(lambda x: ops.pad(x, dim=-2, pad=-1), normal(r, 2, 2, 3), label="before, dim -2")],
    "concat_part": lambda r: [
        C(lambda g, a, b: make("concat_part", g, a, b, axis=1, part=1), normal(r, 2, 5),
          normal(r, 2, 2), normal(r, 2, 3))],
    "getitem": lambda r: [
        C(lambda x: x[1:, ::2], normal(r, 3, 4), label="[1:, ::2]"),
        C(lambda x: x[0], normal(r, 3, 2), label="[0]"),
        C(lambda x: x[2, ::-1], normal(r, 3, 2), label="[2, ::-1]"),
        C(lambda x: x[..., -1], normal(r, 2, 3), label="[..., -1]"),
        C(lambda x: x[::-1, None], normal(r, 3, 2), label="[::-1, None]")],
    "slice_grad": lambda r: [
        C(lambda g, ref: make("slice_grad", g, ref, index=_encode_index((slice(1, None),
                                                                          slice(None, None, 2)))),
          normal(r, 2, 2), normal(r, 3, 4))],
    "gather": lambda r: [
        C(tf.gather, normal(r, 4, 3), ints([0, 2, 2]), label="repeated rows"),
        C(tf.gather, normal(r, 4, 2), ints([[3, 0], [1, 3]], np.int32), label="2-D indices")],
    "scatter_rows": lambda r: [
        C(lambda g, i, ref: make("scatter_rows", g, i, ref), normal(r, 2, 2, 3),
          ints([[0, 2], [2, 3]]), normal(r, 4, 3))],
    # Convolution and pooling (NCHW, OIHW)
    "conv2d": lambda r: [
        C(_conv((1, 1), 0), normal(r, 1, 2, 4, 4), normal(r, 2, 2, 3, 3), label="stride 1"),
        C(_conv((2, 2), "SAME"), normal(r, 1, 2, 5, 5), normal(r, 2, 2, 3, 3),
          label="stride 2 SAME"),
        C(_conv((2, 1), "VALID"), normal(r, 2, 1, 5, 4), normal(r, 2, 1, 2, 2),
          label="stride (2, 1) VALID"),
        C(_conv((1, 1), 1), normal(r, 1, 1, 3, 3), normal(r, 2, 1, 2, 2), label="padding 1")],
    "conv2d_grad_input": lambda r: [
        C(lambda g, w, x: make("conv2d_grad_input", g, w, x, stride=(2, 2), padding="SAME"),
          normal(r, 1, 2, 3, 3), normal(r, 2, 2, 3, 3), normal(r, 1, 2, 5, 5))],
    "conv2d_grad_filter": lambda r: [
        C(lambda g, x, w: make("conv2d_grad_filter", g, x, w, stride=(2, 2), padding="SAME"),
          normal(r, 1, 2, 3, 3), normal(r, 1, 2, 5, 5), normal(r, 2, 2, 3, 3))],
    "max_pool2d": lambda r: [
        C(_pool("max_pool2d", (2, 2), (2, 2), 0), distinct(r, 1, 2, 4, 4), label="2x2"),
        C(_pool("max_pool2d", (3, 3), (2, 2), "SAME"), distinct(r, 1, 1, 5, 5),
          label="3x3 stride 2 SAME"),
        C(_pool("max_pool2d", (2, 2), (1, 1), 1), distinct(r, 1, 1, 3, 3), label="padding 1")],
    "max_pool2d_grad": lambda r: [
        C(lambda g, x: make("max_pool2d_grad", g, x, ksize=(2, 2), stride=(1, 1), padding=0),
          normal(r, 1, 1, 2, 2), distinct(r, 1, 1, 3, 3))],
    "max_pool2d_pick": lambda r: [
        C(lambda g, x: make("max_pool2d_pick", g, x, ksize=(2, 2), stride=(1, 1), padding=0),
          normal(r, 1, 1, 3, 3), distinct(r, 1, 1, 3, 3))],
    "avg_pool2d": lambda r: [
        C(_pool("avg_pool2d", (2, 2), (2, 2), 0), normal(r, 1, 2, 4, 4), label="2x2"),
        C(_pool("avg_pool2d", (3, 3), (1, 1), 1), normal(r, 1, 1, 3, 3), label="padding 1")],
    "avg_pool2d_grad": lambda r: [
        C(lambda g, x: make("avg_pool2d_grad", g, x, ksize=(3, 3), stride=(2, 2),
                            padding="SAME"), normal(r, 1, 1, 2, 2), normal(r, 1, 1, 4, 4))],
    # Softmax family, losses, normalisation
    "softmax": lambda r: [C(tf.nn.softmax, normal(r, 2, 4)),
                          C(tf.nn.softmax, normal(r, 2, 2, 3), label="3-D")],
    "log_softmax": lambda r: [C(tf.nn.log_softmax, normal(r, 2, 4))],
    "softmax_cross_entropy": lambda r: [
        C(tf.nn.sparse_softmax_cross_entropy_with_logits, normal(r, 3, 4), ints([0, 3, 1]),
          label="int64 labels"),
        C(tf.nn.sparse_softmax_cross_entropy_with_logits, normal(r, 2, 3),
          Fixed(np.array([2.0, 0.0])), label="float labels")],
    "one_hot_like": lambda r: [
        C(lambda x, labels: make("one_hot_like", labels, x) * x, normal(r, 2, 3),
          ints([2, 0]))],
    # Gradient checkpointing's marker (memory.py): an identity
    "checkpoint": lambda r: [C(lambda x: make("checkpoint", x * 2.0), normal(r, 2, 3))],
    "layer_norm": lambda r: [
        C(tf.nn.layer_norm, normal(r, 2, 3, 4), normal(r, 4), normal(r, 4), label="3-D"),
        C(lambda x, g, b: tf.nn.layer_norm(x, g, b, eps=0.1), normal(r, 2, 3), normal(r, 3),
          normal(r, 3), label="eps 0.1")],
    # Megatron's f and g (tensor_parallel.py), on a world of one rank: both identities,
    # each with the other as its gradient.
    "tp_copy": lambda r: [C(lambda x: make("tp_copy", x * 2.0, comm=_ONE_RANK), normal(r, 2, 3))],
    "tp_allreduce": lambda r: [
        C(lambda x: make("tp_allreduce", x * 2.0, comm=_ONE_RANK), normal(r, 2, 3))],
}

# Differentiable ops whose check cannot be a finite difference, and the test that
# checks them instead.
GRAD_CHECKED_ELSEWHERE = {
    # A new random mask every run: the check runs forward and backward in one run.
    "dropout_mask": "test_dropout_gradient_uses_the_forward_mask",
    # Collectives across ranks: the gradient of one rank's graph is another collective.
    "tp_copy": "test_tensor_parallel_f_and_g_gradients_are_the_backward_collectives",
    "tp_allreduce": "test_tensor_parallel_f_and_g_gradients_are_the_backward_collectives",
    # Its gradient is zero by definition, not the identity's finite differences.
    "stop_gradient": "test_stop_gradient_passes_the_value_and_no_gradient",
}


def _import_all_tinyflow_modules() -> None:
    """Import every tinyflow module, so ops registered anywhere are in the registry."""
    for info in pkgutil.walk_packages(tf.__path__, "tinyflow."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:
            pass  # an optional dependency (cupy, mpi4py) that is not installed


def _tinyflow_ops(modules: tuple[str, ...] = ("tinyflow.",)) -> dict[str, Any]:
    """The registered ops whose kernels live in `modules` (prefixes)."""
    return {name: op for name, op in REGISTRY.items()
            if op.compute.__module__.startswith(modules)}


_import_all_tinyflow_modules()


def test_every_differentiable_op_has_a_gradient_check():
    needed = {name for name, op in _tinyflow_ops().items()
              if op.differentiable and op.gradient is not None}
    missing = sorted(needed - set(GRAD_CASES) - set(GRAD_CHECKED_ELSEWHERE))
    assert not missing, (f"differentiable ops without a finite-difference check: {missing}; "
                         "add a row to GRAD_CASES in tests/test_ops.py")
    for op, test_name in GRAD_CHECKED_ELSEWHERE.items():
        assert test_name in globals(), f"{op} is said to be checked by missing {test_name}"
    stale = sorted(set(GRAD_CASES) - needed)
    assert not stale, f"GRAD_CASES rows for ops that are not differentiable: {stale}"


def test_ops_without_gradient_are_marked_not_differentiable():
    for name, op in _tinyflow_ops().items():
        assert op.differentiable == (op.gradient is not None), (
            f"op {name}: differentiable={op.differentiable} but gradient is "
            f"{'missing' if op.gradient is None else 'registered'}")


def _rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


@pytest.mark.parametrize("op", sorted(GRAD_CASES))
def test_gradient_matches_finite_differences(op):
    rng = _rng_for(op)
    for case in GRAD_CASES[op](rng):
        check_gradient(op, case, rng)


@pytest.mark.parametrize("op", sorted(GRAD_CASES))
def test_gradient_with_unknown_batch_dim_matches_known_shapes(op):
    """The same graph built on placeholders whose first dim is None (fixed by the
    feed) gives the same gradients: shape rules and unbroadcast work on None dims."""
    rng = _rng_for(op)
    for case in GRAD_CASES[op](rng):
        if case.needs_known_dims:
            continue
        values = _values(case.args)
        free = [i for i, a in enumerate(case.args) if not isinstance(a, Fixed)]
        results = []
        for unknown in (False, True):
            phs = _placeholders(values, unknown_dims=unknown)
            y = case.build(*phs)
            w = tf.placeholder(F64)  # its shape is known only once y has run
            loss = tf.reduce_sum(tf.cast(y, F64) * w)
            grads = [g for g in tf.gradients(loss, [phs[i] for i in free]) if g is not None]
            sess = session()
            feed = dict(zip(phs, values))
            y_value = sess.run(y, feed)
            feed[w] = np.random.default_rng(1).standard_normal(y_value.shape)
            results.append(sess.run([y] + grads, feed))
        for k, (known, unknown) in enumerate(zip(*results)):
            what = "value" if k == 0 else f"gradient {k - 1}"
            np.testing.assert_allclose(unknown, known, rtol=1e-12, err_msg=(
                f"{op} ({case.label}): {what} differs when the first dims are None"))


# Ops whose GRAD_CASES inputs cannot take an empty batch, and why.
EMPTY_BATCH_SKIP = {
    "gather": "the indices point past the end of empty params "
              "(test_gather_names_an_index_past_the_end)",
    # Gradient helpers whose reference input keeps its rows, so that the emptied
    # input no longer fits it (their shape rules take the reference's shape as it is).
    "slice_grad": "", "broadcast_like": "", "reshape_like": "",
}
# A mean over nothing is NaN (numpy, TF): the ops that take one.
EMPTY_BATCH_NAN = {"mean", "count_ratio", "layer_norm"}


@pytest.mark.parametrize("op", sorted(set(GRAD_CASES) - set(EMPTY_BATCH_SKIP)))
def test_gradient_on_an_empty_batch_has_the_inputs_shapes(op):
    """A batch of 0 samples (dim 0 of every input whose dim 0 is the first input's)
    runs forward and backward, in graph mode and eagerly, with results of the right
    shapes; or its shape rule refuses it with a ShapeError. Regression: the
    simplifier rewrote reshape_like(g, x) as reshape(g, x's shape), and the 0 of
    the empty batch then meant "copy dim 0" ("cannot reshape 0 elements into (3, 3,
    2)"); reshape(x, (0, -1)) could not flatten an empty batch."""
    for case in GRAD_CASES[op](_rng_for(op)):
        values = _values(case.args)
        first = next(v.shape[0] for v in values if v.ndim)
        values = [np.zeros((0,) + v.shape[1:], v.dtype) if v.ndim and v.shape[0] == first
                  else v for v in values]
        free = [i for i, a in enumerate(case.args) if not isinstance(a, Fixed)]
        try:
            case.build(*_placeholders(values))
        except tf.ShapeError:
            continue  # refused by the shape rule, with the op and line named
        for unknown in (False, True):
            phs = _placeholders(values, unknown_dims=unknown and not case.needs_known_dims)
            y = case.build(*phs)
            grads = tf.gradients(tf.reduce_sum(tf.cast(y, F64)), [phs[i] for i in free])
            got = session().run([y] + [g for g in grads if g is not None],
                                dict(zip(phs, values)))
            shapes = [values[i].shape for i, g in zip(free, grads) if g is not None]
            assert [g.shape for g in got[1:]] == shapes, f"{op} ({case.label})"
            if op not in EMPTY_BATCH_NAN:
                assert not any(np.isnan(v).any() for v in got if v.dtype.kind == "f"), op
        tensors = [E.tensor(v, requires_grad=i in free) for i, v in enumerate(values)]
        y = case.build(*tensors)
        tf.reduce_sum(tf.cast(y, F64)).backward()
        for i in free:
            assert tensors[i].grad is None or tensors[i].grad.shape == values[i].shape, op


def test_reshape_flattens_an_empty_batch_and_copies_unknown_dims():
    """(0, -1) flattens a batch of 0 (numpy cannot infer the -1 of an empty array),
    and the copied dims cancel when the -1 is resolved: (None, 3, 4, 4) to (0, 0, -1)
    is (None, 3, 16) (it was refused as '16 elements per copied dims', so the
    batch_normalization layer failed to build on an unknown batch)."""
    x = tf.placeholder(F64, (None, 3, 4, 4))
    assert tf.reshape(x, (0, 0, -1)).shape == (None, 3, 16)
    assert tf.nn.batch_normalization(x, training=True).shape == (None, 3, 4, 4)
    flat = tf.reshape(x, (0, -1))
    assert session().run(flat, {x: np.zeros((0, 3, 4, 4))}).shape == (0, 48)
    empty = E.tensor(np.zeros((0, 3, 4, 4)))
    assert empty.reshape(0, -1).shape == (0, 48)
    assert empty.reshape(3, -1).shape == (3, 0)
    with pytest.raises(tf.ShapeError, match="cannot infer the -1"):
        E.tensor(np.zeros((0, 3))).reshape(3, -1, 0)  # (a literal 0 past x's rank)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_over_no_classes_is_empty(op):
    """An empty last axis gives an empty result and gradient (the row max failed
    inside numpy: 'zero-size array to reduction operation maximum')."""
    x = tf.placeholder(F64, (2, None))
    y = make(op, x)
    got = session().run([y, tf.gradients(tf.reduce_sum(y), x)[0]], {x: np.zeros((2, 0))})
    assert [v.shape for v in got] == [(2, 0), (2, 0)]
    assert make(op, E.tensor(np.zeros((2, 3, 0)))).shape == (2, 3, 0)


@pytest.mark.parametrize("build", [lambda x: tf.reduce_max(x, 1), tf.reduce_max,
                                   lambda x: tf.argmax(x, 1), ops.argmax,
                                   lambda x: tf.reduce_min(x, 1), ops.argmin])
def test_max_and_argmax_over_an_empty_axis_are_named(build):
    """numpy's message was 'zero-size array to reduction operation maximum which has
    no identity' (or 'attempt to get argmax of an empty sequence')."""
    with pytest.raises(tf.ShapeError, match=r"over axis \d of size 0 .* has no value"):
        build(tf.placeholder(F64, (2, 0)))
    x = tf.placeholder(F64, (2, None))
    for options in ({}, {"passes": []}):
        with pytest.raises(tf.TinyFlowError, match=r"over axis 1 of size 0 .* has no value"):
            tf.Session(**options).run(build(x), {x: np.zeros((2, 0))})
    assert session().run(build(x), {x: np.ones((2, 1))}).shape in ((2,), ())


def test_gather_names_an_index_past_the_end():
    """numpy's message, for params without rows, was 'cannot do a non-empty take
    from an empty axes'."""
    params = tf.placeholder(F64, (None, 3))
    y = tf.gather(params, tf.constant(np.array([0, 2])))
    for rows in (0, 2):
        with pytest.raises(tf.TinyFlowError, match=rf"index 2 is out of range for params "
                                                    rf"of {rows} rows"):
            session().run(y, {params: np.zeros((rows, 3))})
    assert session().run(y, {params: np.zeros((3, 3))}).shape == (2, 3)
    assert session().run(tf.gather(params, tf.constant([-1])), {params: np.eye(3)})[0, 2] == 1


def test_dropout_gradient_uses_the_forward_mask():
    x = tf.placeholder(F64, (50, 40))
    w = tf.placeholder(F64, (50, 40))
    y = tf.nn.dropout(x, rate=0.25, seed=3)
    (grad,) = tf.gradients(tf.reduce_sum(y * w), [x])
    xv = np.random.default_rng(0).uniform(1.0, 2.0, (50, 40))
    wv = np.random.default_rng(1).standard_normal((50, 40))
    y_value, g_value = session().run([y, grad], {x: xv, w: wv})
    mask = y_value / xv  # the mask this run drew: 0 or 1 / (1 - rate)
    np.testing.assert_allclose(g_value, wv * mask, rtol=1e-12)
    assert set(np.unique(np.round(mask, 12))) == {0.0, round(1 / 0.75, 12)}
    assert 0.15 < np.mean(mask == 0) < 0.35
    assert tf.nn.dropout(x, rate=0.25, training=False) is x


def test_dropout_second_argument_is_tf1s_keep_prob_and_may_be_fed():
    # It was taken for the rate: tf.nn.dropout(x, 0.8) kept 20% and scaled by 5
    # (TF1 keeps 80% and scales by 1.25), and a keep_prob placeholder was refused.
    x = tf.ones((200, 100), F64)
    kept = session().run(tf.nn.dropout(x, 0.8, seed=1))
    assert set(np.unique(kept)) == {0.0, 1.25} and 0.75 < np.mean(kept > 0) < 0.85
    keep_prob = tf.placeholder(F64, ())
    y = tf.nn.dropout(x, keep_prob, seed=2, name="dropped")
    assert y.name == "dropped"
    sess = session()
    half = sess.run(y, {keep_prob: 0.5})
    assert set(np.unique(half)) == {0.0, 2.0} and 0.45 < np.mean(half > 0) < 0.55
    np.testing.assert_array_equal(sess.run(y, {keep_prob: 1.0}), np.ones((200, 100)))
    with pytest.raises(ExecutionError, match=r"keep_prob must be in \(0, 1\], got 0.0"):
        sess.run(y, {keep_prob: 0.0})
    rate = tf.placeholder(F64, ())
    dropped = sess.run(tf.nn.dropout(x, rate=rate, seed=3), {rate: 0.75})
    assert set(np.unique(dropped)) == {0.0, 4.0}
    with pytest.raises(tf.ShapeError, match=r"keep_prob must be a scalar, got shape \(2,\)"):
        tf.nn.dropout(x, tf.placeholder(F64, (2,)))
    with pytest.raises(tf.ShapeError, match="keep_prob must be a float, got int32"):
        tf.nn.dropout(x, tf.placeholder(tf.int32, ()))


def test_tensor_parallel_f_and_g_gradients_are_the_backward_collectives():
    """Megatron's f (tp_copy) and g (tp_allreduce) on two thread ranks. The global
    loss is the sum of the ranks' losses for f (each rank uses the shared x with its
    own weights w_r): dL/dx = w_0 + w_1, which f's backward allreduce gives every
    rank. For g the loss is replicated (computed from the sum of the ranks' parts):
    z = x_0 + x_1 and dL/dx_r = u, g's identity backward."""
    from tinyflow.allreduce import ThreadTransport, run_threads
    from tinyflow.parallel import register_communicator
    rng = np.random.default_rng(5)
    comms = ThreadTransport.group_of(2, timeout=20)
    x_value = rng.standard_normal((3, 4))
    parts = [rng.standard_normal((3, 4)) for _ in comms]
    weights = [rng.standard_normal((3, 4)) for _ in comms]
    u = rng.standard_normal((3, 4))
    graphs = []
    for comm, w in zip(comms, weights):
        key = register_communicator(comm)
        x = tf.placeholder(F64, (3, 4))
        f_loss = tf.reduce_sum(make("tp_copy", x, comm=key) * tf.constant(w))
        part = tf.placeholder(F64, (3, 4))
        z = make("tp_allreduce", part, comm=key)
        g_loss = tf.reduce_sum(z * tf.constant(u))
        fetches = [tf.gradients(f_loss, [x])[0], z, tf.gradients(g_loss, [part])[0]]
        graphs.append((x, part, fetches))

    def rank(comm):
        x, part, fetches = graphs[comm.rank]
        return tf.Session().run(fetches, {x: x_value, part: parts[comm.rank]})

    for f_grad, z, g_grad in run_threads(comms, rank):
        np.testing.assert_allclose(f_grad, weights[0] + weights[1], rtol=1e-12)
        np.testing.assert_allclose(z, parts[0] + parts[1], rtol=1e-12)
        np.testing.assert_array_equal(g_grad, u)


# ----------------------------------------------------------------------------------
# Second derivatives: the gradient graph is an ordinary graph
# ----------------------------------------------------------------------------------

def _second_order_case(case: GradCase, rng: np.random.Generator) -> GradCase | None:
    """A case whose output is <w2, d<w1, f(x)>/dx>: its gradient is a Hessian-vector
    product of f, and check_gradient compares it with differences of the gradient."""
    values = _values(case.args)
    free = [i for i, a in enumerate(case.args) if not isinstance(a, Fixed)]
    w2 = [rng.standard_normal(values[i].shape) for i in free]

    def build(*phs):
        y = case.build(*phs)
        w1 = tf.constant(np.random.default_rng(2).standard_normal(y.shape), F64)
        grads = tf.gradients(tf.reduce_sum(tf.cast(y, F64) * w1), [phs[i] for i in free])
        terms = [tf.reduce_sum(g * tf.constant(w, F64)) for g, w in zip(grads, w2)
                 if g is not None]
        assert terms, f"{case.label}: no input has a gradient"
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    return GradCase(build, case.args, label=f"second order of {case.label}",
                    eps=max(case.eps, 1e-5), rtol=max(case.rtol, 1e-4), atol=1e-6)


@pytest.mark.parametrize("op", sorted(GRAD_CASES))
def test_second_derivative_matches_finite_differences(op):
    rng = _rng_for(op)
    case = GRAD_CASES[op](rng)[0]
    check_gradient(op, _second_order_case(case, rng), rng)


def test_second_derivative_of_tanh_sigmoid_exp_chain_closed_form():
    x = tf.placeholder(F64, (5,))
    y = tf.exp(tf.sigmoid(tf.tanh(x)))
    (dy,) = tf.gradients(y, [x])
    (d2y,) = tf.gradients(dy, [x])
    xv = np.linspace(-2.0, 2.0, 5)
    sess = session()
    got_d1, got_d2 = sess.run([dy, d2y], {x: xv})

    # By hand: t = tanh x, s = sigmoid t, y = exp s.
    t = np.tanh(xv)
    s = 1 / (1 + np.exp(-t))
    dt, ds = 1 - t**2, s * (1 - s)
    d1 = np.exp(s) * ds * dt
    d2 = np.exp(s) * ((ds * dt) ** 2 + ds * (1 - 2 * s) * dt**2 + ds * (-2 * t * dt))
    np.testing.assert_allclose(got_d1, d1, rtol=1e-12)
    np.testing.assert_allclose(got_d2, d2, rtol=1e-10)
    # The second derivative against central differences of the first.
    h = 1e-5
    fd2 = (sess.run(dy, {x: xv + h}) - sess.run(dy, {x: xv - h})) / (2 * h)
    np.testing.assert_allclose(got_d2, fd2, rtol=1e-6, atol=1e-9)

    # And a third derivative, against differences of the second.
    (d3y,) = tf.gradients(d2y, [x])
    h = 1e-5
    fd = (sess.run(d2y, {x: xv + h}) - sess.run(d2y, {x: xv - h})) / (2 * h)
    np.testing.assert_allclose(sess.run(d3y, {x: xv}), fd, rtol=1e-5, atol=1e-7)


def _hvp_check(build_loss, params: list[np.ndarray], rng, rtol=1e-5):
    """H v from autodiff vs (grad(p + h v) - grad(p - h v)) / 2h."""
    phs = [tf.placeholder(F64, p.shape) for p in params]
    loss = build_loss(*phs)
    grads = tf.gradients(loss, phs)
    vs = [rng.standard_normal(p.shape) for p in params]
    dot = tf.reduce_sum(grads[0] * tf.constant(vs[0], F64))
    for g, v in zip(grads[1:], vs[1:]):
        dot = dot + tf.reduce_sum(g * tf.constant(v, F64))
    hvp = tf.gradients(dot, phs)
    sess = session()
    got = sess.run(hvp, dict(zip(phs, params)))
    h = 1e-5
    plus = sess.run(grads, {ph: p + h * v for ph, p, v in zip(phs, params, vs)})
    minus = sess.run(grads, {ph: p - h * v for ph, p, v in zip(phs, params, vs)})
    for k, (g, a, b) in enumerate(zip(got, plus, minus)):
        np.testing.assert_allclose(g, (a - b) / (2 * h), rtol=rtol, atol=1e-7,
                                   err_msg=f"Hessian-vector product, parameter {k}")


def test_hessian_vector_product_of_mlp_loss():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4))
    labels = np.array([0, 2, 1, 2, 0, 1])

    def loss(w1, b1, w2):
        hidden = tf.tanh(tf.matmul(tf.constant(x, F64), w1) + b1)
        logits = tf.matmul(hidden, w2)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            logits, tf.constant(labels)))

    _hvp_check(loss, [rng.standard_normal((4, 5)), rng.standard_normal(5),
                      rng.standard_normal((5, 3))], rng)


def test_hessian_vector_product_of_convnet_loss():
    rng = np.random.default_rng(1)
    images = rng.standard_normal((2, 1, 6, 6))
    labels = np.array([1, 0])

    def loss(w, gamma, fc):
        h = tf.nn.conv2d(tf.constant(images, F64), w, strides=[1, 1, 1, 1], padding="SAME")
        h = tf.nn.max_pool(tf.nn.gelu(h), ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1])
        h = tf.nn.avg_pool(h, ksize=[1, 3, 3, 1], strides=[1, 3, 3, 1])   # (2, 2, 1, 1)
        h = tf.nn.layer_norm(tf.reshape(h, (2, 2)), gamma, tf.constant(np.zeros(2), F64))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.matmul(h, fc), tf.constant(labels)))

    _hvp_check(loss, [rng.standard_normal((2, 1, 3, 3)), rng.standard_normal(2) + 1.0,
                      rng.standard_normal((2, 2))], rng, rtol=1e-4)


# ----------------------------------------------------------------------------------
# Forward values against numpy
# ----------------------------------------------------------------------------------

def _conv_taps(x_shape, w_shape, stride, padding):
    """Every (oi, oj, ki, kj, xi, xj) with output (oi, oj) reading input (xi, xj)
    through filter tap (ki, kj); padding positions are left out. Written from the
    definition (TF's SAME rule: output = ceil(size / stride), odd pad after)."""
    h, w = x_shape[2:]
    kh, kw = w_shape[2:]
    pads = []
    for size, k, s in ((h, kh, stride[0]), (w, kw, stride[1])):
        if padding == "SAME":
            out = -(-size // s)
            total = max((out - 1) * s + k - size, 0)
            pads.append((total // 2, total - total // 2))
        elif padding == "VALID":
            pads.append((0, 0))
        else:
            pads.append((padding, padding))
    oh = (h + sum(pads[0]) - kh) // stride[0] + 1
    ow = (w + sum(pads[1]) - kw) // stride[1] + 1
    taps = []
    for oi in range(oh):
        for oj in range(ow):
            for ki in range(kh):
                for kj in range(kw):
                    xi = oi * stride[0] + ki - pads[0][0]
                    xj = oj * stride[1] + kj - pads[1][0]
                    inside = 0 <= xi < h and 0 <= xj < w
                    taps.append((oi, oj, ki, kj, xi if inside else None, xj))
    return (oh, ow), taps


def conv_reference(x, w, stride=(1, 1), padding=0):
    (oh, ow), taps = _conv_taps(x.shape, w.shape, stride, padding)
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for oi, oj, ki, kj, xi, xj in taps:
        if xi is not None:
            out[:, :, oi, oj] += x[:, :, xi, xj] @ w[:, :, ki, kj].T
    return out


def conv_grad_input_reference(g, w, x, stride=(1, 1), padding=0):
    _, taps = _conv_taps(x.shape, w.shape, stride, padding)
    dx = np.zeros(x.shape)
    for oi, oj, ki, kj, xi, xj in taps:
        if xi is not None:
            dx[:, :, xi, xj] += g[:, :, oi, oj] @ w[:, :, ki, kj]
    return dx


def conv_grad_filter_reference(g, x, w, stride=(1, 1), padding=0):
    _, taps = _conv_taps(x.shape, w.shape, stride, padding)
    dw = np.zeros(w.shape)
    for oi, oj, ki, kj, xi, xj in taps:
        if xi is not None:
            dw[:, :, ki, kj] += g[:, :, oi, oj].T @ x[:, :, xi, xj]
    return dw


def pool_windows(x, ksize, stride, padding):
    """{(oi, oj): [(xi, xj) or None for padding, in row-major window order]}"""
    (oh, ow), taps = _conv_taps(x.shape, (1, 1) + tuple(ksize), stride, padding)
    windows: dict = {}
    for oi, oj, _, _, xi, xj in taps:
        windows.setdefault((oi, oj), []).append(None if xi is None else (xi, xj))
    return (oh, ow), windows


def max_pool_reference(x, ksize, stride, padding):
    (oh, ow), windows = pool_windows(x, ksize, stride, padding)
    out = np.full(x.shape[:2] + (oh, ow), -np.inf)
    for (oi, oj), cells in windows.items():
        for cell in cells:
            if cell is not None:
                out[:, :, oi, oj] = np.maximum(out[:, :, oi, oj], x[:, :, cell[0], cell[1]])
    return out


def max_pool_grad_reference(g, x, ksize, stride, padding):
    """The gradient goes to the first maximum of each window."""
    (oh, ow), windows = pool_windows(x, ksize, stride, padding)
    dx = np.zeros(x.shape)
    for (oi, oj), cells in windows.items():
        for n in range(x.shape[0]):
            for c in range(x.shape[1]):
                values = [x[n, c, p[0], p[1]] if p else -np.inf for p in cells]
                first = cells[int(np.argmax(values))]
                dx[n, c, first[0], first[1]] += g[n, c, oi, oj]
    return dx


def pick_reference(g, x, ksize, stride, padding):
    """g read at the first maximum of each window of x (adjoint of the above)."""
    (oh, ow), windows = pool_windows(x, ksize, stride, padding)
    out = np.zeros(x.shape[:2] + (oh, ow))
    for (oi, oj), cells in windows.items():
        for n in range(x.shape[0]):
            for c in range(x.shape[1]):
                values = [x[n, c, p[0], p[1]] if p else -np.inf for p in cells]
                first = cells[int(np.argmax(values))]
                out[n, c, oi, oj] = g[n, c, first[0], first[1]]
    return out


def scatter_rows_reference(g, indices, ref):
    out = np.zeros(ref.shape)
    np.add.at(out, indices, g)
    return out


def avg_pool_reference(x, ksize, stride, padding):
    """Mean over the window, padding counted as zeros."""
    (oh, ow), windows = pool_windows(x, ksize, stride, padding)
    out = np.zeros(x.shape[:2] + (oh, ow))
    for (oi, oj), cells in windows.items():
        for cell in cells:
            if cell is not None:
                out[:, :, oi, oj] += x[:, :, cell[0], cell[1]]
    return out / (ksize[0] * ksize[1])


def log_softmax_reference(x):
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def gelu_reference(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def sum_to_shape(g, shape):
    """numpy reference of the gradient of broadcasting: sum g down to `shape`."""
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape)


@dataclass
class FwdCase:
    """build(*placeholders) -> Node; reference(*arrays) -> expected array."""

    op: str
    label: str
    build: Callable[..., Node]
    args: list
    reference: Callable[..., Any]
    rtol: float = 1e-6


_R = np.random.default_rng(7)
A23 = _R.standard_normal((2, 3)).astype(np.float32)
B3 = _R.standard_normal(3).astype(np.float32)
POS23 = _R.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
X4 = _R.standard_normal((2, 3, 4))
IMG = _R.standard_normal((2, 2, 5, 5))
FILT = _R.standard_normal((3, 2, 3, 3))
TIES = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]], np.float32)
ROWS = np.array([[0, 3], [3, 1]])
SEL = _encode_index((slice(None, None, -1), slice(1, None)))


def _binary_case(op, fn, numpy_fn, b=B3):
    return FwdCase(op, "(2,3) with (3,)", fn, [A23, b], numpy_fn)


FORWARD_CASES = [
    FwdCase("constant", "array", lambda: tf.constant(A23), [], lambda: A23),
    FwdCase("zeros", "(2, 3)", lambda: tf.zeros((2, 3)), [], lambda: np.zeros((2, 3), np.float32)),
    FwdCase("ones", "int32", lambda: tf.ones(4, tf.int32), [], lambda: np.ones(4, np.int32)),
    _binary_case("add", lambda a, b: a + b, np.add),
    _binary_case("sub", lambda a, b: a - b, np.subtract),
    _binary_case("mul", lambda a, b: a * b, np.multiply),
    _binary_case("div", lambda a, b: a / b, np.divide),
    _binary_case("maximum", tf.maximum, np.maximum),
    _binary_case("minimum", tf.minimum, np.minimum),
    FwdCase("pow", "x ** p", lambda a, b: a ** b, [POS23, B3], np.power, rtol=1e-5),
    FwdCase("add", "scalar int placeholder", lambda a: a + 2, [np.arange(3, dtype=np.int32)],
            lambda a: a + np.int32(2)),
    _binary_case("less", lambda a, b: a < b, np.less),
    _binary_case("less_equal", tf.less_equal, np.less_equal, b=A23[0]),
    _binary_case("greater", lambda a, b: a > b, np.greater),
    _binary_case("greater_equal", tf.greater_equal, np.greater_equal, b=A23[1]),
    _binary_case("equal", tf.equal, np.equal, b=A23[0]),
    _binary_case("not_equal", tf.not_equal, np.not_equal, b=A23[1]),
    FwdCase("neg", "", lambda x: -x, [A23], np.negative),
    FwdCase("exp", "", tf.exp, [A23], np.exp),
    FwdCase("log", "", tf.log, [POS23], np.log),
    FwdCase("sqrt", "", tf.sqrt, [POS23], np.sqrt),
    FwdCase("tanh", "", tf.tanh, [A23], np.tanh),
    FwdCase("sigmoid", "large |x| stays finite", tf.sigmoid,
            [np.array([-800.0, -30.0, 0.0, 30.0, 800.0])],
            lambda x: np.exp(-np.logaddexp(0, -x))),
    FwdCase("relu", "", tf.nn.relu, [A23], lambda x: np.maximum(x, 0)),
    FwdCase("gelu", "", tf.nn.gelu, [A23], gelu_reference, rtol=1e-5),
    FwdCase("erf", "", tf.ops.erf, [A23 * 2], lambda x: np.vectorize(math.erf)(x.astype(F64))
            .astype(np.float32), rtol=1e-6),
    FwdCase("abs", "", tf.abs, [A23], np.abs),
    FwdCase("sign", "", ops.sign, [np.array([-2.0, 0.0, 3.0])], np.sign),
    FwdCase("cast", "float -> int truncates", lambda x: tf.cast(x, tf.int32),
            [np.array([-1.7, 0.2, 2.9])], lambda x: x.astype(np.int32)),
    FwdCase("cast", "bool -> float", lambda x: tf.cast(x > 0, tf.float32), [A23],
            lambda x: (x > 0).astype(np.float32)),
    FwdCase("where", "broadcast", lambda c, a, b: tf.where(c, a, b),
            [A23 > 0, A23, B3], np.where),
    FwdCase("zeros_like", "", tf.zeros_like, [A23], np.zeros_like),
    FwdCase("stop_gradient", "", tf.stop_gradient, [A23], lambda a: a),
    FwdCase("ones_like", "", tf.ones_like, [A23], np.ones_like),
    FwdCase("count_ratio", "", ops.count_ratio, [B3, A23], lambda y, x: np.float32(0.5)),
    FwdCase("matmul", "2-D", tf.matmul, [A23, A23.T.copy()], np.matmul, rtol=1e-5),
    FwdCase("matmul", "batched, broadcast", tf.matmul,
            [X4, _R.standard_normal((2, 1, 4, 2))], np.matmul),
    FwdCase("matmul", "transpose_a and _b", lambda a, b: tf.matmul(a, b, True, True),
            [X4, _R.standard_normal((5, 3))], lambda a, b: np.swapaxes(a, -1, -2) @ b.T),
    FwdCase("bias_add", "NCHW", tf.nn.bias_add, [IMG, np.array([1.0, -2.0])],
            lambda x, b: x + b[None, :, None, None]),
    FwdCase("bias_grad", "NCHW", lambda g: make("bias_grad", g), [IMG],
            lambda g: g.sum(axis=(0, 2, 3))),
    FwdCase("bias_add", "axis -1", lambda x, b: make("bias_add", x, b, axis=-1),
            [X4, _R.standard_normal(4)], lambda x, b: x + b),
    FwdCase("bias_grad", "axis 0", lambda g: make("bias_grad", g, axis=0), [X4],
            lambda g: g.sum(axis=(1, 2))),
    FwdCase("sum", "all", tf.reduce_sum, [X4], np.sum),
    FwdCase("sum", "axes (1, 2) keepdims", lambda x: tf.reduce_sum(x, [1, 2], keepdims=True),
            [X4], lambda x: x.sum((1, 2), keepdims=True)),
    FwdCase("sum", "keep_dims (TF1 spelling), axis -1",
            lambda x: tf.reduce_sum(x, reduction_indices=-1, keep_dims=True), [X4],
            lambda x: x.sum(-1, keepdims=True)),
    FwdCase("mean", "axis 0", lambda x: tf.reduce_mean(x, 0), [X4], lambda x: x.mean(0)),
    FwdCase("mean", "of booleans is a fraction", lambda x: tf.reduce_mean(x > 0), [A23],
            lambda x: np.float32(np.mean(x > 0))),
    FwdCase("max", "axis 1 with ties", lambda x: tf.reduce_max(x, 1), [TIES],
            lambda x: x.max(1)),
    FwdCase("argmax", "axis 1 (first of ties)", lambda x: tf.argmax(x, 1), [TIES],
            lambda x: np.argmax(x, 1)),
    FwdCase("argmax", "all", ops.argmax, [X4], np.argmax),
    FwdCase("argmin", "axis 1 (first of ties)", lambda x: tf.argmin(x, 1), [TIES],
            lambda a: np.argmin(a, 1)),
    FwdCase("argmin", "TF1's default axis 0", tf.argmin, [X4], lambda a: np.argmin(a, 0)),
    FwdCase("min", "axis 1 with ties", lambda x: tf.reduce_min(x, 1), [TIES],
            lambda a: np.min(a, 1)),
    FwdCase("argmax", "TF1's default axis 0", tf.argmax, [X4], lambda a: np.argmax(a, 0)),
    FwdCase("reshape", "0 and -1", lambda x: tf.reshape(x, (0, -1)), [X4],
            lambda x: x.reshape(2, 12)),
    FwdCase("reshape_like", "", ops.reshape_like, [X4, np.zeros((4, 6))],
            lambda x, r: x.reshape(4, 6)),
    FwdCase("transpose", "(2, 0, 1)", lambda x: tf.transpose(x, (2, 0, 1)), [X4],
            lambda x: x.transpose(2, 0, 1)),
    FwdCase("broadcast_to", "", lambda x: tf.broadcast_to(x, (2, 2, 3)), [B3],
            lambda x: np.broadcast_to(x, (2, 2, 3))),
    FwdCase("expand_dims", "axis 1", lambda x: tf.expand_dims(x, 1), [A23],
            lambda x: x[:, None]),
    FwdCase("squeeze", "axis 0", lambda x: tf.squeeze(x, 0), [A23[None]], lambda x: x[0]),
    FwdCase("concat", "axis 1", lambda a, b: tf.concat([a, b], 1), [A23, A23 * 2],
            lambda a, b: np.concatenate([a, b], 1)),
    FwdCase("concat_part", "part 1", lambda g, a, b: make("concat_part", g, a, b, axis=1,
                                                          part=1),
            [X4, X4[:, :1], X4[:, 1:]], lambda g, a, b: g[:, 1:]),
    FwdCase("pad", "dim 1, pad -3 then 3 (the original's test_pad)",
            lambda x: ops.pad(ops.pad(x, dim=1, pad=-3), dim=1, pad=3), [X4],
            lambda x: np.pad(x, ((0, 0), (3, 3), (0, 0)))),
    FwdCase("getitem", "[::-1, 1:]", lambda x: x[::-1, 1:], [A23], lambda x: x[::-1, 1:]),
    FwdCase("getitem", "[..., 0, None]", lambda x: x[..., 0, None], [X4],
            lambda x: x[..., 0, None]),
    FwdCase("slice_grad", "", lambda g, r: make("slice_grad", g, r, index=SEL),
            [A23[:, 1:], A23], lambda g, r: np.pad(g[::-1], ((0, 0), (1, 0)))),
    FwdCase("gather", "2-D indices", tf.gather, [X4[:, 0].T.copy(), ROWS],
            lambda p, i: p[i]),
    FwdCase("scatter_rows", "repeated rows", lambda g, i, r: make("scatter_rows", g, i, r),
            [X4[:, :2, :], ROWS, np.zeros((4, 4))],
            scatter_rows_reference),
    FwdCase("conv2d", "stride 1, padding 0", lambda x, w: image_ops.conv2d(x, w),
            [IMG, FILT], conv_reference),
    FwdCase("conv2d", "stride 2, SAME", lambda x, w: tf.nn.conv2d(x, w, [1, 2, 2, 1], "SAME"),
            [IMG, FILT], lambda x, w: conv_reference(x, w, (2, 2), "SAME")),
    FwdCase("conv2d", "stride (1, 2), VALID",
            lambda x, w: tf.nn.conv2d(x, w, [1, 1, 2, 1], "VALID"), [IMG, FILT[:, :, :2]],
            lambda x, w: conv_reference(x, w, (1, 2), "VALID")),
    FwdCase("conv2d", "even kernel, SAME (odd pad after)",
            lambda x, w: tf.nn.conv2d(x, w, padding="SAME"), [IMG, FILT[:, :, :2, :2]],
            lambda x, w: conv_reference(x, w, (1, 1), "SAME")),
    FwdCase("conv2d_grad_input", "stride 2, SAME",
            lambda g, w, x: make("conv2d_grad_input", g, w, x, stride=(2, 2), padding="SAME"),
            [_R.standard_normal((2, 3, 3, 3)), FILT, IMG],
            lambda g, w, x: conv_grad_input_reference(g, w, x, (2, 2), "SAME")),
    FwdCase("conv2d_grad_filter", "padding 1",
            lambda g, x, w: make("conv2d_grad_filter", g, x, w, stride=(1, 1), padding=1),
            [_R.standard_normal((2, 3, 5, 5)), IMG, FILT],
            lambda g, x, w: conv_grad_filter_reference(g, x, w, (1, 1), 1)),
    FwdCase("max_pool2d", "2x2 VALID (odd size drops a row)",
            lambda x: tf.nn.max_pool(x, [1, 2, 2, 1], [1, 2, 2, 1]), [IMG],
            lambda x: max_pool_reference(x, (2, 2), (2, 2), 0)),
    FwdCase("max_pool2d", "3x3 stride 2 SAME (pads are -inf)",
            lambda x: tf.nn.max_pool(x, [1, 3, 3, 1], [1, 2, 2, 1], "SAME"), [-np.abs(IMG)],
            lambda x: max_pool_reference(x, (3, 3), (2, 2), "SAME")),
    FwdCase("max_pool2d_grad", "ties go to the first max",
            lambda g, x: make("max_pool2d_grad", g, x, ksize=(2, 2), stride=(1, 1), padding=0),
            [np.arange(4.0).reshape(1, 1, 2, 2) + 1, np.ones((1, 1, 3, 3))],
            lambda g, x: max_pool_grad_reference(g, x, (2, 2), (1, 1), 0)),
    FwdCase("max_pool2d_grad", "3x3 stride 2 SAME",
            lambda g, x: make("max_pool2d_grad", g, x, ksize=(3, 3), stride=(2, 2),
                              padding="SAME"),
            [IMG[:, :, :3, :3], -np.abs(IMG)],
            lambda g, x: max_pool_grad_reference(g, x, (3, 3), (2, 2), "SAME")),
    FwdCase("max_pool2d_pick", "", lambda g, x: make("max_pool2d_pick", g, x, ksize=(2, 2),
                                                     stride=(2, 2), padding=0),
            [IMG, _R.standard_normal(IMG.shape)],
            lambda g, x: pick_reference(g, x, (2, 2), (2, 2), 0)),
    FwdCase("avg_pool2d", "3x3 stride 1 padding 1 (pads count as zeros)",
            lambda x: tf.nn.avg_pool2d(x, 3, 1, 1), [IMG],
            lambda x: avg_pool_reference(x, (3, 3), (1, 1), 1)),
    FwdCase("avg_pool2d_grad", "2x2",
            lambda g, x: make("avg_pool2d_grad", g, x, ksize=(2, 2), stride=(2, 2), padding=0),
            [IMG[:, :, :2, :2], IMG[:, :, :4, :4]],
            lambda g, x: np.kron(g, np.ones((2, 2))) / 4),
    FwdCase("softmax", "rows sum to 1", tf.nn.softmax, [X4 * 30],
            lambda x: np.exp(log_softmax_reference(x))),
    FwdCase("log_softmax", "", tf.nn.log_softmax, [X4 * 30], log_softmax_reference),
    FwdCase("softmax_cross_entropy", "int labels",
            tf.nn.sparse_softmax_cross_entropy_with_logits, [A23, np.array([2, 0])],
            lambda x, y: -log_softmax_reference(x)[np.arange(2), y], rtol=1e-5),
    FwdCase("one_hot_like", "", lambda labels, x: make("one_hot_like", labels, x),
            [np.array([2, 0]), A23], lambda labels, x: np.eye(3, dtype=np.float32)[labels]),
    FwdCase("layer_norm", "eps 1e-5", tf.nn.layer_norm, [X4, B3[:1].repeat(4), X4[0, 0]],
            lambda x, g, b: (x - x.mean(-1, keepdims=True)) / np.sqrt(
                x.var(-1, keepdims=True) + 1e-5) * g + b),
    FwdCase("sum_to_like", "(2,3,4) to (3,1)", ops.sum_to_like, [X4, np.zeros((3, 1))],
            lambda g, r: sum_to_shape(g, (3, 1))),
    FwdCase("broadcast_like", "", ops.broadcast_like, [B3, A23],
            lambda x, r: np.broadcast_to(x, (2, 3))),
]


# Ops whose values are checked elsewhere, and where.
FORWARD_CHECKED_ELSEWHERE = {
    "placeholder": "every test feeds one",
    "variable": "test_compat_tinyflow (test_assign, test_init)",
    "assign": "test_compat_tinyflow (test_assign, test_group)",
    "group": "test_compat_tinyflow (test_group)",
    "random_normal": "test_random_sources_are_seeded_and_distributed",
    "truncated_normal": "test_random_sources_are_seeded_and_distributed",
    "random_uniform": "test_random_sources_are_seeded_and_distributed",
    "dropout_mask": "test_dropout_gradient_uses_the_forward_mask",
    # Collectives across ranks: the gradient of one rank's graph is another collective.
    "tp_copy": "test_tensor_parallel_f_and_g_gradients_are_the_backward_collectives",
    "tp_allreduce": "test_tensor_parallel_f_and_g_gradients_are_the_backward_collectives",
}


def test_every_op_has_a_forward_check():
    covered = {c.op for c in FORWARD_CASES} | set(FORWARD_CHECKED_ELSEWHERE)
    # The core ops; fused, checkpoint and allreduce ops have tests of their own layers.
    core = _tinyflow_ops(("tinyflow.ops", "tinyflow.shape_ops", "tinyflow.nn_ops",
                            "tinyflow.image_ops"))
    missing = sorted(set(core) - covered)
    assert not missing, (f"ops without a forward check against numpy: {missing}; add a "
                         "FwdCase to FORWARD_CASES in tests/test_ops.py")


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c.op}-{c.label}")
def test_forward_matches_numpy(case):
    phs = [tf.placeholder(a.dtype, a.shape) for a in case.args]
    y = case.build(*phs)
    assert case.op in {n.op for n in topological_order([y])}, f"{case.op} not built"
    got = session().run(y, dict(zip(phs, case.args)))
    expected = np.asarray(case.reference(*case.args))
    assert got.shape == tuple(y.shape), (
        f"{case.op} ({case.label}): inferred shape {y.shape}, kernel gave {got.shape}")
    assert got.dtype == y.dtype, (
        f"{case.op} ({case.label}): inferred dtype {y.dtype}, kernel gave {got.dtype}")
    assert got.shape == expected.shape, f"{case.op}: shape {got.shape}, numpy {expected.shape}"
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, expected, err_msg=f"{case.op} ({case.label})")
    else:
        np.testing.assert_allclose(got, expected, rtol=case.rtol, atol=1e-6,
                                   err_msg=f"{case.op} ({case.label})")


RANDOM_PROGRAM = """
import numpy as np, tinyflow as tf
nodes = [tf.random_normal((2000,), mean=1.0, stddev=2.0, seed=424242),
         tf.random_uniform((2000,), minval=-1.0, maxval=3.0, seed=434343),
         tf.truncated_normal((2000,), mean=1.0, stddev=2.0, seed=444444)]
sess = tf.Session()
first, second = sess.run(nodes), sess.run(nodes)
np.savez(OUT, a=first[0], u=first[1], a2=second[0], t=first[2])
"""


def test_random_sources_are_seeded_and_distributed(tmp_path):
    """Moments are right, every run draws anew, and a seeded program gives the same
    values in any fresh process (two processes run the same program)."""
    runs = []
    for k in range(2):
        out = tmp_path / f"run{k}.npz"
        subprocess.run([sys.executable, "-c", f"OUT = {str(out)!r}\n" + RANDOM_PROGRAM],
                       check=True, timeout=60)
        runs.append(np.load(out))
    a, u, a2 = runs[0]["a"], runs[0]["u"], runs[0]["a2"]
    assert a.dtype == np.float32 and a.shape == (2000,)
    assert abs(a.mean() - 1.0) < 0.2 and abs(a.std() - 2.0) < 0.2
    assert u.min() >= -1.0 and u.max() < 3.0 and abs(u.mean() - 1.0) < 0.15
    t = runs[0]["t"]   # truncated: within 2 std of the mean; its std is 0.88 of the normal's
    assert t.dtype == np.float32 and t.min() >= -3.0 and t.max() <= 5.0
    assert abs(t.mean() - 1.0) < 0.2 and abs(t.std() - 0.88 * 2.0) < 0.15
    assert not np.array_equal(a2, a), "a second run draws new values"
    for key in ("a", "u", "a2", "t"):
        np.testing.assert_array_equal(runs[1][key], runs[0][key])


# ----------------------------------------------------------------------------------
# Broadcasting, property-based
# ----------------------------------------------------------------------------------

BINARY = {"add": (lambda a, b: a + b, np.add), "sub": (lambda a, b: a - b, np.subtract),
          "mul": (lambda a, b: a * b, np.multiply), "maximum": (tf.maximum, np.maximum)}


@settings(max_examples=30)
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3),
       op=st.sampled_from(sorted(BINARY)), data=st.data())
def test_binary_ops_broadcast_like_numpy(shapes, op, data):
    build, numpy_fn = BINARY[op]
    (sa, sb), out_shape = shapes.input_shapes, shapes.result_shape
    a = data.draw(hnp.arrays(F64, sa, elements=st.floats(-3, 3)))
    b = data.draw(hnp.arrays(F64, sb, elements=st.floats(-3, 3)))
    pa, pb = tf.placeholder(F64, sa), tf.placeholder(F64, sb)
    y = build(pa, pb)
    assert tuple(y.shape) == out_shape
    w = np.linspace(-1, 1, int(np.prod(out_shape))).reshape(out_shape)
    ga, gb = tf.gradients(tf.reduce_sum(y * tf.constant(w, F64)), [pa, pb])
    value, grad_a, grad_b = session().run([y, ga, gb], {pa: a, pb: b})
    np.testing.assert_allclose(value, numpy_fn(a, b))
    # The gradient of broadcasting sums the broadcast axes back down.
    wide = np.broadcast_to
    local_a = {"add": 1.0, "sub": 1.0, "mul": wide(b, out_shape),
               "maximum": (wide(a, out_shape) >= wide(b, out_shape))}[op]
    local_b = {"add": 1.0, "sub": -1.0, "mul": wide(a, out_shape),
               "maximum": (wide(a, out_shape) < wide(b, out_shape))}[op]
    np.testing.assert_allclose(grad_a, sum_to_shape(w * local_a, sa), atol=1e-12)
    np.testing.assert_allclose(grad_b, sum_to_shape(w * local_b, sb), atol=1e-12)


def test_reductions_of_every_axis_combination_match_numpy():
    x = np.random.default_rng(3).standard_normal((2, 3, 4))
    p = tf.placeholder(F64, (None, 3, 4))
    sess = session()
    built = []  # keeps every node alive for the whole test
    for axes in [None, 0, 1, 2, -1, -2, (0, 1), (0, 2), (1, 2), (0, 1, 2), [2, 0]]:
        for keepdims in (False, True):
            for name, fn in (("sum", np.sum), ("mean", np.mean), ("max", np.max)):
                node = getattr(tf, f"reduce_{name}")(p, axes, keepdims=keepdims)
                built.append(node)
                numpy_axes = tuple(axes) if isinstance(axes, list) else axes
                np.testing.assert_allclose(
                    sess.run(node, {p: x}), fn(x, axis=numpy_axes, keepdims=keepdims),
                    rtol=1e-12, err_msg=f"reduce_{name} axis={axes} keepdims={keepdims}")


def test_one_session_runs_many_short_lived_graphs():
    """A new node may reuse the memory (and id()) of a freed one: the Session must
    still compile the new node, not return the old node's cached program."""
    p = tf.placeholder(F64, (2, 3))
    x = np.arange(6.0).reshape(2, 3)
    sess = session()
    for k in range(50):
        node = tf.reduce_sum(p, 1) if k % 2 else tf.reduce_max(p, 0)
        expected = x.sum(1) if k % 2 else x.max(0)
        np.testing.assert_array_equal(sess.run(node, {p: x}), expected, err_msg=f"run {k}")
        del node


def _as_float(x):
    """x in the float numpy computes exp() in (float16 for booleans and int8)."""
    return x.astype(np.exp(x).dtype)


UNARY_NUMPY = {"neg": (lambda x: -x, np.negative), "exp": (tf.exp, np.exp),
               "log": (tf.log, np.log), "sqrt": (tf.sqrt, np.sqrt), "tanh": (tf.tanh, np.tanh),
               "abs": (tf.abs, np.abs), "sign": (ops.sign, np.sign),
               "relu": (tf.nn.relu, lambda x: np.maximum(x, np.zeros((), x.dtype))),
               "sigmoid": (tf.sigmoid, lambda x: 1 / (1 + np.exp(-_as_float(x)))),
               "sum": (tf.reduce_sum, np.sum), "max": (tf.reduce_max, np.max),
               "softmax": (tf.nn.softmax, lambda x: np.exp(x) / np.exp(x).sum(-1))}
BINARY_NUMPY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
                "maximum": np.maximum, "pow": np.power}


@pytest.mark.parametrize("dtype", ["bool", "int8", "int32", "uint8", "float16", "float32"])
def test_dtype_rules_follow_numpy_for_every_input_dtype(dtype):
    """The dtype a rule infers is the one the kernel produces, as numpy would give it:
    exp of int32 is float64, true division of ints a float, a sum of booleans counts
    them. (A rule that says int while the kernel computes floats truncates them into
    planned int memory, or fails there.)"""
    x = np.array([1, 2, 3]).astype(dtype)
    p, q = tf.placeholder(dtype, (3,)), tf.placeholder(dtype, (3,))
    sess = session()
    built = []  # keeps every node alive (see test_one_session_runs_many_short_lived_graphs)
    for name, (build, reference) in UNARY_NUMPY.items():
        with np.errstate(all="ignore"):
            try:
                expected = np.asarray(reference(x))
            except TypeError:  # numpy has no kernel (minus of booleans): a build error
                with pytest.raises(tf.ShapeError):
                    build(p)
                continue
        node = build(p)
        built.append(node)
        got = sess.run(node, {p: x})
        assert node.dtype == got.dtype == expected.dtype, (
            f"{name} of {dtype}: inferred {node.dtype}, kernel {got.dtype}, numpy "
            f"{expected.dtype}")
        np.testing.assert_allclose(got.astype(F64), expected.astype(F64), rtol=1e-3,
                                   err_msg=f"{name} of {dtype}")
    for name, ufunc in BINARY_NUMPY.items():
        try:
            expected = ufunc(x, x)
        except TypeError:  # no kernel in numpy (booleans minus booleans)
            with pytest.raises(tf.ShapeError):
                getattr(ops, name)(p, q)
            continue
        node = getattr(ops, name)(p, q)
        built.append(node)
        got = sess.run(node, {p: x, q: x})
        assert node.dtype == got.dtype == expected.dtype, (
            f"{name} of two {dtype}: inferred {node.dtype}, kernel {got.dtype}, numpy "
            f"{expected.dtype}")
        np.testing.assert_allclose(got.astype(F64), expected.astype(F64), rtol=1e-3)


def test_getitem_shapes_with_unknown_dims():
    """Indexing a dim that is unknown at build time is checked when the feed comes;
    axes sliced from unknown dims stay unknown, the others are inferred exactly."""
    x = tf.placeholder(F64, (None, 3, 4))
    cases = [((2,), (3, 4)), ((-1, 0), (4,)), ((slice(1, None),), (None, 3, 4)),
             ((Ellipsis, None, 1), (None, 3, 1)), ((None, 0, slice(None, None, 2)), (1, 2, 4)),
             ((slice(None), 2, slice(1, 3)), (None, 2))]
    for index, expected in cases:
        assert tf.reshape(x, (-1, 3, 4))[index].shape == expected, index
        assert x[index].shape == expected, index
    with pytest.raises(tf.ShapeError, match="index 3 is out of bounds for axis 1"):
        x[:, 3]
    value = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(session().run(x[1, ::-1], {x: value}), value[1, ::-1])


def test_softmax_cross_entropy_is_stable_and_matches_log_softmax():
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]])
    labels = np.array([1, 2])
    pl, pt = tf.placeholder(F64, (2, 3)), tf.placeholder(tf.int64, (2,))
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(pl, pt)
    (grad,) = tf.gradients(tf.reduce_sum(loss), [pl])
    value, g = session().run([loss, grad], {pl: logits, pt: labels})
    np.testing.assert_allclose(value, [1000.0, np.log(3)], rtol=1e-12)
    probs = np.exp(log_softmax_reference(logits))
    np.testing.assert_allclose(g, probs - np.eye(3)[labels], atol=1e-12)
    assert np.all(np.isfinite(g))


DTYPE_SWEEP = ["bool", "int8", "int32", "uint8", "float16", "float32", "float64"]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c.op}-{c.label}")
def test_dtype_rule_and_kernel_agree_for_every_op_and_dtype(case):
    """Every op (FORWARD_CASES holds one for each registered core op, see
    test_every_op_has_a_forward_check) with its float inputs in every dtype: the op
    either refuses the dtype when it is built (a TinyFlowError naming op and line) or
    its kernel gives the dtype and shape its rule inferred, bitwise the same with and
    without the memory planner (a rule that says int while the kernel computes floats
    would have them truncated into planned int memory). Index inputs keep theirs."""
    from tinyflow.executor import ExecutionError
    for dtype in DTYPE_SWEEP:
        with np.errstate(all="ignore"):
            args = [a.astype(dtype) if a.dtype.kind == "f" else a for a in case.args]
        phs = [tf.placeholder(a.dtype, a.shape) for a in args]
        try:
            y = case.build(*phs)
        except tf.TinyFlowError:
            continue
        outs = []
        for opts in (dict(memory=None, passes=[]), dict()):
            try:
                with np.errstate(all="ignore"):
                    got = tf.Session(**opts).run(y, dict(zip(phs, args)))
            except ExecutionError:
                outs.append(None)
                continue
            where = f"{case.op} ({case.label}) on {dtype} with {opts}"
            assert got.dtype == y.dtype, f"{where}: rule {y.dtype}, kernel {got.dtype}"
            assert got.shape == tuple(y.shape), f"{where}: rule {y.shape}, kernel {got.shape}"
            outs.append(got)
        # Eager mode runs the same kernel at once: same dtype, same bits.
        from tinyflow import eager
        try:
            with np.errstate(all="ignore"):
                eager_out = case.build(*[eager.tensor(a) for a in args])
        except tf.TinyFlowError:
            eager_out = None
        if isinstance(eager_out, tf.Node):  # a source op (zeros, random): no input Tensor
            eager_out = outs[0]
        outs.append(None if eager_out is None else np.asarray(eager_out))
        if any(o is None for o in outs):
            assert all(o is None for o in outs), (
                f"{case.op} on {dtype}: fails with some options only (graph, planned, "
                f"eager: {[o is not None for o in outs]})")
            continue
        for what, other in (("planned", outs[1]), ("eager", outs[2])):
            assert other.dtype == outs[0].dtype, (
                f"{case.op} ({case.label}) on {dtype}: {what} gives {other.dtype}, "
                f"the graph {outs[0].dtype}")
            np.testing.assert_array_equal(other, outs[0],
                                          err_msg=f"{case.op} on {dtype} ({what})")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64", "bool"])
def test_max_pool_of_integers_and_booleans_pads_with_the_lowest_value(dtype):
    """SAME padding pads with the dtype's lowest value: -inf for floats only. It
    failed for ints ('cannot convert float infinity to integer'), and for booleans
    -inf became True, so a window reaching the padding of an all-False x was True."""
    x = np.arange(-6, 9).reshape(1, 1, 3, 5).astype(dtype)
    if dtype == "bool":
        x = np.zeros((1, 1, 3, 5), bool)
    ph = tf.placeholder(x.dtype, x.shape)
    y = tf.nn.max_pool(ph, [1, 3, 3, 1], [1, 2, 2, 1], "SAME")
    expected = max_pool_reference(x.astype(np.float64), (3, 3), (2, 2), "SAME").astype(dtype)
    for opts in (dict(passes=[], memory=None), dict()):
        got = tf.Session(**opts).run(y, {ph: x})
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got, expected)


def test_reshape_copying_an_unknown_dim_still_resolves_minus_one():
    """(?, 4, 1, 1) reshaped to (0, -1) is (?, 4): the copied unknown dim cancels
    (the rule returned (?, -1), and a matmul after it failed to build)."""
    x = tf.placeholder(tf.float32, (None, 4, 1, 1))
    assert tf.reshape(x, (0, -1)).shape == (None, 4)
    assert tf.reshape(x, (0, 2, -1)).shape == (None, 2, 2)
    y = tf.placeholder(tf.float32, (None, None, 3))
    assert tf.reshape(y, (0, -1)).shape == (None, None)
    w = tf.matmul(tf.reshape(x, (0, -1)), tf.ones((4, 5)))
    assert w.shape == (None, 5)


def test_stop_gradient_passes_the_value_and_no_gradient():
    x = tf.placeholder(np.float32, (3,), name="x")
    y = tf.stop_gradient(x * 2.0) * x + x
    (gx,) = tf.gradients(tf.reduce_sum(y), [x])
    xv = np.array([1.0, -2.0, 3.0], np.float32)
    value, grad = tf.Session().run([y, gx], {x: xv})
    np.testing.assert_array_equal(value, xv * 2.0 * xv + xv)
    np.testing.assert_array_equal(grad, xv * 2.0 + 1.0)   # only the path outside it


def test_mean_over_nothing_is_nan_without_numpys_warnings(recwarn):
    # numpy's "Mean of empty slice" and "invalid value encountered in divide"
    # RuntimeWarnings reached the user on an empty batch.
    x = tf.placeholder(np.float32, (None, 3))
    got = session().run([tf.reduce_mean(x), tf.reduce_mean(x, 0), tf.reduce_mean(x, 1)],
                        {x: np.zeros((0, 3), np.float32)})
    assert np.isnan(got[0]) and got[0].dtype == np.float32
    assert np.isnan(got[1]).all() and got[1].shape == (3,) and got[2].shape == (0,)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_uint64_index_beyond_int64_is_out_of_range_not_a_row_from_the_end():
    # Numerics probe: the cast to int64 wrapped 2**64 - 1 to -1, the last row.
    params = tf.constant(np.arange(8.0).reshape(4, 2))
    picked = tf.gather(params, tf.constant(np.array([2**64 - 1], np.uint64)))
    with pytest.raises(ExecutionError, match=r"index 18446744073709551615 is out of range"):
        tf.Session().run(picked)
