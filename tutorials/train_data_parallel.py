"""Lesson: data-parallel training of the digits MLP on N ranks.

Run it three ways; the training code is the same in all three:

    tinyflow launch -n 4 tutorials/train_data_parallel.py   # 4 processes (MPI if installed)
    python tutorials/train_data_parallel.py --threads 4      # 4 ranks as threads
    python tutorials/train_data_parallel.py                  # one rank

What each rank does, every step (Horovod's recipe):

1. take its shard of the global batch: rank r of N gets examples [r*b, (r+1)*b) of
   the same shuffled global batch of N*b examples (every rank shuffles with the same
   seed, so no data is sent);
2. run forward and backward on its shard: its gradient of the *mean* loss over b
   examples;
3. average the gradients over the ranks with the ring allreduce. The allreduce nodes
   sit in the graph (tinyflow.parallel.DistributedOptimizer), one per bucket of
   gradients, last layer first, on the executor's comm stream: the last layer's
   bucket travels while the earlier layers' gradients are still being computed;
4. apply the same averaged gradient on every rank. The mean of N shard means is the
   mean over the global batch, so N ranks with batch b take exactly the steps one
   rank would take with batch N*b, and the replicas never drift apart.

Rank 0 starts everyone from its initial weights (broadcast_variables), shows the
progress bar, reports test accuracy and time, saves a checkpoint (tf.train.Saver), and
with --trace FILE writes rank 0's DebugRecord.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

# One BLAS thread per rank (set before numpy loads BLAS): N ranks already keep N
# cores busy, and extra BLAS threads on top fight over them (a step got 15x slower
# on a loaded 2-core machine). `tinyflow launch` sets these too; yours win.
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import numpy as np

import tinyflow as tf
from tinyflow.cli import (nonnegative_int, positive_float, positive_int, script_prog,
                          writable_file)
from tinyflow.allreduce import ThreadTransport, init_communicator, ring_allreduce, run_threads
from tinyflow.data import load_digits, minibatches
from tinyflow.parallel import DistributedOptimizer, broadcast_variables
from tinyflow.saver import Saver


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=script_prog(__file__),
        description="Train the digits MLP data-parallel on N ranks (processes under "
                    "`tinyflow launch -n N`, or threads with --threads N).")
    parser.add_argument("--threads", type=nonnegative_int, default=0, metavar="N",
                        help="run N ranks as threads of this process")
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="global batch size, split evenly across the ranks")
    parser.add_argument("--hidden", type=positive_int, default=128)
    parser.add_argument("--lr", type=positive_float, default=0.1)
    parser.add_argument("--bucket-kb", type=positive_int, default=16,
                        help="gradient bucket size for the allreduce, in KiB")
    parser.add_argument("--timeout", type=positive_float, default=60.0,
                        help="seconds a rank waits for a peer before giving up")
    parser.add_argument("--checkpoint", default="checkpoints/digits_data_parallel.safetensors")
    parser.add_argument("--trace", metavar="FILE", type=writable_file,
                        help="write rank 0's DebugRecord (tinyflow debug FILE)")
    parser.add_argument("--quick", action="store_true",
                        help="4 epochs of a small model at lr 0.3, 4 KiB buckets")
    args = parser.parse_args(argv)
    if args.quick:
        # Seconds, yet what the lesson teaches: a trained model (about 90% test
        # accuracy; 2 epochs at lr 0.1 stopped near 50%) and several buckets, so the
        # last layer's allreduce overlaps the earlier layers' backward (the small
        # model's ~14 KiB of gradients would fit one 16 KiB bucket: no overlap).
        args.epochs, args.hidden, args.lr, args.bucket_kb = 4, 32, 0.3, 4
    return args


def build_model(hidden: int):
    """The graph every rank runs: an MLP on 8x8 digits, its loss and its accuracy."""
    x = tf.placeholder(tf.float32, (None, 64), name="images")
    y = tf.placeholder(tf.int64, (None,), name="labels")
    model = tf.nn.MLP([64, hidden, hidden, 10])
    logits = model(x)
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(logits, y)
    accuracy = tf.reduce_mean(tf.equal(tf.argmax(logits, 1), y))
    return x, y, loss, accuracy


def progress_bar(total: int, enabled: bool):
    """A rich progress bar on rank 0 (a no-op elsewhere, or without rich)."""
    if not enabled:
        return None
    try:
        from rich.progress import Progress
    except ImportError:
        return None
    bar = Progress(transient=False)
    bar.start()
    bar.add_task("training", total=total)
    return bar


def train_rank(comm, sess, graph, train_op, data, args) -> dict:
    """One rank's training loop, in its own (initialized) Session."""
    x, y, loss, accuracy = graph
    x_train, y_train, x_test, y_test = data
    shard = args.batch_size // comm.size
    broadcast_variables(sess, comm)            # everyone starts from rank 0's weights
    steps_per_epoch = len(x_train) // (shard * comm.size)
    bar = progress_bar(args.epochs * steps_per_epoch, comm.rank == 0)
    started = time.perf_counter()
    history = []
    # Rank 0 records its runs for the debugger (the allreduce nodes on the comm stream).
    recording = (tf.debug.record(args.trace) if args.trace and comm.rank == 0
                 else contextlib.nullcontext())
    with recording:
        _train_epochs(comm, sess, graph, train_op, (x_train, y_train), args, shard, bar,
                      history)
    if bar is not None:
        bar.stop()
    seconds = time.perf_counter() - started
    test_accuracy = float(sess.run(accuracy, {x: x_test, y: y_test}))
    return {"rank": comm.rank, "accuracy": test_accuracy, "seconds": seconds,
            "loss": history}


def _train_epochs(comm, sess, graph, train_op, train_data, args, shard, bar, history):
    x, y, loss, _ = graph
    x_train, y_train = train_data
    for epoch in range(args.epochs):
        losses = []
        # Same seed on every rank: the same global batches, each rank takes its shard.
        for xb, yb in minibatches(x_train, y_train, shard * comm.size, seed=epoch,
                                  drop_last=True):
            mine = slice(comm.rank * shard, (comm.rank + 1) * shard)
            step_loss, _ = sess.run([loss, train_op], {x: xb[mine], y: yb[mine]})
            losses.append(step_loss)
            if bar is not None:
                bar.advance(bar.task_ids[0])
        # The ring is an ordinary function too: average the epoch's loss over ranks.
        mean_loss = ring_allreduce(np.array([np.mean(losses)]), comm, "mean")[0]
        history.append(float(mean_loss))
        tf.debug.scalar("loss", epoch, mean_loss)
        if bar is None and comm.rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss:.4f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    comms = (ThreadTransport.group_of(args.threads, args.timeout) if args.threads
             else [init_communicator(args.timeout)])
    size = comms[0].size
    if args.batch_size % size:
        print(f"--batch-size {args.batch_size} does not split evenly over {size} ranks",
              file=sys.stderr)
        return 2
    data = load_digits()
    graph = build_model(args.hidden)
    # One training op per rank in this process (threads share the graph; each rank's
    # allreduce nodes name its own transport).
    optimizers = {c.rank: DistributedOptimizer(tf.train.SGD(args.lr), c,
                                               bucket_bytes=args.bucket_kb << 10)
                  for c in comms}
    train_ops = {rank: opt.minimize(graph[2]) for rank, opt in optimizers.items()}
    buckets = len(optimizers[comms[0].rank].allreduce_nodes)
    if comms[0].rank == 0:
        overlap = ("each bucket's allreduce runs on the comm stream while the layers "
                   "before it still compute" if buckets > 1 else "one bucket: no overlap")
        print(f"{buckets} gradient bucket(s) of at most {args.bucket_kb} KiB, last layer "
              f"first: {overlap}")
        print(f"buckets={buckets}")
    init = tf.global_variables_initializer()
    # A Session per rank, initialized here in rank order: random initializers draw
    # from one generator per seed in a process, so rank 0 must draw first to start
    # from the weights a lone process would (then broadcast copies them to all).
    sessions = {c.rank: tf.Session() for c in comms}
    for sess in sessions.values():
        sess.run(init)
    run = lambda comm: train_rank(comm, sessions[comm.rank], graph,  # noqa: E731
                                  train_ops[comm.rank], data, args)
    results = run_threads(comms, run) if args.threads else [run(comms[0])]
    first = results[0]
    if first["rank"] == 0:
        mode = f"{size} threads" if args.threads else f"{size} {type(comms[0]).__name__} rank(s)"
        print(f"{mode}: test accuracy {first['accuracy']:.3f}, final loss "
              f"{first['loss'][-1]:.4f}, {first['seconds']:.2f} s for {args.epochs} epochs")
        print(f"test_accuracy={first['accuracy']:.4f}")
        print(f"final_loss={first['loss'][-1]:.4f}")
        print(f"train_seconds={first['seconds']:.2f}")
        if args.trace:
            print(f"trace={args.trace}")
        if args.checkpoint:
            Saver(tf.trainable_variables()).save(sessions[0], args.checkpoint)
            print(f"checkpoint={args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
