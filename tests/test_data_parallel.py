"""Data-parallel training: allreduce nodes in the graph, buckets, the comm stream,
equivalence with single-rank training, and the tutorial run for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.saver import read_checkpoint
from tinyflow.allreduce import ThreadTransport, launch, run_threads
from tinyflow.ops import REGISTRY
from tinyflow.parallel import (
    COMMUNICATORS,
    DistributedOptimizer,
    broadcast_variables,
    plan_buckets,
    timeline_with_ring_steps,
)

TUTORIAL = Path(__file__).resolve().parent.parent / "tutorials" / "train_data_parallel.py"
SIZES = (8, 16, 12, 4)   # features, hidden, hidden, classes


def make_data(steps: int, batch: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * batch, SIZES[0]))
    y = rng.integers(0, SIZES[-1], steps * batch)
    return x, y


def build_mlp(seed: int = 1):
    """A float64 MLP with explicit initial weights (the same however often it is built)."""
    rng = np.random.default_rng(seed)
    x = tf.placeholder(tf.float64, (None, SIZES[0]))
    y = tf.placeholder(tf.int64, (None,))
    h, params = x, []
    for i, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        w = tf.Variable(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in),
                        dtype=tf.float64, name=f"w{i}")
        b = tf.Variable(np.zeros(fan_out), dtype=tf.float64, name=f"b{i}")
        h = tf.matmul(h, w) + b
        if i < len(SIZES) - 2:
            h = tf.nn.relu(h)
        params += [w, b]
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(h, y)
    return x, y, loss, params


def test_allreduce_op_is_registered_impure_and_not_differentiable():
    opdef = REGISTRY["allreduce"]
    assert not opdef.pure and not opdef.differentiable


def test_buckets_go_last_layer_first_and_respect_the_cap():
    x, y, loss, params = build_mlp()
    comm = ThreadTransport.group_of(1)[0]
    grads = tf.train.SGD(0.1).compute_gradients(loss, params)
    # w2 is 12x4 doubles (384 B), b2 32 B; a 400-byte cap closes a bucket after w2.
    buckets = plan_buckets(grads, loss, bucket_bytes=400)
    names = [[v.name for _, v in bucket] for bucket in buckets]
    assert names[0] == ["b2", "w2"]
    assert [n for bucket in names for n in bucket] == ["b2", "w2", "b1", "w1", "b0", "w0"]
    dist = DistributedOptimizer(tf.train.SGD(0.1), comm, bucket_bytes=400)
    averaged = dist.compute_gradients(loss, params)
    assert len(dist.allreduce_nodes) == len(buckets)
    for i, node in enumerate(dist.allreduce_nodes):
        assert node.op == "allreduce" and node.attrs["stream"] == "comm"
        assert node.attrs["bucket"] == i and COMMUNICATORS[node.attrs["comm"]] is comm
        assert node.shape == (sum(int(np.prod(v.shape)) for _, v in buckets[i]),)
    assert all(g.shape == v.shape for g, v in averaged)


def test_one_big_bucket_holds_everything():
    x, y, loss, params = build_mlp()
    dist = DistributedOptimizer(tf.train.SGD(0.1), ThreadTransport.group_of(1)[0],
                                bucket_bytes=1 << 30)
    dist.minimize(loss, params)
    assert len(dist.allreduce_nodes) == 1
    assert len(dist.allreduce_nodes[0].inputs) == len(params)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_four_ranks_with_quarter_batches_match_one_rank(optimizer):
    steps, batch, ranks = 20, 32, 4
    data_x, data_y = make_data(steps, batch)
    make_opt = {"sgd": lambda: tf.train.SGD(0.2),
                "momentum": lambda: tf.train.MomentumOptimizer(0.1, 0.9)}[optimizer]
    x, y, loss, params = build_mlp()

    single = make_opt().minimize(loss, params)
    comms = ThreadTransport.group_of(ranks, timeout=60)
    train_ops = [DistributedOptimizer(make_opt(), c, bucket_bytes=400).minimize(loss, params)
                 for c in comms]
    init = tf.global_variables_initializer()

    sess = tf.Session()
    sess.run(init)
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        sess.run(single, {x: data_x[rows], y: data_y[rows]})
    expected = sess.run(params)

    shard = batch // ranks

    def rank(comm):
        sess = tf.Session()
        sess.run(init)
        broadcast_variables(sess, comm)
        for step in range(steps):
            lo = step * batch + comm.rank * shard
            sess.run(train_ops[comm.rank], {x: data_x[lo:lo + shard], y: data_y[lo:lo + shard]})
        return sess.run(params)

    for got in run_threads(comms, rank):
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)
    # The parameters moved: the equality above is not two copies of the start.
    start = tf.Session()
    start.run(init)
    assert not np.allclose(start.run(params[0]), expected[0])


def test_broadcast_variables_makes_replicas_equal():
    v = tf.Variable(np.zeros(5), dtype=tf.float64, name="v")
    init = tf.global_variables_initializer()

    def rank(comm):
        sess = tf.Session()
        sess.run(init)
        sess.variables[v][...] = comm.rank + 1.0   # every replica different
        broadcast_variables(sess, comm, root=1, variables=[v])
        return sess.run(v)

    assert all(value.tolist() == [2.0] * 5 for value in run_threads(3, rank))


def test_allreduce_runs_on_the_comm_stream_before_the_updates():
    x, y, loss, params = build_mlp()
    comms = ThreadTransport.group_of(2, timeout=60)
    train_ops = [DistributedOptimizer(tf.train.SGD(0.1), c, bucket_bytes=400).minimize(
        loss, params) for c in comms]
    init = tf.global_variables_initializer()
    data_x, data_y = make_data(1, 8)

    def rank(comm):
        sess = tf.Session(trace=True)
        sess.run(init)
        comm.trace = []          # the allreduce nodes record their ring steps here
        sess.run(train_ops[comm.rank], {x: data_x, y: data_y})
        program = sess.last_program
        names = program.schedule.names
        steps = [(s.node.op, names[s.stream]) for s in program.steps]
        return steps, program.last_timeline, names, comm.trace

    steps, timeline, names, records = run_threads(comms, rank)[0]
    assert {stream for op, stream in steps if op == "allreduce"} == {"comm"}
    assert all(stream != "comm" for op, stream in steps if op != "allreduce")
    ops = [op for op, _ in steps]
    # Bucket 0 (the last layer) goes before the first layer's gradient is computed,
    # and every update comes after the last allreduce.
    first_allreduce = ops.index("allreduce")
    last_allreduce = len(ops) - 1 - ops[::-1].index("allreduce")
    assert ops.count("allreduce") == 3
    assert "matmul" in ops[first_allreduce:last_allreduce]
    first_update = min(ops.index(op) for op in ("assign", "fused_assign") if op in ops)
    assert first_update > last_allreduce
    comm_index = names.index("comm")
    reduces = [e for e in timeline if e["op"] == "allreduce"]
    assert [e["stream"] for e in reduces] == [comm_index] * 3

    # The ring inside each allreduce: 2 ranks -> 1 reduce-scatter + 1 all-gather step.
    merged = timeline_with_ring_steps(timeline, records)
    ring = [e for e in merged if e["op"] == "ring_step"]
    assert len(ring) == 3 * 2 and len(merged) == len(timeline) + len(ring)
    for event in reduces:
        inside = [e for e in ring if e["node"].startswith(event["node"] + "/")]
        assert [e["args"]["phase"] for e in inside] == ["reduce-scatter", "all-gather"]
        assert all(event["start"] <= e["start"] <= e["end"] <= event["end"] for e in inside)
        assert all(e["stream"] == comm_index and e["args"]["src"] == 0 for e in inside)


def test_tutorial_under_launch_matches_threads(tmp_path):
    """The lesson runs as 2 threads and as 2 processes (`tinyflow launch -n 2`), and
    both train the same model to the same weights."""
    runs = {}
    for mode in ("threads", "processes"):
        checkpoint = tmp_path / f"{mode}.npz"
        args = ["--quick", "--checkpoint", str(checkpoint)]
        if mode == "threads":
            done = subprocess.run([sys.executable, str(TUTORIAL), "--threads", "2", *args],
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            assert "2 threads: test accuracy" in done.stdout
        else:
            assert launch(2, str(TUTORIAL), args, use_mpi=False) == 0
        runs[mode] = read_checkpoint(checkpoint)   # tf.train.Saver's file, no pickle
    assert len(runs["threads"]) == 6   # weights and biases of three layers
    assert runs["threads"].keys() == runs["processes"].keys()
    for name, value in runs["threads"].items():
        np.testing.assert_allclose(runs["processes"][name], value, rtol=1e-5, atol=1e-6)


def test_tutorial_help():
    done = subprocess.run([sys.executable, str(TUTORIAL), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--threads" in done.stdout


@pytest.mark.parametrize("bucket_bytes, message", [
    ("big", "bucket_bytes must be an int, got 'big'"),
    (-5, "bucket_bytes must be >= 0"),
    (2.5, "bucket_bytes must be an int, got 2.5"),
    (True, "bucket_bytes must be an int, got True"),
])
def test_distributed_optimizer_checks_bucket_bytes(bucket_bytes, message):
    # "big" was int()'s "invalid literal", naming no argument; -5 was taken.
    from tinyflow.parallel import DistributedOptimizer
    comm = ThreadTransport.group_of(1)[0]
    with pytest.raises(tf.ArgumentError, match=message):
        DistributedOptimizer(tf.train.SGD(0.1), comm, bucket_bytes=bucket_bytes)
    DistributedOptimizer(tf.train.SGD(0.1), comm, bucket_bytes=0)   # a bucket per gradient
