"""GPU speed: TinyFlow on CUDA (through CuPy) against PyTorch CUDA, one generated
kernel against one kernel per op, and two CUDA streams overlapping.

Five figures, each measured against a reference in the same run. Without a GPU
(CuPy missing, or no device) every figure is NaN with the note ``skipped: no GPU``.

``gpu_mlp_step_vs_torch``
    One SGD step (forward, backward, update, the loss fetched to the host) of a
    784-1024-1024-10 ReLU MLP, batch 512, float32, by ``tf.Session(device="cuda")``,
    divided by the idiomatic PyTorch CUDA step (``nn.Sequential``,
    ``F.cross_entropy``, ``optim.SGD``). Both copy the batch to the device every
    step and read the loss back, so both end each step synchronized with the GPU.
``gpu_mlp4096_step_vs_torch``
    The same with 4096-wide hidden layers and a batch of 4096: big matmuls, where
    cuBLAS does nearly all the work and the framework's per-op cost matters less.
``gpu_fused_chain_vs_unfused``
    Run time of an 8-op elementwise chain on 16M float32 elements (written back to
    its variable by an assign), compiled with the default passes (one generated
    kernel, gpu.py) divided by the same with ``fuse_elementwise`` disabled (one
    kernel per op). Elementwise kernels are bound by memory traffic, which fusion
    divides by about the chain's length.
``gpu_fused_chain_kernels``
    Kernel launches per run for the chain in the fused program (the note gives the
    unfused count).
``gpu_two_stream_overlap``
    Two independent branches of small matmuls compiled with ``streams=2`` and a
    timeline (timed with CUDA events): the fraction of the less busy stream's busy
    time during which the other stream was busy too. The note gives the run time
    on two streams against one.

Fairness: the MLP implementations start from the same weights and are checked to
compute the same loss and updated weights before timing; steps are timed
interleaved round after round, and each figure is the median of per-round ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from core_bench import TorchStep

import tinyflow as tf
from tinyflow import backend
from tinyflow.ops import REGISTRY

LEARNING_RATE = 0.01
SEED = 0
NO_GPU = "skipped: no GPU (CuPy not installed or no CUDA device)"

MLP_GOAL, FUSED_GOAL, KERNELS_GOAL, OVERLAP_GOAL = "<= 1.2", "<= 0.5", "<= 1", ">= 0.5"
FIGURES = [("gpu_mlp_step_vs_torch", MLP_GOAL, "x"),
           ("gpu_mlp4096_step_vs_torch", MLP_GOAL, "x"),
           ("gpu_fused_chain_vs_unfused", FUSED_GOAL, "x"),
           ("gpu_fused_chain_kernels", KERNELS_GOAL, "kernels"),
           ("gpu_two_stream_overlap", OVERLAP_GOAL, "fraction")]


# ----------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------

def time_interleaved(steps: dict[str, Callable[[], Any]], warmup: int, rounds: int,
                     xp: Any) -> dict[str, list[float]]:
    """Seconds per call of each function, round-robin with a rotating start; the
    device is synchronized before and after each call, so a call's time is its
    work on the GPU, not the launches it queued."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    backend.synchronize(xp)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            backend.synchronize(xp)
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator))


# ----------------------------------------------------------------------------------
# MLP step: TinyFlow on CUDA against PyTorch CUDA
# ----------------------------------------------------------------------------------

def make_problem(sizes: tuple[int, ...], batch: int):
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((batch, sizes[0]), dtype=np.float32)
    labels = rng.integers(0, sizes[-1], batch).astype(np.int64)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = 1.0 / np.sqrt(fan_in)
        params.append(rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32))
        params.append(rng.uniform(-bound, bound, fan_out).astype(np.float32))
    return x, labels, params


class TinyFlowCudaStep:
    def __init__(self, x, labels, params) -> None:
        self.x = tf.placeholder(tf.float32, x.shape)
        self.labels = tf.placeholder(tf.int64, labels.shape)
        self.variables = [tf.Variable(p) for p in params]
        h = self.x
        depth = len(params) // 2
        for layer in range(depth):
            h = tf.matmul(h, self.variables[2 * layer]) + self.variables[2 * layer + 1]
            if layer < depth - 1:
                h = tf.nn.relu(h)
        self.loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(logits=h, labels=self.labels))
        self.train = tf.train.GradientDescentOptimizer(LEARNING_RATE).minimize(self.loss)
        self.session = tf.Session(device="cuda")
        self.session.run(tf.global_variables_initializer())
        self.feed = {self.x: x, self.labels: labels}

    def step(self) -> float:
        loss, _ = self.session.run([self.loss, self.train], self.feed)
        return float(loss)

    def weights(self) -> list[np.ndarray]:
        return [backend.to_host(self.session.variables[v]) for v in self.variables]


def check_same_step(steps: dict[str, Any]) -> None:
    losses = {name: impl.step() for name, impl in steps.items()}
    (ref_name, ref), *others = steps.items()
    for name, impl in others:
        if not np.isclose(losses[name], losses[ref_name], rtol=1e-4, atol=1e-5):
            raise AssertionError(f"GPU benchmark step disagrees: loss {name}="
                                 f"{losses[name]} vs {ref_name}={losses[ref_name]}")
        for k, (got, want) in enumerate(zip(impl.weights(), ref.weights())):
            if not np.allclose(got, want, rtol=1e-3, atol=1e-5):
                raise AssertionError(f"GPU benchmark step disagrees: parameter {k} after "
                                     f"one step, {name} vs {ref_name}")


def mlp_figure(name: str, sizes: tuple[int, ...], batch: int, rounds: int, xp: Any) -> dict:
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        return {"name": name, "value": float("nan"), "goal": MLP_GOAL, "unit": "x",
                "note": "skipped: PyTorch with CUDA not installed"}
    torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS in float32, as CuPy's
    x, labels, params = make_problem(sizes, batch)
    impls = {"tinyflow": TinyFlowCudaStep(x, labels, params),
             "torch": TorchStep(None, x, labels, params, device="cuda")}
    check_same_step(impls)
    times = time_interleaved({n: i.step for n, i in impls.items()}, 3, rounds, xp)
    ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    model = "-".join(map(str, sizes)) + f" MLP, batch {batch}, SGD, float32"
    return {"name": name, "value": paired_ratio(times["tinyflow"], times["torch"]),
            "goal": MLP_GOAL, "unit": "x",
            "note": f"{model}; tinyflow {ms['tinyflow']:.2f} ms, torch {torch.__version__} "
                    f"{ms['torch']:.2f} ms per step (medians of {rounds} interleaved rounds)"}


# ----------------------------------------------------------------------------------
# Fused against unfused elementwise chain
# ----------------------------------------------------------------------------------

def build_chain(elements: int):
    """v <- an 8-op chain of v (bounded by tanh), run for the assign's effect."""
    v = tf.Variable(np.random.default_rng(SEED).standard_normal(elements).astype(np.float32))
    y = tf.tanh(v * 0.5 + 0.25)
    y = tf.nn.relu(y * 1.5 - 0.1)
    y = tf.sigmoid(y) * 2.0
    return v, tf.group(tf.assign(v, y))


def chain_figures(elements: int, rounds: int, xp: Any) -> list[dict]:
    from tinyflow import gpu
    v, update = build_chain(elements)
    init = tf.global_variables_initializer()  # one initializer op, run by each Session
    sessions = {"fused": tf.Session(device="cuda"),
                "unfused": tf.Session(device="cuda", disable=("fuse_elementwise",))}
    for session in sessions.values():
        session.run(init)
        session.run(update)  # compile, and compile the kernels
    results = {name: backend.to_host(s.variables[v]) for name, s in sessions.items()}
    if not np.allclose(results["fused"], results["unfused"], rtol=1e-5, atol=1e-6):
        raise AssertionError("fused and unfused chains compute different values")
    kernels = {}
    for name, session in sessions.items():
        steps = session.last_program.steps
        launches = gpu.stats["launches"]
        session.run(update)
        fused_nodes = [s for s in steps if s.node.op == "fused_elementwise"]
        generated = gpu.stats["launches"] - launches
        elementwise = sum(1 for s in steps if REGISTRY[s.node.op].elementwise
                          and s.node.op != "fused_elementwise")
        # A fused node that did not launch a generated kernel ran op by op.
        op_by_op = sum(len(s.node.attrs["program"]) for s in fused_nodes) \
            if generated < len(fused_nodes) else 0
        kernels[name] = elementwise + generated + op_by_op
    times = time_interleaved({n: (lambda s=s: s.run(update)) for n, s in sessions.items()},
                             3, rounds, xp)
    ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    what = f"8-op elementwise chain on {elements:,} float32 (v <- chain(v))"
    return [{"name": "gpu_fused_chain_vs_unfused", "goal": FUSED_GOAL, "unit": "x",
             "value": paired_ratio(times["fused"], times["unfused"]),
             "note": f"{what}; fused {ms['fused']:.3f} ms, unfused {ms['unfused']:.3f} ms "
                     f"per run (medians of {rounds} interleaved rounds)"},
            {"name": "gpu_fused_chain_kernels", "goal": KERNELS_GOAL, "unit": "kernels",
             "value": float(kernels["fused"]),
             "note": f"{what}: elementwise kernel launches per run, fused "
                     f"{kernels['fused']} vs unfused {kernels['unfused']}"}]


# ----------------------------------------------------------------------------------
# Two streams
# ----------------------------------------------------------------------------------

def _busy(events: list[dict], stream: int) -> list[tuple[float, float]]:
    """The merged [start, end] intervals during which `stream` ran a step."""
    spans = sorted((e["start"], e["end"]) for e in events if e["stream"] == stream)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def stream_overlap(events: list[dict], first: int, second: int) -> float:
    """Of the less busy stream's busy time, the fraction during which the other
    stream was busy too (1: fully overlapped, 0: they took turns). NaN when one
    of the streams ran nothing."""
    a, b = _busy(events, first), _busy(events, second)
    if not a or not b:
        return float("nan")
    together = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in a for b0, b1 in b)
    shorter = min(sum(e - s for s, e in a), sum(e - s for s, e in b))
    return together / shorter if shorter > 0 else float("nan")


def build_branches(size: int, depth: int):
    rng = np.random.default_rng(SEED)
    x = tf.Variable(rng.standard_normal((size, size)).astype(np.float32))
    outputs = []
    for _ in range(2):
        h = x
        for _ in range(depth):
            w = tf.Variable((rng.standard_normal((size, size)) / np.sqrt(size))
                            .astype(np.float32))
            h = tf.tanh(tf.matmul(h, w))
        outputs.append(h)
    return tf.reduce_sum(outputs[0] + outputs[1])


def overlap_figure(size: int, depth: int, rounds: int, xp: Any) -> dict:
    total = build_branches(size, depth)
    init = tf.global_variables_initializer()
    sessions = {"two": tf.Session(device="cuda", streams=2),
                "one": tf.Session(device="cuda", streams=1)}
    traced = tf.Session(device="cuda", streams=2, trace=True)
    for session in [*sessions.values(), traced]:
        session.run(init)
        session.run(total)
    timeline = traced.last_program.last_timeline
    fraction = stream_overlap(timeline, 0, 1)
    times = time_interleaved({n: (lambda s=s: s.run(total)) for n, s in sessions.items()},
                             3, rounds, xp)
    ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    return {"name": "gpu_two_stream_overlap", "goal": OVERLAP_GOAL, "unit": "fraction",
            "value": fraction,
            "note": f"two branches of {depth} matmul+tanh on {size}x{size} float32; "
                    f"2 streams {ms['two']:.3f} ms vs 1 stream {ms['one']:.3f} ms per run; "
                    "overlap read from the timeline's CUDA-event times"}


# ----------------------------------------------------------------------------------
# The contract
# ----------------------------------------------------------------------------------

def figures(quick: bool = False) -> list[dict]:
    """The GPU figures (see the module docstring); `quick` shrinks every size."""
    if not backend.gpu_available():
        return [{"name": name, "value": float("nan"), "goal": goal, "unit": unit,
                 "note": NO_GPU} for name, goal, unit in FIGURES]
    xp = backend.cuda_array_module()
    rounds = 3 if quick else 20
    rows = [mlp_figure("gpu_mlp_step_vs_torch",
                       (784, 64, 64, 10) if quick else (784, 1024, 1024, 10),
                       32 if quick else 512, rounds, xp),
            mlp_figure("gpu_mlp4096_step_vs_torch",
                       (784, 256, 256, 10) if quick else (784, 4096, 4096, 10),
                       256 if quick else 4096, rounds, xp)]
    rows += chain_figures(1 << 14 if quick else 1 << 24, rounds, xp)
    rows.append(overlap_figure(64 if quick else 256, 2 if quick else 8, rounds, xp))
    return rows
