# %% [markdown]
# # Lesson 10: parallelism beyond data parallel
#
# Lesson 6 split the *batch* over ranks and allreduced the gradients. That stops
# working when one rank cannot hold the model, or when the allreduce is mostly
# latency. Each scheme in this lesson cuts something else, and each is measured
# against its textbook formula:
#
# 1. **collectives**: reduce-scatter and all-gather on their own, and a tree
#    allreduce (NCCL's double binary tree) beside the ring;
# 2. **ZeRO**: shard the optimizer state, then the gradients, then the parameters;
# 3. **pipeline**: cut the layers into stages, feed microbatches; the bubble;
# 4. **tensor parallel**: split a matmul's columns, then the next one's rows;
# 5. **parameter server**: servers hold the parameters, workers push and pull.
#
# Every rank here is a thread (`run_threads`); the same code runs as processes under
# `tinyflow launch -n N` or over MPI. `tutorials/train_parallel.py --scheme ...`
# trains the digits MLP with each of them.
#
# **Read along:** `tinyflow/collectives.py`, `zero.py`, `pipeline.py`,
# `tensor_parallel.py`, `param_server.py`, and `Transport.exchange` in
# `transports.py`.

# %%
import numpy as np

import tinyflow as tf
from tinyflow.allreduce import ThreadTransport, ring_allreduce, run_threads
from tinyflow.backend import set_blas_threads
from tinyflow.collectives import (all_gather, choose_algorithm, double_binary_trees,
                                  reduce_scatter, tree_allreduce)

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

RANKS = 4

# %% [markdown]
# ## 1. Collectives: the ring's two halves, and a tree
#
# The ring allreduce is a reduce-scatter (rank r ends with the sum of chunk r) then
# an all-gather (everyone gets every chunk). ZeRO needs the halves apart. The tree
# reduces up a binary tree and broadcasts down: 2 log2 N rounds instead of the
# ring's 2(N-1), so it wins when each round is mostly latency. NCCL's *double*
# tree uses two trees, each carrying half the array, built so that a rank that is an
# inner node of one tree is a leaf of the other.

# %%
def halves(comm):
    x = np.arange(8.0) + comm.rank            # rank r holds 0..7 + r
    mine = reduce_scatter(x.copy(), comm)     # my chunk of the sum
    return mine, all_gather(mine, comm), tree_allreduce(x.copy(), comm), comm.bytes_sent


results = run_threads(RANKS, halves)
for rank, (mine, _, _, sent) in enumerate(results):
    print(f"rank {rank}: reduce_scatter {mine}  bytes sent {sent}")
_, whole, tree, _ = results[0]
print("all_gather:", whole)
print("tree allreduce equals the gathered sum:", np.array_equal(tree, whole))
(_, first), (_, second) = double_binary_trees(8)
print("inner nodes of tree 1:", [r for r in range(8) if first[r]],
      " of tree 2:", [r for r in range(8) if second[r]])
print("auto picks:", {size: choose_algorithm(size, 8) for size in (8 << 10, 16 << 20)})

# %% [markdown]
# ### Exercise
# Every rank's reduce-scatter chunk is 2 of the 8 sums. Check that rank 3's chunk
# is elements 6 and 7 of the total, and that no rank is an inner node of both trees.

# %%
total = sum(np.arange(8.0) + r for r in range(RANKS))
assert np.array_equal(run_threads(RANKS, halves)[3][0], total[6:8])
assert not {r for r in range(8) if first[r]} & {r for r in range(8) if second[r]}

# %% [markdown]
# ## 2. ZeRO: who holds what
#
# With Adam every parameter costs 2 more floats of state. ZeRO stage 1 keeps only
# this rank's 1/N of the state (and a master copy of its shard of the parameters);
# stage 2 also reduce-scatters the gradients; stage 3 also stores only 1/N of the
# parameters and all-gathers them before the forward pass. The training step stays
# the same: the check below trains 4 ranks with stage 3 and one rank with the whole
# batch, and compares.

# %%
from tinyflow.parallel import DistributedOptimizer, broadcast_variables  # noqa: E402


def small_mlp(seed=0):
    rng = np.random.default_rng(seed)
    x = tf.placeholder(tf.float64, (None, 8))
    y = tf.placeholder(tf.int64, (None,))
    w1 = tf.Variable(rng.standard_normal((8, 16)) / 3, dtype=tf.float64)
    w2 = tf.Variable(rng.standard_normal((16, 4)) / 4, dtype=tf.float64)
    logits = tf.matmul(tf.nn.tanh(tf.matmul(x, w1)), w2)
    return x, y, tf.nn.mean_sparse_softmax_cross_entropy_with_logits(logits, y), [w1, w2]


x, y, loss, params = small_mlp()
single = tf.train.AdamOptimizer(0.05).minimize(loss, params)
comms = ThreadTransport.group_of(RANKS)
zeros = [DistributedOptimizer(tf.train.AdamOptimizer(0.05), c, zero=3) for c in comms]
steps = [z.minimize(loss, params) for z in zeros]
init = tf.global_variables_initializer()
rng = np.random.default_rng(1)
xs, ys = rng.standard_normal((16, 8)), rng.integers(0, 4, 16)

sess = tf.Session()
sess.run(init)
for _ in range(3):
    sess.run(single, {x: xs, y: ys})
one_rank = sess.run(params)


def zero_rank(comm):
    s = tf.Session()
    s.run(init)
    broadcast_variables(s, comm)
    zeros[comm.rank].shard(s)
    for _ in range(3):
        mine = slice(4 * comm.rank, 4 * comm.rank + 4)
        s.run(steps[comm.rank], {x: xs[mine], y: ys[mine]})
    reduced = s.run(zeros[comm.rank].zero.reduce_node, {x: xs[:4], y: ys[:4]})
    return zeros[comm.rank].gather_variables(s), zeros[comm.rank].zero.held_bytes(s, reduced)


results = run_threads(comms, zero_rank)
print("ZeRO-3 on 4 ranks vs one rank, largest difference:",
      max(float(np.max(np.abs(a - b))) for a, b in zip(results[0][0], one_rank)))
print("bytes held by rank 0:", results[0][1], "of", (8 * 16 + 16 * 4) * 8,
      "bytes of parameters")

# %% [markdown]
# ### Exercise
# Stage 3 holds 1/4 of the parameters and 2/4 of a parameter vector of Adam state.

# %%
held = results[0][1]
assert held["parameters"] == (8 * 16 + 16 * 4) * 8 // RANKS
assert held["optimizer state"] == 2 * held["parameters"]

# %% [markdown]
# ## 3. Pipeline: stages, microbatches, bubbles
#
# Four dense layers, one per rank. Rank s runs the forward (F) of each microbatch
# when rank s-1 sends it, and the backward (B) when rank s+1 sends the gradient.
# GPipe runs all F's, then all B's; 1F1B interleaves them after a warm-up. Both
# idle for a fraction (p-1)/(m+p-1) of the time (the *bubble*), but 1F1B holds at
# most p microbatches' activations instead of m. Each rank's events are recorded
# in *logical time* (F = 1, B = 2 units; messages carry the sender's clock).

# %%
from tinyflow.pipeline import Pipeline, bubble_fraction, idle_fraction  # noqa: E402

width, microbatches = 6, 8
rng = np.random.default_rng(2)
weights = [tf.Variable(rng.standard_normal((width, width)) / 2, dtype=tf.float64)
           for _ in range(RANKS)]
stages = [lambda h, w=w: tf.nn.tanh(tf.matmul(h, w)) for w in weights]
init = tf.global_variables_initializer()
pp_inputs = rng.standard_normal((16, width))


def pipeline_run(schedule):
    comms = ThreadTransport.group_of(RANKS)
    pipes = [Pipeline(stages, lambda z, t: tf.nn.mean_sparse_softmax_cross_entropy_with_logits(
        z, t), c, (width,), 16, microbatches, tf.train.SGD(0.1), schedule, init=init,
        dtype=np.float64) for c in comms]

    def rank(comm):
        s = tf.Session()
        s.run(pipes[comm.rank].init)
        pipes[comm.rank].train_step(s, pp_inputs, np.arange(16) % width)
        return pipes[comm.rank]

    return run_threads(comms, rank)


for schedule in ("gpipe", "1f1b"):
    pipes = pipeline_run(schedule)
    lane = " ".join(e["node"] for e in pipes[0].events)
    print(f"{schedule}: rank 0 runs {lane}")
    print(f"  idle {idle_fraction([p.events for p in pipes]):.3f} (formula "
          f"{bubble_fraction(RANKS, microbatches):.3f}), most stashed inputs "
          f"{max(p.peak_stash for p in pipes)}")

# %% [markdown]
# ### Exercise
# Double the microbatches: by the formula, the bubble of 4 stages falls from 3/11 to
# 3/19. Check the formula, and that 1F1B's stash did not grow past p.

# %%
assert abs(bubble_fraction(4, 16) - 3 / 19) < 1e-12
assert max(p.peak_stash for p in pipes) == RANKS

# %% [markdown]
# ## 4. Tensor parallel: split the matmuls
#
# Megatron splits y = relu(x W1) W2 without changing its math: rank r keeps columns
# of W1 and the matching rows of W2, and an allreduce adds the partial products.
# The split is a rewrite of the graph, recorded with reasons like any pass:
# `tf.explain` prints them.

# %%
from tinyflow.tensor_parallel import TensorParallel  # noqa: E402

x = tf.placeholder(tf.float64, (4, 8))
w1 = tf.Variable(np.ones((8, 16)), dtype=tf.float64, name="W1")
w2 = tf.Variable(np.ones((16, 2)), dtype=tf.float64, name="W2")
out = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2))
tp = TensorParallel(ThreadTransport.group_of(RANKS)[1])
tp.split_column(w1)
tp.split_row(w2)
local = tp.apply(out)
print(tf.explain(tp))

# %% [markdown]
# ### Exercise
# Rank 1 keeps a 8x4 slice of W1 and a 4x2 slice of W2.

# %%
assert [tp.shards[id(w)][1].shape for w in (w1, w2)] == [(8, 4), (4, 2)]

# %% [markdown]
# ## 5. Parameter server
#
# Rank 0 holds the parameters; ranks 1-3 compute gradients on their shard of the
# batch, push them, and pull the new parameters. Synchronously this is again the
# one-rank step; asynchronously each worker's gradient is applied on its turn, on
# parameters up to two other workers' updates old.

# %%
from tinyflow.param_server import ParameterServer  # noqa: E402

x, y, loss, params = small_mlp(seed=3)
grads = tf.gradients(loss, params)
init = tf.global_variables_initializer()


def ps_rank(comm, mode="sync"):
    ps = ParameterServer(comm, params, servers=1, mode=mode, learning_rate=0.5)
    if ps.is_server:
        return ps.serve(steps=20)
    s = tf.Session()
    s.run(init)
    ps.start(s)
    k, losses = comm.rank - 1, []
    for step in range(20):
        feed = {x: xs[5 * k:5 * k + 5], y: ys[5 * k:5 * k + 5]}
        *g, value = s.run([*grads, loss], feed)
        losses.append(value)
        ps.step(s, step, g)
    return losses


for mode in ("sync", "async"):
    losses = run_threads(RANKS, lambda c, mode=mode: ps_rank(c, mode))[1]
    print(f"{mode}: worker 1's loss {losses[0]:.3f} -> {losses[-1]:.3f}")

# %% [markdown]
# ### Exercise
# Both modes learn: the last loss is below the first.

# %%
assert losses[-1] < losses[0]
assert ring_allreduce(np.ones(1), ThreadTransport.group_of(1)[0])[0] == 1.0
