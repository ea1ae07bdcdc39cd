"""Parallel schemes beyond data parallelism: measured figures against the textbook
formulas (the Ultra-Scale Playbook's, the ZeRO paper's, GPipe's).

``zero_bytes_vs_formula``
    One Adam step of a float64 MLP under ZeRO stages 1, 2, 3 on N = 2 and 4 thread
    ranks. Each rank reports the bytes it holds afterwards: the parameters (the
    Session's full Variables, or the stage-3 shard), the reduced gradients (the
    value of the `zero_reduce` node) and the optimizer state (the slot Variables and
    the master shard). The figure is the largest measured / formula ratio over the
    three kinds, the stages, the ranks and N (formula: `zero.zero_bytes_formula`;
    goal == 1.0).

``pipeline_bubble_error_pts``
    GPipe and 1F1B (`tinyflow.pipeline.Pipeline`) on p = 2, 4 thread ranks (a dense
    tanh layer per stage) with m = 4, 8, 16 microbatches, one step each. Every F and
    B is recorded in logical time (F = 1, B = 2 units; a message carries its sender's
    clock, a receiver starts no earlier). The idle fraction 1 - busy / (p x span) is
    compared with (p-1)/(m+p-1); the figure is the largest difference in percentage
    points (goal <= 3). The note adds the wall-clock idle fraction of the same runs,
    which on a loaded machine with threads sharing the GIL is far noisier.
``pp_1f1b_peak_activations_vs_gpipe``
    The most microbatch inputs any stage held at once, 1F1B / GPipe, p = 4, m = 8
    (goal <= 0.525: p/m plus 5%).

``tp_bytes_vs_theory``
    Megatron column-then-row tensor parallelism (`tinyflow.tensor_parallel`) of two
    MLP blocks on 4 thread ranks: payload bytes each rank sent in one SGD step
    (the largest over ranks) / theory: a ring allreduce of the batch x out
    activations per block forward, and of the batch x in gradients backward for
    every block but the first (fed by data) (goal == 1.0).

Everything runs on thread ranks in this process: these figures count bytes and
steps, not seconds, so they do not depend on the machine's load.
"""

from __future__ import annotations

import json

import numpy as np

SIZES = (16, 24, 12, 4)  # 408 + 300 + 52 = 760 parameters, divisible by 2 and 4


def _row(name: str, value: float, goal: str, unit: str, note: str) -> dict:
    return {"name": name, "value": float(value), "goal": goal, "unit": unit, "note": note}


def _zero_held(stage: int, ranks: int) -> tuple[list[dict], int]:
    import tinyflow as tf
    from tinyflow.allreduce import ThreadTransport, run_threads
    from tinyflow.parallel import DistributedOptimizer, broadcast_variables
    rng = np.random.default_rng(0)
    x = tf.placeholder(tf.float64, (None, SIZES[0]))
    y = tf.placeholder(tf.int64, (None,))
    h = x
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        w = tf.Variable(rng.standard_normal((a, b)) / np.sqrt(a), dtype=tf.float64)
        h = tf.matmul(h, w) + tf.Variable(np.zeros(b), dtype=tf.float64)
        if i < len(SIZES) - 2:
            h = tf.nn.relu(h)
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(h, y)
    comms = ThreadTransport.group_of(ranks, timeout=60)
    dists = [DistributedOptimizer(tf.train.AdamOptimizer(0.01), c, zero=stage)
             for c in comms]
    trains = [d.minimize(loss) for d in dists]
    init = tf.global_variables_initializer()
    feed = {x: rng.standard_normal((8, SIZES[0])), y: rng.integers(0, SIZES[-1], 8)}

    def rank(comm):
        dist = dists[comm.rank]
        sess = tf.Session()
        sess.run(init)
        broadcast_variables(sess, comm)
        dist.shard(sess)
        _, reduced = sess.run([trains[comm.rank], dist.zero.reduce_node], feed)
        return dist.zero.held_bytes(sess, reduced)

    held = run_threads(comms, rank)
    return held, dists[0].zero.total


def _zero_bytes_vs_formula() -> dict:
    from tinyflow.zero import zero_bytes_formula
    worst, parts = 0.0, []
    for ranks in (2, 4):
        for stage in (1, 2, 3):
            held, total = _zero_held(stage, ranks)
            formula = zero_bytes_formula(stage, total, ranks, slots=2, itemsize=8)
            ratio = max(h[k] / formula[k] for h in held for k in formula)
            worst = max(worst, ratio)
            parts.append(f"N={ranks} stage {stage}: " + "/".join(
                f"{held[0][k]}" for k in formula) + f" B ({ratio:.3f})")
    return _row("zero_bytes_vs_formula", worst, "== 1.0", "x",
                "largest measured / formula bytes per rank (parameters/gradients/"
                "optimizer state), Adam, float64 MLP " + "-".join(map(str, SIZES))
                + "; " + "; ".join(parts))


def _pipeline(schedule: str, p: int, m: int) -> list:
    import tinyflow as tf
    from tinyflow.allreduce import ThreadTransport, run_threads
    from tinyflow.pipeline import Pipeline
    width, rng = 32, np.random.default_rng(1)
    weights = [tf.Variable(rng.standard_normal((width, width)) / np.sqrt(width),
                           dtype=tf.float64) for _ in range(p)]
    stages = [lambda h, w=w: tf.nn.tanh(tf.matmul(h, w)) for w in weights]
    init = tf.global_variables_initializer()
    comms = ThreadTransport.group_of(p, timeout=60)
    loss = lambda logits, labels: tf.nn.mean_sparse_softmax_cross_entropy_with_logits(  # noqa: E731
        logits, labels)
    batch = 4 * m
    pipes = [Pipeline(stages, loss, c, (width,), batch, m, tf.train.SGD(0.01), schedule,
                      init=init, dtype=np.float64) for c in comms]
    x = rng.standard_normal((batch, width))
    y = rng.integers(0, width, batch)

    def rank(comm):
        sess = tf.Session()
        sess.run(pipes[comm.rank].init)
        pipes[comm.rank].train_step(sess, x, y)

    run_threads(comms, rank)
    return pipes


def _pipeline_figures(want) -> list[dict]:
    from tinyflow.pipeline import bubble_fraction, idle_fraction
    rows = []
    if want("pipeline_bubble_error_pts"):
        worst, wall, parts = 0.0, 0.0, []
        for schedule in ("gpipe", "1f1b"):
            for p in (2, 4):
                for m in (4, 8, 16):
                    pipes = _pipeline(schedule, p, m)
                    events = [pipe.events for pipe in pipes]
                    theory = bubble_fraction(p, m)
                    error = abs(idle_fraction(events) - theory) * 100
                    worst = max(worst, error)
                    wall = max(wall, abs(idle_fraction(events, "wall") - theory) * 100)
                    parts.append(f"{schedule} p={p} m={m}: {idle_fraction(events):.3f} vs "
                                 f"{theory:.3f}")
        rows.append(_row("pipeline_bubble_error_pts", worst, "<= 3", "pts",
                         "largest |logical idle fraction - (p-1)/(m+p-1)| x 100; "
                         + "; ".join(parts) + f"; wall-clock idle fractions differ by up "
                         f"to {wall:.1f} pts (threads, loaded machine)"))
    if want("pp_1f1b_peak_activations_vs_gpipe"):
        peak = {s: max(pipe.peak_stash for pipe in _pipeline(s, 4, 8))
                for s in ("gpipe", "1f1b")}
        rows.append(_row("pp_1f1b_peak_activations_vs_gpipe", peak["1f1b"] / peak["gpipe"],
                         "<= 0.525", "x", f"most microbatch inputs a stage holds at once, "
                         f"p=4, m=8: 1F1B {peak['1f1b']}, GPipe {peak['gpipe']}"))
    return rows


def _tp_bytes_vs_theory() -> dict:
    import tinyflow as tf
    from tinyflow.allreduce import ThreadTransport, run_threads
    from tinyflow.tensor_parallel import TensorParallel, tp_bytes_theory
    blocks, batch, ranks = [(32, 64, 32), (32, 64, 8)], 16, 4
    rng = np.random.default_rng(3)
    x = tf.placeholder(tf.float64, (batch, blocks[0][0]))
    y = tf.placeholder(tf.int64, (batch,))
    h, marks = x, []
    for inp, hid, out in blocks:
        w1 = tf.Variable(rng.standard_normal((inp, hid)) / np.sqrt(inp), dtype=tf.float64)
        w2 = tf.Variable(rng.standard_normal((hid, out)) / np.sqrt(hid), dtype=tf.float64)
        h = tf.nn.tanh(tf.matmul(tf.nn.relu(tf.matmul(h, w1)), w2))
        marks.append((w1, w2))
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(h, y)
    comms = ThreadTransport.group_of(ranks, timeout=60)
    tps, trains = [], []
    for comm in comms:
        tp = TensorParallel(comm)
        for w1, w2 in marks:
            tp.split_column(w1)
            tp.split_row(w2)
        local = tp.apply(loss)
        trains.append(tf.train.SGD(0.1).minimize(local))
        tps.append(tp)
    init = tf.global_variables_initializer()
    feed = {x: rng.standard_normal((batch, blocks[0][0])), y: rng.integers(0, 8, batch)}

    def rank(comm):
        sess = tf.Session()
        sess.run(init)
        tps[comm.rank].shard(sess)
        sess.run(trains[comm.rank], feed)   # compile and warm up
        before = comm.bytes_sent
        sess.run(trains[comm.rank], feed)
        return comm.bytes_sent - before

    sent = max(run_threads(comms, rank))
    theory = tp_bytes_theory(batch, [(i, o) for i, _, o in blocks], ranks, 8)
    return _row("tp_bytes_vs_theory", sent / theory, "== 1.0", "x",
                f"max bytes a rank sent in one SGD step ({sent}) / theory ({theory:.0f}); "
                f"2 Megatron MLP blocks {blocks}, batch {batch}, {ranks} thread ranks, float64")


def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    """The parallel-scheme figures (see the module docstring)."""
    want = lambda name: only is None or only in name  # noqa: E731
    rows = []
    if want("zero_bytes_vs_formula"):
        rows.append(_zero_bytes_vs_formula())
    rows += _pipeline_figures(want)
    if want("tp_bytes_vs_theory"):
        rows.append(_tp_bytes_vs_theory())
    return rows


if __name__ == "__main__":
    for row in figures():
        print(json.dumps(row))
