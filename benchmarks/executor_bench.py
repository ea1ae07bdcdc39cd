"""Executor figures: streams overlapping, the cost of streams, and the memory plan.

two_stream_ratio
    Two independent chains of 1024x1024 float32 matmuls joined by an add, run with
    2 streams / with 1 stream, BLAS limited to one thread in both (so each stream
    uses one core). Goal <= 0.65 on a 2-core machine: 0.5 is perfect overlap.
overhead_us_per_node_2streams
    The 1000-op chain of tiny ops (core_bench's) compiled with streams=2, per node.
    A chain has no independent branches, so stream assignment keeps it on one stream
    and the cost is the 1-stream cost; the goal is <= 2x the 1-stream figure, which
    the note gives.
overhead_us_per_node_2chains
    Two independent 500-op chains of the same tiny ops, joined at the end: with
    streams=2 each chain gets its own stream (two threads really running, taking
    turns on the GIL), per node / the same program on 1 stream. Goal <= 2.
planned_vs_unplanned_mlp_step
    A training step of a 784-1024-1024-10 MLP (batch 512, SGD) with the memory plan
    (every intermediate a view of one arena, kernels writing through out=) / without
    (each step allocates its result). Goal <= 1.0: planning must not cost time.
"""

from __future__ import annotations

import statistics
from contextlib import ExitStack

import numpy as np
from core_bench import build_chain, limit_threads, paired_ratio, time_interleaved

import tinyflow as tf


def two_branch_graph(n: int, depth: int):
    rng = np.random.default_rng(0)
    x = tf.placeholder(tf.float32, (n, n))
    a, b = x, x
    for _ in range(depth):
        a = tf.matmul(a, tf.constant((rng.standard_normal((n, n)) / np.sqrt(n))
                                     .astype(np.float32)))
        b = tf.matmul(b, tf.constant((rng.standard_normal((n, n)) / np.sqrt(n))
                                     .astype(np.float32)))
    return x, a + b


def two_stream_figure(n: int, depth: int, rounds: int) -> dict:
    x, out = two_branch_graph(n, depth)
    feeds = {x: np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)}
    programs = {s: tf.compile([out], {x: ((n, n), np.float32)}, streams=s, passes=[])
                for s in (1, 2)}
    one, two = (p.run(feeds, {})[0] for p in programs.values())
    if not np.allclose(one, two, rtol=1e-4, atol=1e-4):
        raise AssertionError("2 streams compute a different result than 1 stream")
    used = len(set(programs[2].schedule.stream_of))
    times = time_interleaved({s: (lambda p=p: p.run(feeds, {})) for s, p in programs.items()},
                             warmup=2, rounds=rounds)
    ms = {s: 1e3 * statistics.median(t) for s, t in times.items()}
    # The overlap, from a traced run: time both streams were busy at once.
    traced = tf.compile([out], {x: ((n, n), np.float32)}, streams=2, passes=[], trace=True)
    traced.run(feeds, {})
    busy = [[(e["start"], e["end"]) for e in traced.last_timeline if e["stream"] == s]
            for s in (0, 1)]
    overlap = sum(max(0.0, min(e0, e1) - max(s0, s1))
                  for s0, e0 in busy[0] for s1, e1 in busy[1])
    return {"name": "two_stream_ratio", "goal": "<= 0.65", "unit": "x",
            "value": paired_ratio(times[2], times[1]),
            "note": f"2 chains of {depth} {n}x{n} matmuls; 1 stream {ms[1]:.0f} ms, "
                    f"2 streams {ms[2]:.0f} ms (medians of {rounds} rounds), {used} streams "
                    f"used; the traced run overlaps the streams for {1e3 * overlap:.0f} ms"}


def overhead_2streams_figure(length: int, rounds: int) -> dict:
    x, _, y = build_chain(length)
    feeds = {x: np.full((1,), 0.25, np.float32)}
    programs = {s: tf.compile([y], {x: ((1,), np.float32)}, passes=[], streams=s)
                for s in (1, 2)}
    times = time_interleaved({s: (lambda p=p: p.run(feeds, {})) for s, p in programs.items()},
                             warmup=3, rounds=rounds)
    per_node = {s: 1e6 * statistics.median(t) / length for s, t in times.items()}
    return {"name": "overhead_us_per_node_2streams", "goal": f"<= {2 * per_node[1]:.2f}",
            "unit": "us", "value": per_node[2],
            "note": f"{length}-op chain, streams=2 ({len(set(programs[2].schedule.stream_of))} "
                    f"used); 1 stream: {per_node[1]:.2f} us/node (goal: at most 2x that)"}


def two_chains_figure(length: int, rounds: int) -> dict:
    x = tf.placeholder(tf.float32, (1,))
    c = tf.constant(np.float32(0.5))
    ends = []
    for _ in range(2):
        y = x
        for i in range(length):
            kind = i % 4
            y = y + c if kind == 0 else y * c if kind == 1 else tf.tanh(y) if kind == 2 else -y
        ends.append(y)
    out = ends[0] + ends[1]
    feeds = {x: np.full((1,), 0.25, np.float32)}
    programs = {s: tf.compile([out], {x: ((1,), np.float32)}, passes=[], streams=s)
                for s in (1, 2)}
    one, two = (p.run(feeds, {})[0] for p in programs.values())
    if not np.allclose(one, two):
        raise AssertionError("two chains on 2 streams compute a different result")
    times = time_interleaved({s: (lambda p=p: p.run(feeds, {})) for s, p in programs.items()},
                             warmup=3, rounds=rounds)
    nodes = 2 * length + 1
    per_node = {s: 1e6 * statistics.median(t) / nodes for s, t in times.items()}
    used = len(set(programs[2].schedule.stream_of))
    return {"name": "overhead_us_per_node_2chains", "goal": "<= 2", "unit": "x",
            "value": paired_ratio(times[2], times[1]),
            "note": f"2 chains of {length} tiny ops: {per_node[2]:.2f} us/node on 2 streams "
                    f"({used} used) vs {per_node[1]:.2f} us/node on 1"}


def mlp_step(sizes: list[int], batch: int, memory: str | None):
    tf.reset_default_graph()  # this Session initializes this model's variables only
    rng = np.random.default_rng(0)
    x = tf.placeholder(tf.float32, (batch, sizes[0]))
    labels = tf.placeholder(tf.int64, (batch,))
    h = x
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = tf.Variable((rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in))
                        .astype(np.float32), name=f"w{i}")
        b = tf.Variable(np.zeros(fan_out, np.float32), name=f"b{i}")
        h = tf.matmul(h, w) + b
        if i < len(sizes) - 2:
            h = tf.nn.relu(h)
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(h, labels)
    train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
    sess = tf.Session(memory=memory)
    sess.run(tf.global_variables_initializer())
    feeds = {x: rng.standard_normal((batch, sizes[0])).astype(np.float32),
             labels: rng.integers(0, sizes[-1], batch)}
    return lambda: sess.run([loss, train], feeds)[0]


def planned_figure(sizes: list[int], batch: int, rounds: int) -> dict:
    steps = {m: mlp_step(sizes, batch, m) for m in ("auto", None)}
    first = {m: float(s()) for m, s in steps.items()}
    if not np.isclose(first["auto"], first[None], rtol=1e-5):
        raise AssertionError(f"planned and unplanned steps disagree: {first}")
    times = time_interleaved(steps, warmup=2, rounds=rounds)
    ms = {m: 1e3 * statistics.median(t) for m, t in times.items()}
    return {"name": "planned_vs_unplanned_mlp_step", "goal": "<= 1.0", "unit": "x",
            "value": paired_ratio(times["auto"], times[None]),
            "note": f"{'-'.join(map(str, sizes))} MLP, batch {batch}, SGD: planned "
                    f"{ms['auto']:.1f} ms, unplanned {ms[None]:.1f} ms per step"}


def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    want = lambda name: only is None or only in name  # noqa: E731
    rows = []
    with ExitStack() as stack:
        threads_note = limit_threads(stack, 1)  # one BLAS thread per stream, both runs
        if want("two_stream_ratio"):
            row = two_stream_figure(256 if quick else 1024, 2 if quick else 4,
                                    3 if quick else 7)
            row["note"] += f"; {threads_note}"
            rows.append(row)
        if want("overhead_us_per_node_2streams"):
            rows.append(overhead_2streams_figure(100 if quick else 1000, 5 if quick else 30))
        if want("overhead_us_per_node_2chains"):
            rows.append(two_chains_figure(50 if quick else 500, 5 if quick else 30))
        if want("planned_vs_unplanned_mlp_step"):
            sizes, batch = ([64, 128, 128, 10], 64) if quick else ([784, 1024, 1024, 10], 512)
            row = planned_figure(sizes, batch, 3 if quick else 9)
            row["note"] += f"; {threads_note}"
            rows.append(row)
    return rows
