"""tf.function keeps eager mode's autograd rules: each case runs the same Python
function eagerly and traced, and the two must agree (the same values, or the same
kind of error). Found by an adversarial probe of eager mode and tracing; before
the fixes, each traced run here gave an answer where eager mode raised, or a
gradient that silently missed a path.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import eager
from tinyflow.eager import EagerError


def both(fn):
    """The function itself and a fresh tf.function of it."""
    return [("eager", fn), ("traced", tf.function(fn))]


def test_backward_through_a_traced_result_is_an_error_not_a_missed_path():
    # The traced result kept no history: `fn(x, w) + (w * w).sum()` sent gradient
    # only through the second term (w.grad = 2w instead of x + 2w).
    def f(x, w):
        return (x * w).sum()

    w = eager.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    x = eager.tensor(np.array([4.0, 5.0, 6.0]))
    (f(x, w) + (w * w).sum()).backward()
    np.testing.assert_array_equal(w.grad.numpy(), [6.0, 9.0, 12.0])

    traced = tf.function(f)
    w = eager.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    y = traced(x, w)
    assert y.requires_grad and not y.is_leaf      # as eager's result
    with pytest.raises(EagerError, match="result of a call of tf.function f"):
        (y + (w * w).sum()).backward()
    assert w.grad is None                          # nothing half accumulated
    with eager.no_grad():                          # no history asked: none given
        assert not traced(x, w).requires_grad
    assert traced(x, w).item() == 32.0             # its value is there as ever


def test_a_traced_step_that_calls_backward_inside_still_returns_its_loss():
    def step(w):
        loss = (w * w).sum()
        loss.backward()
        return loss

    w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
    loss = tf.function(step)(w)
    assert loss.item() == 5.0
    np.testing.assert_array_equal(w.grad.numpy(), [2.0, 4.0])


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_a_second_backward_needs_retain_graph_traced_too(mode):
    def twice(w):
        y = (w * w).sum()
        y.backward()
        y.backward()
        return y

    def shared(w):               # two losses over one subgraph
        h = w * w
        h.sum().backward()
        (h * 2.0).sum().backward()
        return h

    for fn in (twice, shared):
        run = dict(both(fn))[mode]
        w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
        with pytest.raises(EagerError, match="backward through a graph a second time"):
            run(w)


def test_retain_graph_lets_a_traced_backward_run_twice_as_eagerly():
    def twice(w):
        y = (w * w).sum()
        y.backward(retain_graph=True)
        y.backward()
        return y

    grads = []
    for _, fn in both(twice):
        w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
        fn(w)
        grads.append(w.grad.numpy())
    np.testing.assert_array_equal(grads[0], [4.0, 8.0])
    np.testing.assert_array_equal(grads[1], grads[0])


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_a_value_written_after_its_op_used_it_stops_a_traced_backward(mode):
    def step(w, x):
        y = (w * x).sum()
        x.add_(1.0)            # mul's gradient for w reads x as mul saw it
        y.backward()
        return y

    run = dict(both(step))[mode]
    w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
    with pytest.raises(EagerError, match=r"written in place afterwards"):
        run(w, eager.tensor(np.array([3.0, 4.0])))


def test_a_write_the_gradient_does_not_read_is_allowed_traced_as_eagerly():
    def step(w, x):
        y = (w + x).sum()      # add's gradient reads neither input
        x.add_(1.0)
        y.backward()
        return y

    grads = []
    for _, fn in both(step):
        w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
        fn(w, eager.tensor(np.array([3.0, 4.0])))
        grads.append(w.grad.numpy())
    np.testing.assert_array_equal(grads[0], [1.0, 1.0])
    np.testing.assert_array_equal(grads[1], grads[0])


def test_the_traced_error_names_both_lines():
    @tf.function
    def step(w, x):
        y = (w * x).sum()
        x.add_(1.0)
        y.backward()
        return y

    w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
    with pytest.raises(EagerError, match=r"test_traced_semantics.py:\d+.*"
                                         r"test_traced_semantics.py:\d+"):
        step(w, eager.tensor(np.array([3.0, 4.0])))


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_a_seed_of_another_shape_is_refused_traced_too(mode):
    def step(w):
        y = w * w
        y.backward(eager.tensor(np.array([1.0])))
        return y

    run = dict(both(step))[mode]
    w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
    with pytest.raises(EagerError, match=r"gradient has shape \(1,\), the Tensor \(2,\)"):
        run(w)


Out = collections.namedtuple("Out", "loss logits")


def test_a_namedtuple_result_comes_back_a_namedtuple():
    def f(x):
        return Out(x.sum(), x * 2.0)

    x = eager.tensor(np.array([1.0, 2.0]))
    for _, fn in both(f):
        out = fn(x)
        assert type(out) is Out
        assert out.loss.item() == 3.0
        np.testing.assert_array_equal(out.logits.numpy(), [2.0, 4.0])


def test_an_object_holding_a_traced_tensor_is_refused():
    @dataclasses.dataclass
    class Result:
        loss: object

    @tf.function
    def f(x):
        return Result(x.sum())

    with pytest.raises(EagerError, match="returned a Result holding a traced Tensor"):
        f(eager.tensor(np.array([1.0, 2.0])))


def test_tensors_in_tuples_and_lists_are_inputs_not_identities():
    # A tuple of Tensors was a Python value keyed by the Tensors' identity: every
    # call with new Tensors traced again, and the cache kept every one alive.
    @tf.function
    def f(pair, scales):
        a, b = pair
        return a * b * scales[0] + scales[1]

    for i in range(5):
        a, b = eager.tensor(np.full(3, float(i))), eager.tensor(np.full(3, 2.0))
        out = f((a, b), [eager.tensor(np.ones(3)), 0.5])
        np.testing.assert_array_equal(out.numpy(), np.full(3, 2.0 * i + 0.5))
    assert len(f.traces) == 1
    assert "arguments nested as tuple(x, x), list(x, x)" in f.explain()
    f((a, b), [eager.tensor(np.ones(3)), 0.25])     # a new Python value: a new trace
    assert len(f.traces) == 2


def test_a_leaf_made_inside_a_traced_function_traces_once():
    # `delta = tensor(0, requires_grad=True)` inside the function was a Tensor from
    # outside after the first call, whose .grad then broke the guard on every call.
    def attack(x):
        delta = eager.tensor(np.zeros(2), requires_grad=True)
        ((x + delta) ** 2).sum().backward()
        return delta.grad

    traced = tf.function(attack)
    for i in range(4):
        x = eager.tensor(np.array([1.0, 2.0]) * i)
        np.testing.assert_array_equal(traced(x).numpy(), attack(x).numpy())
    assert len(traced.traces) == 1


def test_a_decorated_method_gets_its_instance():
    class Model:
        def __init__(self, scale: float) -> None:
            self.w = eager.tensor(np.array([1.0, 2.0]) * scale)

        @tf.function
        def forward(self, x):
            return (self.w * x).sum()

    x = eager.tensor(np.array([3.0, 4.0]))
    model = Model(1.0)
    assert model.forward(x).item() == 11.0
    assert Model(2.0).forward(x).item() == 22.0
    model.forward(x)
    assert "1 trace(s)" in model.forward.explain()   # its own traces, kept with it
    assert isinstance(Model.forward, tf.function(lambda: None).__class__)


def test_a_method_of_an_unhashable_instance_is_traced_and_freed_with_it():
    # The instance was a Python value of each call, in the cache key: a dataclass
    # (unhashable) was refused, and the cache kept every instance alive.
    import gc
    import weakref

    @dataclasses.dataclass
    class Scale:
        w: object

        @tf.function
        def __call__(self, x):
            return self.w * x

    scale = Scale(eager.tensor(np.array([2.0])))
    np.testing.assert_array_equal(scale(eager.tensor(np.array([3.0]))).numpy(), [6.0])
    gone = weakref.ref(scale)
    del scale
    gc.collect()
    assert gone() is None


def test_nested_arguments_are_named_by_their_place_in_messages():
    @tf.function
    def f(pair):
        return pair[0] * 2.0

    a = eager.tensor(np.ones(2))
    f((a, a))
    f((a, eager.tensor(np.ones(2))))
    assert "argument 0[1] is ((2,), '<f8', False, True); traced for the same as " \
        "argument 0[0]" in f.explain()
    f([a, a])
    assert "the arguments are (list(x, x)); traced for (tuple(x, x))" in f.explain()

    @tf.function
    def write(pair):
        pair[1].add_(1.0)

    with pytest.raises(EagerError, match=r"into argument 0\[1\], a numpy array"):
        write((a, np.ones(2)))


def test_dicts_are_opened_and_other_tuple_subclasses_are_values():
    class Pair(tuple):
        def __new__(cls, a, b):
            return super().__new__(cls, (a, b))

    @tf.function
    def f(weights, pair):
        return {"y": weights["w"] * float(pair[0])}

    out = f({"w": eager.tensor(np.array([1.5]))}, Pair(2, 3))
    np.testing.assert_array_equal(out["y"].numpy(), [3.0])
    f({"w": eager.tensor(np.array([2.5]))}, Pair(2, 3))
    assert len(f.traces) == 1


def test_session_run_gives_a_namedtuple_back_too():
    x = tf.constant(2.0)
    got = tf.Session().run(Out(x, x * 3.0))
    assert type(got) is Out and got.logits == 6.0


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_a_second_backward_adds_into_the_grad_in_place(mode):
    # PyTorch's AccumulateGrad: `g = w.grad` held across a backward sees the sum
    # (the sum was a new Tensor, and g kept the first gradient).
    def step(w):
        (w * w).sum().backward()
        return w.grad

    run = dict(both(step))[mode]
    w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
    first = run(w)
    held = w.grad
    run(w)
    assert w.grad is held
    np.testing.assert_array_equal(held.numpy(), [4.0, 8.0])
    if mode == "eager":
        assert first is held


def test_a_grad_set_or_widened_is_a_new_tensor_traced_as_eagerly():
    def reset_then_backward(w):
        w.grad = None
        (w * w).sum().backward()
        return w.grad

    def widening(w, x):            # a float32 .grad plus a float64 gradient
        (w * x).sum().backward()
        return w.grad

    for fn, extra in ((reset_then_backward, ()), (widening, (np.array([3.0, 4.0]),))):
        results = []
        for _, run in both(fn):
            w = eager.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
            w.grad = eager.tensor(np.array([10.0, 10.0], np.float32))
            held = w.grad
            run(w, *[eager.tensor(e) for e in extra])
            results.append((w.grad is held, w.grad.dtype, w.grad.numpy().tolist(),
                            held.numpy().tolist()))
        assert results[0] == results[1], results
        assert results[0][0] is False


def test_create_graph_keeps_the_sum_out_of_place():
    w = eager.tensor(np.array([1.0, 2.0]), requires_grad=True)
    (w * w * w).sum().backward(create_graph=True)
    held = w.grad
    (w * w * w).sum().backward(create_graph=True)
    assert w.grad is not held and w.grad.requires_grad
    np.testing.assert_array_equal(w.grad.numpy(), [6.0, 24.0])


def test_a_method_called_through_its_class_and_a_classmethod_work():
    # Model.forward(m, x) keyed the cache by the instance (kept alive for ever), and
    # @classmethod over @tf.function raised a raw TypeError (a class's mappingproxy).
    import gc
    import weakref

    class Model:
        def __init__(self, scale: float) -> None:
            self.w = eager.tensor(np.array([scale]))

        @tf.function
        def forward(self, x):
            return self.w * x

        @classmethod
        @tf.function
        def triple(cls, x):
            return x * 3.0

    x = eager.tensor(np.array([2.0]))
    model = Model(1.5)
    assert Model.forward(model, x).item() == 3.0
    assert model.forward(x).item() == 3.0
    assert "1 trace(s)" in model.forward.explain()       # the same Function both ways
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
    assert Model.triple(x).item() == 6.0
    assert Model(2.0).triple(x).item() == 6.0
