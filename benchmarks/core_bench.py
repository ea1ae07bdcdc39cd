"""Core speed: how much a TinyFlow training step costs over the same work done by hand.

Three figures, each measured against a reference in the same process and run:

``mlp_step_vs_numpy``
    One SGD training step (forward, backward, update, and the loss fetched) of a
    784-1024-1024-10 ReLU MLP on a batch of 512 float32 examples, run through
    ``tf.Session.run``, divided by the same step written by hand in numpy: every
    intermediate preallocated and written with ``out=``, transposes as BLAS flags
    (views, never copies), updates in place. Both call the same BLAS, so the ratio is
    what the framework costs on top of the arithmetic (extra passes over memory,
    allocation, Python per op).
``mlp_step_vs_torch``
    The same TinyFlow step divided by the idiomatic PyTorch CPU step
    (``nn.Sequential``, ``F.cross_entropy``, ``optim.SGD``, ``zero_grad(set_to_none)``).
    PyTorch is optional; without it the row says ``skipped: torch not installed``.
    PyTorch uses its own BLAS (MKL or oneDNN), so the note also gives numpy/torch:
    the part of the gap that is BLAS, not TinyFlow.
``overhead_us_per_node``
    A 1000-node chain of tiny elementwise ops (add, mul, tanh, neg in turn) on a
    one-element array, compiled with ``passes=[]`` so nothing is fused or folded
    away: run time of the Program divided by the number of ops, in microseconds.
    The kernel itself does almost nothing, so this is the executor's per-node cost
    (dispatch, argument gathering, `out=` handling). The note gives the cost of
    the same numpy calls in a bare Python loop, the floor any executor pays.

Fairness. The three MLP steps start from the same weights and are checked, before
timing, to compute the same loss and the same updated weights (a benchmark of two
different computations would be meaningless). They run interleaved, round after
round, in a rotating order, so a noisy neighbour slows all of them alike; the
figure is the median of the per-round ratios. Every library gets the same number of
threads (``TINYFLOW_BENCH_THREADS``, default 1: see `bench_threads`), set with
threadpoolctl for BLAS and OpenMP and with ``torch.set_num_threads``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

import tinyflow as tf

LEARNING_RATE = 0.01
SEED = 0


@dataclass(frozen=True)
class MLPConfig:
    """The benchmarked model: layer sizes, batch size, and how long to measure."""

    sizes: tuple[int, ...]
    batch: int
    warmup: int
    rounds: int


FULL_MLP = MLPConfig(sizes=(784, 1024, 1024, 10), batch=512, warmup=3, rounds=25)
# quick=True (the smoke test) checks that the benchmark runs, not its speed.
QUICK_MLP = MLPConfig(sizes=(784, 64, 64, 10), batch=32, warmup=1, rounds=3)

CHAIN_NODES, CHAIN_RUNS = 1000, 200
QUICK_CHAIN_NODES, QUICK_CHAIN_RUNS = 100, 5


def bench_threads() -> int:
    """Threads every library gets: $TINYFLOW_BENCH_THREADS, else 1.

    One by default because a multi-threaded BLAS on a machine shared with other
    work measures the scheduler: when a core is busy elsewhere, a step waits for its
    second BLAS thread to be scheduled (on a loaded 2-core machine a 0.1 ms numpy
    step took 40 ms). One thread measures cost per core, reproducibly; more threads
    make the matmuls faster and so TinyFlow's own overhead a larger share.
    """
    return int(os.environ.get("TINYFLOW_BENCH_THREADS") or 1)


def limit_threads(stack: ExitStack, threads: int) -> str:
    """Give BLAS/OpenMP (numpy's and torch's) `threads` threads for the stack's
    lifetime; return how that was done, for the figures' notes."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return "threads: library defaults (threadpoolctl not installed)"
    stack.enter_context(threadpool_limits(limits=threads))
    return f"{threads} thread{'s' if threads > 1 else ''} (threadpoolctl)"


# ----------------------------------------------------------------------------------
# The model, its data and weights (shared by the three implementations)
# ----------------------------------------------------------------------------------

def make_problem(config: MLPConfig) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """A batch (x float32, labels int64) and the weights [W1, b1, W2, b2, ...]; W is
    (fan_in, fan_out) and each layer computes x @ W + b."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((config.batch, config.sizes[0]), dtype=np.float32)
    labels = rng.integers(0, config.sizes[-1], config.batch).astype(np.int64)
    params = []
    for fan_in, fan_out in zip(config.sizes[:-1], config.sizes[1:]):
        bound = 1.0 / np.sqrt(fan_in)
        params.append(rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32))
        params.append(rng.uniform(-bound, bound, fan_out).astype(np.float32))
    return x, labels, params


class TinyFlowStep:
    """The model in TinyFlow's TF1 API; `step()` is one `Session.run` of it."""

    def __init__(self, config: MLPConfig, x: np.ndarray, labels: np.ndarray,
                 params: list[np.ndarray]) -> None:
        self.x = tf.placeholder(tf.float32, (config.batch, config.sizes[0]), name="x")
        self.labels = tf.placeholder(tf.int64, (config.batch,), name="labels")
        self.variables = [tf.Variable(p) for p in params]
        h = self.x
        for layer in range(len(params) // 2):
            weight, bias = self.variables[2 * layer], self.variables[2 * layer + 1]
            h = tf.matmul(h, weight) + bias
            if layer < len(params) // 2 - 1:
                h = tf.nn.relu(h)
        self.loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(logits=h, labels=self.labels))
        self.train = tf.train.GradientDescentOptimizer(LEARNING_RATE).minimize(self.loss)
        self.session = tf.Session()
        self.session.run(tf.global_variables_initializer())
        self.feed = {self.x: x, self.labels: labels}

    def step(self) -> float:
        loss, _ = self.session.run([self.loss, self.train], self.feed)
        return float(loss)

    def weights(self) -> list[np.ndarray]:
        return [self.session.variables[v] for v in self.variables]

    def describe(self) -> str:
        """The options the Session compiled with (the defaults), for the note."""
        options = getattr(self.session.last_program, "options", {})
        memory = options.get("memory", "?")
        passes = "default pipeline" if options.get("passes") is None else options["passes"]
        return f"Session defaults (passes: {passes}, memory={memory!r})"


class NumpyStep:
    """The same step by hand in numpy, as a careful numpy programmer writes it.

    Every activation and gradient has a preallocated buffer that BLAS and the ufuncs
    write into (``out=``); transposed operands are views, which numpy hands to BLAS
    as a transpose flag; the update is in place. The only allocations per step are
    the small (batch, 1) row reductions of the softmax and the relu masks.
    """

    def __init__(self, config: MLPConfig, x: np.ndarray, labels: np.ndarray,
                 params: list[np.ndarray]) -> None:
        self.x, self.labels = x, labels
        self.params = [p.copy() for p in params]
        self.rows = np.arange(config.batch)
        batch, widths = config.batch, config.sizes[1:]
        self.acts = [np.empty((batch, w), np.float32) for w in widths]   # h1, h2, logits
        self.dacts = [np.empty((batch, w), np.float32) for w in widths]  # their gradients
        self.grads = [np.empty_like(p) for p in self.params]

    def step(self) -> float:
        weights, biases = self.params[0::2], self.params[1::2]
        depth = len(weights)
        # Forward: h = relu(h_prev @ W + b), the last layer without relu.
        inputs = [self.x] + self.acts[:-1]
        for layer in range(depth):
            h = np.matmul(inputs[layer], weights[layer], out=self.acts[layer])
            h += biases[layer]
            if layer < depth - 1:
                np.maximum(h, 0.0, out=h)
        # Softmax cross entropy, mean over the batch; its gradient is (p - onehot) / B.
        logits, dlogits = self.acts[-1], self.dacts[-1]
        logits -= logits.max(axis=1, keepdims=True)
        np.exp(logits, out=dlogits)
        total = dlogits.sum(axis=1, keepdims=True)
        loss = float(np.log(total).mean() - logits[self.rows, self.labels].mean())
        dlogits /= total
        dlogits[self.rows, self.labels] -= 1.0
        dlogits *= 1.0 / len(self.rows)
        # Backward: dW = h_prev^T @ dh, db = sum(dh), dh_prev = (dh @ W^T) * (h_prev > 0).
        for layer in reversed(range(depth)):
            dh = self.dacts[layer]
            np.matmul(inputs[layer].T, dh, out=self.grads[2 * layer])
            np.sum(dh, axis=0, out=self.grads[2 * layer + 1])
            if layer > 0:
                dprev = np.matmul(dh, weights[layer].T, out=self.dacts[layer - 1])
                dprev *= inputs[layer] > 0
        # Update in place: W -= lr * dW.
        for param, grad in zip(self.params, self.grads):
            grad *= LEARNING_RATE
            param -= grad
        return loss

    def weights(self) -> list[np.ndarray]:
        return self.params


class TorchStep:
    """The same step in idiomatic PyTorch: nn.Sequential and optim.SGD, on the CPU or
    (`device="cuda"`, gpu_bench's reference) on a GPU, where the batch is copied to
    the device every step as tinyflow's feeds are. `config` is unused (every step
    class takes the same arguments)."""

    def __init__(self, config: MLPConfig | None, x: np.ndarray, labels: np.ndarray,
                 params: list[np.ndarray], device: str = "cpu") -> None:
        import torch
        self.torch = torch
        self.device = device
        layers: list[Any] = []
        for layer in range(len(params) // 2):
            weight, bias = params[2 * layer], params[2 * layer + 1]
            linear = torch.nn.Linear(*weight.shape)
            with torch.no_grad():  # torch keeps W as (out, in)
                linear.weight.copy_(torch.from_numpy(weight.T.copy()))
                linear.bias.copy_(torch.from_numpy(bias))
            layers += [linear, torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers[:-1]).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)
        self.x, self.labels = torch.from_numpy(x), torch.from_numpy(labels)  # no copies

    def step(self) -> float:
        x, labels = self.x.to(self.device), self.labels.to(self.device)  # CPU: no copy
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.cross_entropy(self.model(x), labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def weights(self) -> list[np.ndarray]:
        out = []
        for module in self.model:
            if isinstance(module, self.torch.nn.Linear):
                out += [module.weight.detach().cpu().numpy().T,
                        module.bias.detach().cpu().numpy()]
        return out


def check_same_step(steps: dict[str, Any]) -> None:
    """Run one step of each implementation and require the same loss and weights,
    so that the timed code really is the same computation everywhere."""
    losses = {name: impl.step() for name, impl in steps.items()}
    ref_name, ref = next(iter(steps.items()))
    for name, impl in steps.items():
        if not np.isclose(losses[name], losses[ref_name], rtol=1e-4, atol=1e-5):
            raise AssertionError(f"benchmark step disagrees: loss {name}={losses[name]} "
                                 f"vs {ref_name}={losses[ref_name]}")
        for k, (got, want) in enumerate(zip(impl.weights(), ref.weights())):
            if not np.allclose(got, want, rtol=1e-3, atol=1e-5):
                worst = float(np.max(np.abs(got - want)))
                raise AssertionError(f"benchmark step disagrees: parameter {k} after one "
                                     f"step, {name} vs {ref_name} differ by {worst:g}")


def time_interleaved(steps: dict[str, Callable[[], Any]], warmup: int, rounds: int
                     ) -> dict[str, list[float]]:
    """Seconds per call of each function, measured round-robin: in each round every
    function runs once, the starting one rotating, so load changes hit all alike."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of numerator/denominator (each round's pair shares its load)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def mlp_figures(config: MLPConfig, threads_note: str, threads: int,
                with_torch: bool = True) -> list[dict]:
    """mlp_step_vs_numpy and (when `with_torch`) mlp_step_vs_torch, measured together."""
    x, labels, params = make_problem(config)
    impls: dict[str, Any] = {"tinyflow": TinyFlowStep(config, x, labels, params),
                             "numpy": NumpyStep(config, x, labels, params)}
    torch = None
    if with_torch:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is not None:
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        impls["torch"] = TorchStep(config, x, labels, params)
    try:
        check_same_step(impls)
        times = time_interleaved({n: i.step for n, i in impls.items()},
                                 config.warmup, config.rounds)
    finally:
        if torch is not None:
            torch.set_num_threads(torch_threads)
    ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    model = "-".join(map(str, config.sizes)) + f" MLP, batch {config.batch}, SGD, float32"
    spread = _spread(times["tinyflow"], times["numpy"])
    rows = [{"name": "mlp_step_vs_numpy", "goal": "<= 1.15", "unit": "x",
             "value": paired_ratio(times["tinyflow"], times["numpy"]),
             "note": f"{model}; tinyflow {ms['tinyflow']:.1f} ms, numpy {ms['numpy']:.1f} ms "
                     f"per step (medians of {config.rounds} interleaved rounds; per-round "
                     f"ratio {spread}); {impls['tinyflow'].describe()}; {threads_note}"}]
    if not with_torch:
        return rows
    if torch is None:
        rows.append({"name": "mlp_step_vs_torch", "goal": "<= 1.3", "unit": "x",
                     "value": float("nan"), "note": "skipped: torch not installed"})
    else:
        rows.append({"name": "mlp_step_vs_torch", "goal": "<= 1.3", "unit": "x",
                     "value": paired_ratio(times["tinyflow"], times["torch"]),
                     "note": f"torch {torch.__version__} {ms['torch']:.1f} ms per step; "
                             f"numpy/torch {paired_ratio(times['numpy'], times['torch']):.2f}"
                             " (the BLAS part of the gap); " + threads_note})
    return rows


def _spread(a: list[float], b: list[float]) -> str:
    ratios = sorted(x / y for x, y in zip(a, b))
    return f"{ratios[0]:.2f}..{ratios[-1]:.2f}"


# ----------------------------------------------------------------------------------
# Per-node overhead
# ----------------------------------------------------------------------------------

def build_chain(length: int) -> tuple[tf.Node, tf.Node, tf.Node]:
    """x -> add c -> mul c -> tanh -> neg -> add c ... (`length` op nodes).

    Returns (x, c, y). Values stay bounded (tanh), so no step meets NaN or Inf."""
    x = tf.placeholder(tf.float32, (1,), name="chain_x")
    c = tf.constant(np.float32(0.5))
    y = x
    for i in range(length):
        kind = i % 4
        y = y + c if kind == 0 else y * c if kind == 1 else tf.tanh(y) if kind == 2 else -y
    return x, c, y


def numpy_chain(length: int, value: np.ndarray) -> Callable[[], np.ndarray]:
    """The same chain as bare numpy calls in a Python loop: the floor of the cost."""
    c = np.float32(0.5)
    calls = [(np.add, c), (np.multiply, c), (np.tanh, None), (np.negative, None)]

    def run() -> np.ndarray:
        y = value
        for i in range(length):
            fn, arg = calls[i % 4]
            y = fn(y) if arg is None else fn(y, arg)
        return y
    return run


def overhead_figure(length: int, runs: int) -> dict:
    x, _, y = build_chain(length)
    program = tf.compile([y], {x: ((1,), np.float32)}, {}, passes=[])
    value = np.full((1,), 0.25, np.float32)
    feeds: dict = {x: value}
    bare = numpy_chain(length, value)
    got, want = program.run(feeds, {})[0], bare()
    if not np.allclose(got, want, rtol=1e-5):
        raise AssertionError(f"chain benchmark computes {got}, numpy gives {want}")
    times = time_interleaved({"tinyflow": lambda: program.run(feeds, {}), "numpy": bare},
                             warmup=3, rounds=runs)
    # Divided by the chain's op nodes (the shared constant is not counted), so the
    # figure does not depend on how the Program stores its steps.
    per_node = 1e6 * statistics.median(times["tinyflow"]) / length
    floor = 1e6 * statistics.median(times["numpy"]) / length
    memory = getattr(program, "options", {}).get("memory", "default")
    return {"name": "overhead_us_per_node", "goal": "<= 10", "unit": "us",
            "value": per_node,
            "note": f"{length}-op chain of add/mul/tanh/neg on 1 element, passes=[], "
                    f"memory={memory!r}; median Program.run of {runs} / {length}; the same "
                    f"numpy calls in a bare loop: {floor:.2f} us/op"}


# ----------------------------------------------------------------------------------
# The contract: figures(quick) -> rows
# ----------------------------------------------------------------------------------

def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    """The core-speed figures (see the module docstring). `quick` shrinks the model
    and the runs to a smoke test; `only` keeps the figures whose name contains it."""
    want = lambda name: only is None or only in name  # noqa: E731
    threads = bench_threads()
    rows: list[dict] = []
    with ExitStack() as stack:
        threads_note = limit_threads(stack, threads)
        if want("mlp_step_vs_numpy") or want("mlp_step_vs_torch"):
            config = QUICK_MLP if quick else FULL_MLP
            rows += [r for r in mlp_figures(config, threads_note, threads,
                                            with_torch=want("mlp_step_vs_torch"))
                     if want(r["name"])]
        if want("overhead_us_per_node"):
            length, runs = ((QUICK_CHAIN_NODES, QUICK_CHAIN_RUNS) if quick
                            else (CHAIN_NODES, CHAIN_RUNS))
            rows.append(overhead_figure(length, runs))
    return rows


if __name__ == "__main__":
    for row in figures():
        print(f"{row['name']:24} {row['value']:8.3f} {row['unit']:3} goal {row['goal']:8} "
              f"{row['note']}")
