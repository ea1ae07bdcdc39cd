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


def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    """The parallel-scheme figures (see the module docstring)."""
    want = lambda name: only is None or only in name  # noqa: E731
    rows = []
    if want("zero_bytes_vs_formula"):
        rows.append(_zero_bytes_vs_formula())
    return rows


if __name__ == "__main__":
    for row in figures():
        print(json.dumps(row))
