"""Train the digits MLP with any parallel scheme: one script, nine ways to cut the work.

    python tutorials/train_parallel.py --scheme zero3 --threads 4   # 4 ranks as threads
    tinyflow launch -n 4 tutorials/train_parallel.py --scheme pp-1f1b   # 4 processes
    python tutorials/train_parallel.py --scheme tp --check          # and compare to 1 rank
    python tutorials/train_parallel.py --model charlm --scheme tp   # attention heads split

Schemes (each a module of tinyflow; the model and the data are the same for all):

    dp          data parallel: every rank a replica, gradients allreduced (parallel.py)
    zero1/2/3   ZeRO: optimizer state, + gradients, + parameters sharded (zero.py)
    tp          Megatron tensor parallel: layers 1-2 and 3-4 split column-then-row
                (tensor_parallel.py)
    pp-gpipe    pipeline parallel, one layer group per rank, 4 microbatches, GPipe
    pp-1f1b     the same with the 1F1B schedule (pipeline.py)
    ps-sync     parameter server: rank 0 serves, the others push and pull (param_server.py)
    ps-async    the same, asynchronous with bounded staleness

The model: 64 -> H -> H -> H -> 10 (relu, tanh, relu), float64, momentum SGD; or, with
`--model charlm`, train_charlm.py's transformer (float64, 4 heads, next-character
prediction on 32-character windows) for dp, zero1-3, tp (Q, K, V and the MLP's first
layer by columns, the output projections by rows: each rank computes its heads) and
ps-*; the pipeline schemes cut the MLP's layer list. Every
scheme but ps-async computes what one rank computes on the whole batch; `--check`
trains that one rank too and prints the largest relative difference of the weights.
`--trace FILE` (threads) writes a DebugRecord with a timeline lane per rank: the
pipeline's F and B per microbatch and the collectives' steps; open it with
`tinyflow debug FILE` to see, e.g., 1F1B's bubbles.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import numpy as np

import tinyflow as tf
from tinyflow.cli import (nonnegative_int, positive_float, positive_int, script_prog,
                          writable_file)
from tinyflow.allreduce import ThreadTransport, init_communicator, ring_allreduce, run_threads
from tinyflow.collectives import all_gather
from tinyflow.data import load_digits, minibatches
from tinyflow.param_server import ParameterServer
from tinyflow.parallel import DistributedOptimizer, broadcast_variables
from tinyflow.pipeline import Pipeline
from tinyflow.rank_trace import collective_events, rank_stream_name, scheme_record
from tinyflow.saver import Saver
from tinyflow.tensor_parallel import TensorParallel

SCHEMES = ["dp", "zero1", "zero2", "zero3", "tp", "pp-gpipe", "pp-1f1b", "ps-sync",
           "ps-async"]
MLP_LAYERS = 4  # build_model's dense layers: a pipeline has at most this many stages


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=script_prog(__file__),
        description="Train the digits MLP with a parallel scheme, on threads (--threads N) "
                    "or under `tinyflow launch -n N`.")
    parser.add_argument("--scheme", choices=SCHEMES, default="zero2")
    parser.add_argument("--model", choices=["mlp", "charlm"], default="mlp")
    parser.add_argument("--threads", type=nonnegative_int, default=0, metavar="N",
                        help="N ranks as threads (default: 4, or the launcher's ranks)")
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--batch-size", type=positive_int, default=48)
    parser.add_argument("--hidden", type=positive_int, default=64)
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--microbatches", type=positive_int, default=4)
    parser.add_argument("--timeout", type=positive_float, default=60.0)
    parser.add_argument("--check", action="store_true",
                        help="also train one rank on the whole batch and compare weights")
    parser.add_argument("--trace", metavar="FILE", type=writable_file,
                        help="a DebugRecord, a lane per rank")
    parser.add_argument("--checkpoint", default="checkpoints/digits_parallel.safetensors")
    parser.add_argument("--quick", action="store_true", help="2 epochs, fewer batches")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 2
    if args.model == "charlm" and args.scheme.startswith("pp-"):
        parser.error("--model charlm runs dp, zero1-3, tp and ps-*; the pipeline schemes "
                     "cut the MLP's layer list")
    if args.threads and (problem := split_problem(args, args.threads)):
        parser.error(problem)
    return args


def split_problem(args: argparse.Namespace, ranks: int) -> str | None:
    """Why `ranks` ranks cannot run args.scheme exactly, or None. Each data-parallel
    rank (each ps worker) trains on an equal share of the batch: a batch that does
    not split evenly would silently lose its last rows. A pipeline cuts the layers
    into one group per rank: more ranks than layers would leave a stage empty."""
    scheme, batch = args.scheme, args.batch_size
    if (scheme == "dp" or scheme.startswith("zero")) and batch % ranks:
        return f"--batch-size {batch} does not split evenly over {ranks} ranks"
    if scheme.startswith("ps-") and ranks > 1 and batch % (ranks - 1):
        return (f"--batch-size {batch} does not split evenly over {ranks - 1} workers "
                f"({ranks} ranks, one of them the server)")
    if scheme.startswith("pp-") and ranks > MLP_LAYERS:
        return (f"--scheme {scheme} cuts the model's {MLP_LAYERS} layers into one stage "
                f"per rank: {ranks} stages would leave one empty (use at most "
                f"{MLP_LAYERS} ranks)")
    if scheme.startswith("pp-") and batch % args.microbatches:
        return (f"--batch-size {batch} does not split evenly into --microbatches "
                f"{args.microbatches}")
    return None


# ----------------------------------------------------------------------------------
# The model: four dense layers, as closures over their Variables
# ----------------------------------------------------------------------------------

def build_model(hidden: int):
    rng = np.random.default_rng(0)
    widths = [64, hidden, hidden, hidden, 10]
    activations = [tf.nn.relu, tf.nn.tanh, tf.nn.relu, None]
    layers, params = [], []
    for k, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        w = tf.Variable(rng.standard_normal((a, b)) * np.sqrt(2.0 / a), dtype=tf.float64,
                        name=f"w{k}")
        bias = tf.Variable(np.zeros(b), dtype=tf.float64, name=f"b{k}")
        act = activations[k]
        layers.append(lambda h, w=w, bias=bias, act=act:
                      act(tf.matmul(h, w) + bias) if act else tf.matmul(h, w) + bias)
        params += [w, bias]
    x = tf.placeholder(tf.float64, (None, 64), name="images")
    y = tf.placeholder(tf.int64, (None,), name="labels")
    logits = x
    for layer in layers:
        logits = layer(logits)
    loss = loss_fn(logits, y)
    accuracy = tf.reduce_mean(tf.equal(tf.argmax(logits, 1), y))
    return {"x": x, "y": y, "loss": loss, "accuracy": accuracy, "params": params,
            "layers": layers}


CHARLM = {"context": 32, "dim": 32, "heads": 4, "layers": 1, "corpus_chars": 40_000}


def build_charlm_model():
    """train_charlm.py's transformer in float64, on windows of the docstring corpus:
    x = (B, T) character ids, y = the next characters. Returns the MLP's keys plus
    `mark` (the tensor-parallel split of each block) and `data`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_charlm import CharTransformer

    from tinyflow.data import CharVocab, char_corpus
    text = char_corpus(CHARLM["corpus_chars"])
    vocab, context = CharVocab(text), CHARLM["context"]
    ids = vocab.encode(text)
    windows = (len(ids) - 1) // context
    xs = ids[:windows * context].reshape(windows, context)
    ys = ids[1:windows * context + 1].reshape(windows, context)
    split = int(0.9 * windows)
    data = (xs[:split], ys[:split], xs[split:], ys[split:])
    net = CharTransformer(len(vocab), context, CHARLM["dim"], CHARLM["heads"],
                          CHARLM["layers"], seed=0, dtype=np.float64)
    x = tf.placeholder(tf.int64, (None, context), name="ids")
    y = tf.placeholder(tf.int64, (None, context), name="next_ids")
    logits = net(x, tf.constant(np.arange(context, dtype=np.int64)))
    labels = tf.reshape(y, (-1,))
    params = [net.token_embedding, net.position_embedding]
    params += [v for block in net.blocks for v in block.values()]
    params += [net.final_gamma, net.final_beta, net.unembedding]

    def mark(tp):
        for block in net.blocks:
            for name in ("wq", "wk", "wv"):
                tp.split_column(block[name])
            tp.split_row(block["wo"])
            tp.split_column(block["w1"], bias=block["b1"])
            tp.split_row(block["w2"])

    return {"x": x, "y": y, "loss": loss_fn(logits, labels), "params": params,
            "accuracy": tf.reduce_mean(tf.equal(tf.argmax(logits, 1), labels)),
            "layers": None, "mark": mark, "data": data}


def loss_fn(logits, labels):
    return tf.nn.mean_sparse_softmax_cross_entropy_with_logits(logits, labels)


def optimizer(args):
    return tf.train.MomentumOptimizer(args.lr, 0.9)


# ----------------------------------------------------------------------------------
# One runner per scheme: init(sess), step(sess, step, xb, yb), weights(sess)
# ----------------------------------------------------------------------------------

class DataParallel:
    """dp and zero1-3: rank r trains on rows [r*s, (r+1)*s) of each batch."""

    def __init__(self, model, comm, args, zero):
        self.model, self.comm = model, comm
        self.dist = DistributedOptimizer(optimizer(args), comm, zero=zero)
        self.train = self.dist.minimize(model["loss"], model["params"])

    def init(self, sess):
        broadcast_variables(sess, self.comm, variables=self.model["params"])
        if self.dist.zero is not None:
            self.dist.shard(sess)

    def step(self, sess, step, xb, yb):
        s = len(xb) // self.comm.size
        mine = slice(self.comm.rank * s, (self.comm.rank + 1) * s)
        sess.run(self.train, {self.model["x"]: xb[mine], self.model["y"]: yb[mine]})

    def weights(self, sess):
        if self.dist.zero is not None:
            return _flat(self.dist.gather_variables(sess))
        return _flat(sess.variables[p] for p in self.model["params"])


class TensorParallelRunner:
    """tp: every rank sees the whole batch and holds 1/N of each split layer."""

    def __init__(self, model, comm, args):
        self.model, self.tp = model, TensorParallel(comm)
        params = model["params"]
        if "mark" in model:
            model["mark"](self.tp)
        else:
            for k in (0, 2):  # layers 1 and 3 by columns, 2 and 4 by rows
                self.tp.split_column(params[2 * k], bias=params[2 * k + 1])
                self.tp.split_row(params[2 * k + 2])
        local = self.tp.apply(model["loss"])
        mine = [self.tp.shards[id(p)][1] if id(p) in self.tp.shards else p for p in params]
        self.train = optimizer(args).minimize(local, mine)

    def init(self, sess):
        self.tp.shard(sess)

    def step(self, sess, step, xb, yb):
        sess.run(self.train, {self.model["x"]: xb, self.model["y"]: yb})

    def weights(self, sess):
        return _flat(self.tp.gather_variables(sess, self.model["params"]))


class PipelineRunner:
    """pp-*: rank s holds a contiguous group of the four layers."""

    def __init__(self, model, comm, args, schedule, init):
        layers, n = model["layers"], comm.size
        groups = [layers[k * len(layers) // n:(k + 1) * len(layers) // n] for k in range(n)]
        stages = [lambda h, g=g: _chain(g, h) for g in groups]
        self.comm = comm
        self.pipe = Pipeline(stages, loss_fn, comm, (64,), args.batch_size,
                             args.microbatches, optimizer(args), schedule, init=init,
                             dtype=np.float64)

    def init(self, sess):
        sess.run(self.pipe.init)

    def step(self, sess, step, xb, yb):
        self.pipe.train_step(sess, xb, yb)

    def weights(self, sess):
        """Every stage's weights, on every rank (each stage sends its own around)."""
        mine = _flat(sess.variables[v] for v in self.pipe.variables)
        sizes = np.zeros(self.comm.size, np.int64)
        sizes[self.comm.rank] = mine.size
        ring_allreduce(sizes, self.comm)
        width = int(sizes.max())
        padded = np.zeros(width)
        padded[:mine.size] = mine
        everything = all_gather(padded, self.comm).reshape(self.comm.size, width)
        return np.concatenate([everything[r, :sizes[r]] for r in range(self.comm.size)])


class ParameterServerRunner:
    """ps-*: rank 0 serves the parameters, ranks 1.. are workers."""

    def __init__(self, model, comm, args, mode):
        self.model, self.comm = model, comm
        self.ps = ParameterServer(comm, model["params"], 1, mode, args.lr, 0.9)
        self.grads = tf.gradients(model["loss"], model["params"])

    def init(self, sess):
        if not self.ps.is_server:
            self.ps.start(sess)

    def step(self, sess, step, xb, yb):
        workers = self.comm.size - 1
        s = len(xb) // workers
        k = self.comm.rank - 1
        feed = {self.model["x"]: xb[k * s:(k + 1) * s], self.model["y"]: yb[k * s:(k + 1) * s]}
        self.ps.step(sess, step, sess.run(self.grads, feed))

    def weights(self, sess):
        return _flat(sess.variables[p] for p in self.model["params"])


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.ravel(a) for a in arrays])


def _chain(layers, h):
    for layer in layers:
        h = layer(h)
    return h


def make_runner(model, comm, args, init):
    scheme = args.scheme
    if scheme == "dp" or scheme.startswith("zero"):
        return DataParallel(model, comm, args, 0 if scheme == "dp" else int(scheme[-1]))
    if scheme == "tp":
        return TensorParallelRunner(model, comm, args)
    if scheme.startswith("pp-"):
        return PipelineRunner(model, comm, args, scheme[3:], init)
    return ParameterServerRunner(model, comm, args, scheme[3:])


# ----------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------

def batches(data, args, epoch):
    x_train, y_train = data[0], data[1]
    if args.quick:
        x_train, y_train = x_train[:480], y_train[:480]
    return minibatches(x_train, y_train, args.batch_size, seed=epoch, drop_last=True)


def train(runner, comm, sess, data, args):
    """One rank's training; returns (all weights flat, timeline events, seconds)."""
    runner.init(sess)
    events, step, started = [], 0, time.perf_counter()
    if isinstance(runner, ParameterServerRunner) and runner.ps.is_server:
        # A server answers every worker step: as many as there are batches.
        runner.ps.serve(sum(1 for epoch in range(args.epochs)
                            for _ in batches(data, args, epoch)))
        return None, collective_events(comm.trace or [], comm.rank), 0.0
    for epoch in range(args.epochs):
        for xb, yb in batches(data, args, epoch):
            began = time.perf_counter()
            runner.step(sess, step, xb, yb)
            if isinstance(runner, PipelineRunner):
                events = list(runner.pipe.events)  # the last step's F's and B's
            else:   # the whole step on this rank's "run" lane: its collectives,
                # on the comm lane, show where they fall inside it (or overlap it)
                events.append({"node": f"step{step}", "op": "step",
                               "stream": rank_stream_name(comm.rank, "run"),
                               "start": began, "end": time.perf_counter()})
            step += 1
    seconds = time.perf_counter() - started
    events += collective_events(comm.trace or [], comm.rank)
    return runner.weights(sess), events, seconds


def one_rank_weights(model, data, args):
    """The reference: plain momentum SGD on the whole batch, one rank."""
    train_op = optimizer(args).minimize(model["loss"], model["params"])
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())  # the weights and this optimizer's slots
    for epoch in range(args.epochs):
        for xb, yb in batches(data, args, epoch):
            sess.run(train_op, {model["x"]: xb, model["y"]: yb})
    return _flat(sess.variables[p] for p in model["params"])


def communicators(args):
    """The ranks and whether `tinyflow launch` started them (one per process);
    otherwise all of them here, as threads."""
    comms = [] if args.threads else [init_communicator(args.timeout)]
    launched = bool(comms) and comms[0].size > 1
    if not launched:  # not under `tinyflow launch`: ranks as threads
        comms = ThreadTransport.group_of(args.threads or 4, args.timeout)
    return comms, launched


def model_and_data(args):
    if args.model == "charlm":
        model = build_charlm_model()
        return model, model["data"]
    data = load_digits()
    return build_model(args.hidden), data


def save_trace(comms, sessions, results, args):
    """One record of every rank's timeline, and what each rank keeps between steps."""
    held = {c.rank: {v.name: tf.backend.to_host(a)
                     for v, a in sessions[c.rank].variables_in_use().items()}
            for c in comms}
    record = scheme_record([e for r in results for e in r[1]],
                           f"{args.scheme} on {comms[0].size} ranks", held=held)
    tf.trace.save(record, args.trace)
    print(f"trace={args.trace}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    comms, launched = communicators(args)
    problem = split_problem(args, comms[0].size)  # (--threads N was checked already)
    if problem:
        print(f"train_parallel.py: {problem}", file=sys.stderr)
        return 2
    model, data = model_and_data(args)
    init = tf.global_variables_initializer()  # the weights: a pipeline stage picks its own
    runners = {c.rank: make_runner(model, c, args, init) for c in comms}
    init_all = tf.global_variables_initializer()  # and the optimizer slots the runners made
    sessions = {}
    for c in comms:
        sessions[c.rank] = tf.Session()
        sessions[c.rank].run(init_all)
        c.trace = [] if args.trace else None
    run = lambda c: train(runners[c.rank], c, sessions[c.rank], data, args)  # noqa: E731
    results = [run(comms[0])] if launched else run_threads(comms, run)
    report_rank = comms[0].size - 1 if args.scheme.startswith("ps-") else 0  # a worker
    mine = next((r for c, r in zip(comms, results) if c.rank == report_rank), None)
    if mine is None:
        return 0
    flat, events, seconds = mine
    report(model, flat, data, args, seconds, comms[0].size)
    if args.trace and not launched:
        save_trace(comms, sessions, results, args)
    if args.check:
        reference = one_rank_weights(model, data, args)
        diff = np.max(np.abs(flat - reference) / (np.abs(reference) + 1e-12))
        print(f"max_rel_diff_vs_one_rank={diff:.3e}")
    return 0


def report(model, flat, data, args, seconds, ranks):
    eval_sess = tf.Session()
    offset = 0
    for p in model["params"]:
        count = int(np.prod(p.shape))
        eval_sess.variables[p] = flat[offset:offset + count].reshape(p.shape).copy()
        offset += count
    x_train, y_train, x_test, y_test = data
    feed = {model["x"]: x_test, model["y"]: y_test}
    accuracy, loss = eval_sess.run([model["accuracy"], model["loss"]], feed)
    print(f"{args.scheme} on {ranks} ranks: test accuracy {accuracy:.3f}, {seconds:.2f} s")
    print(f"test_accuracy={accuracy:.4f}")
    print(f"test_loss={loss:.4f}")
    if args.checkpoint:
        Saver(model["params"]).save(eval_sess, args.checkpoint)
        print(f"checkpoint={args.checkpoint}")


if __name__ == "__main__":
    sys.exit(main())
