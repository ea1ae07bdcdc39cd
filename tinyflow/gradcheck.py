"""The gradient checker: tf.gradients against central finite differences.

Every op's gradient rule is hand-written, so every one can be wrong. The check that
catches it is the oldest in the field: perturb one input element by +-eps, run the
graph twice, and compare the slope (f(x + eps) - f(x - eps)) / 2 eps with what
autodiff says, element by element. minitorch ships the same check to its students
(`minitorch.grad_check`), and so does PyTorch (`torch.autograd.gradcheck`).

    from tinyflow.gradcheck import check_gradients
    check_gradients(lambda x, w: tf.tanh(tf.matmul(x, w)), [x_value, w_value])

The output is reduced to a scalar with random weights, sum(w * y), so that every
output element's gradient is seen with a different factor (a plain sum would hide a
gradient that is wrong by a permutation). A failure raises `GradientCheckError`
naming the op, the argument, the element index, the expected (finite-difference)
and the got (autodiff) value. Use float64 inputs: in float32 the rounding error of
the difference is of the order of the slope itself.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from tinyflow import api, ops
from tinyflow.autodiff import gradients
from tinyflow.errors import TinyFlowError
from tinyflow.session import Session
from tinyflow.graph import Node


class GradientCheckError(TinyFlowError, AssertionError):
    """autodiff and finite differences disagree (or the check was set up wrongly)."""


def check_gradients(build: Callable[..., Node], args: Sequence[Any], *,
                    fixed: Collection[int] = (), eps: float = 1e-6, rtol: float = 1e-5,
                    atol: float = 1e-7, rng: np.random.Generator | None = None,
                    op: str | None = None, label: str = "",
                    session_options: dict | None = None) -> None:
    """Check the gradient of ``build(*placeholders)`` with respect to each argument.

    args     one array per placeholder `build` takes (copied: never changed)
    fixed    indices of arguments that are fed but not perturbed (labels, indices,
             conditions); every other argument must be a float64 array
    eps      the finite-difference step; rtol, atol: how close the two must be
    rng      draws the weights of the scalar loss (default: seed 0)
    op       the name failures give (default: the op of the node `build` returns)
    label    a case label for the failure message

    Raises GradientCheckError at the first element that disagrees.
    """
    values = [np.array(a) for a in args]
    free = [i for i in range(len(values)) if i not in set(fixed)]
    _check_inputs(values, free)
    placeholders = [api.placeholder(v.dtype, v.shape) for v in values]
    y = build(*placeholders)
    if not isinstance(y, Node) or y.shape is None or None in y.shape:
        raise GradientCheckError(f"check_gradients: build must return a graph node of "
                                 f"known shape, got {y!r}")
    name = f"{op or y.op!r}" + (f" (case {label!r})" if label else "")
    rng = rng if rng is not None else np.random.default_rng(0)
    weights = rng.standard_normal(y.shape)
    loss = api.reduce_sum(ops.cast(y, np.float64) * ops.constant(weights, np.float64))
    session = Session(**(session_options or {}))
    feed = dict(zip(placeholders, values))
    got = _autodiff(session, loss, [placeholders[i] for i in free], feed)
    for i, grad in zip(free, got):
        if grad.shape != values[i].shape:
            raise GradientCheckError(f"gradient check failed for op {name}: the gradient "
                                     f"of argument {i} has shape {grad.shape}, but the "
                                     f"argument has shape {values[i].shape}")
        _compare(lambda: session.run(loss, feed), values[i], grad, i, name, eps, rtol, atol)


def _autodiff(session: Session, loss: Node, xs: list[Node], feed: dict) -> list[np.ndarray]:
    """tf.gradients of `loss` for each of `xs`, run once; zeros where the loss does not
    depend on an input (tf.gradients gives None there)."""
    grads = gradients(loss, xs)
    wanted = [g for g in grads if g is not None]
    computed = iter(session.run(wanted, feed) if wanted else [])
    return [np.zeros(x.shape, x.dtype) if g is None else next(computed)
            for x, g in zip(xs, grads)]


def _check_inputs(values: list[np.ndarray], free: list[int]) -> None:
    for i in free:
        if values[i].dtype != np.float64:
            raise GradientCheckError(
                f"check_gradients: argument {i} is {values[i].dtype}; perturbed "
                "arguments must be float64 (list labels and indices in `fixed`)")


def _compare(run_loss: Callable[[], Any], x: np.ndarray, got: np.ndarray, i: int,
             name: str, eps: float, rtol: float, atol: float) -> None:
    """Central differences of the loss for every element of `x` (fed by reference,
    perturbed in place and restored) against autodiff's `got`."""
    for index in np.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + eps
        plus = run_loss()
        x[index] = saved - eps
        minus = run_loss()
        x[index] = saved
        expected = (plus - minus) / (2 * eps)
        if not np.isclose(got[index], expected, rtol=rtol, atol=atol):
            raise GradientCheckError(
                f"gradient check failed for op {name}: argument {i}, element {index}: "
                f"expected {expected:.8g} (central differences), got {got[index]:.8g} "
                f"(tf.gradients); input value {saved:.6g}")
