"""What the graph passes do to real training graphs, and what they cost.

Figures (each measured against a reference in the same process and run):

``mlp_nodes_before`` / ``mlp_nodes_after``
    Nodes of the MLP training graph (forward, backward, Adam updates) as compiled
    with ``passes=[]`` and with the default pipeline.
``cnn_nodes_before`` / ``cnn_nodes_after``, ``transformer_nodes_before`` / ``..._after``
    The same for a small CNN (two conv + pool layers) and one pre-norm transformer
    block (causal self-attention and a GELU MLP), both trained with Adam.
``fused_vs_unfused_mlp_step``
    One training step of the MLP compiled with the default pipeline, divided by the
    same step compiled with ``passes=[]``: both Sessions start from the same
    weights, are checked to compute the same loss and updates, and run interleaved,
    round after round; the figure is the median of the per-round ratios.
``fused_vs_unfused_small_ops``
    The same ratio for Program.run of a 300-op chain of elementwise ops on 16
    floats: there the executor's per-step work is the cost, and fusion removes it.
    On a CPU the arithmetic of a fused node is still one numpy call per op, so the
    MLP step gains only the steps it no longer runs; this figure shows the other end.
``compile_ms_1k_nodes`` / ``compile_ms_10k_nodes``
    Milliseconds to specialize and run every pass on a ~1,000- and a ~10,000-node
    training graph (a deep residual tanh MLP with its gradients and SGD updates);
    the note says how the time grows from 1k to 10k nodes (10x is linear).

Run ``python benchmarks/passes_bench.py`` to also print `passes.explain` for the
three models.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
from core_bench import bench_threads, limit_threads, time_interleaved

import tinyflow as tf
from tinyflow import passes

SEED = 0


@dataclass
class Model:
    """A training graph ready to run: fetches, one batch of feeds, the initializer."""

    name: str
    fetches: list[tf.Node]
    feeds: dict[tf.Node, np.ndarray]
    init: tf.Node
    description: str


def build_mlp(sizes: tuple[int, ...] = (64, 256, 256, 10), batch: int = 32) -> Model:
    """tf.nn.MLP (ReLU) with softmax cross entropy and Adam, float32. The default is
    the model of tutorials/train_mlp.py (8x8 digits, two hidden layers of 256)."""
    rng = np.random.default_rng(SEED)
    x = tf.placeholder(tf.float32, (batch, sizes[0]), name="x")
    labels = tf.placeholder(tf.int64, (batch,), name="labels")
    net = tf.nn.MLP(list(sizes))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(net(x), labels))
    train = tf.train.AdamOptimizer(1e-3).minimize(loss)
    feeds = {x: rng.standard_normal((batch, sizes[0])).astype(np.float32),
             labels: rng.integers(0, sizes[-1], batch)}
    return Model("mlp", [train, loss], feeds, tf.global_variables_initializer(),
                 f"{'-'.join(map(str, sizes))} ReLU MLP, batch {batch}, Adam, float32")


def build_cnn(batch: int = 16) -> Model:
    """conv3x3(8)-relu-pool-conv3x3(16)-relu-pool-linear(10) on 12x12 images, Adam."""
    rng = np.random.default_rng(SEED)
    x = tf.placeholder(tf.float32, (batch, 1, 12, 12), name="images")
    labels = tf.placeholder(tf.int64, (batch,), name="labels")
    net = tf.nn.Sequential(
        tf.nn.Conv2d(1, 8, 3, padding=1, name="conv1"), tf.nn.ReLU(), tf.nn.MaxPool2d(2),
        tf.nn.Conv2d(8, 16, 3, padding=1, name="conv2"), tf.nn.ReLU(), tf.nn.MaxPool2d(2),
        tf.nn.Flatten(), tf.nn.Linear(16 * 3 * 3, 10, name="head"))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(net(x), labels))
    train = tf.train.AdamOptimizer(1e-3).minimize(loss)
    feeds = {x: rng.standard_normal((batch, 1, 12, 12)).astype(np.float32),
             labels: rng.integers(0, 10, batch)}
    return Model("cnn", [train, loss], feeds, tf.global_variables_initializer(),
                 f"2-conv CNN on 1x12x12, batch {batch}, Adam")


def build_transformer_block(batch: int = 4, length: int = 16, dim: int = 32,
                            heads: int = 4, vocab: int = 50) -> Model:
    """One pre-norm transformer block (GPT-2 layout) on token embeddings, with a
    next-token loss and Adam: ln -> causal multi-head attention -> residual ->
    ln -> linear-GELU-linear -> residual -> ln -> logits."""
    rng = np.random.default_rng(SEED)
    ids = tf.placeholder(tf.int64, (batch, length), name="ids")
    targets = tf.placeholder(tf.int64, (batch, length), name="targets")
    head_dim = dim // heads
    embed = tf.nn.Embedding(vocab, dim, name="embed")
    ln1, ln2, ln3 = (tf.nn.LayerNorm(dim, name=f"ln{i}") for i in (1, 2, 3))
    q_proj, k_proj, v_proj, o_proj = (tf.nn.Linear(dim, dim, name=n) for n in "qkvo")
    up, down = tf.nn.Linear(dim, 4 * dim, name="up"), tf.nn.Linear(4 * dim, dim, name="down")
    unembed = tf.nn.Linear(dim, vocab, name="unembed")

    def split_heads(t):  # (B, T, D) -> (B, H, T, d)
        return tf.transpose(tf.reshape(t, (batch, length, heads, head_dim)), (0, 2, 1, 3))

    h = embed(ids)
    a = ln1(h)
    q, k, v = split_heads(q_proj(a)), split_heads(k_proj(a)), split_heads(v_proj(a))
    scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(head_dim))
    causal = np.triu(np.full((length, length), -1e9, np.float32), 1)
    attention = tf.nn.softmax(scores + tf.constant(causal))
    mixed = tf.reshape(tf.transpose(tf.matmul(attention, v), (0, 2, 1, 3)),
                       (batch, length, dim))
    h = h + o_proj(mixed)
    h = h + down(tf.nn.gelu(up(ln2(h))))
    logits = tf.reshape(unembed(ln3(h)), (batch * length, vocab))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        logits, tf.reshape(targets, (batch * length,))))
    train = tf.train.AdamOptimizer(1e-3).minimize(loss)
    feeds = {ids: rng.integers(0, vocab, (batch, length)),
             targets: rng.integers(0, vocab, (batch, length))}
    return Model("transformer", [train, loss], feeds, tf.global_variables_initializer(),
                 f"1 transformer block, {heads} heads, dim {dim}, length {length}, "
                 f"batch {batch}, Adam")


def compiled(model: Model, options: dict) -> tuple[tf.Session, Any]:
    """A Session with `options`, variables initialized, one step run; its Program."""
    session = tf.Session(**options)
    session.run(model.init)
    session.run(model.fetches, model.feeds)
    return session, session.last_program


def node_counts(model: Model) -> tuple[int, int, Any]:
    """(nodes with passes=[], nodes after the default pipeline, the optimized Program)."""
    _, plain = compiled(model, {"passes": []})
    _, optimized = compiled(model, {})
    return len(plain.graph.nodes), len(optimized.graph.nodes), optimized


def count_rows(model: Model) -> list[dict]:
    before, after, program = node_counts(model)
    fused = sum(n.op.startswith("fused") for n in program.graph.nodes)
    rewrites = len(program.ctx.records)
    return [{"name": f"{model.name}_nodes_before", "value": float(before), "goal": ">= 1",
             "unit": "nodes", "note": f"{model.description}; compiled with passes=[]"},
            {"name": f"{model.name}_nodes_after", "value": float(after),
             "goal": f"< {before}", "unit": "nodes",
             "note": f"default pipeline: {rewrites} rewrites, {fused} fused nodes "
                     f"({after / before:.0%} of the nodes left)"}]


# ----------------------------------------------------------------------------------
# Step time, fused vs unfused
# ----------------------------------------------------------------------------------

def step_ratio_row(model: Model, rounds: int, threads_note: str) -> dict:
    fused, _ = compiled(model, {})
    plain = tf.Session(passes=[])
    plain.variables.update({v: np.array(a, copy=True) for v, a in fused.variables.items()})
    # Same weights, same step: the losses and the updated weights must agree.
    start = {v: np.array(a, copy=True) for v, a in fused.variables.items()}
    loss_fused = fused.run(model.fetches, model.feeds)[1]
    loss_plain = plain.run(model.fetches, model.feeds)[1]
    if not np.isclose(loss_fused, loss_plain, rtol=1e-4):
        raise AssertionError(f"fused step loss {loss_fused} != unfused {loss_plain}")
    for v in start:
        if not np.allclose(fused.variables[v], plain.variables[v], rtol=1e-4, atol=1e-6):
            raise AssertionError(f"fused and unfused steps update {v.name} differently")
    run = {"fused": lambda: fused.run(model.fetches, model.feeds),
           "unfused": lambda: plain.run(model.fetches, model.feeds)}
    times = time_interleaved(run, warmup=3, rounds=rounds)
    ratios = sorted(a / b for a, b in zip(times["fused"], times["unfused"]))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    steps = {k: len(s.last_program.steps) for k, s in (("fused", fused), ("unfused", plain))}
    return {"name": "fused_vs_unfused_mlp_step", "value": statistics.median(ratios),
            "goal": "<= 0.90", "unit": "x",
            "note": f"{model.description}; default pipeline {ms['fused']:.2f} ms "
                    f"({steps['fused']} steps) vs passes=[] {ms['unfused']:.2f} ms "
                    f"({steps['unfused']} steps), medians of {rounds} interleaved rounds, "
                    f"per-round ratio {ratios[0]:.2f}..{ratios[-1]:.2f}; Session defaults "
                    f"otherwise; {threads_note}"}


def chain_ratio_row(length: int, rounds: int) -> dict:
    """Where fusion pays on a CPU: many small elementwise ops, whose cost is the
    executor's per-step work rather than arithmetic."""
    x = tf.placeholder(tf.float32, (16,), name="chain_x")
    y = x
    for i in range(length):
        y = tf.tanh(y) if i % 2 else y * 0.5 + 0.25
    sources = {x: ((16,), np.dtype(np.float32))}
    fused = tf.compile([y], sources, {})
    plain = tf.compile([y], sources, {}, passes=[])
    feeds = {x: np.linspace(-1, 1, 16, dtype=np.float32)}
    if not np.allclose(fused.run(feeds, {})[0], plain.run(feeds, {})[0], rtol=1e-5):
        raise AssertionError("fused and unfused chains disagree")
    times = time_interleaved({"fused": lambda: fused.run(feeds, {}),
                              "unfused": lambda: plain.run(feeds, {})}, 3, rounds)
    ratios = sorted(a / b for a, b in zip(times["fused"], times["unfused"]))
    us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    return {"name": "fused_vs_unfused_small_ops", "value": statistics.median(ratios),
            "goal": "<= 0.5", "unit": "x",
            "note": f"{length}-op chain (x*0.5+0.25, tanh) on 16 floats: Program.run "
                    f"{us['fused']:.0f} us ({len(fused.steps)} steps) vs passes=[] "
                    f"{us['unfused']:.0f} us ({len(plain.steps)} steps); medians of {rounds} "
                    "interleaved rounds"}


# ----------------------------------------------------------------------------------
# Compile time on 1k- and 10k-node graphs
# ----------------------------------------------------------------------------------

def deep_training_graph(layers: int, width: int = 8) -> tuple[list, dict]:
    """h = h + 0.5 tanh(h W_i + b_i), `layers` times; mean(h^2); SGD on all W, b.
    About 25 nodes per layer once the gradients and updates are built. Returns the
    fetches and the sources (shapes) `specialize` needs."""
    x = tf.placeholder(tf.float32, (4, width))
    h, params = x, []
    for _ in range(layers):
        w = tf.Variable(np.full((width, width), 0.1, np.float32))
        b = tf.Variable(np.zeros(width, np.float32))
        params += [w, b]
        h = h + tf.tanh(tf.matmul(h, w) + b) * 0.5
    loss = tf.reduce_mean(h * h)
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss, params)
    sources = {p: (p.shape, p.dtype) for p in params}
    sources[x] = ((4, width), np.dtype(np.float32))
    return [train, loss], sources


def compile_ms(layers: int, repeats: int) -> tuple[float, int, int]:
    """Median milliseconds of specialize + the whole pipeline; nodes before, after."""
    fetches, sources = deep_training_graph(layers)
    times, before, after = [], 0, 0
    for _ in range(repeats):
        start = time.perf_counter()
        graph, _ = passes.specialize(fetches, sources)
        optimized = passes.run_pipeline(graph, passes.PassContext())
        times.append(time.perf_counter() - start)
        before, after = len(graph.nodes), len(optimized.nodes)
    return 1e3 * statistics.median(times), before, after


def compile_rows(quick: bool) -> list[dict]:
    small_layers, big_layers, repeats = (40, 80, 1) if quick else (40, 400, 5)
    small_ms, small_n, small_after = compile_ms(small_layers, repeats)
    big_ms, big_n, big_after = compile_ms(big_layers, repeats)
    growth = big_ms / small_ms
    return [{"name": "compile_ms_1k_nodes", "value": small_ms, "goal": "< 100", "unit": "ms",
             "note": f"specialize + all passes on a {small_n}-node residual-MLP training "
                     f"graph (-> {small_after} nodes); median of {repeats}"},
            {"name": "compile_ms_10k_nodes", "value": big_ms, "goal": "< 1000", "unit": "ms",
             "note": f"the same on {big_n} nodes (-> {big_after}); {growth:.1f}x the time "
                     f"of {small_n} nodes for {big_n / small_n:.1f}x the nodes; median of "
                     f"{repeats}"}]


# ----------------------------------------------------------------------------------
# The contract: figures(quick) -> rows
# ----------------------------------------------------------------------------------

def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    """The passes figures (see the module docstring); `quick` shrinks everything to a
    smoke test; `only` keeps the figures whose name contains it."""
    want = lambda name: only is None or only in name  # noqa: E731

    def group(*names: str) -> bool:
        """Whether a group of figures, measured together, has one that is wanted."""
        return any(want(name) for name in names)
    rows: list[dict] = []
    with ExitStack() as stack:
        threads_note = limit_threads(stack, bench_threads())
        mlp = build_mlp((64, 32, 10), 8) if quick else build_mlp()
        if group("mlp_nodes_before", "mlp_nodes_after"):
            rows += count_rows(mlp)
        if group("cnn_nodes_before", "cnn_nodes_after"):
            rows += count_rows(build_cnn(4 if quick else 16))
        if group("transformer_nodes_before", "transformer_nodes_after"):
            rows += count_rows(build_transformer_block(2, 8, 16, 2, 20) if quick
                               else build_transformer_block())
        if want("fused_vs_unfused_mlp_step"):
            rows.append(step_ratio_row(mlp, 5 if quick else 300, threads_note))
        if want("fused_vs_unfused_small_ops"):
            rows.append(chain_ratio_row(30 if quick else 300, 5 if quick else 200))
        if group("compile_ms_1k_nodes", "compile_ms_10k_nodes"):
            rows += compile_rows(quick)
    return [r for r in rows if want(r["name"])]


def main() -> None:
    """Print the figures and `passes.explain` of the three models."""
    for build in (build_mlp, build_cnn, build_transformer_block):
        model = build()
        before, after, program = node_counts(model)
        print(f"== {model.description}: {before} -> {after} nodes")
        print(passes.explain(program, max_rewrites=12))
    for row in figures(quick="--quick" in sys.argv):
        print(f"{row['name']:28} {row['value']:10.3f} {row['unit']:6} goal {row['goal']:8}"
              f" {row['note']}")


if __name__ == "__main__":
    main()
