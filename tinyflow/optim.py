"""Optimizers (tf.train): parameter updates as graph nodes.

`minimize(loss)` builds the gradient graph (autodiff.py) and, for each trainable
Variable, the nodes that compute its new value and `assign` it. The result is one
`group` node: running it runs a whole training step (forward, backward, update) as
one compiled program, so the passes and the memory planner see the updates too.

SGD, momentum (Polyak 1964; as in PyTorch; Nesterov's in TF1's form), Adagrad (Duchi
et al. 2011), RMSProp (Hinton's lecture notes; TF1's form), Adam (Kingma & Ba 2015)
with optional decoupled weight decay (AdamW, Loshchilov & Hutter 2019).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinyflow import api, ops
from tinyflow.autodiff import gradients
from tinyflow.graph import Node, reachable


class Optimizer:
    """Base: compute_gradients + apply_gradients = minimize (TF1's split)."""

    def __init__(self, learning_rate: float | Node, weight_decay: float = 0.0) -> None:
        # A node (a schedule) is taken as it is; a number is checked here, where the
        # line is the user's: a NaN or infinite rate trained every weight to NaN
        # without a word, and a string failed later inside minimize.
        if not isinstance(learning_rate, Node):
            learning_rate = _hyper(self, "learning_rate", learning_rate, 0.0, None)
        self.learning_rate = learning_rate
        self.weight_decay = _hyper(self, "weight_decay", weight_decay, 0.0, None)
        # The slot Variables made so far: variable -> {slot name: slot} (TF1's get_slot)
        self._slots: dict[Node, dict[str, Node]] = {}

    def get_slot_names(self) -> list[str]:
        """TF1's get_slot_names: the names of the slots this optimizer made so far
        ("momentum"; Adam's "m" and "v")."""
        return sorted({name for slots in self._slots.values() for name in slots})

    def get_slot(self, var: Node, name: str) -> Node | None:
        """TF1's get_slot: the slot Variable `name` this optimizer made for `var`
        (the latest, if it updated var twice), or None."""
        return self._slots.get(var, {}).get(name)

    def compute_gradients(self, loss: Node, var_list: Sequence[Node] | None = None
                          ) -> list[tuple[Node, Node]]:
        """[(gradient, variable)] for the trainable variables `loss` depends on."""
        _check_loss(self, "compute_gradients", loss)
        if var_list is None:
            under = {id(n) for n in reachable([loss])}
            var_list = [v for v in api.trainable_variables() if id(v) in under]
        grads = gradients(loss, list(var_list))
        return [(g, v) for g, v in zip(grads, var_list) if g is not None]

    def apply_gradients(self, grads_and_vars: Sequence[tuple[Node, Node]]) -> Node:
        return api.group(*[self._update(g, v) for g, v in grads_and_vars])

    def minimize(self, loss: Node, var_list: Sequence[Node] | None = None) -> Node:
        """One training step: the updates of the variables, and the layers' own
        updates (batch normalization's moving statistics) of the layers under loss."""
        _check_loss(self, "minimize", loss)
        step = self.apply_gradients(self.compute_gradients(loss, var_list))
        under = {id(n) for n in reachable([loss])}
        layer_updates = [u for u, source in api.update_ops if id(source) in under]
        return api.group(step, *layer_updates) if layer_updates else step

    def _update(self, grad: Node, var: Node) -> Node:
        raise NotImplementedError

    def _slot(self, var: Node, name: str, fill: float = 0.0) -> Node:
        """A Variable shaped like `var`, all `fill` at first (momentum, Adam's moments
        start at 0, RMSProp's mean square at 1, Adagrad's sum at 0.1, as in TF1).

        When `var`'s shape is not known yet (a `tf.nn.linear` weight before
        `tf.infer_variable_shapes`), the slot starts as zeros_like(var), as in the
        original TinyFlow: it takes var's shape when the initializer first runs.
        """
        if var.shape is None or None in var.shape:
            init = ops.zeros_like(var)
        else:
            init = ops.zeros(var.shape, var.dtype)
        if fill:
            init = init + fill
        slot = api.Variable(init, name=f"{var.name}/{name}", trainable=False)
        self._slots.setdefault(var, {})[name] = slot
        return slot


def _check_loss(optimizer: Optimizer, method: str, loss: object) -> None:
    # minimize(3.0), or a loss left None, failed inside the graph walk as
    # "'float' object has no attribute 'inputs'" (an AttributeError).
    if not isinstance(loss, Node):
        raise ops.argument_error(f"{type(optimizer).__name__}.{method}",
                                 f"loss must be a graph node (built with tf ops), got "
                                 f"{loss!r}")


def _hyper(optimizer: Optimizer, arg: str, value: object, low: float,
           below: float | None) -> float:
    """`value` as a finite number >= low (and < below, if given), as PyTorch checks."""
    op = type(optimizer).__name__
    value = ops.float_attr(op, arg, value, low=low)
    if below is not None and value >= below:
        raise ops.argument_error(op, f"{arg} must be [{low:g}, {below:g}), got {value!r}")
    return value


class GradientDescentOptimizer(Optimizer):
    """var -= lr * (grad + weight_decay * var)"""

    def _update(self, grad: Node, var: Node) -> Node:
        if self.weight_decay:
            grad = grad + self.weight_decay * var
        return api.assign(var, var - self.learning_rate * grad)


class MomentumOptimizer(Optimizer):
    """velocity = momentum * velocity + grad;  var -= lr * velocity (TF1's and
    PyTorch's form). With use_nesterov, TF1's Nesterov form: the step looks one
    velocity ahead, var -= lr * (grad + momentum * velocity)."""

    def __init__(self, learning_rate: float | Node, momentum: float = 0.9,
                 weight_decay: float = 0.0, use_nesterov: bool = False) -> None:
        super().__init__(learning_rate, weight_decay)
        self.momentum = _hyper(self, "momentum", momentum, 0.0, None)
        self.use_nesterov = ops.bool_attr("MomentumOptimizer", "use_nesterov", use_nesterov)

    def _update(self, grad: Node, var: Node) -> Node:
        if self.weight_decay:
            grad = grad + self.weight_decay * var
        velocity = self._slot(var, "momentum")
        new_velocity = api.assign(velocity, self.momentum * velocity + grad)
        if self.use_nesterov:
            step = grad * self.learning_rate + new_velocity * self.momentum * self.learning_rate
            return api.assign(var, var - step)
        return api.assign(var, var - self.learning_rate * new_velocity)


class AdagradOptimizer(Optimizer):
    """Adagrad (Duchi et al. 2011), TF1's form: every weight's step shrinks with the
    squares of its gradients so far.

        accum += g^2;   var -= lr * g / sqrt(accum)     (accum starts at 0.1)
    """

    def __init__(self, learning_rate: float | Node, initial_accumulator_value: float = 0.1
                 ) -> None:
        super().__init__(learning_rate)
        # 0 would divide the first step by sqrt(0): every weight NaN or inf.
        self.initial_accumulator_value = _hyper(self, "initial_accumulator_value",
                                                initial_accumulator_value, 0.0, None)
        if self.initial_accumulator_value == 0.0:
            raise ops.argument_error("AdagradOptimizer", "initial_accumulator_value must be "
                                                         "above 0, got 0.0")

    def _update(self, grad: Node, var: Node) -> Node:
        accum = self._slot(var, "accumulator", self.initial_accumulator_value)
        new_accum = api.assign(accum, accum + grad * grad)
        return api.assign(var, var - self.learning_rate * grad / ops.sqrt(new_accum))


class RMSPropOptimizer(Optimizer):
    """RMSProp (Hinton's lecture 6e), TF1's form: divide the step by a running root
    mean square of the gradients (starting at 1, as TF1's slot does).

        ms = decay ms + (1 - decay) g^2;   mom = momentum mom + lr g / sqrt(ms + eps)
        var -= mom

    With centered=True the mean square is taken about the running mean gradient mg:
    sqrt(ms - mg^2 + eps).
    """

    def __init__(self, learning_rate: float | Node, decay: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-10, centered: bool = False) -> None:
        super().__init__(learning_rate)
        self.decay = _hyper(self, "decay", decay, 0.0, 1.0)
        self.momentum = _hyper(self, "momentum", momentum, 0.0, None)
        self.epsilon = _hyper(self, "epsilon", epsilon, 0.0, None)
        self.centered = ops.bool_attr("RMSPropOptimizer", "centered", centered)

    def _update(self, grad: Node, var: Node) -> Node:
        dtype = np.dtype(var.dtype or np.float32)
        rest = one_minus(self.decay, dtype)
        ms = self._slot(var, "rms", 1.0)
        new_ms = api.assign(ms, self.decay * ms + rest * grad * grad)
        spread = new_ms
        if self.centered:
            mg = self._slot(var, "mg")
            new_mg = api.assign(mg, self.decay * mg + rest * grad)
            spread = new_ms - new_mg * new_mg
        mom = self._slot(var, "momentum")
        new_mom = api.assign(mom, self.momentum * mom
                             + self.learning_rate * grad / ops.sqrt(spread + self.epsilon))
        return api.assign(var, var - new_mom)


class AdamOptimizer(Optimizer):
    """Adam with bias correction folded into the step size:

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        var -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

    `weight_decay` is decoupled (AdamW): var -= lr * weight_decay * var.
    """

    def __init__(self, learning_rate: float | Node = 0.001, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-8, weight_decay: float = 0.0
                 ) -> None:
        super().__init__(learning_rate, weight_decay)
        # beta 1.0 divides by 1 - beta^t = 0: every weight NaN after the first step.
        self.beta1 = _hyper(self, "beta1", beta1, 0.0, 1.0)
        self.beta2 = _hyper(self, "beta2", beta2, 0.0, 1.0)
        self.epsilon = _hyper(self, "epsilon", epsilon, 0.0, None)

    def apply_gradients(self, grads_and_vars: Sequence[tuple[Node, Node]]) -> Node:
        self._step_sizes: dict[np.dtype, Node] = {}
        return super().apply_gradients(grads_and_vars)

    def _step_size(self, dtype: np.dtype) -> Node:
        """lr * sqrt(1 - b2^t) / (1 - b1^t), computed in `dtype` (TF1 does it in the
        variable's dtype). One step counter per dtype, shared by every variable of
        that dtype; each update reads the counter's new value."""
        if dtype not in self._step_sizes:
            name = "adam_step" if not self._step_sizes else f"adam_step_{dtype.name}"
            step = api.Variable(np.zeros((), dtype), name=name, trainable=False)
            t = api.assign(step, step + 1.0)
            one = dtype.type(1.0)
            self._step_sizes[dtype] = self.learning_rate * ops.sqrt(
                one - ops.power(self.beta2, t)) / (one - ops.power(self.beta1, t))
        return self._step_sizes[dtype]

    def _update(self, grad: Node, var: Node) -> Node:
        m, v = self._slot(var, "m"), self._slot(var, "v")
        dtype = np.dtype(var.dtype or np.float32)
        new_m = api.assign(m, self.beta1 * m + one_minus(self.beta1, dtype) * grad)
        new_v = api.assign(v, self.beta2 * v + one_minus(self.beta2, dtype) * grad * grad)
        step_size = self._step_size(dtype)
        step = step_size * new_m / (ops.sqrt(new_v) + self.epsilon)
        if self.weight_decay:
            step = step + self.learning_rate * self.weight_decay * var
        return api.assign(var, var - step)


def one_minus(beta: float, dtype: np.dtype) -> float:
    """1 - beta as the variable's dtype computes it (TF1 does): in float32, 1 - 0.999f
    is 1.0000467e-3, not 1e-3. The bias correction's 1 - beta^t is computed in that
    dtype too, so at t = 1 the two are the same number and cancel exactly; with
    1 - beta rounded from Python's float64 they differed by 5e-5, and an Adam step
    was 5x further from the exact one than TF1's."""
    return float(dtype.type(1.0) - dtype.type(beta))


SGD = GradientDescentOptimizer
Momentum = MomentumOptimizer
Adam = AdamOptimizer
Adagrad = AdagradOptimizer
RMSProp = RMSPropOptimizer

# tf.train.Saver lives in saver.py (checkpoints of Variables); TF1 spells it here.
from tinyflow.saver import CheckpointError, Saver  # noqa: E402, F401
