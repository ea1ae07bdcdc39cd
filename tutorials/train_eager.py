"""Train the digits MLP PyTorch-style: eager Tensors, a training loop you can step
through in a debugger, and one decorator that compiles the step into a graph.

    python tutorials/train_eager.py              # eager: every op runs when reached
    python tutorials/train_eager.py --traced     # the same step, @tf.function
    tinyflow train eager --trace eager.tfdbg.json   # record the first steps' ops

The model is `tf.nn.MLP` (the graph layers) given eager weights by
`eager.to_eager`; the loop is PyTorch's: `zero_grad`, the loss, `backward`,
`step`. With `--traced` the step function is traced once into a Graph (forward,
backward and the Adam updates), compiled with the passes and the memory planner,
and replayed for every batch of the same shape (a last, smaller batch traces once
more). Both print `test_accuracy=...`; on the same seed they print the same losses.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

import tinyflow as tf
from tinyflow.cli import (nonnegative_int, positive_float, positive_int, script_prog,
                          writable_file)
from tinyflow import eager, tracing
from tinyflow.backend import DEFAULT_BLAS_THREADS, set_blas_threads
from tinyflow.data import load_digits, minibatches


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=script_prog(__file__), description="Train the digits MLP with eager Tensors.")
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--hidden", type=positive_int, default=128, help="units per hidden layer")
    parser.add_argument("--traced", action="store_true",
                        help="compile the training step with @tf.function")
    parser.add_argument("--quick", action="store_true", help="a short run for tests")
    parser.add_argument("--trace", metavar="FILE", type=writable_file,
                        help="record the first epoch's eager ops (tinyflow debug FILE)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the minibatch order")
    parser.add_argument("--checkpoint", metavar="PATH", default="checkpoints/eager_mlp.safetensors",
                        help="where to save the trained parameters ('' to skip)")
    parser.add_argument("--threads", type=nonnegative_int, metavar="N",
                        default=DEFAULT_BLAS_THREADS,
                        help="BLAS threads (default %(default)s: fastest on a busy machine; "
                             "0: one per core)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.quick:
        args.epochs = min(args.epochs, 5)
    return args


def evaluate(model: object, x: np.ndarray, y: np.ndarray) -> float:
    with eager.no_grad():
        predictions = np.argmax(model(eager.tensor(x)).numpy(), axis=1)
    return float(np.mean(predictions == y))


def make_train_step(model: object, optimizer: object) -> object:
    """One training step, PyTorch-style: zero the gradients, forward, backward, update."""
    def train_step(x: eager.Tensor, y: eager.Tensor) -> eager.Tensor:
        optimizer.zero_grad()
        loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(model(x), y)
        loss.backward()
        optimizer.step()
        return loss
    return train_step


def static_plan_bytes(hidden: int, x: np.ndarray, y: np.ndarray) -> int:
    """The arena the memory planner gives the same training step traced: the static
    plan beside the eager run's caching allocator in the debugger's memory view.
    Measured on a fresh model (the bytes do not depend on the weights), so the model
    being trained takes no extra step, and in an allocator of its own, so the
    recorded allocator's figures are the training run's alone."""
    previous = eager.set_allocator(eager.CachingAllocator())
    try:
        model = eager.to_eager(tf.nn.MLP([64, hidden, hidden, 10]))
        step = make_train_step(model, eager.Adam(eager.parameters(model)))
        comparison = tracing.memory_comparison(step, eager.tensor(x), eager.tensor(y))
    finally:
        eager.set_allocator(previous)
    return comparison["static_arena"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_blas_threads(args.threads)
    x_train, y_train, x_test, y_test = load_digits(seed=0)
    model = eager.to_eager(tf.nn.MLP([64, args.hidden, args.hidden, 10]))
    train_step = make_train_step(model, eager.Adam(eager.parameters(model), lr=args.lr))
    step = tf.function(train_step) if args.traced else train_step
    recording = (tf.debug.record(args.trace, title="train_eager")
                 if args.trace and not args.traced else contextlib.nullcontext())
    if args.trace and not args.traced:   # (measured before recording starts)
        static_arena = static_plan_bytes(args.hidden, x_train[:args.batch_size],
                                         y_train[:args.batch_size])
    began = time.perf_counter()
    losses = []
    for epoch in range(args.epochs):
        # Only the first epoch is recorded: a record is for reading, not archiving.
        context = recording if epoch == 0 else contextlib.nullcontext()
        with context as recorder:
            if recorder is not None:   # the static plan of the same step, for comparison
                recorder.memory_reference("static plan (traced step)", static_arena)
            for xb, yb in minibatches(x_train, y_train, args.batch_size,
                                      seed=args.seed * 1000 + epoch):
                losses.append(step(eager.tensor(xb), eager.tensor(yb)).item())
                if recorder is not None:   # the debugger's curves view (key 4)
                    recorder.scalar("loss", len(losses) - 1, losses[-1])
        print(f"epoch {epoch + 1}/{args.epochs}: loss {np.mean(losses[-10:]):.4f}")
    seconds = time.perf_counter() - began
    accuracy = evaluate(model, x_test, y_test)
    mode = "traced" if args.traced else "eager"
    print(f"mode={mode}")
    print(f"loss_start={losses[0]:.4f}")
    print(f"loss_end={np.mean(losses[-10:]):.4f}")
    print(f"train_seconds={seconds:.2f}")
    print(f"test_accuracy={accuracy:.4f}")
    if args.checkpoint:
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
        path = eager.save(model, args.checkpoint)
        # Prove the checkpoint holds the model, as the other training scripts do: a
        # fresh model, restore, re-score.
        fresh = eager.to_eager(tf.nn.MLP([64, args.hidden, args.hidden, 10]))
        eager.restore(fresh, path)
        restored_accuracy = evaluate(fresh, x_test, y_test)
        print(f"checkpoint={path}")
        print(f"restored_test_accuracy={restored_accuracy:.4f}")
        if restored_accuracy != accuracy:
            print("error: the restored model scores differently", file=sys.stderr)
            return 1
    if args.traced:
        print(step.explain())
    if args.trace and not args.traced:
        print(f"trace={args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
