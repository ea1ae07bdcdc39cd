# %% [markdown]
# # Lesson 9: define-by-run, tracing, and dynamic memory
#
# Lessons 1-8 built graphs first and ran them later (TF1's *define-and-run*). That
# is what lets a compiler see the whole program: fuse ops, plan memory, overlap
# streams. PyTorch made the other choice popular: *define-by-run*, where every op
# runs the moment Python reaches it, so `print`, `if` and a debugger just work.
# Here the same model runs both ways, over the same op registry.
#
# In this lesson you will
#
# 1. run ops eagerly on `Tensor`s and differentiate them with a tape;
# 2. see why `y.backward()` twice needs `retain_graph=True`, and that it accumulates;
# 3. train the same MLP eagerly and then *traced* into a graph (`tf.function`),
#    get bitwise-equal numbers, and measure what tracing buys (and where it does not);
# 4. meet a *graph break*: Python control flow on a value the graph has not computed;
# 5. put three memory strategies side by side for one training step: the static
#    plan (lesson 4), a caching allocator (PyTorch's), and plain malloc.
#
# **Read along:** `tinyflow/eager.py`: the module docstring, `apply` (one op, at
# once), `backward` and `_input_grads` (the gradient rules of lesson 2, interpreted
# on values); `tinyflow/tracing.py`: `Function` (tracing and its guard);
# `tinyflow/allocator.py`: `CachingAllocator` (`malloc`, `free`, `_split`, `_merge`).

# %%
import math
import statistics
import time

import numpy as np

import tinyflow as tf
from tinyflow import eager, tracing
from tinyflow.backend import set_blas_threads

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

# %% [markdown]
# ## 1. Ops that run at once
#
# `eager.tensor` makes a leaf. Every TinyFlow op accepts Tensors: `ops.make` sees a
# Tensor among the inputs and hands the op to `eager.apply`, which asks the
# registry for the op's shape rule (the same errors, with your line) and runs its
# `compute` into memory from the allocator. The result is a value you can print.

# %%
x = eager.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
y = tf.tanh(x) * x            # runs now
print("y =", y.numpy())
loss = y.sum()
loss.backward()               # walks the tape: tanh and mul's gradient rules
print("dloss/dx =", x.grad.numpy())
expected = np.tanh([1.0, 2.0, 3.0]) + np.array([1.0, 2.0, 3.0]) / np.cosh([1.0, 2.0, 3.0]) ** 2
assert np.allclose(x.grad.numpy(), expected)

# %% [markdown]
# The gradient rules are the graph's own (`OpDef.gradient` builds Nodes). Eager
# backward builds each rule's little graph once per op and shape, over stand-ins
# for the inputs, the output and the incoming gradient, then *evaluates* it on the
# actual Tensors. One rule, two ways to run it.

# %% [markdown]
# ## 2. Backward twice
#
# After `backward`, the tape's saved values are released (that is what frees the
# activations in a training loop). A second backward through the same graph has
# nothing left to read, so it is an error unless the first kept them with
# `retain_graph=True`; then gradients *accumulate* into `.grad`, which is why
# training loops call `zero_grad()`.

# %%
a = eager.tensor(np.array([3.0]), requires_grad=True)
b = a * a
b.backward(retain_graph=True)
print("after one backward:", a.grad.item())     # 6
b.backward()
print("after two:", a.grad.item())              # 12: accumulated
try:
    b.backward()
except eager.EagerError as err:
    print("third:", err)

# %% [markdown]
# ### Exercise 1: the gradient of a cube
#
# Reset the gradient (`a.grad = None`), differentiate `a * a * a` at a = 3, and
# predict `a.grad` before running. (Solution filled in; then remove the reset
# line: what does the assert need now?)

# %%
a.grad = None
(a * a * a).backward()
assert a.grad.item() == 27.0

# %% [markdown]
# ## 3. One model, two modes
#
# `eager.to_eager` gives a `tf.nn` model eager parameters (the values its
# initializers give), so the same layer code runs eagerly. The optimizers follow
# PyTorch: `zero_grad`, `backward`, `step`. Then `tf.function` traces the very
# same step function into a graph: it runs once on *symbolic* Tensors that build
# Nodes, including the backward pass (`tf.gradients`) and the optimizer's in-place
# updates (which become outputs written back after each run), and compiles it
# with the passes, the planner and the executor.

# %%
from tinyflow.data import load_digits  # noqa: E402

train_x, train_y, _, _ = load_digits(seed=0)
images, labels = train_x[:512], train_y[:512]
model = eager.to_eager(tf.nn.MLP([64, 64, 10]), dtype=np.float64)
params = eager.parameters(model)
start = [p.numpy() for p in params]


def train(step_fn, steps=30):
    """The losses of `steps` steps from the same start, and each step's seconds."""
    with eager.no_grad():
        for p, value in zip(params, start):
            p.assign_(value)
    losses, seconds = [], []
    for i in range(steps):
        rows = slice((i * 64) % 512, (i * 64) % 512 + 64)
        begin = time.perf_counter()
        losses.append(step_fn(eager.tensor(images[rows], dtype=np.float64),
                              eager.tensor(labels[rows])).item())
        seconds.append(time.perf_counter() - begin)
    return losses, seconds


def step_ms(seconds):
    """The median step after the first, in ms (the first traced call also traces
    and compiles; the median shrugs off a step slowed by other work)."""
    return 1e3 * statistics.median(seconds[1:])


def make_step():
    optimizer = eager.Adam(params, lr=0.01)

    def step(x, y):
        optimizer.zero_grad()
        loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(model(x), y)
        loss.backward()
        optimizer.step()
        return loss
    return step


eager_losses, eager_seconds = train(make_step())
traced_step = tf.function(make_step())
traced_losses, traced_seconds = train(traced_step)
print(f"eager : loss {eager_losses[0]:.4f} -> {eager_losses[-1]:.4f}; "
      f"{step_ms(eager_seconds):.3f} ms a step")
print(f"traced: loss {traced_losses[0]:.4f} -> {traced_losses[-1]:.4f}; "
      f"{step_ms(traced_seconds):.3f} ms a step, after a first call of "
      f"{traced_seconds[0] * 1e3:.1f} ms (tracing and compiling)")
assert eager_losses == traced_losses     # bitwise: the same ops in the same order
print(traced_step.explain())
program = traced_step.cache[next(iter(traced_step.cache))][0].program
print("\n".join(tf.explain(program).splitlines()[:8]), "\n  ...")

# %% [markdown]
# What did tracing buy? Every traced call after the first is one `Program.run`:
# the step's ops fused into fewer kernels (the pass table above counts the nodes
# before and after each pass), writing into one planned arena, with no Python
# work per op. The first call paid for tracing and compiling instead. Both show
# in the numbers, so here they are side by side: a step in each mode, and how
# many steps repay the first call (until then, tracing has cost time, not saved it).

# %%
def compare(what, eager_ms, traced_ms, first_ms, per):
    """Print the two times, their ratio and what it says, and how many calls
    repay the first traced call's tracing and compiling."""
    ratio = traced_ms / eager_ms
    if ratio < 0.9:
        words = f"tracing made it {1 / ratio:.1f}x faster"
    elif ratio > 1.1:
        words = f"tracing made it {ratio:.1f}x slower"
    else:
        words = "about as fast either way"
    print(f"{what}: eager {eager_ms:.3f} ms, traced {traced_ms:.3f} ms a {per}; "
          f"traced/eager {ratio:.2f}: {words}")
    if traced_ms < eager_ms:
        print(f"  the first traced call took {first_ms:.1f} ms: repaid after about "
              f"{math.ceil(first_ms / (eager_ms - traced_ms))} {per}s")
    else:
        print(f"  the first traced call took {first_ms:.1f} ms, never repaid here")


compare("MLP step", step_ms(eager_seconds), step_ms(traced_seconds),
        traced_seconds[0] * 1e3, "step")

# %% [markdown]
# Dispatch is nearly all there is in a chain of small ops that each do almost
# nothing: eager mode's time is then the Python work of every op (the registry
# lookup, the shape rule, the allocator), which the compiled program did once,
# when it compiled. A chain of 200 ops on one number, timed both ways in turns:

# %%
def chain(y):
    for i in range(200):
        kind = i % 4
        y = y + 0.5 if kind == 0 else y * 0.5 if kind == 1 else tf.tanh(y) if kind == 2 else -y
    return y


one = eager.tensor(np.array([0.25]))
traced_chain = tf.function(chain)
begin = time.perf_counter()
traced_chain(one)                       # traces and compiles
first_call = time.perf_counter() - begin
assert np.array_equal(chain(one).numpy(), traced_chain(one).numpy())   # bitwise
chain_seconds = {"eager": [], "traced": []}
for _ in range(15):                     # in turns: other work slows both alike
    for mode, run in (("eager", lambda: chain(one)), ("traced", lambda: traced_chain(one))):
        begin = time.perf_counter()
        run()
        chain_seconds[mode].append(time.perf_counter() - begin)
eager_ms, traced_ms = (1e3 * statistics.median(chain_seconds[m]) for m in ("eager", "traced"))
compare("200 tiny ops", eager_ms, traced_ms, first_call * 1e3, "call")
chain_program = traced_chain.cache[next(iter(traced_chain.cache))][0].program
print(f"the traced chain runs as {len(chain_program.steps)} kernel(s) "
      f"({len(chain_program.graph.nodes)} nodes after the passes)")

# %% [markdown]
# Put together: a traced call saves the Python work of each op, so it saves the
# most, relative to the whole, where that work is most of the whole (compare the
# two ratios above), and it pays only after enough calls to repay the first. (So
# timing all 30 steps, the first call included, can show no gain at all.) The
# trace is kept per input signature (shapes and dtypes): a new batch size traces
# again, and `explain()` says why.

# %%
traced_step(eager.tensor(images[:32], dtype=np.float64), eager.tensor(labels[:32]))
print(traced_step.explain())
assert len(traced_step.traces) == 2

# %% [markdown]
# ## 4. A graph break
#
# A traced function runs on symbolic Tensors: they have shapes, not values. Python
# control flow that needs a value (`if loss > 1:`) cannot be recorded into a
# graph; TinyFlow stops with an error naming your line (Dynamo calls this a graph
# break). The fix is to compute the choice in the graph: `tf.where`.


# %%
@tf.function
def clipped(x):
    if x.sum() > 1.0:
        return x / x.sum()
    return x


try:
    clipped(eager.tensor(np.ones(3)))
except eager.GraphBreak as err:
    print(err)


@tf.function
def clipped_in_graph(x):
    total = tf.reduce_sum(x)
    return tf.where(total > 1.0, x / total, x)


print(clipped_in_graph(eager.tensor(np.ones(3))).numpy())

# %% [markdown]
# ## 5. Three ways to give the same step memory
#
# * **static plan** (lesson 4): the traced graph's arena, every lifetime known
#   before the first step;
# * **caching allocator** (`eager.CachingAllocator`, after PyTorch's CUDA caching
#   allocator): requests rounded to 512 bytes, small ones carved out of 2 MiB
#   segments, best-fit reuse of freed blocks, splitting and merging; in front of
#   that, glibc's *fast bins*: a freed small block waits whole for the next request
#   of its exact size (no search, split or merge: an eager loop asks for the same
#   sizes again and again). It never gives memory back to the system (that is the
#   point: `cudaMalloc` is slow), so it *reserves* more than Tensors *allocate*;
# * **plain malloc**: exactly what each Tensor asks, freed when it dies.

# %%
optimizer = eager.SGD(params, lr=0.01)


def sgd_step(x, y):
    optimizer.zero_grad()
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


report = tracing.memory_comparison(sgd_step, eager.tensor(images[:256], dtype=np.float64),
                                 eager.tensor(labels[:256]))
kib = lambda n: f"{n / 1024:8.1f} KiB"  # noqa: E731
print("static plan arena      ", kib(report["static_arena"]),
      "  lower bound", kib(report["static_lower_bound"]))
print("caching: peak reserved ", kib(report["caching_reserved"]),
      "  peak allocated", kib(report["caching_allocated"]))
print("plain malloc peak      ", kib(report["malloc_peak"]))
print(f"fragmentation at the allocated peak: {report['fragmentation']:.1%} of reserved "
      "bytes held by no Tensor")
for event in report["events"][:6]:
    print(f"  {event['event']:<13} block #{event['block']:<3} {event['size']:>7} B  "
          f"{event['reason']}")
assert report["static_arena"] <= report["malloc_peak"] <= report["caching_reserved"]

# %% [markdown]
# The same eager step in the debugger: inside `tf.debug.record`, every eager op
# becomes a node (forward and backward), a bar on the timeline, and a block in the
# memory view, whose inspector says why the block is where it is (a block waiting in
# the fast bin of its size, the best-fitting free block, or a new segment). Open it
# with `tinyflow debug FILE`.

# %%
import os  # noqa: E402
import tempfile  # noqa: E402

from tinyflow import trace  # noqa: E402

with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "eager.tfdbg.json")
    with tf.debug.record(path, title="one eager SGD step"):
        sgd_step(eager.tensor(images[:64], dtype=np.float64), eager.tensor(labels[:64]))
    record = trace.load(path)
plan = record["memory_plan"]
print(f"recorded {len(record['schedule'])} eager ops; memory view: {plan['strategy']}, "
      f"{kib(plan['arena_bytes'])} reserved, {kib(plan['lower_bound_bytes'])} allocated at peak")
print("why is the first block here?", plan["tensors"][0]["reason"])

# %% [markdown]
# Why the order: the plan sees the future, so it packs tensors tighter than any
# allocator that only learns of a tensor when it is made; malloc gives back what is
# freed at once; the caching allocator keeps whole segments (and rounds every
# block up), trading memory for never calling the system allocator in the loop.
#
# ### Exercise 2: a smaller batch
#
# Measure the same step with a batch 16 times smaller. Which of the three numbers
# barely moves, and why? (Solution filled in: the smallest segment is 2 MiB, so
# the caching allocator's reservation stays put while the plan shrinks.)

# %%
small = tracing.memory_comparison(sgd_step, eager.tensor(images[:16], dtype=np.float64),
                                eager.tensor(labels[:16]))
print("batch 16: static", kib(small["static_arena"]), " caching reserved",
      kib(small["caching_reserved"]))
assert small["static_arena"] < report["static_arena"]
assert small["caching_reserved"] == report["caching_reserved"]
