"""Image models: a TinyFlow training step of small CNNs against PyTorch CPU.

Figures (each a median of per-round ratios, TinyFlow / PyTorch, interleaved rounds,
one BLAS/OpenMP thread each unless ``TINYFLOW_BENCH_THREADS`` says otherwise):

``cnn_step_vs_torch``
    One SGD step of a CIFAR-shaped CNN: batch 64, 3x32x32, conv3x3-32 (padding 1,
    bias), relu, max pool 2, conv3x3-64, relu, max pool 2, linear 10, softmax cross
    entropy (mean). TinyFlow through ``Session.run`` with its defaults; PyTorch with
    ``F.conv2d``/``F.max_pool2d``/``optim.SGD``, from the same weights, checked to
    compute the same loss and updates before timing.
``lenet_step_vs_torch``
    The same for the original TinyFlow's LeNet example on MNIST-shaped batches
    (100 x 1x28x28): conv5x5-20 SAME + bias, tanh, pool 2, conv5x5-50 SAME + bias,
    tanh, pool 2, linear 500 (no bias), tanh, linear 10.
``maxpool_vs_torch``
    Forward and backward of 2x2 max pooling on the CNN's first pooled tensor
    (64, 32, 32, 32): a Program fetching the pooled value and its input gradient,
    against ``F.max_pool2d`` + ``backward``.
``conv2d_fwd_bwd_vs_torch``
    Forward and both gradients of the CNN's second convolution (64, 32, 16, 16) with
    64 3x3 filters, padding 1, against ``F.conv2d`` + ``backward``.

PyTorch is optional: without it every figure is NaN with a note ``skipped: ...``.
PyTorch's CPU convolutions are oneDNN kernels (direct convolution with vectorized
inner loops, no im2col copy); TinyFlow's are numpy: copies into an im2col layout and
one BLAS GEMM per cache-sized chunk of the batch (see tinyflow/image_ops.py).
"""

from __future__ import annotations

import statistics
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
from core_bench import bench_threads, limit_threads, paired_ratio, time_interleaved

import tinyflow as tf

SEED = 0
LEARNING_RATE = 0.01


@dataclass(frozen=True)
class Net:
    """A small image classifier: input shape, conv layers (out channels, kernel,
    padding, activation), hidden linear layers, classes."""

    name: str
    batch: int
    image: tuple[int, int, int]
    convs: tuple[tuple[int, int, int, str], ...]
    hidden: tuple[int, ...]
    classes: int = 10
    conv_bias: bool = True


CNN = Net("cnn", 64, (3, 32, 32), ((32, 3, 1, "relu"), (64, 3, 1, "relu")), ())
LENET = Net("lenet", 100, (1, 28, 28), ((20, 5, 2, "tanh"), (50, 5, 2, "tanh")), (500,))


def shrink(net: Net) -> Net:
    """The quick (smoke-test) version of `net`: a small batch and small images."""
    return Net(net.name, 4, (net.image[0], 12, 12), net.convs, net.hidden)


def make_params(net: Net) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Images, labels and the weights: per conv (O, C, k, k) filters and (O,) bias,
    then per linear layer an (in, out) matrix (no bias, as the original's linear)."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((net.batch,) + net.image, dtype=np.float32)
    labels = rng.integers(0, net.classes, net.batch).astype(np.int64)
    params, channels, side = [], net.image[0], net.image[1]
    for out, k, _, _ in net.convs:
        bound = 1.0 / np.sqrt(channels * k * k)
        params.append(rng.uniform(-bound, bound, (out, channels, k, k)).astype(np.float32))
        params.append(rng.uniform(-bound, bound, out).astype(np.float32))
        channels, side = out, side // 2
    width = channels * side * side
    for out in net.hidden + (net.classes,):
        bound = 1.0 / np.sqrt(width)
        params.append(rng.uniform(-bound, bound, (width, out)).astype(np.float32))
        width = out
    return x, labels, params


class TinyFlowNet:
    """The net in TinyFlow's TF1 API; `step()` is one `Session.run`."""

    def __init__(self, net: Net, x: np.ndarray, labels: np.ndarray,
                 params: list[np.ndarray]) -> None:
        images = tf.placeholder(tf.float32, x.shape)
        targets = tf.placeholder(tf.int64, labels.shape)
        self.variables = [tf.Variable(p) for p in params]
        h, k = images, 0
        for _, _, pad, act in net.convs:
            h = tf.nn.conv2d(h, self.variables[k], padding=pad)
            h = tf.nn.bias_add(h, self.variables[k + 1])
            h = tf.nn.relu(h) if act == "relu" else tf.tanh(h)
            h = tf.nn.max_pool(h, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1])
            k += 2
        h = tf.reshape(h, (net.batch, -1))
        for layer, w in enumerate(self.variables[k:]):
            h = tf.matmul(h, w)
            if layer < len(net.hidden):
                h = tf.tanh(h)
        self.loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(h, targets))
        self.train = tf.train.GradientDescentOptimizer(LEARNING_RATE).minimize(self.loss)
        self.session = tf.Session()
        self.session.run(tf.global_variables_initializer())
        self.feed = {images: x, targets: labels}

    def step(self) -> float:
        return float(self.session.run([self.loss, self.train], self.feed)[0])

    def weights(self) -> list[np.ndarray]:
        return [self.session.variables[v] for v in self.variables]


class TorchNet:
    """The same net and step in PyTorch (functional ops on leaf tensors, optim.SGD)."""

    def __init__(self, net: Net, x: np.ndarray, labels: np.ndarray,
                 params: list[np.ndarray]) -> None:
        import torch
        self.torch, self.net = torch, net
        self.params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
        self.optimizer = torch.optim.SGD(self.params, lr=LEARNING_RATE)
        self.x, self.labels = torch.from_numpy(x), torch.from_numpy(labels)

    def step(self) -> float:
        F = self.torch.nn.functional
        self.optimizer.zero_grad(set_to_none=True)
        h, k = self.x, 0
        for _, _, pad, act in self.net.convs:
            h = F.conv2d(h, self.params[k], self.params[k + 1], padding=pad)
            h = self.torch.relu(h) if act == "relu" else self.torch.tanh(h)
            h = F.max_pool2d(h, 2)
            k += 2
        h = h.reshape(self.net.batch, -1)
        for layer, w in enumerate(self.params[k:]):
            h = h @ w
            if layer < len(self.net.hidden):
                h = self.torch.tanh(h)
        loss = F.cross_entropy(h, self.labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def weights(self) -> list[np.ndarray]:
        return [p.detach().numpy() for p in self.params]


def _same_step(a: Any, b: Any) -> None:
    """One step of each; they must agree on the loss and the updated weights."""
    la, lb = a.step(), b.step()
    if not np.isclose(la, lb, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"image benchmark steps disagree: loss {la} vs {lb}")
    for k, (wa, wb) in enumerate(zip(a.weights(), b.weights())):
        if not np.allclose(wa, wb, rtol=1e-3, atol=1e-5):
            raise AssertionError(f"image benchmark steps disagree on parameter {k} by "
                                 f"{float(np.max(np.abs(wa - wb))):g}")


def _skipped(name: str, goal: str) -> dict:
    return {"name": name, "value": float("nan"), "goal": goal, "unit": "x",
            "note": "skipped: torch not installed"}


def _ratio_row(name: str, goal: str, times: dict[str, list[float]], what: str,
               threads_note: str) -> dict:
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    rounds = len(times["tinyflow"])
    return {"name": name, "goal": goal, "unit": "x",
            "value": paired_ratio(times["tinyflow"], times["torch"]),
            "note": f"{what}; tinyflow {ms['tinyflow']:.1f} ms, torch {ms['torch']:.1f} ms "
                    f"(medians of {rounds} interleaved rounds); {threads_note}"}


def step_row(net: Net, rounds: int, threads_note: str) -> dict:
    """`<net>_step_vs_torch`: one SGD step, TinyFlow / PyTorch."""
    x, labels, params = make_params(net)
    ours, theirs = TinyFlowNet(net, x, labels, params), TorchNet(net, x, labels, params)
    _same_step(ours, theirs)
    times = time_interleaved({"tinyflow": ours.step, "torch": theirs.step}, 2, rounds)
    what = (f"{net.name}: batch {net.batch}x{'x'.join(map(str, net.image))}, convs "
            f"{[c[:2] for c in net.convs]}, SGD step, float32")
    return _ratio_row(f"{net.name}_step_vs_torch", "<= 1.0", times, what, threads_note)


def kernel_row(name: str, shape: tuple[int, ...], filters: int | None, rounds: int,
               threads_note: str) -> dict:
    """Forward + backward of one max pool (filters None) or one padded 3x3 conv:
    a TinyFlow Program fetching the output and the gradients, against torch."""
    import torch
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal(shape, dtype=np.float32)
    xt = torch.from_numpy(x).requires_grad_()
    x_node = tf.placeholder(tf.float32, shape)
    if filters is None:
        y = tf.nn.max_pool(x_node, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1])
        wanted, params, pt = [x_node], [], []
        forward = lambda: torch.nn.functional.max_pool2d(xt, 2)  # noqa: E731
    else:
        w = rng.standard_normal((filters, shape[1], 3, 3), dtype=np.float32)
        w_node = tf.constant(w)
        y = tf.nn.conv2d(x_node, w_node, padding=1)
        wanted, params = [x_node, w_node], [w]
        pt = [torch.from_numpy(w).requires_grad_()]
        forward = lambda: torch.nn.functional.conv2d(xt, pt[0], padding=1)  # noqa: E731
    g = rng.standard_normal(tuple(y.shape), dtype=np.float32)
    grads = tf.gradients(tf.reduce_sum(y * tf.constant(g)), wanted)
    program = tf.compile([y] + grads, {x_node: (shape, np.float32)}, {})
    gt = torch.from_numpy(g)

    def torch_step() -> None:
        for p in [xt] + pt:
            p.grad = None
        forward().backward(gt)

    ours = program.run({x_node: x}, {})
    torch_step()
    for got, want in zip(ours[1:], [xt.grad] + [p.grad for p in pt]):
        if not np.allclose(got, want.numpy(), rtol=1e-3, atol=1e-3):
            raise AssertionError(f"{name}: gradients disagree with torch")
    del params
    times = time_interleaved({"tinyflow": lambda: program.run({x_node: x}, {}),
                              "torch": torch_step}, 2, rounds)
    what = (f"max_pool2d 2x2 forward+backward on {shape}" if filters is None else
            f"conv2d {shape} * ({filters}, {shape[1]}, 3, 3), padding 1, forward + both "
            "gradients")
    return _ratio_row(name, "<= 1000", times, what, threads_note)


def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    """The image-model figures (module docstring); `quick` shrinks every shape."""
    names = ["cnn_step_vs_torch", "lenet_step_vs_torch", "maxpool_vs_torch",
             "conv2d_fwd_bwd_vs_torch"]
    names = [n for n in names if only is None or only in n]
    try:
        import torch
    except ImportError:
        return [_skipped(n, "<= 1.0" if "step" in n else "<= 1000") for n in names]
    rounds = 3 if quick else 15
    rows = []
    with ExitStack() as stack:
        threads = bench_threads()
        threads_note = limit_threads(stack, threads)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        stack.callback(torch.set_num_threads, old)
        threads_note += f"; torch {torch.__version__}"
        for name in names:
            if name.endswith("_step_vs_torch"):
                net = CNN if name.startswith("cnn") else LENET
                rows.append(step_row(shrink(net) if quick else net, rounds, threads_note))
            elif name == "maxpool_vs_torch":
                shape = (4, 8, 12, 12) if quick else (64, 32, 32, 32)
                rows.append(kernel_row(name, shape, None, rounds, threads_note))
            else:
                shape, filters = ((4, 8, 12, 12), 8) if quick else ((64, 32, 16, 16), 64)
                rows.append(kernel_row(name, shape, filters, rounds, threads_note))
    return rows


if __name__ == "__main__":
    for row in figures():
        print(f"{row['name']:26} {row['value']:8.3f} {row['unit']:3} goal {row['goal']:8} "
              f"{row['note']}")
