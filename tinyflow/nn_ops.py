"""Neural-network ops: bias, softmax, losses, layer norm, dropout.

They register into the same registry as ops.py (one dict for all ops); they live in
their own file only so that each file reads in one sitting. Convolution and pooling
are in image_ops.py.
"""

from __future__ import annotations


import numpy as np

from tinyflow import backend
from tinyflow.graph import Node, ShapeError, user_source_line
from tinyflow.shape_ops import expand_dims
from tinyflow.ops import (
    OpDef,
    Mismatch,
    Operand,
    argument_error,
    float_attr,
    infer_same,
    int_like,
    normalize_axes,
    result_dtype,
    cast,
    exp,
    float_dtype,
    make,
    ones_like,
    reduce_sum,
    register,
    sum_to_like,
    zero_gradient,
    zeros_like,
)

# bias_add (the original TinyFlow's): add a (C,) bias along one axis of x, its
# attribute `axis`: 1 by default, the channel axis of NCHW images and the feature
# axis of (N, C) matrices; the last axis for TF1's channels-last tensors such as
# (batch, time, features) (nn.bias_add picks it from data_format). Negative axes
# count from the end, for an x whose rank is not known when the graph is built.

def bias_axis(attrs: dict, rank: int) -> int:
    """bias_add's axis as a dimension of an x of `rank` (a Mismatch if out of range)."""
    (axis,) = normalize_axes(attrs.get("axis", 1), rank)
    return axis


def bias_along_last_axis(node: Node) -> bool:
    """Whether bias_add `node` (its shape known) adds its bias along x's last axis,
    as a (C,) array broadcasts from the right (the passes and the ONNX export ask)."""
    rank = len(node.shape)
    return rank >= 2 and bias_axis(node.attrs, rank) == rank - 1


def _bias_axis_check(attrs: dict, dtypes: list) -> None:
    """`axis`, when given, is an int."""
    if not int_like(attrs.get("axis", 1)):
        raise Mismatch(f"axis must be an int, got {attrs['axis']!r}")


def _bias_view(b, ndim, axis):
    """b (C,) shaped to broadcast along dimension `axis` of an ndim-array."""
    return b.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))


def _bias_add_infer(shapes, dtypes, attrs):
    x, b = shapes
    if len(x) < 2 or len(b) != 1:
        raise Mismatch("bias_add needs x of rank >= 2 and a bias of rank 1")
    axis = bias_axis(attrs, len(x))
    if x[axis] is not None and b[0] is not None and x[axis] != b[0]:
        raise Mismatch(f"bias has {b[0]} entries but dimension {axis} of x is {x[axis]}")
    return tuple(x), result_dtype(dtypes)


def _bias_add_compute(xp, x, b, out=None, axis=1):
    return xp.add(x, _bias_view(b, x.ndim, axis % x.ndim), out=out)


def _bias_grad_compute(xp, g, out=None, axis=1):
    axis = axis % g.ndim
    others = tuple(d for d in range(g.ndim) if d != axis)
    return g.sum(axis=others, dtype=g.dtype)  # g's dtype, as the rule says


register(OpDef("bias_add", _bias_add_compute, _bias_add_infer,
               lambda n, g: [g, make("bias_grad", g, **n.attrs)], inplace=0,
               doc="x + b along dimension `axis` (default 1: channels)",
               check=_bias_axis_check))


def _bias_grad_infer(shapes, dtypes, attrs):
    """(C,) for g shaped like bias_add's x, (N, C, ...) for the default axis 1; dtype
    of g."""
    g = shapes[0]
    if len(g) < 2:
        raise Mismatch("bias_grad needs g of rank >= 2 (shaped like bias_add's x)")
    return (g[bias_axis(attrs, len(g))],), dtypes[0]


register(OpDef("bias_grad", _bias_grad_compute, _bias_grad_infer,
               lambda n, g: [make("bias_add", zeros_like(n.inputs[0]), g, **n.attrs)],
               doc="sum over every axis but `axis` (default 1; gradient of bias_add)",
               check=_bias_axis_check))


# ----------------------------------------------------------------------------------
# Softmax family (over the last axis)
# ----------------------------------------------------------------------------------

def _softmax_compute(xp, x, out=None):
    # Subtracting the row max keeps exp() from overflowing; it cancels in the ratio.
    # (Integers become floats first: x - max would wrap around in uint8.)
    x = x.astype(float_dtype(x.dtype), copy=False)
    if x.shape[-1] == 0:
        return _no_classes(xp, x, out)
    shifted = x - x.max(axis=-1, keepdims=True)
    e = xp.exp(shifted, out=out)
    e /= e.sum(axis=-1, keepdims=True)
    return e


def _log_softmax_compute(xp, x, out=None):
    x = x.astype(float_dtype(x.dtype), copy=False)
    if x.shape[-1] == 0:
        return _no_classes(xp, x, out)
    shifted = x - x.max(axis=-1, keepdims=True)
    logsum = xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    return xp.subtract(shifted, logsum, out=out)


def _no_classes(xp, x, out):
    """(Log-)softmax over an empty last axis: an empty result, as in TF. (The row
    max above would fail inside numpy: a max over no elements has no value.)"""
    return xp.empty(x.shape, x.dtype) if out is None else out


def _softmax_grad(n, g):
    # dx = s * (g - sum(g * s))
    return [n * (g - reduce_sum(g * n, -1, keepdims=True))]


def _log_softmax_grad(n, g):
    # dx = g - softmax(x) * sum(g)
    return [g - exp(n) * reduce_sum(g, -1, keepdims=True)]


def _infer_float(shapes, dtypes, attrs):
    """Shape of input 0; its dtype if a float, else the float numpy computes in."""
    return tuple(shapes[0]), float_dtype(dtypes[0])


def _infer_classes(shapes, dtypes, attrs):
    """As _infer_float, for an input with a last axis (the classes): a scalar has
    none (it built, then failed inside numpy at run time)."""
    if len(shapes[0]) == 0:
        raise Mismatch("needs an input of rank >= 1 (its last axis holds the classes), "
                       "got a scalar")
    return _infer_float(shapes, dtypes, attrs)


register(OpDef("softmax", _softmax_compute, _infer_classes, _softmax_grad,
               doc="exp(x) / sum(exp(x)) over the last axis"))
register(OpDef("log_softmax", _log_softmax_compute, _infer_classes, _log_softmax_grad,
               doc="x - log(sum(exp(x))) over the last axis"))


def _xent_infer(shapes, dtypes, attrs):
    logits, labels = shapes
    if len(logits) < 1:
        raise Mismatch("logits need a class axis")
    if len(labels) != len(logits) - 1 or any(
            a is not None and b is not None and a != b for a, b in zip(labels, logits[:-1])):
        raise Mismatch("labels must have the logits' shape without the class axis")
    return tuple(logits[:-1]), float_dtype(dtypes[0])


def _class_indices(labels, classes: int):
    """Labels as int64 class indices; a label outside [0, classes) is an error (numpy
    would wrap a negative index around, or give a silent all-zero one-hot row)."""
    idx = labels.astype(np.int64, copy=False)
    if labels.dtype.kind == "f" and idx.size and not (idx == labels).all():
        raise ValueError("float labels must be whole numbers (class indices); got "
                         f"{labels[idx != labels].ravel()[:3].tolist()}")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= classes):
        raise ValueError(f"labels must be in [0, {classes}); got values in "
                         f"[{int(idx.min())}, {int(idx.max())}]")
    return idx


def _xent_compute(xp, logits, labels, out=None):
    idx = _class_indices(labels, logits.shape[-1])
    logp = _log_softmax_compute(xp, logits)
    picked = xp.take_along_axis(logp, idx[..., None], axis=-1)[..., 0]
    return xp.negative(picked, out=out)


def _one_hot_like_compute(xp, labels, logits, out=None):
    # The gradient of the loss may run without the loss kernel: check labels here too.
    classes = logits.shape[-1]
    result = (_class_indices(labels, classes)[..., None] == xp.arange(classes))
    return result.astype(logits.dtype)


def _xent_grad(n, g):
    logits, labels = n.inputs
    probs = make("softmax", logits)
    onehot = make("one_hot_like", labels, logits)
    return [expand_dims(g, -1) * (probs - onehot), None]


register(OpDef("softmax_cross_entropy", _xent_compute, _xent_infer, _xent_grad,
               doc="-log softmax(logits)[label] per example; labels are class indices"))


def _one_hot_like_infer(shapes, dtypes, attrs):
    """(labels, logits): labels' shape plus the class axis, logits' dtype; labels
    must fit the logits as for the loss (their shape less the class axis)."""
    labels, logits = shapes
    _xent_infer([logits, labels], dtypes[::-1], attrs)
    return tuple(labels) + (logits[-1],), dtypes[1]


register(OpDef("one_hot_like", _one_hot_like_compute, _one_hot_like_infer, zero_gradient,
               doc="one-hot rows, classes = last dim of input 1", shape_inputs=(1,)))


def softmax(x: Operand) -> Node:
    return make("softmax", x)


def log_softmax(x: Operand) -> Node:
    return make("log_softmax", x)


def softmax_cross_entropy(logits: Operand, labels: Operand) -> Node:
    """Per-example cross entropy of integer class `labels` (any numeric dtype)."""
    return make("softmax_cross_entropy", logits, labels)


# ----------------------------------------------------------------------------------
# Layer norm (Ba et al. 2016), over the last axis
# ----------------------------------------------------------------------------------

def _layer_norm_infer(shapes, dtypes, attrs):
    x, gamma, beta = shapes
    if len(x) < 1 or len(gamma) != 1 or len(beta) != 1:
        raise Mismatch("layer_norm needs x (..., D), gamma (D,) and beta (D,)")
    for p in (gamma[0], beta[0]):
        if x[-1] is not None and p is not None and p != x[-1]:
            raise Mismatch(f"last dim {x[-1]} differs from the scale/shift size {p}")
    return tuple(x), float_dtype(result_dtype(dtypes))


def _layer_norm_compute(xp, x, gamma, beta, out=None, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    centered = x - mu
    rstd = 1.0 / xp.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    result = centered * rstd * gamma + beta
    dtype = float_dtype(xp.result_type(x.dtype, gamma.dtype, beta.dtype))
    return result.astype(dtype, copy=False)


def _layer_norm_grad(n, g):
    # Written with ordinary ops so second derivatives work. With xhat = (x - mu) * rstd
    # and gx = g * gamma:  dx = rstd * (gx - mean(gx) - xhat * mean(gx * xhat)).
    from tinyflow.ops import reduce_mean, sqrt
    x, gamma, beta = n.inputs
    eps = n.attrs.get("eps", 1e-5)
    mu = reduce_mean(x, -1, keepdims=True)
    centered = x - mu
    rstd = 1.0 / sqrt(reduce_mean(centered * centered, -1, keepdims=True) + eps)
    xhat = centered * rstd
    gx = g * gamma
    dx = rstd * (gx - reduce_mean(gx, -1, keepdims=True)
                 - xhat * reduce_mean(gx * xhat, -1, keepdims=True))
    # Reduce over every leading axis by summing down to gamma's (D,) shape: this
    # works even when x's rank is not known yet.
    dgamma = sum_to_like(g * xhat, gamma)
    dbeta = sum_to_like(g, beta)
    return [dx, dgamma, dbeta]


register(OpDef("layer_norm", _layer_norm_compute, _layer_norm_infer, _layer_norm_grad,
               doc="normalise the last axis to mean 0, variance 1; then scale and shift"))


def layer_norm(x: Operand, gamma: Operand, beta: Operand, eps: float = 1e-5) -> Node:
    # eps="a" was float()'s bare ValueError; a NaN eps, or a negative one (sqrt of
    # variance + eps < 0), made NaN outputs. eps = 0 is allowed (PyTorch and Keras
    # take it too; only a constant row then divides by zero).
    return make("layer_norm", x, gamma, beta, eps=float_attr("layer_norm", "eps", eps, low=0))


# ----------------------------------------------------------------------------------
# Dropout (Srivastava et al. 2014), "inverted": kept units are scaled by 1/(1-rate)
# so evaluation is the identity. The mask is its own (random, impure) node, and the
# output is x * mask, so the gradient uses the very mask the forward pass drew.
# ----------------------------------------------------------------------------------

def _dropout_mask_compute(xp, x, keep_prob=None, out=None, rate=0.5, seed=0,
                          generators=None):
    """A mask of x's shape: 0 with probability `rate`, else 1/(1-rate). With a second
    input, the rate is 1 - keep_prob, read at run time (TF1's keep_prob placeholder,
    fed 0.5 to train and 1.0 to evaluate)."""
    from tinyflow.ops import generator
    if keep_prob is not None:
        keep_value = float(keep_prob)
        if not 0.0 < keep_value <= 1.0:   # (NaN fails this too)
            raise ValueError(f"keep_prob must be in (0, 1], got {keep_value}")
        rate = 1.0 - keep_value
    keep = backend.to_device(xp, generator(seed, generators).random(x.shape) >= rate)
    mask = keep.astype(x.dtype) / (1.0 - rate)
    return mask


def _dropout_mask_infer(shapes, dtypes, attrs):
    if len(shapes) == 2:
        if shapes[1] is not None and len(shapes[1]) != 0:
            raise Mismatch(f"keep_prob must be a scalar, got shape {tuple(shapes[1])}")
        if dtypes[1] is not None and dtypes[1].kind != "f":
            raise Mismatch(f"keep_prob must be a float, got {dtypes[1]}")
    return infer_same(shapes, dtypes, attrs)


# The mask's values do not depend on x's values (only its shape): zero gradient.
# It lies on the path from the weights to the loss (x * mask), so it needs one.
def _dropout_mask_check(attrs, dtypes):
    if dtypes[0] is not None and dtypes[0].kind != "f":
        raise Mismatch(f"dropout needs a float input, got {dtypes[0]} (TF1 too)")


register(OpDef("dropout_mask", _dropout_mask_compute, _dropout_mask_infer, zero_gradient,
               pure=False, random=True, doc="random 0 or 1/(1-rate) of x's shape; "
               "an optional second input keep_prob sets rate = 1 - keep_prob at run time",
               check=_dropout_mask_check))


def check_dropout_input(x: Operand) -> None:
    """Dropout of ints is a build error even where no mask is made (training=False,
    rate 0), as the mask op's own check makes it when one is."""
    if isinstance(x, Node) and x.dtype is not None and x.dtype.kind != "f":
        raise ShapeError(f"dropout needs a float input, got {x.dtype} (TF1 too); cast it "
                         f"first (at {user_source_line()})")


def dropout(x: Operand, rate: float = 0.5, training: bool = True,
            seed: int | None = None, name: str | None = None) -> Node:
    """Zero each element with probability `rate` (training), identity otherwise.
    (tf.nn.dropout, in nn.py, is TF1's signature over this: keep_prob first.)"""
    from tinyflow.ops import _next_seed
    # A number, checked here: a string or a node reached `0.0 <= rate` (a TypeError,
    # or "the truth value of graph node"), and NaN passed as a plain ValueError.
    if not 0.0 <= float_attr("dropout", "rate", rate) < 1.0:
        raise argument_error("dropout", f"rate must be in [0, 1), got {rate!r}")
    check_dropout_input(x)
    if not training or rate == 0.0:
        return x
    return make("mul", x, make("dropout_mask", x, rate=float(rate), seed=_next_seed(seed)),
                name=name)


__all__ = ["softmax", "log_softmax",
           "softmax_cross_entropy", "layer_norm", "dropout", "cast", "ones_like"]
