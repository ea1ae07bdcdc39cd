"""ZeRO stages 1-3 (zero.py): the same weights as one rank on the whole batch, the
bytes each rank holds against the paper's formula, and mismatched stages."""

from __future__ import annotations

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.allreduce import ThreadTransport, run_threads
from tinyflow.parallel import DistributedOptimizer, broadcast_variables
from tinyflow.transports import CollectiveError
from tinyflow.zero import zero_bytes_formula

SIZES = (8, 10, 6, 4)  # 184 parameters: 4 equal shards


def build_mlp(seed: int = 3):
    rng = np.random.default_rng(seed)
    x = tf.placeholder(tf.float64, (None, SIZES[0]))
    y = tf.placeholder(tf.int64, (None,))
    h, params = x, []
    for i, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        w = tf.Variable(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in),
                        dtype=tf.float64, name=f"w{i}")
        b = tf.Variable(rng.standard_normal(fan_out) * 0.1, dtype=tf.float64, name=f"b{i}")
        h = tf.matmul(h, w) + b
        if i < len(SIZES) - 2:
            h = tf.nn.tanh(h)
        params += [w, b]
    return x, y, tf.nn.mean_sparse_softmax_cross_entropy_with_logits(h, y), params


OPTIMIZERS = {"adam": lambda: tf.train.AdamOptimizer(0.01),
              "momentum": lambda: tf.train.MomentumOptimizer(0.1, 0.9),
              "sgd": lambda: tf.train.SGD(0.2)}
SLOTS = {"adam": 2, "momentum": 1, "sgd": 0}


def train_zero(stage: int, optimizer: str, ranks: int, steps: int = 6, batch: int = 12,
               stages: tuple[int, ...] | None = None):
    """(one-rank weights, [per-rank ZeRO weights], [per-rank held bytes])."""
    rng = np.random.default_rng(7)
    data_x = rng.standard_normal((steps * batch, SIZES[0]))
    data_y = rng.integers(0, SIZES[-1], steps * batch)
    x, y, loss, params = build_mlp()
    single = OPTIMIZERS[optimizer]().minimize(loss, params)
    comms = ThreadTransport.group_of(ranks, timeout=20)
    stages = stages or (stage,) * ranks
    dists = [DistributedOptimizer(OPTIMIZERS[optimizer](), c, zero=s)
             for c, s in zip(comms, stages)]
    trains = [d.minimize(loss, params) for d in dists]
    init = tf.global_variables_initializer()

    sess = tf.Session()
    sess.run(init)
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        sess.run(single, {x: data_x[rows], y: data_y[rows]})
    expected = sess.run(params)
    shard = batch // ranks

    def rank(comm):
        dist = dists[comm.rank]
        sess = tf.Session()
        sess.run(init)
        broadcast_variables(sess, comm)
        dist.shard(sess)
        for step in range(steps):
            lo = step * batch + comm.rank * shard
            feed = {x: data_x[lo:lo + shard], y: data_y[lo:lo + shard]}
            _, reduced = sess.run([trains[comm.rank], dist.zero.reduce_node], feed)
        return dist.gather_variables(sess), dist.zero.held_bytes(sess, reduced)

    results = run_threads(comms, rank)
    return expected, [r[0] for r in results], [r[1] for r in results]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_zero_matches_one_rank_on_the_whole_batch(stage, optimizer):
    expected, got, _ = train_zero(stage, optimizer, ranks=4)
    for weights in got:
        for a, b in zip(weights, expected):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    for a, b in zip(got[0], got[1]):  # the replicas are bitwise identical
        assert a.tobytes() == b.tobytes()


def test_zero_with_uneven_shards_and_sgd():
    expected, got, _ = train_zero(2, "sgd", ranks=3, batch=9)
    for a, b in zip(got[2], expected):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_held_bytes_match_the_formula(stage):
    ranks = 4
    _, _, held = train_zero(stage, "adam", ranks=ranks, steps=1)
    total = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:]))
    assert total % ranks == 0  # (so the formula's Psi/N is exact)
    formula = zero_bytes_formula(stage, total, ranks, SLOTS["adam"], 8)
    for per_rank in held:
        assert per_rank == formula


def test_held_bytes_count_only_this_optimizers_slots():
    # held_bytes found the slots by name, so a second model in the same process
    # (its shard of the same name) counted the first model's Adam moments too, and
    # benchmarks/parallel_bench.py reported 3x the formula once the global
    # initializer covered every Variable.
    train_zero(3, "adam", ranks=4, steps=1)
    _, _, held = train_zero(3, "adam", ranks=4, steps=1)
    total = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:]))
    assert held[0] == zero_bytes_formula(3, total, 4, SLOTS["adam"], 8)


def test_mismatched_zero_stages_are_a_collective_error():
    with pytest.raises(CollectiveError, match="zero"):
        train_zero(2, "momentum", ranks=2, steps=1, stages=(2, 3))


def test_zero_stage_must_be_known():
    with pytest.raises(ValueError, match="zero must be"):
        DistributedOptimizer(tf.train.SGD(0.1), ThreadTransport.group_of(1)[0], zero=4)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("empty", [(3, 0), (0, 3)])
def test_an_empty_variable_trains_beside_the_others(stage, empty):
    """A 0 in a reshape target copies the input's dim: flattening a (3, 0) variable
    to (prod(shape),) = (0,) asked for (3,), and minimize failed with a ShapeError
    ('cannot reshape 0 elements into (3,)')."""
    x = tf.placeholder(tf.float64, (None, 3))
    w = tf.Variable(np.ones((3, 2)), dtype=tf.float64, name="w")
    e = tf.Variable(np.zeros(empty), dtype=tf.float64, name="e")
    loss = tf.reduce_sum(tf.matmul(x, w)) + tf.reduce_sum(e)
    comms = ThreadTransport.group_of(2, timeout=20)
    dists = [DistributedOptimizer(tf.train.SGD(0.1), c, zero=stage) for c in comms]
    trains = [d.minimize(loss, [w, e]) for d in dists]
    init = tf.global_variables_initializer()

    def rank(comm):
        sess = tf.Session()
        sess.run(init)
        dists[comm.rank].shard(sess)
        sess.run(trains[comm.rank], {x: np.full((2, 3), comm.rank + 1.0)})
        return dists[comm.rank].gather_variables(sess)

    for got_w, got_e in run_threads(comms, rank):
        np.testing.assert_allclose(got_w, np.ones((3, 2)) - 0.1 * 3.0)  # mean of 2 and 4
        assert got_e.shape == empty
