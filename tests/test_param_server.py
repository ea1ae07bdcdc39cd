"""Parameter server (param_server.py): synchronous training equals one rank with the
whole batch; asynchronous training learns; a dead server is named by the workers."""

from __future__ import annotations

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.allreduce import ThreadTransport, run_threads
from tinyflow.param_server import ParameterServer
from tinyflow.transports import CollectiveError

SIZES = (5, 8, 3)


def build():
    rng = np.random.default_rng(4)
    x = tf.placeholder(tf.float64, (None, SIZES[0]))
    y = tf.placeholder(tf.int64, (None,))
    w1 = tf.Variable(rng.standard_normal(SIZES[:2]) / 2, dtype=tf.float64, name="sw1")
    b1 = tf.Variable(np.zeros(SIZES[1]), dtype=tf.float64, name="sb1")
    w2 = tf.Variable(rng.standard_normal(SIZES[1:]) / 2, dtype=tf.float64, name="sw2")
    logits = tf.matmul(tf.nn.tanh(tf.matmul(x, w1) + b1), w2)
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(logits, y)
    return x, y, loss, [w1, b1, w2]


def run(mode, servers=2, workers=3, steps=8, momentum=0.9, dead_server=None, timeout=20):
    batch = 12
    rng = np.random.default_rng(8)
    data_x = rng.standard_normal((steps * batch, SIZES[0]))
    data_y = (data_x[:, 0] > 0).astype(np.int64) + (data_x[:, 1] > 0)
    x, y, loss, params = build()
    single = tf.train.MomentumOptimizer(0.2, momentum).minimize(loss, params)
    grads = tf.gradients(loss, params)
    init = tf.global_variables_initializer()
    sess = tf.Session()
    sess.run(init)
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        sess.run(single, {x: data_x[rows], y: data_y[rows]})
    expected = sess.run(params)
    comms = ThreadTransport.group_of(servers + workers, timeout=timeout)
    shard = batch // workers

    def rank(comm):
        ps = ParameterServer(comm, params, servers, mode, 0.2, momentum)
        if ps.is_server:
            if comm.rank == dead_server:
                return "dead"
            try:
                return ps.serve(steps)
            except CollectiveError as err:
                if dead_server is None:
                    raise
                return err
        sess = tf.Session()
        sess.run(init)
        try:
            ps.start(sess)
            k = comm.rank - servers
            losses = []
            for step in range(steps):
                lo = step * batch + k * shard
                feed = {x: data_x[lo:lo + shard], y: data_y[lo:lo + shard]}
                *g, value = sess.run([*grads, loss], feed)
                losses.append(value)
                ps.step(sess, step, g)
        except CollectiveError as err:
            if dead_server is None:
                raise
            return err
        return sess.run(params), losses

    return expected, run_threads(comms, rank)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("servers", [1, 2])
def test_synchronous_ps_equals_one_rank(momentum, servers):
    expected, results = run("sync", servers=servers, momentum=momentum)
    for weights, _ in results[servers:]:
        for a, b in zip(weights, expected):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_asynchronous_ps_learns_but_is_not_synchronous():
    expected, results = run("async", steps=30, momentum=0.0)
    weights, losses = results[2]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert not all(np.allclose(a, b) for a, b in zip(weights, expected))


def test_a_dead_server_is_named_by_every_worker():
    _, results = run("sync", servers=2, dead_server=1, timeout=1.0)
    for err in [results[0], *results[2:]]:  # the other server too
        assert isinstance(err, CollectiveError), results
        assert err.peer == 1 and "rank 1" in str(err)


def test_ps_checks_its_arguments():
    comm = ThreadTransport.group_of(2)[0]
    with pytest.raises(tf.TinyFlowError if hasattr(tf, "TinyFlowError") else Exception,
                       match="servers"):
        ParameterServer(comm, [], servers=2)
    with pytest.raises(ValueError, match="mode"):
        ParameterServer(comm, [], servers=1, mode="eventual")
