"""tf.nn: neural-network functions, and layer objects built from them.

The functions are the TF1 / original-TinyFlow surface (`tf.nn.relu`, `tf.nn.conv2d`,
`tf.nn.sparse_softmax_cross_entropy_with_logits`, ...). The layer objects (`Linear`,
`Conv2d`, `MLP`, ...) are a convenience on top, in the style of PyTorch modules: a
layer owns its Variables and, when called on a node, builds graph nodes. They are
not a second API: every layer is a few lines over the functions.

Images are NCHW and filters OIHW, like the original TinyFlow and PyTorch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyflow import api, image_ops, nn_ops, ops, shape_ops
from tinyflow.registry import source_kind
from tinyflow.graph import Node
from tinyflow.image_ops import avg_pool2d, max_pool2d
from tinyflow.nn_ops import layer_norm, log_softmax, softmax
from tinyflow.ops import gelu, relu, sigmoid, tanh

__all__ = ["relu", "gelu", "sigmoid", "tanh", "softmax", "log_softmax", "dropout",
           "layer_norm", "conv2d", "max_pool", "avg_pool", "bias_add", "linear",
           "moments", "batch_normalization",
           "flatten_layer", "softmax_cross_entropy_with_logits",
           "softmax_cross_entropy_with_logits_v2", "sigmoid_cross_entropy_with_logits",
           "l2_loss", "leaky_relu", "softplus",
           "sparse_softmax_cross_entropy_with_logits",
           "mean_sparse_softmax_cross_entropy_with_logits", "embedding_lookup",
           "Module", "Linear", "Conv2d", "MaxPool2d", "Embedding", "LayerNorm", "Dropout",
           "ReLU", "GELU", "Tanh", "Flatten", "Sequential", "MLP", "avg_pool2d",
           "max_pool2d"]


# ----------------------------------------------------------------------------------
# Functions (TF1 / original TinyFlow)
# ----------------------------------------------------------------------------------

def _spatial(op: str, arg: str, pair: Any, default: tuple[int, int]) -> tuple[int, int]:
    """TF writes window sizes and strides as [1, h, w, 1]; accept that, (h, w) or h.

    Any other length is refused: a length of 3 or 5 used to take entries 0 and 1
    ([1, 2, 2] pooled 1 x 2), and TF's NCHW spelling [1, 1, 2, 2] took (1, 2)
    silently; the outer entries of a 4-list must be 1."""
    if pair is None:
        return default
    if isinstance(pair, (Sequence, np.ndarray)) and not isinstance(pair, str) \
            and len(pair) == 4:
        n, h, w, c = ops.ints_attr(op, arg, pair)
        if n != 1 or c != 1:
            raise ops.argument_error(op, f"{arg} {list(pair)} must be [1, h, w, 1] "
                                         "(or (h, w), or an int)")
        return (h, w)
    return image_ops.pair_attr(op, arg, pair)


def _nchw(op: str, data_format: str) -> None:
    if data_format != "NCHW":
        raise ops.argument_error(op, f"data_format {data_format!r}: TinyFlow's images are "
                                     "NCHW (as the original TinyFlow's); transpose NHWC "
                                     "data first")


def _units(op: str, arg: str, value: Any) -> int:
    """A layer's number of filters or units: a positive int. Checked now, as the
    weight's shape is only built later (infer_variable_shapes), and a -3 or 2.5
    there became a Variable of that shape."""
    if ops.int_attr(op, arg, value) < 1:
        raise ops.argument_error(op, f"{arg} must be >= 1, got {value!r}")
    return int(value)


def conv2d(x: Node, filter: Node | None = None, strides: Any = None, padding: Any = "VALID",
           data_format: str = "NCHW", *, num_filter: int | None = None, ksize: Any = None,
           name: str | None = None, no_bias: bool = True) -> Node:
    """2-D convolution of x (N, C, H, W). Padding is "VALID" unless asked, as in the
    original TinyFlow's python/tinyflow/nn.py (and TF1, which requires it).

    Two spellings, as in the original TinyFlow:
      conv2d(x, W, strides=[1, s, s, 1], padding="SAME")   with W a (O, C, kh, kw) node
      conv2d(x, num_filter=20, ksize=[1, 5, 5, 1], name="conv1", no_bias=False)
    The second creates Variables `<name>_weight` (and `<name>_bias`) whose shapes are
    inferred later from x's shape (`tf.infer_variable_shapes`).
    """
    _nchw("conv2d", data_format)
    stride = _spatial("conv2d", "strides", strides, (1, 1))
    if filter is None:
        if num_filter is None or ksize is None:
            raise TypeError("conv2d needs a filter node, or num_filter= and ksize=")
        num_filter = _units("conv2d", "num_filter", num_filter)
        kh, kw = _spatial("conv2d", "ksize", ksize, (1, 1))
        # The window is the deferred weight's shape here, not a conv attribute, so
        # the conv's own check never saw a 0: it failed only when shapes were
        # inferred, as a Variable of shape (O, C, 0, 0).
        if min(kh, kw) < 1:
            raise ops.argument_error("conv2d", f"ksize must be >= 1, got {ksize!r}")
        name = name or f"conv2d_{next(_layer_ids)}"
        filter = api.Variable(name=f"{name}_weight")
        api.deferred_shapes[filter] = (x, lambda s: (num_filter, s[1], kh, kw))
        y = image_ops.conv2d(x, filter, stride, padding)
        if not no_bias:
            bias = api.Variable(name=f"{name}_bias", shape=(num_filter,))
            y = bias_add(y, bias, data_format="NCHW")
        return y
    return image_ops.conv2d(x, filter, stride, padding)


def max_pool(x: Node, ksize: Any = (1, 2, 2, 1), strides: Any = None,
             padding: Any = "VALID", data_format: str = "NCHW") -> Node:
    """Max pooling; ksize/strides as TF's [1, h, w, 1] or (h, w)."""
    _nchw("max_pool", data_format)
    k = _spatial("max_pool", "ksize", ksize, (2, 2))
    return max_pool2d(x, k, _spatial("max_pool", "strides", strides, k),
                      0 if padding == "VALID" else padding)


def avg_pool(x: Node, ksize: Any = (1, 2, 2, 1), strides: Any = None,
             padding: Any = "VALID", data_format: str = "NCHW") -> Node:
    """Average pooling (padding counts as zeros); ksize/strides as for max_pool."""
    _nchw("avg_pool", data_format)
    k = _spatial("avg_pool", "ksize", ksize, (2, 2))
    return avg_pool2d(x, k, _spatial("avg_pool", "strides", strides, k),
                      0 if padding == "VALID" else padding)


def moments(x: Node, axes: Sequence[int], keepdims: bool = False) -> tuple[Node, Node]:
    """TF1's tf.nn.moments: the mean and (biased) variance of x over `axes`."""
    mean = ops.reduce_mean(x, axes, keepdims=True)
    centered = x - mean
    variance = ops.reduce_mean(centered * centered, axes, keepdims=keepdims)
    if not keepdims:
        mean = ops.reduce_mean(x, axes)
    return mean, variance


def batch_normalization(x: Node, mean: Any = None, variance: Any = None, offset: Any = None,
                        scale: Any = None, variance_epsilon: float = 1e-5, name: str | None
                        = None, *, training: bool = True, momentum: float = 0.9) -> Node:
    """Batch normalization (Ioffe & Szegedy 2015), in two spellings.

    TF1's: batch_normalization(x, mean, variance, offset, scale, variance_epsilon) is
    (x - mean) * scale / sqrt(variance + eps) + offset, all broadcast against x (get
    the statistics from `tf.nn.moments`); offset and scale may be None.

    The original TinyFlow's: batch_normalization(x) is a layer over the channel axis 1
    (NCHW images or (N, C) features), like Torch's SpatialBatchNormalization: it owns
    a scale (ones) and an offset (zeros) that train, and moving averages of the mean
    and variance. With training=True it normalizes with the batch's statistics and
    every `minimize` of a loss under it also updates the moving averages
    (moving = momentum * moving + (1 - momentum) * batch); with training=False it
    uses the moving averages; calling it again with the same `name` reuses the
    layer's Variables (an inference graph beside the training one). Its Variables
    initialize themselves once their shape is known (`tf.infer_variable_shapes`,
    then `tf.initialize_all_variables`).

    variance_epsilon must be a finite number >= 0 (an ArgumentError otherwise): a
    negative one makes sqrt(variance + eps) NaN wherever the variance is small.
    momentum must be in [0, 1], training a flag: a momentum of 1.5 or NaN made the
    moving averages diverge or NaN silently.
    """
    variance_epsilon = ops.float_attr("batch_normalization", "variance_epsilon",
                                      variance_epsilon, low=0)
    momentum = ops.float_attr("batch_normalization", "momentum", momentum, low=0)
    if momentum > 1:
        raise ops.argument_error("batch_normalization", f"momentum must be <= 1, got "
                                                        f"{momentum!r}")
    training = ops.bool_attr("batch_normalization", "training", training)
    if mean is None and variance is None:
        return _batch_norm_layer(x, variance_epsilon, name, training, momentum)
    inv = 1.0 / ops.sqrt(variance + variance_epsilon)
    if scale is not None:
        inv = inv * scale
    shift = -mean * inv if offset is None else offset - mean * inv
    return x * inv + shift  # TF1's own arrangement of the arithmetic


_batch_norms: dict[str, dict[str, Node]] = {}  # layer name -> its Variables


def _batch_norm_layer(x: Node, eps: float, name: str | None, training: bool,
                      momentum: float) -> Node:
    name = name or f"batchnorm_{next(_layer_ids)}"
    params = _batch_norms.get(name)
    if params is None:  # a new layer; a known name reuses its Variables (TF1's reuse)
        params = _batch_norms[name] = {
            key: _channel_variable(x, f"{name}_{key}", fill, trainable)
            for key, fill, trainable in [("scale", 1.0, True), ("offset", 0.0, True),
                                         ("moving_mean", 0.0, False),
                                         ("moving_variance", 1.0, False)]}
    # x as (N, C, everything else), so that any rank >= 2 works, even one not known
    # yet; statistics over axes 0 and 2, parameters seen along axis 1.
    x3 = shape_ops.reshape(x, (0, 0, -1))
    view = (1, -1, 1)
    scale, offset = (shape_ops.reshape(params[k], view) for k in ("scale", "offset"))
    if training:
        batch_mean, batch_var = moments(x3, [0, 2])
        for key, stat in (("moving_mean", batch_mean), ("moving_variance", batch_var)):
            moving = params[key]
            api.update_ops.append((api.assign(
                moving, momentum * moving + (1.0 - momentum) * stat), x))
        mean, variance = shape_ops.reshape(batch_mean, view), shape_ops.reshape(batch_var, view)
    else:
        mean, variance = (shape_ops.reshape(params[k], view)
                          for k in ("moving_mean", "moving_variance"))
    return shape_ops.reshape_like(batch_normalization(x3, mean, variance, offset, scale, eps), x)


def _channel_variable(x: Node, name: str, fill: float, trainable: bool) -> Node:
    """A (C,) Variable for axis 1 of x, filled with `fill`; of deferred shape (set by
    tf.infer_variable_shapes) when x's channel count is not known yet."""
    dtype = x.dtype if x.dtype is not None and x.dtype.kind == "f" else np.float32
    channels = None if x.shape is None else x.shape[1]
    if channels is not None:
        init = (ops.ones if fill == 1.0 else ops.zeros)((channels,), dtype)
        return api.Variable(init, name=name, trainable=trainable)
    var = api.Variable(name=name, dtype=dtype, trainable=trainable)
    api.deferred_shapes[var] = (x, lambda s: (s[1],))
    api.deferred_fills[var] = fill
    return var


def dropout(x: Node, keep_prob: Any = None, noise_shape: Any = None, seed: int | None = None,
            name: str | None = None, rate: Any = None, training: bool = True) -> Node:
    """TF1's tf.nn.dropout: keep each element with probability `keep_prob` (the second
    argument, as in TF1) and scale the kept ones by 1/keep_prob; or say `rate=`
    (= 1 - keep_prob, TF 1.13's spelling). Either may be a scalar tensor, such as
    TF1's `keep_prob` placeholder fed 0.5 to train and 1.0 to evaluate.
    `training=False` returns x itself (TinyFlow's switch, as tf.layers.dropout's)."""
    if (keep_prob is None) == (rate is None):
        raise ops.argument_error("dropout", "give exactly one of keep_prob (the second "
                                            "argument) and rate (= 1 - keep_prob)")
    if noise_shape is not None:
        raise ops.argument_error("dropout", "noise_shape is not supported: every element "
                                            "is kept or dropped on its own")
    keep_prob, rate = _scalar(keep_prob), _scalar(rate)
    if not _is_tensor(keep_prob) and not _is_tensor(rate):
        if rate is None:
            keep = ops.float_attr("dropout", "keep_prob", keep_prob)
            if not 0.0 < keep <= 1.0:
                raise ops.argument_error("dropout", f"keep_prob must be in (0, 1], got "
                                                    f"{keep_prob!r}")
            rate = 1.0 - keep
        return nn_ops.dropout(x, rate, training, seed, name)
    nn_ops.check_dropout_input(x)   # a tensor: a mask that reads it at run time
    if not training:
        return x
    keep = keep_prob if keep_prob is not None else ops.sub(1.0, rate)
    mask = ops.make("dropout_mask", x, keep, seed=ops._next_seed(seed))
    return ops.make("mul", x, mask, name=name)


CHANNELS_LAST = ("NHWC", "N...C", "NWC", "NDHWC")
CHANNELS_FIRST = ("NCHW", "NC...", "NCW", "NCDHW")


def _is_tensor(value: Any) -> bool:
    """A graph node or an eager Tensor (symbolic ones in a trace included)."""
    return isinstance(value, Node) or getattr(value, "__tinyflow_tensor__", False)


def _scalar(value: Any) -> Any:
    """A 0-d numpy array as the number it holds (anything else as it is)."""
    return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value


def bias_add(x: Node, bias: Node, data_format: str | None = None,
             name: str | None = None) -> Node:
    """x + bias along the channel axis: dimension 1 of TinyFlow's NCHW images (4-D,
    the original TinyFlow's layout), the last dimension for other ranks (TF1's
    default, "N...C": a (batch, time, features) tensor); for (N, C) matrices the
    two agree; an input of unknown rank takes dimension 1, as the original TinyFlow's
    layers did. `data_format` ("NHWC" / "N...C" or "NCHW" / "NC...") says which.
    Either way it is one `bias_add` op whose `axis` attribute names the dimension
    (so its gradient, ONNX export and fusion all know it)."""
    rank = len(x.shape) if getattr(x, "shape", None) is not None else None
    if data_format is None:   # (an unknown rank: the original TinyFlow's dimension 1,
        channels_last = rank is not None and rank not in (2, 4)   # its conv layers')
    elif data_format in CHANNELS_LAST + CHANNELS_FIRST:
        channels_last = data_format in CHANNELS_LAST
    else:
        raise ops.argument_error("bias_add", f"data_format must be one of "
                                             f"{CHANNELS_LAST + CHANNELS_FIRST}, got "
                                             f"{data_format!r}")
    if not channels_last or rank == 2:   # (for (N, C) the two agree: dimension 1)
        return ops.make("bias_add", x, bias, name=name)
    # The last axis: counted from the end while the rank is unknown.
    return ops.make("bias_add", x, bias, axis=-1 if rank is None else rank - 1, name=name)


_layer_ids = itertools.count()


def linear(x: Node, num_hidden: int, name: str | None = None, no_bias: bool = True) -> Node:
    """Fully connected layer y = x W^T (+ b), creating `<name>_weight` (num_hidden, D)
    and `<name>_bias` with shapes inferred later (`tf.infer_variable_shapes`)."""
    num_hidden = _units("linear", "num_hidden", num_hidden)
    name = name or f"linear_{next(_layer_ids)}"
    weight = api.Variable(name=f"{name}_weight")
    api.deferred_shapes[weight] = (x, lambda s: (num_hidden, s[-1]))
    y = ops.matmul(x, weight, transpose_b=True)
    if not no_bias:
        bias = api.Variable(name=f"{name}_bias", shape=(num_hidden,))
        y = bias_add(y, bias)
    return y


def flatten_layer(x: Node) -> Node:
    """(N, ...) -> (N, everything else)."""
    return shape_ops.reshape(x, (0, -1))


def sparse_softmax_cross_entropy_with_logits(logits: Node | None = None,
                                             labels: Node | None = None) -> Node:
    """Per-example cross entropy; `labels` are class indices (any numeric dtype)."""
    return nn_ops.softmax_cross_entropy(logits, labels)


def mean_sparse_softmax_cross_entropy_with_logits(logits: Node, labels: Node) -> Node:
    return ops.reduce_mean(nn_ops.softmax_cross_entropy(logits, labels))


def softmax_cross_entropy_with_logits(logits: Node | None = None,
                                      labels: Node | None = None) -> Node:
    """Per-example cross entropy against a probability distribution (one-hot) labels.
    As TF1's, no gradient flows into `labels` (the _v2 function lets it)."""
    if _is_tensor(labels):   # (a literal has no gradient to stop)
        labels = ops.stop_gradient(labels)
    return softmax_cross_entropy_with_logits_v2(logits, labels)


def softmax_cross_entropy_with_logits_v2(logits: Node | None = None,
                                         labels: Node | None = None) -> Node:
    """Per-example cross entropy against a probability distribution; gradients flow
    into both logits and labels (TF1's _v2)."""
    return ops.neg(ops.reduce_sum(labels * log_softmax(logits), -1))


def _operand(value: Any) -> Any:
    """A literal (a number, list or numpy array) as a constant tensor, so that the
    `*` and `-` below build ops instead of doing Python's list arithmetic."""
    return value if _is_tensor(value) else ops.constant(value)


def _relu_and_neg_abs(x: Node) -> tuple[Node, Node]:
    """max(x, 0) and -|x| as TF1's stable logistic forms build them, with
    where(x >= 0, ...): their gradients at x = 0 are 1 and -1, so these forms'
    gradient there is sigmoid(0) = 0.5. (maximum's tie sends 1 to x and abs's
    sign(0) is 0: the gradient at 0 came out 1.) The values are the same."""
    nonnegative = x >= 0.0
    return ops.where(nonnegative, x, 0.0), ops.where(nonnegative, -x, x)


def sigmoid_cross_entropy_with_logits(labels: Any = None, logits: Any = None) -> Node:
    """Elementwise logistic loss of `logits` against 0/1 (or probability) `labels`,
    in TF1's stable form: max(x, 0) - x * z + log(1 + exp(-|x|)) (no overflow for
    large |x|)."""
    logits = _operand(logits)
    relu, neg_abs = _relu_and_neg_abs(logits)
    return relu - logits * labels + ops.log(1.0 + ops.exp(neg_abs))


def l2_loss(t: Any) -> Node:
    """TF1's tf.nn.l2_loss: sum(t * t) / 2 (weight decay's penalty)."""
    t = _operand(t)
    return ops.reduce_sum(t * t) / 2.0


def leaky_relu(features: Any, alpha: float = 0.2) -> Node:
    """TF1's definition: maximum(alpha * x, x) (for alpha < 1)."""
    alpha = ops.float_attr("leaky_relu", "alpha", alpha, low=0)
    features = _operand(features)
    return ops.maximum(features * alpha, features)


def softplus(features: Any) -> Node:
    """log(1 + exp(x)), as max(x, 0) + log(1 + exp(-|x|)) so a large x does not
    overflow exp."""
    features = _operand(features)
    relu, neg_abs = _relu_and_neg_abs(features)
    return relu + ops.log(1.0 + ops.exp(neg_abs))


def embedding_lookup(params: Node, ids: Node) -> Node:
    return shape_ops.gather(params, ids)


# ----------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------

# Layer initializers draw from seeds taken in order from this counter, so building
# the same model twice in a fresh process gives the same initial weights.
_init_seeds = itertools.count(7)


def _uniform_variable(shape: tuple[int, ...], bound: float, name: str) -> Node:
    init = ops.random_uniform(shape, -bound, bound, seed=next(_init_seeds))
    return api.Variable(init, name=name)


class Module:
    """A callable that owns Variables. `parameters()` lists them (layers first)."""

    def parameters(self) -> list[Node]:
        params: list[Node] = []
        for value in vars(self).values():
            if isinstance(value, Node) and source_kind(value) == "variable":
                params.append(value)
            elif isinstance(value, Module):
                params.extend(value.parameters())
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, Module):
                        params.extend(item.parameters())
        return params

    def __call__(self, x: Node, training: bool = True) -> Node:
        raise NotImplementedError


class Linear(Module):
    """y = x @ W + b, W (in, out). Uniform(+-1/sqrt(in)) init, as PyTorch's default."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 name: str = "linear") -> None:
        in_features = _units("Linear", "in_features", in_features)  # (1/sqrt(-1): numpy's
        out_features = _units("Linear", "out_features", out_features)  # domain error)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = _uniform_variable((in_features, out_features), bound, f"{name}_w")
        self.bias = _uniform_variable((out_features,), bound, f"{name}_b") if bias else None

    def __call__(self, x: Node, training: bool = True) -> Node:
        y = ops.matmul(x, self.weight) if x.ndim in (None, 2) else _batched_linear(x, self)
        # y is ours and dies here: eagerly, the bias is added into its memory
        # (make_over), as PyTorch's addmm reuses the bias's copy for its product. The
        # arithmetic is still y + b (the same bits); the graph is y + b.
        return y if self.bias is None else ops.make_over("add", y, self.bias)


def _batched_linear(x: Node, layer: Linear) -> Node:
    # (..., in) @ (in, out): matmul broadcasts the weight over the leading dims.
    return ops.matmul(x, layer.weight)


class Conv2d(Module):
    """NCHW convolution with (out, in, k, k) filters and a per-channel bias."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 stride: int = 1, padding: int | str = 0, bias: bool = True,
                 name: str = "conv") -> None:
        in_channels = _units("Conv2d", "in_channels", in_channels)  # (a 0 divided by 0)
        out_channels = _units("Conv2d", "out_channels", out_channels)
        kernel_size = _units("Conv2d", "kernel_size", kernel_size)
        bound = 1.0 / math.sqrt(in_channels * kernel_size * kernel_size)
        self.weight = _uniform_variable((out_channels, in_channels, kernel_size, kernel_size),
                                        bound, f"{name}_w")
        self.bias = _uniform_variable((out_channels,), bound, f"{name}_b") if bias else None
        self.stride, self.padding = stride, padding

    def __call__(self, x: Node, training: bool = True) -> Node:
        y = image_ops.conv2d(x, self.weight, self.stride, self.padding)
        return y if self.bias is None else bias_add(y, self.bias, data_format="NCHW")


class MaxPool2d(Module):
    def __init__(self, kernel_size: int = 2, stride: int | None = None) -> None:
        self.kernel_size, self.stride = kernel_size, stride

    def __call__(self, x: Node, training: bool = True) -> Node:
        return max_pool2d(x, self.kernel_size, self.stride)


class Embedding(Module):
    """Rows of a (num, dim) table picked by integer ids; N(0, 1) init as PyTorch."""

    def __init__(self, num_embeddings: int, dim: int, name: str = "embedding") -> None:
        # A 0-row table built and failed at the first lookup (any id is out of
        # range); a -1 or 2.5 was an error of random_normal's, not Embedding's.
        num_embeddings = _units("Embedding", "num_embeddings", num_embeddings)
        dim = _units("Embedding", "dim", dim)
        init = ops.random_normal((num_embeddings, dim), 0.0, 1.0, seed=next(_init_seeds))
        self.weight = api.Variable(init, name=f"{name}_w")

    def __call__(self, ids: Node, training: bool = True) -> Node:
        return shape_ops.gather(self.weight, ids)


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, name: str = "ln") -> None:
        dim = _units("LayerNorm", "dim", dim)  # (np.ones(-1): numpy's error)
        self.gamma = api.Variable(np.ones(dim, np.float32), name=f"{name}_g")
        self.beta = api.Variable(np.zeros(dim, np.float32), name=f"{name}_b")
        # Checked here, where the layer is built, not first at its call.
        self.eps = ops.float_attr("LayerNorm", "eps", eps, low=0)

    def __call__(self, x: Node, training: bool = True) -> Node:
        return layer_norm(x, self.gamma, self.beta, self.eps)


class Dropout(Module):
    """Dropout while training (call with training=False to evaluate)."""

    def __init__(self, rate: float = 0.5, seed: int | None = None) -> None:
        self.rate, self.seed = rate, seed

    def __call__(self, x: Node, training: bool = True) -> Node:
        return nn_ops.dropout(x, self.rate, training, self.seed)


class Activation(Module):
    """An elementwise activation layer: the registry's op `op` on its input."""

    op = ""

    def __call__(self, x: Node, training: bool = True) -> Node:
        return ops.make(self.op, x)

    def over(self, x: Node) -> Node:
        """The activation of x, for a caller that made x and drops it after this
        call (Sequential: a Linear's output): in eager mode the result may take x's
        memory (ops.make_over). In graph mode this is __call__, and so it is for a
        subclass with a __call__ of its own (which may not be just `op`)."""
        if type(self).__call__ is not Activation.__call__:
            return self(x)
        return ops.make_over(self.op, x)


class ReLU(Activation):
    op = "relu"


class GELU(Activation):
    op = "gelu"


class Tanh(Activation):
    op = "tanh"


class Flatten(Module):
    def __call__(self, x: Node, training: bool = True) -> Node:
        return flatten_layer(x)


class Sequential(Module):
    def __init__(self, *layers: Module) -> None:
        self.layers = list(layers)

    def __call__(self, x: Node, training: bool = True) -> Node:
        # A Linear's output here is read by the next layer and by nothing else, so
        # eagerly an activation after it may write over it (Activation.over), the
        # reuse the static plan finds by itself for a graph. (A subclass of Linear
        # might keep its output: only Linear itself is trusted with that.)
        previous = None
        for layer in self.layers:
            if isinstance(layer, Activation) and type(previous) is Linear:
                x = layer.over(x)
            else:
                x = layer(x, training=training)
            previous = layer
        return x


class MLP(Sequential):
    """Linear layers of the given sizes with an activation between them.

    MLP([784, 1024, 1024, 10]) is Linear(784, 1024), ReLU, Linear(1024, 1024), ReLU,
    Linear(1024, 10): logits out.
    """

    def __init__(self, sizes: Sequence[int], activation: str = "relu",
                 dropout_rate: float = 0.0, name: str = "mlp") -> None:
        acts = {"relu": ReLU, "gelu": GELU, "tanh": Tanh}
        # An unknown name was a bare KeyError when a hidden layer looked it up, and
        # went unnoticed with none (MLP([4, 3])).
        if not isinstance(activation, str) or activation not in acts:
            raise ops.argument_error("MLP", f"activation must be one of {sorted(acts)}, "
                                            f"got {activation!r}")
        layers: list[Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(Linear(fan_in, fan_out, name=f"{name}{i}"))
            if i < len(sizes) - 2:
                layers.append(acts[activation]())
                if dropout_rate:
                    layers.append(Dropout(dropout_rate))
        super().__init__(*layers)
