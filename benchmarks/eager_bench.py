"""Eager mode and tracing (tinyflow/eager.py) against PyTorch eager and the static plan.

``eager_overhead_vs_torch``
    A 1000-op chain of tiny ops (add, mul, tanh, neg on one float32 element), run
    eagerly: TinyFlow's time per op divided by PyTorch eager's on the same chain
    (no autograd on either side). The arithmetic is nothing, so this is the cost of
    dispatching one op in Python (TinyFlow: registry lookup, shape rule, allocator,
    kernel into `out`) against PyTorch's C++ dispatcher.
``traced_vs_eager_small_ops``
    The same chain decorated with ``tf.function``: one compiled Program (fused
    into a few kernels) per call, divided by the eager chain. What tracing buys.
``eager_mlp_step_vs_torch``
    One SGD training step of the 784-1024-1024-10 MLP, batch 512 (core_bench's
    problem), written PyTorch-style (tf.nn.MLP's Linear and ReLU layers made eager,
    as the PyTorch step uses nn.Linear), divided by the PyTorch step.
``allocator_reserved_over_arena_mlp`` / ``_cnn`` / ``_transformer``
    The caching allocator's peak reserved bytes over one eager training step, divided
    by the static plan's arena for the same step traced. The issue sets no goal (ours:
    within 10x): the caching allocator rounds (512 B) and reserves whole segments
    (2 MiB / 20 MiB), and cannot know the future, while the plan sees every lifetime
    before it starts. On the small CNN one 1.2 MiB request takes a 20 MiB segment of
    its own (PyTorch's rule), which alone is 10x its 1.95 MiB arena.

Timing is interleaved round-robin with one thread per library, as in core_bench.
"""

from __future__ import annotations

import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

import tinyflow as tf
from tinyflow import eager as E
from tinyflow import tracing

from core_bench import (FULL_MLP, QUICK_MLP, LEARNING_RATE, TorchStep, bench_threads,
                        check_same_step, limit_threads, make_problem, paired_ratio,
                        time_interleaved)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tutorials"))

CHAIN, QUICK_CHAIN = 1000, 100


def _eager_chain(length: int, x: E.Tensor) -> Any:
    c = np.float32(0.5)
    y = x
    for i in range(length):
        kind = i % 4
        y = y + c if kind == 0 else y * c if kind == 1 else tf.tanh(y) if kind == 2 else -y
    return y


def _torch_chain(torch: Any, length: int, x: Any) -> Any:
    y = x
    for i in range(length):
        kind = i % 4
        y = y + 0.5 if kind == 0 else y * 0.5 if kind == 1 else torch.tanh(y) if kind == 2 \
            else -y
    return y


def chain_figures(length: int, rounds: int) -> list[dict]:
    x = E.tensor(np.full((1,), 0.25, np.float32))
    eager_run = lambda: _eager_chain(length, x)  # noqa: E731
    traced = tf.function(lambda v: _eager_chain(length, v))
    traced_run = lambda: traced(x)  # noqa: E731
    steps = {"eager": eager_run, "traced": traced_run}
    want = eager_run().numpy()
    got = traced_run().numpy()
    if not np.array_equal(want, got):
        raise AssertionError(f"traced chain gives {got}, eager {want}")
    try:
        import torch
        tx = torch.full((1,), 0.25)
        steps["torch"] = lambda: _torch_chain(torch, length, tx)
        if not np.allclose(steps["torch"]().numpy(), want, rtol=1e-5):
            raise AssertionError("torch chain disagrees with the eager chain")
    except ImportError:
        torch = None
    with E.no_grad():
        times = time_interleaved(steps, warmup=3, rounds=rounds)
    eager_us = 1e6 * statistics.median(times["eager"]) / length
    rows = []
    if torch is None:
        rows.append({"name": "eager_overhead_vs_torch", "goal": "<= 1.0", "unit": "x",
                     "value": float("nan"), "note": "skipped: torch not installed"})
    else:
        torch_us = 1e6 * statistics.median(times["torch"]) / length
        rows.append({"name": "eager_overhead_vs_torch", "goal": "<= 1.0", "unit": "x",
                     "value": paired_ratio(times["eager"], times["torch"]),
                     "note": f"{length}-op chain of add/mul/tanh/neg on 1 float32: tinyflow "
                             f"eager {eager_us:.2f} us/op, torch {torch.__version__} eager "
                             f"{torch_us:.2f} us/op (no autograd on either)"})
    rows.append({"name": "traced_vs_eager_small_ops", "goal": "<= 0.33", "unit": "x",
                 "value": paired_ratio(times["traced"], times["eager"]),
                 "note": f"the same chain through tf.function: "
                         f"{1e6 * statistics.median(times['traced']) / length:.2f} us/op "
                         f"traced vs {eager_us:.2f} eager"})
    return rows


class EagerStep:
    """core_bench's MLP step, PyTorch-style: the model is tf.nn.MLP (Linear and ReLU
    layers, as TorchStep's nn.Sequential of nn.Linear) made eager by to_eager, with
    the problem's weights, and eager.SGD."""

    def __init__(self, config: Any, x: np.ndarray, labels: np.ndarray,
                 params: list[np.ndarray]) -> None:
        self.x, self.labels = E.tensor(x), E.tensor(labels)
        self.model = E.to_eager(tf.nn.MLP(config.sizes))
        self.params = E.parameters(self.model)   # W (in, out) then b, layer by layer
        with E.no_grad():
            for param, value in zip(self.params, params, strict=True):
                param.assign_(value)
        self.optimizer = E.SGD(self.params, lr=LEARNING_RATE)

    def step(self) -> float:
        self.optimizer.zero_grad()
        logits = self.model(self.x)
        loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(logits, self.labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def weights(self) -> list[np.ndarray]:
        return [p.numpy() for p in self.params]


def mlp_figure(config: Any, threads: int, threads_note: str) -> dict:
    try:
        import torch
    except ImportError:
        return {"name": "eager_mlp_step_vs_torch", "goal": "<= 1.1", "unit": "x",
                "value": float("nan"), "note": "skipped: torch not installed"}
    x, labels, params = make_problem(config)
    impls = {"eager": EagerStep(config, x, labels, params),
             "torch": TorchStep(config, x, labels, params)}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_same_step(impls)
        times = time_interleaved({n: i.step for n, i in impls.items()},
                                 config.warmup, config.rounds)
    finally:
        torch.set_num_threads(before)
    ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    model = "-".join(map(str, config.sizes)) + f" MLP, batch {config.batch}, SGD"
    return {"name": "eager_mlp_step_vs_torch", "goal": "<= 1.1", "unit": "x",
            "value": paired_ratio(times["eager"], times["torch"]),
            "note": f"{model}: eager {ms['eager']:.1f} ms, torch {ms['torch']:.1f} ms per step; "
                    + threads_note}


def _mlp_model(quick: bool) -> tuple[Any, tuple]:
    sizes = [64, 128, 10] if quick else [784, 1024, 1024, 10]
    model = E.to_eager(tf.nn.MLP(sizes))
    rng = np.random.default_rng(0)
    x = E.tensor(rng.standard_normal((32 if quick else 512, sizes[0]), dtype=np.float32))
    y = E.tensor(rng.integers(0, 10, x.shape[0]))
    return model, (x, y)


def _cnn_model(quick: bool) -> tuple[Any, tuple]:
    import train_cnn

    class CNN:
        def __init__(self) -> None:
            self.w1 = train_cnn.uniform_variable((8, 1, 3, 3), 9, "w1", 1)
            self.b1 = tf.Variable(tf.zeros((8,)), name="b1")
            self.w2 = train_cnn.uniform_variable((16, 8, 3, 3), 72, "w2", 2)
            self.b2 = tf.Variable(tf.zeros((16,)), name="b2")
            self.fc = train_cnn.uniform_variable((64, 10), 64, "fc", 3)

        def __call__(self, x: Any) -> Any:
            h = train_cnn.conv_block(x, self.w1, self.b1)
            h = train_cnn.conv_block(h, self.w2, self.b2)
            return tf.matmul(tf.reshape(h, (-1, 64)), self.fc)
    rng = np.random.default_rng(0)
    batch = 16 if quick else 128
    x = E.tensor(rng.standard_normal((batch, 1, 8, 8), dtype=np.float32))
    return E.to_eager(CNN()), (x, E.tensor(rng.integers(0, 10, batch)))


def _transformer_model(quick: bool) -> tuple[Any, tuple]:
    from train_charlm import CharTransformer
    context = 16 if quick else 64
    model = CharTransformer(40, context, 32 if quick else 64, 4, 1 if quick else 2, seed=0)
    E.to_eager(model)
    positions = E.tensor(np.arange(context))
    ids = np.random.default_rng(0).integers(0, 40, (4 if quick else 16, context))
    return (lambda i: model(i, positions)), (E.tensor(ids), E.tensor(ids.reshape(-1)))


def _segments_note(events: list[dict]) -> str:
    """Where the reserved bytes went: PyTorch's rule gives requests up to 1 MiB
    shared 2 MiB segments and each larger one (under 10 MiB) a 20 MiB segment, so on
    a small model one request just over 1 MiB can be most of what is reserved."""
    segments = [e["size"] for e in events if e["event"] == "segment_alloc"]
    small = sum(1 for size in segments if size == 2 << 20)
    large = [size >> 20 for size in segments if size != 2 << 20]
    over = [e["requested"] for e in events
            if e["event"] == "alloc" and e["requested"] > 1 << 20]
    return (f"segments: {small} x 2 MiB (small pool), large pool "
            f"{' + '.join(f'{m} MiB' for m in large) or 'none'} for {len(over)} requests "
            f"over 1 MiB (largest {max(over, default=0) / 2**20:.2f} MiB)")


def allocator_figures(quick: bool) -> list[dict]:
    rows = []
    for name, build in [("mlp", _mlp_model), ("cnn", _cnn_model),
                        ("transformer", _transformer_model)]:
        model, batch = build(quick)
        params = getattr(model, "eager_parameters", None) or [
            t for t in _closure_params(model)]
        report = tracing.memory_comparison(_sgd_step(model, E.SGD(params, lr=0.01)), *batch)
        mib = lambda b: b / 2**20  # noqa: E731
        rows.append({"name": f"allocator_reserved_over_arena_{name}", "goal": "<= 10",
                     "unit": "x", "value": report["caching_reserved"] / report["static_arena"],
                     "note": f"one SGD step: caching allocator reserved "
                             f"{mib(report['caching_reserved']):.2f} MiB (allocated peak "
                             f"{mib(report['caching_allocated']):.2f}), plain malloc peak "
                             f"{mib(report['malloc_peak']):.2f}, static arena "
                             f"{mib(report['static_arena']):.2f} (lower bound "
                             f"{mib(report['static_lower_bound']):.2f}); "
                             + _segments_note(report["events"]) + "; the issue sets no "
                             "goal, ours: within 10x of the plan"})
    return rows


def _sgd_step(model: Any, opt: E.Optimizer) -> Any:
    def step(x: Any, y: Any) -> Any:
        opt.zero_grad()
        loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def _closure_params(forward: Any) -> list[E.Tensor]:
    for cell in forward.__closure__ or ():
        model = cell.cell_contents
        if hasattr(model, "eager_parameters"):
            return model.eager_parameters
    raise ValueError("no eager model found")


def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    want = lambda name: only is None or only in name  # noqa: E731
    threads = bench_threads()
    rows: list[dict] = []
    with ExitStack() as stack:
        threads_note = limit_threads(stack, threads)
        if want("eager_overhead_vs_torch") or want("traced_vs_eager_small_ops"):
            rows += [r for r in chain_figures(QUICK_CHAIN if quick else CHAIN,
                                              5 if quick else 30) if want(r["name"])]
        if want("eager_mlp_step_vs_torch"):
            rows.append(mlp_figure(QUICK_MLP if quick else FULL_MLP, threads, threads_note))
        if want("allocator_reserved_over_arena"):
            rows += [r for r in allocator_figures(quick) if want(r["name"])]
    return rows


if __name__ == "__main__":
    for row in figures():
        print(f"{row['name']:36} {row['value']:8.3f} {row['unit']:3} goal {row['goal']:8} "
              f"{row['note']}")
