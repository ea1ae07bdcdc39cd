"""The library's gradient checker catches a wrong gradient and names where."""

from __future__ import annotations

import re

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.gradcheck import GradientCheckError, check_gradients
from tinyflow.ops import OpDef, infer_same, make, register

# An op whose gradient rule is wrong on purpose: d(x^2)/dx is 2x, the rule says x.
# (Its kernel lives in this test module, so the registry-wide op checks of
# tests/test_ops.py, which look at tinyflow's own kernels, ignore it.)
WRONG = register(OpDef("gradcheck_test_square", lambda xp, x, out=None: x * x, infer_same,
                       lambda n, g: [g * n.inputs[0]]))


def test_a_correct_gradient_passes():
    rng = np.random.default_rng(0)
    check_gradients(lambda x, w: tf.tanh(tf.matmul(x, w)),
                    [rng.standard_normal((3, 4)), rng.standard_normal((4, 2))])


def test_a_wrong_gradient_names_op_argument_index_expected_and_got():
    x = np.array([[0.5, -1.0], [2.0, 0.25]])
    with pytest.raises(GradientCheckError) as err:
        check_gradients(lambda a, b: a + make(WRONG.name, b), [x, x.copy()])
    message = str(err.value)
    # argument 0 (a + ...) is right; argument 1 goes through the wrong rule.
    assert "op 'add'" in message and "argument 1, element (0, 0)" in message
    # Both values carry the loss's random weight for element (0, 0); their ratio is
    # the true slope 2x over the wrong rule's x: 2.
    expected, got = map(float, re.search(r"expected (\S+) \(central differences\), "
                                         r"got (\S+) \(tf.gradients\)", message).groups())
    assert expected / got == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(GradientCheckError, match="op 'square_op' \\(case 'mine'\\)"):
        check_gradients(lambda a: make(WRONG.name, a), [x], op="square_op", label="mine")


def test_fixed_arguments_are_fed_not_perturbed_and_inputs_are_not_changed():
    logits = np.random.default_rng(1).standard_normal((4, 3))
    labels = np.array([0, 2, 1, 2])
    before = logits.copy()
    check_gradients(lambda z, y: tf.nn.sparse_softmax_cross_entropy_with_logits(z, y),
                    [logits, labels], fixed=[1])
    np.testing.assert_array_equal(logits, before)


def test_bad_setups_are_named():
    with pytest.raises(GradientCheckError, match="argument 1 is int64"):
        check_gradients(lambda z, y: z * tf.cast(y, tf.float64),
                        [np.ones(3), np.arange(3)])
    with pytest.raises(GradientCheckError, match="must return a graph node"):
        check_gradients(lambda z: 3.0, [np.ones(3)])
    assert issubclass(GradientCheckError, tf.TinyFlowError)
