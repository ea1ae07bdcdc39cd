# %% [markdown]
# # Lesson 4: planning memory before anything runs
#
# A static graph tells us, before the first step runs, the size of every tensor
# and which steps write and read it. So memory can be planned the way a compiler
# allocates registers: each intermediate tensor gets an *offset* in one big
# buffer (the arena), and two tensors may share bytes when they are never alive at
# the same time. A planned program allocates nothing while it runs.
#
# In this lesson you will
#
# 1. compare the planner's strategies on an MLP training step: the arena they
#    need against "no reuse at all" (naive) and the lower bound;
# 2. watch the validator reject a plan that is wrong;
# 3. trade computation for memory with gradient checkpointing.
#
# **Read along:** `tinyflow/memory.py`: the module docstring (the whole story in
# one page), `liveness`, `plan_memory`, `validate_plan`; `tinyflow/arena.py`: the
# strategies in `STRATEGIES`, each a function (blocks, conflicts) -> offsets; then
# `tinyflow/sublinear.py`: `memory_order`, `choose_checkpoints` and `recompute`
# (gradient checkpointing, Chen et al. 2016).

# %%
import dataclasses

import numpy as np

import tinyflow as tf
from tinyflow import memory, sublinear
from tinyflow.backend import set_blas_threads
from tinyflow.memory import format_bytes

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

# %% [markdown]
# ## 1. A training step to plan
#
# Forward, backward and the SGD updates of a 4-layer MLP, batch 128: the graph
# `Session.run(train_op)` compiles. `tf.compile` takes the fed shapes and the
# variables' shapes; the `memory` option picks the planner ("auto" tries every
# strategy and keeps the smallest arena; it is the default).

# %%
BATCH, SIZES = 128, [64, 256, 256, 256, 10]
x = tf.placeholder(tf.float32, (BATCH, SIZES[0]), name="images")
y = tf.placeholder(tf.int64, (BATCH,), name="labels")
mlp = tf.nn.MLP(SIZES)
loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(mlp(x), y)
train_op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)

feeds = {x: ((BATCH, SIZES[0]), np.float32), y: ((BATCH,), np.int64)}
variables = {v: (v.shape, v.dtype) for v in mlp.parameters()}
program = tf.compile([loss, train_op], feeds, variables, memory="auto")
plan = program.memory_plan

print(f"{len(program.steps)} steps; chosen strategy: {plan.strategy}")
print(f"  naive (no reuse) {format_bytes(plan.naive_bytes):>10}")
for name, arena in sorted(plan.strategies.items(), key=lambda item: item[1]):
    if name == "naive":
        continue  # printed above
    print(f"  {name:<20} {format_bytes(arena):>10}   {arena / plan.lower_bound_bytes:.3f}"
          " x lower bound")
print(f"  lower bound      {format_bytes(plan.lower_bound_bytes):>10}   (most bytes alive "
      "at one step)")

# %% [markdown]
# Things to notice:
#
# * Reuse matters: the best arena is a fraction of the naive one.
# * No plan can beat the lower bound (the most bytes alive at any one step), so
#   `arena / lower bound` is exactly what a heuristic wastes. Finding the smallest
#   arena is NP-hard (strip packing), which is why "auto" tries several greedy
#   orders, as TensorFlow Lite and MXNet do, and keeps the best.
#
# `plan.describe()` says where each tensor went and why:

# %%
print(plan.describe(limit=8))

# %% [markdown]
# A planned program computes the same values as one that allocates every tensor
# fresh (`memory=None`); the executor writes each kernel's result straight into
# its view of the arena (`out=`).

# %%
sess = tf.Session()
sess.run(tf.global_variables_initializer())
initial = {v: a.copy() for v, a in sess.variables.items()}
rng = np.random.default_rng(0)
batch = {x: rng.normal(size=(BATCH, SIZES[0])).astype(np.float32),
         y: rng.integers(0, 10, BATCH)}
unplanned = tf.compile([loss, train_op], feeds, variables, memory=None)
store_a = {v: a.copy() for v, a in initial.items()}
store_b = {v: a.copy() for v, a in initial.items()}
loss_planned = program.run(batch, store_a)[0]
loss_unplanned = unplanned.run(batch, store_b)[0]
print("loss planned / unplanned:", loss_planned, loss_unplanned)
assert np.allclose(loss_planned, loss_unplanned)
assert all(np.allclose(store_a[v], store_b[v]) for v in initial)   # same updates

# %% [markdown]
# ### Exercise 1: the bounds every plan obeys
#
# For every strategy, check `lower bound <= arena <= naive`, and that "auto" is
# at least as good as each. (Solution filled in; then try `BATCH = 1`: which
# strategy wins when the weights' gradients dominate the activations?)

# %%
for name, arena in plan.strategies.items():
    assert plan.lower_bound_bytes <= arena <= plan.naive_bytes, name
    assert plan.arena_bytes <= arena, name
print("lower bound <= arena <= naive for all", len(plan.strategies), "strategies")

# %% [markdown]
# ## 2. The validator
#
# A wrong plan does not crash; it silently gives wrong numbers (one tensor
# overwrites another that is still needed). So the executor checks every plan with
# `memory.validate_plan`, which trusts nothing the plan says: it recomputes every
# lifetime from the steps and checks every pair of tensors that share bytes.
#
# The planner works on `PlanStep`s (name, inputs, bytes, in-place input);
# `memory.steps_from_graph` makes them from a compiled graph, in a given order. We
# use the order the program above was planned in: with a memory plan, `compile`
# schedules the steps with `sublinear.memory_order` (the topological order with the
# lowest peak, see section 3), not in the graph's plain depth-first order, so the
# plan below is the program's own. Let us plan, then break the plan on purpose:
# move one tensor onto another that is alive at the same time.

# %%
steps, external, keep = memory.steps_from_graph(program.graph,
                                                sublinear.memory_order(program.graph))
good = memory.plan_memory(steps, external, keep)
assert good.arena_bytes == plan.arena_bytes  # the same plan the program runs with
memory.validate_plan(good, steps)            # no error: the plan is safe

arena_tensors = [t for t in good.tensors if t.offset is not None and t.nbytes > 0]
victim, intruder = next((a, b) for a in arena_tensors for b in arena_tensors
                        if a.first_step < b.first_step <= a.last_step
                        and b.inplace_of is None)
broken = dataclasses.replace(good, tensors=[
    dataclasses.replace(t, offset=victim.offset) if t is intruder else t
    for t in good.tensors])
try:
    memory.validate_plan(broken, steps)
    raise AssertionError("the validator accepted an unsafe plan")
except memory.PlanError as err:
    print("PlanError:", err)
    assert victim.name in str(err) and intruder.name in str(err)

# %% [markdown]
# ## 3. Gradient checkpointing: memory for time
#
# Training keeps every forward value that the backward pass reads (the
# *activations*) from the forward pass until its gradient is done, so memory grows
# with depth. Chen et al. (2016) keep only a few of them (segment boundaries) and
# recompute the rest in the backward pass, just before they are needed: with N
# layers in sqrt(N) segments, O(sqrt N) memory for one extra forward pass.
#
# In TinyFlow it is a graph pass: `compile(..., checkpoint="sqrt")` (or a byte
# budget). Backward nodes then read clones named `<node>/recompute`.

# %%
DEPTH, WIDTH = 16, 256
deep_x = tf.placeholder(tf.float32, (64, WIDTH), name="deep_x")
deep_y = tf.placeholder(tf.int64, (64,), name="deep_y")
deep = tf.nn.MLP([WIDTH] * (DEPTH + 1) + [10])
deep_loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(deep(deep_x), deep_y)
deep_train = tf.train.GradientDescentOptimizer(0.1).minimize(deep_loss)
deep_feeds = {deep_x: ((64, WIDTH), np.float32), deep_y: ((64,), np.int64)}
deep_vars = {v: (v.shape, v.dtype) for v in deep.parameters()}


def arena_in_order(graph, order=None) -> int:
    """Arena bytes for `graph` when its steps run in `order` (default: the graph's
    depth-first topological order)."""
    return memory.plan_memory(*memory.steps_from_graph(graph, order)).arena_bytes


results = {}
print(f"{'checkpoint':<12}{'steps':>6}{'activations':>13}{'arena, dfs order':>18}"
      f"{'arena, memory_order':>21}")
for mode in (None, "sqrt"):
    compiled = tf.compile([deep_loss, deep_train], deep_feeds, deep_vars, checkpoint=mode)
    graph = compiled.graph
    results[mode] = (compiled, sublinear.activation_bytes(graph),
                     arena_in_order(graph, sublinear.memory_order(graph)))
    print(f"{mode or 'off':<12}{len(compiled.steps):>6}{format_bytes(results[mode][1]):>13}"
          f"{format_bytes(arena_in_order(graph)):>18}{format_bytes(results[mode][2]):>21}")

for record in results["sqrt"][0].ctx.records:
    if record.pass_name == "checkpoint":
        print("[checkpoint]", record.reason)
        break

# %% [markdown]
# Things to notice:
#
# * The stored activations shrink to a fraction; the steps grow by the recomputed
#   forward nodes (about one extra forward pass, at most).
# * The arena shrinks only under a good *order* of steps. The graph's depth-first
#   order runs the whole chain of activation gradients before any weight gradient,
#   so every value stays alive to the end anyway. `sublinear.memory_order` tries a
#   few topological orders and keeps the one with the lowest peak (as XLA's memory
#   scheduler does); `compile` runs the steps in that order.
#
# ### Exercise 2: checkpointing keeps the gradients
#
# Recomputing must give the same numbers. Run one training step with and without
# checkpointing from the same weights and compare the updated weights. (Solution
# filled in; then try `checkpoint=` a byte budget such as `600_000` and see which
# boundaries `choose_checkpoints` picks.)

# %%
plain_program, plain_stored, plain_peak = results[None]
ckpt_program, ckpt_stored, ckpt_peak = results["sqrt"]
assert ckpt_stored < plain_stored / 2 and ckpt_peak < plain_peak
assert len(ckpt_program.steps) > len(plain_program.steps)
assert any(n.name.endswith("/recompute") for n in ckpt_program.graph.nodes)

weights = {v: rng.normal(scale=0.05, size=shape).astype(dtype)
           for v, (shape, dtype) in deep_vars.items()}
deep_batch = {deep_x: rng.normal(size=(64, WIDTH)).astype(np.float32),
              deep_y: rng.integers(0, 10, 64)}
store_plain = {v: a.copy() for v, a in weights.items()}
store_ckpt = {v: a.copy() for v, a in weights.items()}
loss_plain = plain_program.run(deep_batch, store_plain)[0]
loss_ckpt = ckpt_program.run(deep_batch, store_ckpt)[0]
assert np.allclose(loss_plain, loss_ckpt)
assert all(np.allclose(store_plain[v], store_ckpt[v], atol=1e-6) for v in weights)
print(f"same loss ({loss_plain:.4f}) and the same updated weights, with "
      f"{format_bytes(ckpt_stored)} instead of {format_bytes(plain_stored)} of activations")

# %% [markdown]
# ## What to remember
#
# * Liveness + in-place + offsets = one arena, planned once, reused every run.
# * `lower bound <= arena <= naive`; "auto" keeps the best of several heuristics.
# * The validator proves a plan safe; it is cheap, so it always runs.
# * Checkpointing is a graph rewrite: fewer stored activations, more steps.
#
# Next: lesson 5 runs the planned steps on streams and records a timeline.
