# %% [markdown]
# # Lesson 3: graph passes that explain themselves
#
# Between the graph you build and the program that runs sits a small compiler: a
# list of *passes*, each a plain function `(graph, ctx) -> graph`. They remove
# algebraic identities (`x * 1`), merge duplicate work (common subexpression
# elimination), precompute what only depends on constants (folding), drop dead
# work, and fuse chains of small ops into one kernel. Every rewrite appends a
# `RewriteRecord` saying what was removed, what was added, and why, so you can
# always ask the compiler what it did.
#
# In this lesson you will
#
# 1. compile one graph with no passes and with the default pipeline, and compare;
# 2. read `explain()`, the compiler's report;
# 3. add your own pattern rule to the simplification table and watch it fire;
# 4. see an optimizer's update computed straight into its variable.
#
# **Read along:** `tinyflow/passes.py`: the module docstring, `simplify`, `cse`,
# `PIPELINE` and `explain`; `tinyflow/fusion_passes.py`: `fuse_dense`;
# `tinyflow/rules.py`: the rule table `RULES` and `add_rule`; `tinyflow/rewrite.py`:
# `new_node` and the sweep under every pass; the fused ops run in `tinyflow/fusion.py`.
# Passes ask the registry (`tinyflow/registry.py`) what an op is: `pure`,
# `elementwise`, `mutates` (writes a variable), `dense_activation` (fuse_dense may
# absorb it), `reshape` (the rule that merges reshapes); `tf.compile`'s phases are
# the functions right after `compile` in `tinyflow/executor.py`.

# %%
import numpy as np

import tinyflow as tf
from tinyflow import fusion, passes, rules
from tinyflow.backend import set_blas_threads
from tinyflow.rewrite import new_node
from tinyflow.rules import Rule, add_rule

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

rng = np.random.default_rng(0)


def count_op(graph, op: str) -> int:
    """How many times `graph` computes `op`: as a node, or inside a fused node's program."""
    count = 0
    for node in graph.nodes:
        if node.op == "fused_elementwise":
            count += fusion.program_ops(node.attrs["program"]).count(op)
        count += node.op == op
    return count

# %% [markdown]
# ## 1. A graph with some waste in it
#
# Real graphs are full of small redundancies: layers that multiply by a scale of
# 1, a negation undone by another helper function, the same subexpression
# written twice. Here is a tiny layer with all three.

# %%
x = tf.placeholder(tf.float32, (4, 8), name="x")
W = tf.placeholder(tf.float32, (8, 16), name="W")
b = tf.placeholder(tf.float32, (16,), name="b")

hidden = tf.nn.relu(tf.matmul(x, W) + b)        # a dense layer
scaled = hidden * 1.0 - 0.0                      # a "scale and shift" with defaults
flipped = -scaled                                # a helper negates ...
z = tf.exp(-flipped)                             # ... and another negates back
out = tf.reduce_sum(tf.tanh(z) * 2.0 - tf.tanh(z))  # tanh(z) written twice

feeds = {x: ((4, 8), np.float32), W: ((8, 16), np.float32), b: ((16,), np.float32)}
values = {x: rng.normal(size=(4, 8)).astype(np.float32),
          W: rng.normal(size=(8, 16)).astype(np.float32) / 4,
          b: rng.normal(size=16).astype(np.float32)}

# %% [markdown]
# `tf.compile` is what `Session.run` calls: fetches, the fed shapes, options.
# `passes=[]` switches the optimizer off; by default every pass of
# `passes.PIPELINE` runs, in this order (the last, lesson 4's gradient
# checkpointing, changes nothing unless asked). Each entry is a
# `Pass(name, fn, needs, provides)`: the runner refuses a pass whose need no
# earlier pass provides.

# %%
print("pipeline:", " -> ".join(p.name for p in passes.PIPELINE))
plain = tf.compile([out], feeds, passes=[])
optimized = tf.compile([out], feeds)

print(f"no passes: {len(plain.graph.nodes)} nodes, {len(plain.steps)} steps to run")
print(f"default:   {len(optimized.graph.nodes)} nodes, {len(optimized.steps)} steps to run")
(plain_value,) = plain.run(values, {})
(optimized_value,) = optimized.run(values, {})
print("same answer:", plain_value, optimized_value)
assert len(optimized.steps) < len(plain.steps)
assert np.allclose(plain_value, optimized_value, rtol=1e-5)

# %% [markdown]
# ## 2. The compiler's report
#
# `tf.explain(program)` (that is `passes.explain`) lists the node count after each
# pass, every rewrite record, and the fused nodes with the small programs they run.
# Read it top to bottom and match each line with the graph above.

# %%
print(tf.explain(optimized))

# %% [markdown]
# Things to notice:
#
# * `simplify` removed `mul(x, 1)`, `sub(x, 0)` and `neg(neg(x))`, then listed
#   the nodes those rewrites left unused. Each rule gives exactly the value it
#   replaces, for every input: `log(exp(x)) -> x` is not one (exp(200.) is inf in
#   float32), nor is a float `x + 0.0 -> x` (-0.0 + 0.0 is +0.0).
# * `cse` found the second `tanh(z)`: same op, same inputs, same attributes.
# * `fuse_dense` turned matmul + add + relu into one `fused_dense` node, and
#   `fuse_elementwise` fused the remaining elementwise chains; each fused node
#   "stands for" the user nodes it replaced (its *provenance*), which is how the
#   debugger maps a fused kernel back to your lines.
#
# The records are plain data on the program's pass context:

# %%
for record in optimized.ctx.records[:3]:
    print(record)
by_pass = {}
for record in optimized.ctx.records:
    by_pass[record.pass_name] = by_pass.get(record.pass_name, 0) + 1
print("rewrites per pass:", by_pass)
assert by_pass["simplify"] >= 3 and by_pass["cse"] >= 1

# %% [markdown]
# A pass can be switched off by name, which is how you find out which pass is
# responsible for something (a speedup, or a bug):

# %%
no_cse = tf.compile([out], feeds, disable=["cse"])
print(f"tanh computed {count_op(optimized.graph, 'tanh')} time(s) with cse, "
      f"{count_op(no_cse.graph, 'tanh')} without")
assert count_op(optimized.graph, "tanh") == 1 and count_op(no_cse.graph, "tanh") == 2

# %% [markdown]
# ## 3. Write a rule
#
# `simplify` is driven by a table, `rules.RULES`: each `Rule` has a pattern (also
# the reason its records give), the op it starts at, and a function
# `rewrite(node) -> replacement or None`. A rule must hold for *every* input,
# including NaN and infinity: that is why `x * 0 -> 0` is not in the table.

# %%
print(f"{len(rules.RULES)} rules, for example:")
for rule in rules.RULES[:4]:
    print("  ", rule.pattern)
with np.errstate(invalid="ignore"):
    print("inf * 0 =", np.float32(np.inf) * np.float32(0), "(so x * 0 -> 0 would be wrong)")

# %% [markdown]
# `relu` is idempotent: `relu(relu(x)) == relu(x)` for every x. Code that stacks
# helpers often applies it twice (a layer with a built-in activation, followed by
# an explicit one). The table has no rule for that yet:

# %%
h = tf.placeholder(tf.float32, (32, 32), name="h")
double = tf.nn.relu(tf.nn.relu(h)) * 3.0
h_feed = {h: ((32, 32), np.float32)}

before = tf.compile([double], h_feed)
print("relus computed before our rule:", count_op(before.graph, "relu"))
assert count_op(before.graph, "relu") == 2


# %% [markdown]
# The rule looks at a `relu` node; if its input is itself a `relu`, the inner node
# is the answer (same shape and dtype, so nothing else to check). `add_rule`
# appends it to the table and to the index by op (`RULES_BY_OP`) that `simplify`
# reads.

# %%
def relu_of_relu(node):
    """relu(relu(x)) -> relu(x): the outer relu changes nothing."""
    inner = node.inputs[0]
    return inner if inner.op == "relu" else None


new_rule = Rule("relu(relu(x)) -> relu(x)", "relu", relu_of_relu)
add_rule(new_rule)

after = tf.compile([double], h_feed)
fired = [r for r in after.ctx.records if r.reason == new_rule.pattern]
for record in fired:
    print(record)
assert len(fired) == 1 and fired[0].pass_name == "simplify"

sample = {h: rng.normal(size=(32, 32)).astype(np.float32)}
assert np.allclose(before.run(sample, {})[0], after.run(sample, {})[0])
print("relus computed after our rule:", count_op(after.graph, "relu"))
assert count_op(after.graph, "relu") == 1

# %% [markdown]
# ### Exercise: a rule that builds a node
#
# `abs(neg(x)) -> abs(x)` holds for every x (also NaN and infinity). This rule
# must build a *new* node, `abs(x)`. Use `rewrite.new_node`, the helper behind the
# built-in rules: it keeps the replaced node's `phase` and `provenance` (so the
# checkpointing pass and the debugger still know what the node stands for) and
# infers its shape. The solution is filled in; try writing
# `neg(sub(a, b)) -> sub(b, a)` next, and check that it fires.

# %%
def abs_of_neg(node):
    """abs(neg(x)) -> abs(x)."""
    inner = node.inputs[0]
    if inner.op != "neg":
        return None
    return new_node("abs", [inner.inputs[0]], {}, node, absorbed=(inner,))


abs_rule = Rule("abs(neg(x)) -> abs(x)", "abs", abs_of_neg)
add_rule(abs_rule)

a = tf.placeholder(tf.float32, (8,), name="a")
program = tf.compile([tf.abs(-a)], {a: ((8,), np.float32)})
records = [r for r in program.ctx.records if r.reason == abs_rule.pattern]
print(records)
assert len(records) == 1 and records[0].added     # a new abs node was added
a_value = np.array([-np.inf, -2, -0.5, 0, 0.5, 2, np.inf, np.nan], dtype=np.float32)
assert np.array_equal(program.run({a: a_value}, {})[0], np.abs(a_value), equal_nan=True)

# %% [markdown]
# ## 4. An optimizer step: the update written into the variable
#
# `w - lr * g` is computed, then `assign` copies it into `w`. The value exists only
# to be copied, so `fuse_assign` computes it straight into `w`'s own buffer: one
# node, no temporary, no copy. It runs where the assign ran, after every other
# reader of `w` (the read-before-write edges of `graph.topological_order`), so a
# read of `w` in the same run still sees the old value.

# %%
w = tf.Variable(np.ones((4, 3), np.float32), name="w")
g = tf.placeholder(tf.float32, (4, 3), name="g")
old_w_times_2 = w * 2.0
step = tf.assign(w, w - 0.1 * g)
session = tf.Session()
session.run(tf.global_variables_initializer())
buffer = session.variables[w]
doubled, _ = session.run([old_w_times_2, step], {g: np.ones((4, 3), np.float32)})
print("\n".join(tf.explain(session.last_program, max_rewrites=0).splitlines()[-2:]))
assert count_op(session.last_program.graph, "fused_assign") == 1
assert session.variables[w] is buffer             # updated in place
assert np.allclose(doubled, 2.0) and np.allclose(session.run(w), 0.9)

# %% [markdown]
# ## What to remember
#
# * A pass is a function from graph to graph; `PIPELINE` lists them in order, with
#   what each needs and provides, and `compile(passes=..., disable=...)` picks
#   among them.
# * Every rewrite leaves a record; `explain()` and the debugger read them.
# * A simplification is a row in a table: a pattern, an op, a rewrite function.
# * Fusion also saves copies: an update computed into its variable needs none.
#
# Next: lesson 4 plans the memory of the optimized program.
