"""Pipeline parallelism (pipeline.py): GPipe and 1F1B train to the same weights as
one rank on the whole batch, keep the bubble and the stash the formulas predict, and a
dead stage is a CollectiveError naming it."""

from __future__ import annotations

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.allreduce import ThreadTransport, run_threads
from tinyflow.pipeline import (
    Pipeline,
    bubble_fraction,
    idle_fraction,
    schedule_1f1b,
    schedule_gpipe,
)
from tinyflow.transports import CollectiveError

WIDTHS = (6, 9, 8, 7, 3)  # 4 layers: one per stage on 4 ranks


def make_layers(seed: int = 5):
    """Dense layers over explicit float64 weights: the same however often built."""
    rng = np.random.default_rng(seed)
    layers = []
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        w = tf.Variable(rng.standard_normal((a, b)) / np.sqrt(a), dtype=tf.float64,
                        name=f"pw{i}")
        bias = tf.Variable(rng.standard_normal(b) * 0.1, dtype=tf.float64, name=f"pb{i}")
        last = i == len(WIDTHS) - 2
        layers.append(lambda h, w=w, bias=bias, last=last:
                      (tf.matmul(h, w) + bias) if last else tf.nn.tanh(tf.matmul(h, w) + bias))
    return layers


def loss_fn(logits, labels):
    return tf.nn.mean_sparse_softmax_cross_entropy_with_logits(logits, labels)


def data(steps, batch):
    rng = np.random.default_rng(11)
    return (rng.standard_normal((steps * batch, WIDTHS[0])),
            rng.integers(0, WIDTHS[-1], steps * batch))


def run_pipeline(schedule, ranks=4, microbatches=4, steps=3, batch=8, make_opt=None,
                 die_at=None, crash=False, timeout=20):
    make_opt = make_opt or (lambda: tf.train.MomentumOptimizer(0.1, 0.9))
    layers = make_layers()
    x = tf.placeholder(tf.float64, (None, WIDTHS[0]))
    y = tf.placeholder(tf.int64, (None,))
    h = x
    for layer in layers:
        h = layer(h)
    params = tf.trainable_variables()[-2 * len(layers):]
    single = make_opt().minimize(loss_fn(h, y), params)
    comms = ThreadTransport.group_of(ranks, timeout=timeout)
    init = tf.global_variables_initializer()
    groups = [layers[k * len(layers) // ranks:(k + 1) * len(layers) // ranks]
              for k in range(ranks)]
    stages = [lambda h, g=g: _chain(g, h) for g in groups]
    pipes = [Pipeline(stages, loss_fn, c, (WIDTHS[0],), batch, microbatches, make_opt(),
                      schedule, init=init, dtype=np.float64) for c in comms]
    data_x, data_y = data(steps, batch)
    sess = tf.Session()
    sess.run(init)
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        sess.run(single, {x: data_x[rows], y: data_y[rows]})
    expected = sess.run(params)

    def rank(comm):
        pipe = pipes[comm.rank]
        sess = tf.Session()
        sess.run(pipe.init)
        if die_at is not None and comm.rank == die_at:
            if crash:
                raise RuntimeError(f"stage {die_at} crashed")
            return "dead", pipe
        try:
            for step in range(steps):
                rows = slice(step * batch, (step + 1) * batch)
                pipe.train_step(sess, data_x[rows], data_y[rows])
        except CollectiveError as err:
            if die_at is None:
                raise
            return err, pipe
        return sess.run(pipe.variables), pipe

    results = run_threads(comms, rank)
    if die_at is not None:
        return expected, [r for r, _ in results], None
    got = [w for weights, _ in results for w in weights]
    return expected, got, [pipe for _, pipe in results]


def _chain(layers, h):
    for layer in layers:
        h = layer(h)
    return h


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_pipeline_matches_one_rank_on_the_whole_batch(schedule, ranks):
    expected, got, _ = run_pipeline(schedule, ranks=ranks, microbatches=4)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_pipeline_with_adam():
    expected, got, _ = run_pipeline("1f1b", make_opt=lambda: tf.train.AdamOptimizer(0.01))
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_schedules_run_every_microbatch_once_each_way():
    for make in (schedule_gpipe, schedule_1f1b):
        for p, m in [(2, 4), (4, 8), (4, 2)]:
            for s in range(p):
                actions = make(s, p, m)
                assert sorted(actions) == sorted([("F", i) for i in range(m)] +
                                                 [("B", i) for i in range(m)])
                for i in range(m):  # a microbatch's backward comes after its forward
                    assert actions.index(("F", i)) < actions.index(("B", i))
    assert schedule_1f1b(0, 4, 8)[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert schedule_1f1b(3, 4, 8)[:2] == [("F", 0), ("B", 0)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_and_stash_follow_the_formulas(schedule):
    p, m = 4, 8
    _, _, pipes = run_pipeline(schedule, ranks=p, microbatches=m, steps=1, batch=16)
    measured = idle_fraction([pipe.events for pipe in pipes])
    assert measured == pytest.approx(bubble_fraction(p, m), abs=1e-12)
    peak = max(pipe.peak_stash for pipe in pipes)
    assert peak == (m if schedule == "gpipe" else p)


def test_a_dead_stage_is_named_by_the_others():
    """Stage 2 of 4 stops (returns without a word): stage 3 waits for its activation,
    stage 1 for its gradient, stage 0 for stage 1, which waits for stage 2. Every one
    must name stage 2 within the timeout."""
    _, errors, _ = run_pipeline("1f1b", die_at=2, timeout=1.0)
    for r in (0, 1, 3):
        assert isinstance(errors[r], CollectiveError), errors
        assert errors[r].peer == 2, (r, str(errors[r]))
    assert errors[2] == "dead"


def test_a_crashed_stage_stops_the_others_at_once():
    with pytest.raises(RuntimeError, match="stage 1 crashed"):
        run_pipeline("gpipe", die_at=1, crash=True, timeout=30)


def test_pipeline_checks_its_arguments():
    comm = ThreadTransport.group_of(2)[0]
    layers = make_layers()
    with pytest.raises(tf.TinyFlowError if hasattr(tf, "TinyFlowError") else Exception,
                       match="stages need"):
        Pipeline(layers, loss_fn, comm, (WIDTHS[0],), 8, 4, tf.train.SGD(0.1))
    with pytest.raises(ValueError, match="do not divide"):
        Pipeline(layers[:2], loss_fn, comm, (WIDTHS[0],), 8, 3, tf.train.SGD(0.1))
    with pytest.raises(ValueError, match="schedule"):
        Pipeline(layers[:2], loss_fn, comm, (WIDTHS[0],), 8, 4, tf.train.SGD(0.1),
                 schedule="zigzag")


@pytest.mark.parametrize("microbatches, batch, name", [
    (0, 8, "microbatches"), (-2, 8, "microbatches"), (2.0, 8, "microbatches"),
    (True, 8, "microbatches"), (2, 0, "batch_size"), (2, -4, "batch_size"),
    (2, "8", "batch_size")])
def test_pipeline_refuses_bad_counts_naming_them(microbatches, batch, name):
    """microbatches=0 was a ZeroDivisionError, -2 a ShapeError of a placeholder,
    batch_size=0 accepted."""
    (comm,) = ThreadTransport.group_of(1)
    with pytest.raises(tf.TinyFlowError, match=f"Pipeline: {name} must be") as info:
        Pipeline([make_layers()[0]], loss_fn, comm, (WIDTHS[0],), batch, microbatches,
                 tf.train.SGD(0.1))
    assert repr(microbatches if name == "microbatches" else batch) in str(info.value)


@pytest.mark.parametrize("rows, label_rows, name", [(7, 7, "x"), (6, 6, "x"),
                                                    (8, 6, "labels")])
def test_a_batch_of_the_wrong_size_is_named(rows, label_rows, name):
    """A 7-row batch for batch_size=8 was numpy's "array split does not result in an
    equal division"."""
    (comm,) = ThreadTransport.group_of(1, timeout=5)
    pipe = Pipeline([make_layers()[0]], loss_fn, comm, (WIDTHS[0],), 8, 2,
                    tf.train.SGD(0.1), init=tf.global_variables_initializer(),
                    dtype=np.float64)
    sess = tf.Session()
    sess.run(pipe.init)
    wrong = rows if name == "x" else label_rows
    with pytest.raises(tf.TinyFlowError, match=rf"{name} has shape \({wrong}\b.*batch_size 8"):
        pipe.train_step(sess, np.ones((rows, WIDTHS[0])), np.zeros(label_rows, np.int64))
    with pytest.raises(tf.TinyFlowError, match="x is None"):
        pipe.train_step(sess, None, np.zeros(8, np.int64))


def test_a_stages_slots_keep_their_initializer_for_variables_initializer():
    # A stage takes its optimizer slots' initializers out of the global list (another
    # rank's global initializer must not run them); tf.variables_initializer then
    # said such a slot had "no initial value".
    layers = make_layers()
    stages = [lambda h, layer=layer: layer(h) for layer in layers[:2]]
    comms = ThreadTransport.group_of(2, timeout=20)
    pipe = Pipeline(stages, loss_fn, comms[0], (WIDTHS[0],), 4, 2,
                    tf.train.MomentumOptimizer(0.1, 0.9), "1f1b",
                    init=tf.global_variables_initializer(), dtype=np.float64)
    slots = [a.inputs[0] for a in pipe.init.inputs if "/momentum" in a.inputs[0].name]
    assert slots and not any(a.inputs[0] in slots for a in
                             tf.global_variables_initializer().inputs)
    sess = tf.Session()
    sess.run(tf.variables_initializer(slots))
    assert all(not sess.variables[s].any() for s in slots)
