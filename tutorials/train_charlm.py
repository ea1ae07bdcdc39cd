"""Train a small transformer language model on text that ships with Python itself.

    python tutorials/train_charlm.py              # a few minutes on 2 cores
    tinyflow train charlm --quick                 # seconds: a tiny model, a few steps

The corpus is the docstrings of the standard library's modules
(`tinyflow.data.char_corpus`), so it needs no download; the model predicts it one
character at a time. It is a decoder-only transformer (Vaswani et al. 2017, in the
pre-norm arrangement of GPT-2, Radford et al. 2019), built from TinyFlow's ordinary
ops so that every piece is visible:

    ids (B, T) -> token embedding + position embedding           (B, T, D)
    N blocks of:
        x = x + attention(layer_norm(x))     causal, H heads of D/H dims each
        x = x + mlp(layer_norm(x))           D -> 4D -> gelu -> D
    layer_norm -> linear -> logits over the characters           (B*T, V)

Causal attention is written out: scores = Q K^T / sqrt(D/H) with `tf.matmul` on
(B, H, T, T) batches, the future masked with `tf.where` (the mask itself is built in
the graph by comparing position ids), `tf.nn.softmax`, then a matmul with V.

The script prints the validation loss before and after training
(`loss_start=...`, `loss_end=...`, in nats per character; the uniform guess is
ln(vocabulary) ~ 4.55) and samples text from the trained model.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import tinyflow as tf
from tinyflow.cli import (nonnegative_int, positive_float, positive_int, script_prog,
                          writable_file)
from tinyflow.backend import DEFAULT_BLAS_THREADS, set_blas_threads
from tinyflow import debug
from tinyflow.data import CharVocab, char_corpus
from tinyflow.saver import Saver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=script_prog(__file__),
        description="Train a character-level transformer on the standard library's "
                    "docstrings with TinyFlow, then sample from it.")
    parser.add_argument("--steps", type=positive_int, default=1500, help="training steps")
    parser.add_argument("--epochs", type=positive_float, default=None,
                        help="train for this many passes over the corpus instead of --steps")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--context", type=positive_int, default=64,
                        help="characters per window (T)")
    # Model sizes default to None: --quick picks small ones only where not given.
    parser.add_argument("--dim", type=positive_int, help="model width (D; default 96)")
    parser.add_argument("--heads", type=positive_int, help="attention heads (default 4)")
    parser.add_argument("--layers", type=positive_int, help="blocks (default 2)")
    parser.add_argument("--lr", type=positive_float, default=3e-3,
                        help="peak Adam learning rate (warmup, then cosine decay)")
    parser.add_argument("--corpus-chars", type=positive_int, default=400_000,
                        help="characters of docstrings to read")
    parser.add_argument("--sample-chars", type=positive_int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run for tests: a small model, 40 steps")
    parser.add_argument("--trace", metavar="FILE", type=writable_file,
                        help="record a DebugRecord of the training step (tinyflow debug FILE)")
    parser.add_argument("--checkpoint", metavar="PATH", default="checkpoints/charlm.safetensors",
                        help="where to save the trained Variables ('' to skip)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights, the batches and the sampling")
    parser.add_argument("--threads", type=nonnegative_int, metavar="N",
                        default=DEFAULT_BLAS_THREADS,
                        help="BLAS threads (default %(default)s: fastest on a busy machine; "
                             "0: one per core)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.epochs = min(args.steps, 40), None
        args.batch_size, args.context = min(args.batch_size, 16), min(args.context, 32)
        args.dim, args.heads, args.layers = args.dim or 32, args.heads or 2, args.layers or 1
        args.corpus_chars, args.sample_chars = min(args.corpus_chars, 50_000), 80
    args.dim, args.heads, args.layers = args.dim or 96, args.heads or 4, args.layers or 2
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    return args


# ----------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------

class CharTransformer:
    """The Variables of a decoder-only transformer, and the graph that applies them."""

    def __init__(self, vocab_size: int, context: int, dim: int, heads: int, layers: int,
                 seed: int, dtype: type = np.float32) -> None:
        # dtype: float32 to train; float64 where a test compares schemes exactly
        # (tutorials/train_parallel.py --model charlm --check).
        self.dim, self.heads, self.context, self.dtype = dim, heads, context, dtype
        seeds = iter(range(seed * 1000, seed * 1000 + 1000))

        def weight(shape: tuple[int, ...], name: str, std: float = 0.02) -> tf.Node:
            # GPT-2's initializer: N(0, 0.02); projections into the residual stream
            # are scaled down by sqrt(2 * layers) so the stream's variance stays ~1.
            return tf.Variable(tf.random_normal(shape, stddev=std, dtype=dtype,
                                                seed=next(seeds)), name=name)

        def zeros(size: int, name: str) -> tf.Node:
            return tf.Variable(tf.zeros((size,), dtype), name=name)

        def ones(size: int, name: str) -> tf.Node:
            return tf.Variable(tf.ones((size,), dtype), name=name)

        residual_std = 0.02 / math.sqrt(2 * layers)
        self.token_embedding = weight((vocab_size, dim), "token_embedding")
        self.position_embedding = weight((context, dim), "position_embedding")
        self.blocks = []
        for i in range(layers):
            self.blocks.append({
                "ln1_gamma": ones(dim, f"block{i}_ln1_gamma"),
                "ln1_beta": zeros(dim, f"block{i}_ln1_beta"),
                "wq": weight((dim, dim), f"block{i}_wq"),
                "wk": weight((dim, dim), f"block{i}_wk"),
                "wv": weight((dim, dim), f"block{i}_wv"),
                "wo": weight((dim, dim), f"block{i}_wo", residual_std),
                "ln2_gamma": ones(dim, f"block{i}_ln2_gamma"),
                "ln2_beta": zeros(dim, f"block{i}_ln2_beta"),
                "w1": weight((dim, 4 * dim), f"block{i}_mlp_w1"),
                "b1": zeros(4 * dim, f"block{i}_mlp_b1"),
                "w2": weight((4 * dim, dim), f"block{i}_mlp_w2", residual_std),
                "b2": zeros(dim, f"block{i}_mlp_b2"),
            })
        self.final_gamma = ones(dim, "final_ln_gamma")
        self.final_beta = zeros(dim, "final_ln_beta")
        self.unembedding = weight((dim, vocab_size), "unembedding")

    def split_heads(self, x: tf.Node) -> tf.Node:
        """(B*T, D) rows -> (B, H, T, D/H): each head's sequence as one matrix."""
        x = tf.reshape(x, (-1, self.context, self.heads, self.dim // self.heads))
        return tf.transpose(x, (0, 2, 1, 3))

    def attention(self, x: tf.Node, block: dict, causal_mask: tf.Node) -> tf.Node:
        q = self.split_heads(tf.matmul(x, block["wq"]))
        k = self.split_heads(tf.matmul(x, block["wk"]))
        v = self.split_heads(tf.matmul(x, block["wv"]))
        scale = self.dtype(1.0 / math.sqrt(self.dim // self.heads))
        scores = tf.matmul(q, k, transpose_b=True) * scale            # (B, H, T, T)
        # Position t may only look at positions <= t: the rest get -1e9 before the
        # softmax, so their weights are exactly 0.
        scores = tf.where(causal_mask, scores, tf.constant(self.dtype(-1e9)))
        weights = tf.nn.softmax(scores)
        heads = tf.matmul(weights, v)                                 # (B, H, T, D/H)
        merged = tf.reshape(tf.transpose(heads, (0, 2, 1, 3)), (-1, self.dim))
        return tf.matmul(merged, block["wo"])

    def mlp(self, x: tf.Node, block: dict) -> tf.Node:
        hidden = tf.nn.gelu(tf.matmul(x, block["w1"]) + block["b1"])
        return tf.matmul(hidden, block["w2"]) + block["b2"]

    def __call__(self, ids: tf.Node, positions: tf.Node) -> tf.Node:
        """Logits (B*T, V) for token ids (B, T) at position ids (T,) = 0..T-1.

        Between the blocks the activations are kept as a (B*T, D) matrix: every
        projection is then one plain 2-D matmul (one BLAS call, and a weight gradient
        without a sum over the batch); only attention needs the (B, H, T, D/H) view.
        """
        # causal_mask[i, j] = positions[j] <= positions[i]
        causal_mask = tf.less_equal(tf.expand_dims(positions, 0), tf.expand_dims(positions, 1))
        x = (tf.nn.embedding_lookup(self.token_embedding, ids)
             + tf.nn.embedding_lookup(self.position_embedding, positions))
        x = tf.reshape(x, (-1, self.dim))
        for block in self.blocks:
            x = x + self.attention(tf.nn.layer_norm(x, block["ln1_gamma"], block["ln1_beta"]),
                                   block, causal_mask)
            x = x + self.mlp(tf.nn.layer_norm(x, block["ln2_gamma"], block["ln2_beta"]), block)
        x = tf.nn.layer_norm(x, self.final_gamma, self.final_beta)
        return tf.matmul(x, self.unembedding)


# ----------------------------------------------------------------------------------
# Data, evaluation, sampling
# ----------------------------------------------------------------------------------

def random_windows(data: np.ndarray, batch: int, context: int, rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray]:
    """`batch` random windows of the text: inputs (B, T) and next characters (B, T)."""
    starts = rng.integers(0, len(data) - context - 1, size=batch)
    index = starts[:, None] + np.arange(context)
    return data[index], data[index + 1]


def progress_bar() -> Progress:
    """A rich progress bar on stderr (stdout keeps the parseable result lines)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                    console=Console(stderr=True))


def sample(sess: tf.Session, logits: tf.Node, ids: tf.Node, positions: tf.Node,
           vocab: CharVocab, prompt: str, length: int, context: int, temperature: float,
           rng: np.random.Generator) -> str:
    """Extend `prompt` by `length` characters, each drawn from the model's softmax.

    The model always sees exactly `context` characters (the latest ones), so one
    compiled program serves every step.
    """
    window = list(vocab.encode(prompt[-context:]))
    position_ids = np.arange(context, dtype=np.int64)
    out = []
    for _ in range(length):
        step_logits = sess.run(logits, {ids: np.array([window]), positions: position_ids})
        scaled = step_logits[-1].astype(np.float64) / temperature  # the last position
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        nxt = int(rng.choice(len(probs), p=probs))
        out.append(nxt)
        window = window[1:] + [nxt]
    return vocab.decode(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_blas_threads(args.threads)
    text = char_corpus(args.corpus_chars)
    vocab = CharVocab(text)
    data = vocab.encode(text)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    if args.epochs is not None:
        args.steps = max(1, int(args.epochs * len(train_data) / (args.batch_size * args.context)))

    ids = tf.placeholder(tf.int64, shape=(None, None), name="ids")
    targets = tf.placeholder(tf.int64, shape=(None, None), name="targets")
    positions = tf.placeholder(tf.int64, shape=(None,), name="positions")
    learning_rate = tf.placeholder(tf.float32, shape=(), name="learning_rate")
    model = CharTransformer(len(vocab), args.context, args.dim, args.heads, args.layers,
                            args.seed)
    logits = model(ids, positions)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        logits=logits, labels=tf.reshape(targets, (-1,))))
    train_op = tf.train.AdamOptimizer(learning_rate, weight_decay=0.01).minimize(loss)
    saver = Saver()

    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    position_ids = np.arange(args.context, dtype=np.int64)

    # A fixed validation set: the same windows before and after training.
    val_batches = [random_windows(val_data, args.batch_size, args.context,
                                  np.random.default_rng(10_000 + i)) for i in range(4)]

    def validation_loss(session: tf.Session) -> float:
        return float(np.mean([session.run(loss, {ids: xb, targets: yb,
                                                  positions: position_ids})
                              for xb, yb in val_batches]))

    loss_start = validation_loss(sess)
    warmup = max(1, args.steps // 20)
    rng = np.random.default_rng(args.seed)
    recorder = debug.record(args.trace) if args.trace else contextlib.nullcontext()
    start = time.perf_counter()
    with recorder as rec, progress_bar() as bar:
        task = bar.add_task("charlm", total=args.steps, status="")
        for step in range(args.steps):
            xb, yb = random_windows(train_data, args.batch_size, args.context, rng)
            if step < warmup:
                lr = args.lr * (step + 1) / warmup
            else:
                progress = (step - warmup) / max(1, args.steps - warmup)
                lr = 0.5 * args.lr * (1.0 + math.cos(math.pi * progress))
            step_loss, _ = sess.run([loss, train_op], {ids: xb, targets: yb,
                                                       positions: position_ids,
                                                       learning_rate: np.float32(lr)})
            if rec is not None:
                rec.scalar("loss", step, step_loss)
            # (this batch's training loss; loss_end below is the validation loss)
            bar.update(task, advance=1, status=f"train loss {step_loss:.3f}")
    seconds = time.perf_counter() - start
    loss_end = validation_loss(sess)

    print(f"vocab_size={len(vocab)}")
    print(f"corpus_chars={len(text)}")
    print(f"train_seconds={seconds:.2f}")
    print(f"loss_start={loss_start:.4f}")
    print(f"loss_end={loss_end:.4f}")
    if args.trace:
        print(f"trace={args.trace}")
    if args.checkpoint:
        path = saver.save(sess, args.checkpoint)
        fresh = tf.Session()
        saver.restore(fresh, path)
        restored = validation_loss(fresh)
        print(f"checkpoint={path}")
        print(f"restored_loss={restored:.4f}")
        if not math.isclose(restored, loss_end, rel_tol=1e-6):
            print("error: the restored model scores differently", file=sys.stderr)
            return 1

    prompt = vocab.decode(val_data[:args.context])
    text_out = sample(sess, logits, ids, positions, vocab, prompt, args.sample_chars,
                      args.context, args.temperature, np.random.default_rng(args.seed))
    print("--- sample (the prompt, then '|', then the model's continuation) ---")
    print(prompt + "|" + text_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
