"""Memory: how close the arena planner gets to the lower bound, and what gradient
checkpointing saves and costs.

Every figure comes from programs compiled the way users get them
(``tf.compile(..., memory="auto")``, with the default passes), so it measures the
planner under the executor's own schedule:

``arena_over_lower_bound_mlp`` / ``_cnn`` / ``_transformer``
    Arena bytes of the planned training step (forward, backward, update) divided by
    the lower bound: the most bytes alive at any one step of that schedule. No plan
    can beat the bound, so 1.00 means the heuristic wasted nothing. Models: the
    784-1024-1024-10 ReLU MLP of core_bench (batch 512, SGD); a three-block conv net
    on 3x32x32 images (batch 32, Adam); a two-block pre-LN transformer (d=128, 4
    heads, 64 tokens, batch 8, Adam).
``arena_over_naive_mlp``
    The same MLP arena divided by the sum of all its intermediates (no reuse at all):
    what planning saves over allocating every tensor once.
``checkpoint_memory_saving``
    A 64-layer, 256-wide ReLU MLP (batch 256, SGD): arena bytes of the training step
    without / with ``checkpoint="sqrt"`` (Chen et al. 2016). The note also gives the
    ratio of stored activations (forward values the backward reads) and the ratio
    under `sublinear.memory_order`, the memory-aware schedule.
``checkpoint_time_ratio``
    The same model: step time with / without checkpointing (one recomputed forward),
    interleaved rounds, median of the per-round ratios.

Threads: $TINYFLOW_BENCH_THREADS (default: the usable CPUs), set with threadpoolctl.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from typing import Any

import numpy as np
from core_bench import bench_threads, limit_threads

import tinyflow as tf
from tinyflow import memory, sublinear
from tinyflow.graph import reachable


# ----------------------------------------------------------------------------------
# Models: each returns (fetches, feeds {node: array}, params)
# ----------------------------------------------------------------------------------

def _params_under(fetches) -> list:
    under = {id(n) for n in reachable(fetches)}
    return [v for v in tf.global_variables() if id(v) in under]


def mlp_model(sizes, batch, seed=0):
    x = tf.placeholder(tf.float32, (batch, sizes[0]))
    y = tf.placeholder(tf.int64, (batch,))
    net = tf.nn.MLP(list(sizes))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(net(x), y))
    train = tf.train.SGD(0.01).minimize(loss)
    rng = np.random.default_rng(seed)
    feeds = {x: rng.normal(size=(batch, sizes[0])).astype(np.float32),
             y: rng.integers(0, sizes[-1], batch)}
    return [loss, train], feeds, _params_under([loss, train])


def cnn_model(batch, channels=(16, 32, 64), size=32, seed=0):
    x = tf.placeholder(tf.float32, (batch, 3, size, size))
    y = tf.placeholder(tf.int64, (batch,))
    layers, prev = [], 3
    for c in channels:
        layers += [tf.nn.Conv2d(prev, c, 3, padding=1), tf.nn.ReLU(), tf.nn.MaxPool2d(2)]
        prev = c
    side = size // 2 ** len(channels)
    layers += [tf.nn.Flatten(), tf.nn.Linear(prev * side * side, 128), tf.nn.ReLU(),
               tf.nn.Linear(128, 10)]
    logits = tf.nn.Sequential(*layers)(x)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(logits, y))
    train = tf.train.Adam(1e-3).minimize(loss)
    rng = np.random.default_rng(seed)
    feeds = {x: rng.normal(size=(batch, 3, size, size)).astype(np.float32),
             y: rng.integers(0, 10, batch)}
    return [loss, train], feeds, _params_under([loss, train])


def transformer_model(batch, seq, d, heads, blocks, vocab=256, seed=0):
    """Pre-LN transformer blocks (attention, then a 4x GELU MLP), next-token loss."""
    ids = tf.placeholder(tf.int64, (batch, seq))
    targets = tf.placeholder(tf.int64, (batch, seq))
    h = tf.nn.Embedding(vocab, d)(ids)
    dh = d // heads
    for b in range(blocks):
        qkv = tf.nn.Linear(d, 3 * d, name=f"qkv{b}")(tf.nn.LayerNorm(d, name=f"ln{b}a")(h))
        qkv = tf.transpose(tf.reshape(qkv, (batch, seq, 3, heads, dh)), (2, 0, 3, 1, 4))
        q, k, v = qkv[0], qkv[1], qkv[2]
        weights = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) * (1.0 / dh ** 0.5))
        mixed = tf.reshape(tf.transpose(tf.matmul(weights, v), (0, 2, 1, 3)), (batch, seq, d))
        h = h + tf.nn.Linear(d, d, name=f"proj{b}")(mixed)
        inner = tf.nn.gelu(tf.nn.Linear(d, 4 * d, name=f"fc{b}")(
            tf.nn.LayerNorm(d, name=f"ln{b}b")(h)))
        h = h + tf.nn.Linear(4 * d, d, name=f"out{b}")(inner)
    logits = tf.nn.Linear(d, vocab, name="head")(tf.nn.LayerNorm(d, name="lnf")(h))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(logits, targets))
    train = tf.train.Adam(1e-3).minimize(loss)
    rng = np.random.default_rng(seed)
    feeds = {ids: rng.integers(0, vocab, (batch, seq)), targets: rng.integers(0, vocab,
                                                                               (batch, seq))}
    return [loss, train], feeds, _params_under([loss, train])


def compile_program(fetches, feeds, params, **options) -> Any:
    return tf.compile(fetches, {n: (a.shape, a.dtype) for n, a in feeds.items()},
                      {p: (p.shape, p.dtype) for p in params}, memory="auto", **options)


# ----------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------

def _plan_figures(name, model, want) -> list[dict]:
    rows = []
    if not (want(f"arena_over_lower_bound_{name}") or
            (name == "mlp" and want("arena_over_naive_mlp"))):
        return rows
    program = compile_program(*model)
    plan = program.memory_plan
    tried = ", ".join(f"{k} {v / plan.lower_bound_bytes:.3f}"
                      for k, v in plan.strategies.items())
    order_peak = sublinear.peak_bytes(program.graph, sublinear.memory_order(program.graph))
    if want(f"arena_over_lower_bound_{name}"):
        rows.append({"name": f"arena_over_lower_bound_{name}",
                     "value": plan.arena_bytes / plan.lower_bound_bytes, "goal": "<= 1.05",
                     "unit": "x",
                     "note": f"arena {memory.format_bytes(plan.arena_bytes)}, bound "
                             f"{memory.format_bytes(plan.lower_bound_bytes)} over "
                             f"{len(program.steps)} steps; best {plan.strategy}; all: "
                             f"{tried}; memory_order would bring the bound to "
                             f"{memory.format_bytes(order_peak)}"})
    if name == "mlp" and want("arena_over_naive_mlp"):
        rows.append({"name": "arena_over_naive_mlp",
                     "value": plan.arena_bytes / plan.naive_bytes, "goal": "<= 0.5",
                     "unit": "x",
                     "note": f"arena {memory.format_bytes(plan.arena_bytes)} vs every "
                             f"intermediate its own bytes {memory.format_bytes(plan.naive_bytes)}"
                             "; the issue sets no goal, ours: planning at least halves it. "
                             "No plan can beat lower bound / naive = "
                             f"{plan.lower_bound_bytes / plan.naive_bytes:.3f} (a training "
                             "step keeps its activations alive for the backward pass)"})
    return rows


def _checkpoint_figures(config, want, rounds) -> list[dict]:
    rows = []
    if not (want("checkpoint_memory_saving") or want("checkpoint_time_ratio")):
        return rows
    fetches, feeds, params = mlp_model(*config)
    plain = compile_program(fetches, feeds, params)
    ckpt = compile_program(fetches, feeds, params, checkpoint="sqrt")
    graphs = (plain.graph, ckpt.graph)
    if want("checkpoint_memory_saving"):
        arena = [p.memory_plan.arena_bytes for p in (plain, ckpt)]
        stored = [sublinear.activation_bytes(g) for g in graphs]
        ordered = [sublinear.peak_bytes(g, sublinear.memory_order(g)) for g in graphs]
        layers = len(config[0]) - 2
        rows.append({"name": "checkpoint_memory_saving", "value": arena[0] / arena[1],
                     "goal": ">= 4", "unit": "x",
                     "note": f"{layers}-layer MLP width {config[0][1]} batch {config[1]}: "
                             f"arena {memory.format_bytes(arena[0])} -> "
                             f"{memory.format_bytes(arena[1])} (executor's schedule); "
                             f"under memory_order {memory.format_bytes(ordered[0])} -> "
                             f"{memory.format_bytes(ordered[1])} "
                             f"({ordered[0] / ordered[1]:.2f}x); stored activations "
                             f"{memory.format_bytes(stored[0])} -> "
                             f"{memory.format_bytes(stored[1])} "
                             f"({stored[0] / stored[1]:.1f}x)"})
    if want("checkpoint_time_ratio"):
        store = _initial_store(params)
        stores = [{k: v.copy() for k, v in store.items()} for _ in range(2)]
        programs = (plain, ckpt)
        for program, s in zip(programs, stores):   # warm up; same first loss
            program.run(feeds, s)
        ratios = []
        for r in range(rounds):
            seconds = [0.0, 0.0]
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                start = time.perf_counter()
                programs[k].run(feeds, stores[k])
                seconds[k] = time.perf_counter() - start
            ratios.append(seconds[1] / seconds[0])
        rows.append({"name": "checkpoint_time_ratio", "value": statistics.median(ratios),
                     "goal": "<= 1.35", "unit": "x",
                     "note": f"training step with / without checkpoint='sqrt', median of "
                             f"{rounds} interleaved rounds; {len(ckpt.steps)} vs "
                             f"{len(plain.steps)} steps"})
    return rows


def _initial_store(params) -> dict:
    """Weights: He initialisation (variance 2 / fan_in keeps activations' scale
    through 64 ReLU layers; smaller weights would decay them into denormals, which
    numpy's matmul handles a hundred times slower). Everything else (biases,
    optimizer slots and step counters) starts at zero."""
    rng = np.random.default_rng(0)
    trainable = {id(v) for v in tf.trainable_variables()}
    store = {}
    for p in params:
        store[p] = np.zeros(p.shape, p.dtype)
        if id(p) in trainable and len(p.shape) >= 2:
            fan_in = p.shape[0] if len(p.shape) == 2 else int(np.prod(p.shape[1:]))
            bound = np.sqrt(6.0 / fan_in)
            store[p] = rng.uniform(-bound, bound, p.shape).astype(p.dtype)
    return store


def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    """The memory figures (see the module docstring). `quick` shrinks every model to
    a smoke test; `only` keeps the figures whose name contains it."""
    want = lambda name: only is None or only in name  # noqa: E731
    rows: list[dict] = []
    with ExitStack() as stack:
        threads = limit_threads(stack, bench_threads())
        if quick:
            models = {"mlp": lambda: mlp_model((32, 32, 32, 10), 8),
                      "cnn": lambda: cnn_model(2, channels=(4, 8), size=8),
                      "transformer": lambda: transformer_model(2, 8, 16, 2, 1, vocab=16)}
            deep, rounds = (tuple([16] * 9 + [10]), 8), 2
        else:
            models = {"mlp": lambda: mlp_model((784, 1024, 1024, 10), 512),
                      "cnn": lambda: cnn_model(32),
                      "transformer": lambda: transformer_model(8, 64, 128, 4, 2)}
            deep, rounds = (tuple([256] * 65 + [10]), 256), 21
        for name, build in models.items():
            if want(f"arena_over_lower_bound_{name}") or (
                    name == "mlp" and want("arena_over_naive_mlp")):
                rows += _plan_figures(name, build(), want)
        rows += _checkpoint_figures(deep, want, rounds)
    for row in rows:
        if row["name"] == "checkpoint_time_ratio":
            row["note"] += f"; {threads}"
    return rows


if __name__ == "__main__":
    for row in figures():
        print(f"{row['name']:32} {row['value']:8.3f} {row['goal']:>8}  {row['note']}")
