"""One DebugRecord for all ranks (rank_trace.py): `launch --trace` merges the ranks'
records, a pipeline's events make a record with a lane per rank."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import trace
from tinyflow.allreduce import ThreadTransport, launch, run_threads
from tinyflow.cli import main
from tinyflow.collectives import tree_allreduce
from tinyflow.pipeline import Pipeline
from tinyflow.rank_trace import collective_events, merge_records, scheme_record

SCRIPT = r'''
import numpy as np
import tinyflow as tf
from tinyflow.allreduce import init_communicator
from tinyflow.parallel import DistributedOptimizer, broadcast_variables
comm = init_communicator(timeout=30)
x = tf.placeholder(tf.float32, (4, 3))
w = tf.Variable(np.ones((3, 2), np.float32))
loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
train = DistributedOptimizer(tf.train.SGD(0.1), comm).minimize(loss)
sess = tf.Session()
sess.run(tf.global_variables_initializer())
broadcast_variables(sess, comm)
for step in range(3):
    sess.run(train, {x: np.full((4, 3), comm.rank + 1.0, np.float32)})
'''


def test_launch_trace_merges_every_rank(tmp_path):
    script = tmp_path / "dp.py"
    script.write_text(SCRIPT)
    out = tmp_path / "merged.json"
    assert launch(2, str(script), use_mpi=False, trace=str(out)) == 0
    record = trace.load(out)
    names = [s["name"] for s in record["streams"]]
    assert any(n.startswith("rank0/") for n in names) and any(n.startswith("rank1/")
                                                              for n in names)
    ranks = {e["args"]["rank"] for t in record["timelines"] for e in t["events"]}
    assert ranks == {0, 1}
    assert not list(tmp_path.glob("merged.json.rank*"))  # the parts were merged away


def test_cli_launch_trace_checks_the_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["launch", "-n", "2", "--trace", str(tmp_path / "no" / "f.json"),
              str(tmp_path / "x.py")])


def test_merge_renames_streams_and_keeps_rank0_steps():
    a = trace.empty_record("r0")
    a["timelines"] = [{"run": 0, "label": "run 0", "events": []}]
    b = trace.empty_record("r1")
    b["streams"].append({"id": 1, "name": "comm"})
    b["timelines"] = [{"run": 0, "label": "run 0", "events": [
        {"step": None, "node": "x", "op": "ring_step", "stream": 1, "start": 0.0,
         "end": 1.0, "bytes": 8, "summary": None}]}]
    merged = merge_records([a, b])
    assert [s["name"] for s in merged["streams"]] == ["rank0/compute0", "rank1/compute0",
                                                      "rank1/comm"]
    assert merged["timelines"][0]["events"][0]["stream"] == 2


def test_pipeline_and_tree_events_make_one_record(tmp_path):
    widths = (4, 6, 3)
    rng = np.random.default_rng(0)
    ws = [tf.Variable(rng.standard_normal((a, b)), dtype=tf.float64)
          for a, b in zip(widths[:-1], widths[1:])]
    stages = [lambda h, w=w: tf.nn.tanh(tf.matmul(h, w)) for w in ws]
    init = tf.global_variables_initializer()
    comms = ThreadTransport.group_of(2, timeout=20)
    loss = lambda logits, y: tf.nn.mean_sparse_softmax_cross_entropy_with_logits(  # noqa: E731
        logits, y)
    pipes = [Pipeline(stages, loss, c, (4,), 8, 4, tf.train.SGD(0.1), "1f1b", init=init,
                      dtype=np.float64) for c in comms]
    x, y = rng.standard_normal((8, 4)), rng.integers(0, 3, 8)

    def rank(comm):
        comm.trace = []
        sess = tf.Session()
        sess.run(pipes[comm.rank].init)
        pipes[comm.rank].train_step(sess, x, y)
        tree_allreduce(np.ones(16), comm)
        return pipes[comm.rank].events + collective_events(comm.trace, comm.rank)

    events = [e for per_rank in run_threads(comms, rank) for e in per_rank]
    record = scheme_record(events, "1f1b on 2 ranks")
    trace.save(record, tmp_path / "pp.json")
    names = [s["name"] for s in trace.load(tmp_path / "pp.json")["streams"]]
    assert names == ["rank0/comm", "rank0/compute", "rank1/comm", "rank1/compute"]
    kinds = {e["node"][0] for e in record["timelines"][0]["events"]}
    assert {"F", "B", "t"} <= kinds
    assert Path(sys.executable)  # (records are plain JSON: no pickle)


def test_reduce_scatter_and_all_gather_record_their_ring_steps():
    # ZeRO-2/3 run reduce_scatter and all_gather, not ring_allreduce, and those did not
    # record their steps: the zero3 scheme's record held a timeline with no events.
    from tinyflow.collectives import all_gather, reduce_scatter
    comms = ThreadTransport.group_of(3, timeout=20)

    def rank(comm):
        comm.trace = []
        shard = reduce_scatter(np.arange(7.0), comm, "sum")
        full = all_gather(shard, comm, total=7)
        return full, collective_events(comm.trace, comm.rank)

    results = run_threads(comms, rank)
    for full, _ in results:
        np.testing.assert_array_equal(full, 3 * np.arange(7.0))
    events = [e for _, per_rank in results for e in per_rank]
    assert sorted({(e["stream"], e["op"]) for e in events}) == [
        (f"rank{r}/comm", phase) for r in range(3) for phase in ("all-gather",
                                                                  "reduce-scatter")]
    assert len(events) == 3 * 2 * 2   # per rank, N - 1 steps of each phase
    assert all(e["end"] >= e["start"] and e["bytes"] > 0 for e in events)
    scheme_record(events, "zero on 3 ranks")   # a valid record


def test_scheme_record_keeps_an_events_args_in_one_level():
    # collective_events put rank and dst under "args", which scheme_record nested one
    # level deeper ({"args": {"args": {"rank": 3, "dst": 0}}}).
    events = collective_events([{"phase": "all-gather", "step": 0, "start": 1.0, "end": 2.0,
                                 "bytes": 8, "dst": 1}], 0)
    events.append({"node": "F0", "stream": "rank0/compute", "start": 0.5, "end": 1.0,
                   "microbatch": 0})
    record = scheme_record(events, "one level")
    args = {e["node"]: e["args"] for e in record["timelines"][0]["events"]}
    assert args["all-gather[0]"] == {"rank": 0, "dst": 1}
    assert args["F0"] == {"microbatch": 0}
