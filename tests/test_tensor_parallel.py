"""Tensor parallelism (tensor_parallel.py): Megatron's column-then-row split as a
graph rewrite with reasons; same weights as one rank; bytes per step as in theory."""

from __future__ import annotations

import re

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.allreduce import ThreadTransport, run_threads
from tinyflow.graph import TinyFlowError
from tinyflow.tensor_parallel import TensorParallel, tp_bytes_theory

BLOCKS = [(8, 16, 8), (8, 16, 4)]  # (in, hidden, out) per MLP block
BATCH = 6


def build(seed: int = 2):
    rng = np.random.default_rng(seed)
    x = tf.placeholder(tf.float64, (BATCH, BLOCKS[0][0]))
    y = tf.placeholder(tf.int64, (BATCH,))
    h, params, marks = x, [], []
    for k, (inp, hid, out) in enumerate(BLOCKS):
        w1 = tf.Variable(rng.standard_normal((inp, hid)) / np.sqrt(inp), dtype=tf.float64,
                         name=f"tw{k}a")
        b1 = tf.Variable(rng.standard_normal(hid) * 0.1, dtype=tf.float64, name=f"tb{k}a")
        w2 = tf.Variable(rng.standard_normal((hid, out)) / np.sqrt(hid), dtype=tf.float64,
                         name=f"tw{k}b")
        b2 = tf.Variable(rng.standard_normal(out) * 0.1, dtype=tf.float64, name=f"tb{k}b")
        h = tf.matmul(tf.nn.relu(tf.matmul(h, w1) + b1), w2) + b2
        if k < len(BLOCKS) - 1:
            h = tf.nn.tanh(h)
        params += [w1, b1, w2, b2]
        marks.append((w1, b1, w2))
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(h, y)
    return x, y, loss, params, marks


def train(ranks: int, make_opt, steps: int = 4):
    x, y, loss, params, marks = build()
    single = make_opt().minimize(loss, params)
    comms = ThreadTransport.group_of(ranks, timeout=20)
    tps, trains = [], []
    for comm in comms:
        tp = TensorParallel(comm)
        for w1, b1, w2 in marks:
            tp.split_column(w1, bias=b1)
            tp.split_row(w2)
        local = tp.apply(loss)
        mine = [tp.shards[id(p)][1] if id(p) in tp.shards else p for p in params]
        trains.append(make_opt().minimize(local, mine))
        tps.append(tp)
    init = tf.global_variables_initializer()
    rng = np.random.default_rng(9)
    feeds = [(rng.standard_normal((BATCH, BLOCKS[0][0])), rng.integers(0, 4, BATCH))
             for _ in range(steps)]
    sess = tf.Session()
    sess.run(init)
    for fx, fy in feeds:
        sess.run(single, {x: fx, y: fy})
    expected = sess.run(params)

    def rank(comm):
        tp = tps[comm.rank]
        sess = tf.Session()
        sess.run(init)
        tp.shard(sess)
        sent = []
        for fx, fy in feeds:
            before = comm.bytes_sent
            sess.run(trains[comm.rank], {x: fx, y: fy})
            sent.append(comm.bytes_sent - before)
        return tp.gather_variables(sess, params), sent

    return expected, run_threads(comms, rank), tps


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_tensor_parallel_matches_one_rank(ranks, opt):
    make_opt = {"sgd": lambda: tf.train.SGD(0.3),
                "adam": lambda: tf.train.AdamOptimizer(0.01)}[opt]
    expected, results, _ = train(ranks, make_opt)
    for weights, _ in results:
        for a, b in zip(weights, expected):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_bytes_per_step_match_theory_and_the_rewrites_are_explained():
    ranks = 4
    _, results, tps = train(ranks, lambda: tf.train.SGD(0.1), steps=2)
    theory = tp_bytes_theory(BATCH, [(i, o) for i, _, o in BLOCKS], ranks, 8)
    for _, sent in results:
        assert sent == [theory] * 2
    text = tf.explain(tps[0])
    assert "column-split tw0a 8x16 -> 8x4" in text
    assert "row-split tw1b 16x4 -> 4x4" in text
    assert len(tps[0].ctx.records) == 4


def test_a_row_split_needs_a_column_split_input():
    x, y, loss, params, marks = build()
    tp = TensorParallel(ThreadTransport.group_of(2)[0])
    tp.split_row(marks[0][2])
    with pytest.raises(TinyFlowError, match="must be column-split"):
        tp.apply(loss)


def test_a_split_tensor_into_a_non_elementwise_op_is_refused():
    x = tf.placeholder(tf.float64, (4, 8))
    w = tf.Variable(np.ones((8, 8)), dtype=tf.float64)
    tp = TensorParallel(ThreadTransport.group_of(2)[0])
    tp.split_column(w)
    with pytest.raises(TinyFlowError, match="not elementwise"):
        tp.apply(tf.reduce_sum(tf.matmul(x, w)))


# ----------------------------------------------------------------------------------
# Attention heads (the char transformer's block): Q, K, V by columns, output by rows
# ----------------------------------------------------------------------------------

SEQ, HEADS, DIM = 3, 4, 8


def build_attention(seed: int = 4):
    """x + attention(x), then an MLP block and a linear readout (float64): causal
    attention written as train_charlm.py writes it."""
    rng = np.random.default_rng(seed)

    def var(shape, name, scale=0.3):
        return tf.Variable(rng.standard_normal(shape) * scale, dtype=tf.float64, name=name)

    x = tf.placeholder(tf.float64, (None, DIM))
    y = tf.placeholder(tf.int64, (None,))
    wq, wk, wv, wo = (var((DIM, DIM), f"a_{n}") for n in "qkvo")
    w1, b1, w2 = var((DIM, 16), "a_w1"), var((16,), "a_b1", 0.1), var((16, DIM), "a_w2")
    readout = var((DIM, 5), "a_readout")

    def heads(t):  # (B*T, D) -> (B, H, T, D/H)
        return tf.transpose(tf.reshape(t, (-1, SEQ, HEADS, DIM // HEADS)), (0, 2, 1, 3))

    q, k, v = heads(tf.matmul(x, wq)), heads(tf.matmul(x, wk)), heads(tf.matmul(x, wv))
    mask = tf.constant(np.tril(np.ones((SEQ, SEQ), bool)))
    scores = tf.where(mask, tf.matmul(q, k, transpose_b=True) * (1 / np.sqrt(DIM // HEADS)),
                      tf.constant(-1e9))
    merged = tf.reshape(tf.transpose(tf.matmul(tf.nn.softmax(scores), v), (0, 2, 1, 3)),
                        (-1, DIM))
    h = x + tf.matmul(merged, wo)
    h = h + tf.matmul(tf.nn.relu(tf.matmul(h, w1) + b1), w2)
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(tf.matmul(h, readout), y)
    params = [wq, wk, wv, wo, w1, b1, w2, readout]

    def mark(tp):
        for w in (wq, wk, wv):
            tp.split_column(w)
        tp.split_row(wo)
        tp.split_column(w1, bias=b1)
        tp.split_row(w2)

    return x, y, loss, params, mark


@pytest.mark.parametrize("ranks", [2, 4])
def test_attention_heads_split_over_ranks_match_one_rank(ranks):
    x, y, loss, params, mark = build_attention()
    steps, batch = 3, 2
    single = tf.train.AdamOptimizer(0.05).minimize(loss, params)
    comms = ThreadTransport.group_of(ranks, timeout=20)
    tps, trains = [], []
    for comm in comms:
        tp = TensorParallel(comm)
        mark(tp)
        local = tp.apply(loss)
        mine = [tp.shards[id(p)][1] if id(p) in tp.shards else p for p in params]
        trains.append(tf.train.AdamOptimizer(0.05).minimize(local, mine))
        tps.append(tp)
    init = tf.global_variables_initializer()
    rng = np.random.default_rng(3)
    feeds = [(rng.standard_normal((batch * SEQ, DIM)), rng.integers(0, 5, batch * SEQ))
             for _ in range(steps)]
    sess = tf.Session()
    sess.run(init)
    for fx, fy in feeds:
        sess.run(single, {x: fx, y: fy})
    expected = sess.run(params)

    def rank(comm):
        sess = tf.Session()
        sess.run(init)
        tps[comm.rank].shard(sess)
        sent = []
        for fx, fy in feeds:
            before = comm.bytes_sent
            sess.run(trains[comm.rank], {x: fx, y: fy})
            sent.append(comm.bytes_sent - before)
        return tps[comm.rank].gather_variables(sess, params), sent

    for weights, sent in run_threads(comms, rank):
        for got, want, p in zip(weights, expected, params):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=p.name)
        # Attention and MLP are both (D -> D) column-then-row blocks: one allreduce of
        # (B*T) x D forward each; backward one for the MLP's input (the residual
        # stream), none for attention's (x is data), Q, K and V sharing one f.
        theory = tp_bytes_theory(batch * SEQ, [(DIM, DIM), (DIM, DIM)], ranks, 8)
        assert sent == [theory] * steps
    text = tf.explain(tps[0])
    assert "column-split a_q" in text and "row-split a_o" in text


def test_a_reshape_that_mixes_the_split_axis_is_refused():
    comms = ThreadTransport.group_of(2, timeout=5)
    x = tf.placeholder(tf.float64, (6, DIM))
    w = tf.Variable(np.ones((DIM, DIM)), dtype=tf.float64, name="mix_w")
    out = tf.reduce_sum(tf.reshape(tf.matmul(x, w), (DIM, 6)))  # columns mixed with rows
    tp = TensorParallel(comms[0])
    tp.split_column(w)
    with pytest.raises(TinyFlowError, match=r"reshape 6x8 -> 8x6 mixes the split axis 1"):
        tp.apply(out)


# ----------------------------------------------------------------------------------
# Transposed operands, split weights read elsewhere, transposes with default axes
# ----------------------------------------------------------------------------------

T_IN, T_HID, T_OUT, T_BATCH = 5, 8, 3, 6


def serial_and_split(ranks, loss, params, mark, feed):
    """The loss and the weights after one SGD step, serial and on each of `ranks`
    ranks (weights gathered back): [(loss, weights)] with the serial one first."""
    single = tf.train.SGD(0.5).minimize(loss, params)
    comms = ThreadTransport.group_of(ranks, timeout=20)
    tps, locals_, trains = [], [], []
    for comm in comms:
        tp = TensorParallel(comm)
        mark(tp)
        locals_.append(tp.apply(loss))
        mine = [tp.shards[id(p)][1] if id(p) in tp.shards else p for p in params]
        trains.append(tf.train.SGD(0.5).minimize(locals_[-1], mine))
        tps.append(tp)
    init = tf.global_variables_initializer()
    sess = tf.Session()
    sess.run(init)
    serial_loss = sess.run(loss, feed)
    sess.run(single, feed)
    serial = [(serial_loss, sess.run(params))]

    def rank(comm):
        sess = tf.Session()
        sess.run(init)
        tps[comm.rank].shard(sess)
        value = sess.run(locals_[comm.rank], feed)
        sess.run(trains[comm.rank], feed)
        return value, tps[comm.rank].gather_variables(sess, params)

    return serial + run_threads(comms, rank)


def build_transposed(ta1, tb1, ta2, tb2, sizes=(T_IN, T_HID, T_OUT), seed=5):
    """An MLP block whose matmuls read x, h and the weights transposed as the flags
    say (a transposed weight is stored out x in, as torch.nn.Linear stores it)."""
    rng = np.random.default_rng(seed)
    n_in, hidden, n_out = sizes
    x = tf.placeholder(tf.float64, (n_in, T_BATCH) if ta1 else (T_BATCH, n_in))
    y = tf.placeholder(tf.int64, (T_BATCH,))
    w1 = tf.Variable(rng.standard_normal((hidden, n_in) if tb1 else (n_in, hidden)) * 0.5,
                     dtype=tf.float64, name="t_w1")
    b1 = tf.Variable(rng.standard_normal(hidden) * 0.1, dtype=tf.float64, name="t_b1")
    w2 = tf.Variable(rng.standard_normal((n_out, hidden) if tb2 else (hidden, n_out)) * 0.4,
                     dtype=tf.float64, name="t_w2")
    h = tf.nn.tanh(tf.matmul(x, w1, transpose_a=ta1, transpose_b=tb1) + b1)
    if ta2:  # (hidden, B): the slice moves to axis 0, the one transpose_a sums over
        h = tf.transpose(h, (1, 0))
    logits = tf.matmul(h, w2, transpose_a=ta2, transpose_b=tb2)
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(logits, y)
    feed = {x: rng.standard_normal(x.shape), y: rng.integers(0, n_out, T_BATCH)}
    return loss, [w1, b1, w2], feed


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("flags", [(0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1),
                                   (0, 1, 0, 0), (1, 0, 0, 1)],
                         ids=lambda f: "ta{}tb{}-ta{}tb{}".format(*f))
# Distinct sizes: a cut on the wrong axis fails to build. Square ones: it builds and
# silently computes another model (as it did before transposes were handled).
@pytest.mark.parametrize("sizes", [(T_IN, T_HID, T_OUT), (8, 8, 8)],
                         ids=["distinct", "square"])
def test_transposed_operands_match_serial(ranks, flags, sizes):
    """Forward and one SGD step on 1, 2 and 4 ranks equal the serial program's, with
    transpose_a/transpose_b on the column-split and the row-split matmul."""
    loss, (w1, b1, w2), feed = build_transposed(*map(bool, flags), sizes=sizes)

    def mark(tp):
        tp.split_column(w1, bias=b1)
        tp.split_row(w2)

    (want_loss, want), *results = serial_and_split(ranks, loss, [w1, b1, w2], mark, feed)
    for got_loss, got in results:
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-12)
        for a, b, p in zip(got, want, (w1, b1, w2)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=p.name)


def test_a_weight_used_both_plain_and_transposed_is_refused():
    x = tf.placeholder(tf.float64, (2, 4))
    w = tf.Variable(np.ones((4, 4)), dtype=tf.float64, name="tied_w")
    second = tf.matmul(x, w, transpose_b=True)  # needs w's rows cut, the first its columns
    tp = TensorParallel(ThreadTransport.group_of(2)[0])
    tp.split_column(w)
    with pytest.raises(TinyFlowError, match=re.escape(
            f"{second.name} (matmul, at {second.where}) splits tied_w along axis 0, but "
            "another matmul already split it along axis 1")):
        tp.apply(tf.matmul(x, w) + second)


@pytest.mark.parametrize("read", ["w1", "b1", "w2"])
def test_a_split_weight_read_outside_its_matmul_is_refused(read):
    """An L2 term on a split weight would read the full Variable, which no rank keeps:
    its gradient was silently dropped."""
    loss, (w1, b1, w2), _ = build_transposed(False, False, False, False)
    weight = {"w1": w1, "b1": b1, "w2": w2}[read]
    penalty = tf.square(weight)
    tp = TensorParallel(ThreadTransport.group_of(1)[0])
    tp.split_column(w1, bias=b1)
    tp.split_row(w2)
    with pytest.raises(TinyFlowError, match=re.escape(
            f"{penalty.name} (mul, at {penalty.where}) reads {weight.name}")) as err:
        tp.apply(loss + 0.01 * tf.reduce_sum(penalty))
    assert "test_tensor_parallel.py:" in str(err.value)
    assert "each rank holds only its shard" in str(err.value)


@pytest.mark.parametrize("axes", [None, (-1, -2)])
def test_transpose_with_default_or_negative_axes_moves_the_slice(axes):
    rng = np.random.default_rng(6)
    x = tf.placeholder(tf.float64, (T_BATCH, T_IN))
    w1 = tf.Variable(rng.standard_normal((T_IN, T_HID)), dtype=tf.float64, name="d_w1")
    w2 = tf.Variable(rng.standard_normal((T_HID, T_OUT)), dtype=tf.float64, name="d_w2")
    h = tf.transpose(tf.nn.tanh(tf.matmul(x, w1)), axes)  # (HID, B): the slice on axis 0
    loss = tf.reduce_sum(tf.square(tf.matmul(tf.transpose(h, axes), w2)))

    def mark(tp):
        tp.split_column(w1)
        tp.split_row(w2)

    feed = {x: rng.standard_normal((T_BATCH, T_IN))}
    (want_loss, want), *results = serial_and_split(2, loss, [w1, w2], mark, feed)
    for got_loss, got in results:
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-12)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
