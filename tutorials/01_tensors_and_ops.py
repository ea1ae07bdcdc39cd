# %% [markdown]
# # Lesson 1: tensors, ops and the op registry
#
# TinyFlow programs are written the way TensorFlow 1 programs were: first you
# *build* a graph of operations, then a `Session` *runs* it. Building computes
# nothing; it only records what should be computed, so that the layers below
# (autodiff, passes, the memory planner, the executor) can look at the whole
# program before it runs.
#
# In this lesson you will
#
# 1. build a graph from placeholders and Variables and run it with `Session.run`;
# 2. see that every op is *data* in a registry: a compute function, a shape rule,
#    a gradient and a few flags that the passes read;
# 3. meet shape inference, which rejects a wrong program while you build it, with
#    an error that names the op, the shapes and your line of code.
#
# **Read along:** `tinyflow/graph.py` (`Node`, `user_source_line`),
# `tinyflow/registry.py` (`OpDef`, `REGISTRY`, `register`), `tinyflow/ops.py` (`make`,
# `infer_node`, `shape_error`; and `Mismatch`, `infer_same`, `result_dtype`, which op
# modules such as `shape_ops.py`, `nn_ops.py` and `image_ops.py` build on),
# `tinyflow/errors.py` (`ShapeError`), `tinyflow/api.py` (`placeholder`, `Variable`)
# and `Session.run` in `tinyflow/session.py`.
#
# Run it as a script (`python tutorials/01_tensors_and_ops.py`) or open it as a
# notebook (`jupytext --to notebook tutorials/01_tensors_and_ops.py`).

# %%
import numpy as np

import tinyflow as tf
from tinyflow.backend import set_blas_threads
from tinyflow.ops import REGISTRY

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

# %% [markdown]
# ## 1. Build a graph, then run it
#
# A `placeholder` is a value you feed at run time; `None` in its shape is a
# dimension (here the batch size) that the feed fixes. A `Variable` is state that
# lives in the Session across runs; its initializer runs when you run
# `tf.global_variables_initializer()`.

# %%
x = tf.placeholder(tf.float32, shape=(None, 3), name="x")
W = tf.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="W")
b = tf.Variable(np.array([0.5, -0.5], dtype=np.float32), name="b")
y = tf.matmul(x, W) + b

print(y)

# %% [markdown]
# Notice what the printed node holds: its name, its op, its shape as far as it is
# known (`?x2`: the batch is still open), its dtype, and **where** it was built:
# this file and line. Every layer of TinyFlow keeps `where`, so any error later,
# in a pass, the planner or a kernel, can point back at your line.
#
# Now run it. The first `run` of a set of fetches and fed shapes *compiles* a
# `Program` (passes, schedule, memory plan) and caches it; later runs with the
# same shapes reuse it.

# %%
sess = tf.Session()
sess.run(tf.global_variables_initializer())

batch = np.array([[1, 0, 0], [0, 1, 1]], dtype=np.float32)
result = sess.run(y, feed_dict={x: batch})
print(result)
assert np.allclose(result, batch @ np.arange(6).reshape(3, 2) + [0.5, -0.5])

first_program = sess.last_program
sess.run(y, feed_dict={x: batch * 2})          # same shapes: the cached program
assert sess.last_program is first_program
sess.run(y, feed_dict={x: np.ones((5, 3))})    # batch of 5: a new program
assert sess.last_program is not first_program
print("same shapes reused the program; a new batch size compiled another")

# %% [markdown]
# ## 2. The op registry is data
#
# `tinyflow.ops.REGISTRY` is a plain dict from op name to an `OpDef`: the
# `compute(xp, *arrays, out=None, **attrs)` function (`xp` is numpy, or cupy on a
# GPU), the shape/dtype rule `infer`, the `gradient` rule, and flags. The layers
# above never test op names one by one: CSE asks `pure`, fusion asks
# `elementwise`, the memory planner asks `inplace`; the executor asks `source`
# (is this a feed, a variable or a constant?) and `mutates` (does this op write a
# variable in place, as `assign` does?), the stream scheduler asks `cost`. This is
# NNVM's design (the IR under the original TinyFlow): attributes registered beside
# each op, in one table (`tinyflow/registry.py`), so adding an op is one
# `register` call.

# %%
print(f"{len(REGISTRY)} ops registered\n")
print(f"{'op':<14}{'elementwise':>12}{'inplace':>9}{'pure':>6}{'commutative':>13}"
      f"{'differentiable':>16}")
for name in ["add", "mul", "exp", "relu", "matmul", "sum", "argmax", "assign",
             "random_normal"]:
    op = REGISTRY[name]
    print(f"{name:<14}{op.elementwise!s:>12}{op.inplace!s:>9}{op.pure!s:>6}"
          f"{op.commutative!s:>13}{op.differentiable!s:>16}")

# %% [markdown]
# Things to notice in the table:
#
# * `inplace=0` on `add`, `exp`, `relu`: the output may overwrite input 0 when
#   nothing else reads it later (lesson 4's planner uses that). `matmul` cannot:
#   it reads every input element many times while it writes.
# * `assign` and `random_normal` are not `pure`: two random draws are two
#   different values, so CSE must never merge them and constant folding must never
#   run them at compile time.
# * `argmax` is not differentiable, so autodiff refuses a path through it.
#
# The functions in an `OpDef` are ordinary Python you can call yourself:

# %%
matmul = REGISTRY["matmul"]
print("matmul rule:", matmul.infer([(2, 3), (3, 4)], [np.dtype("float32")] * 2, {}))
print("add compute:", REGISTRY["add"].compute(np, np.array([1.0, 2.0]), np.array(10.0)))

# %% [markdown]
# ### Exercise 1: ask the registry
#
# Find every op the registry marks `commutative` (the line below is the answer).
# Why are `maximum` and `minimum` not among them? (Try `np.maximum(0.0, -0.0)` and
# `np.maximum(-0.0, 0.0)`.) Then try listing the ops that are `elementwise` but not
# `pure`: there are none. Why would the fusion pass, which merges elementwise ops
# into one kernel, care?

# %%
commutative = sorted(name for name, op in REGISTRY.items() if op.commutative)
print("commutative:", commutative)
assert {"add", "mul"} <= set(commutative)
assert not {"sub", "matmul", "maximum", "minimum"} & set(commutative)

# %% [markdown]
# ## 3. Shape inference: errors while you build
#
# `ops.make` runs the op's `infer` rule as soon as the input shapes are known, so
# a matrix product of incompatible matrices fails on the line that writes it,
# not deep inside a kernel later. The message has one format everywhere
# (`ops.shape_error`): op, every input shape, the reason, and your file:line.

# %%
try:
    # `w_wrong` is created on the same line as the matmul, so its `where` is the
    # line the error must name.
    tf.matmul(x, w_wrong := tf.placeholder(tf.float32, (4, 5), name="w_wrong"))
except tf.ShapeError as err:
    message = str(err)
print(message)
assert message.startswith("matmul:")
assert "(?, 3)" in message and "(4, 5)" in message
assert w_wrong.where in message

# %% [markdown]
# When a shape is not known while building (a placeholder declared with
# `shape=None`), the check waits for the feed. The error then comes from
# `Session.run`, and it still names the line that built the op:

# %%
p = tf.placeholder(tf.float32, name="p")   # shape unknown until fed
q = tf.placeholder(tf.float32, name="q")
total = p + q
try:
    sess.run(total, {p: np.ones((2, 3)), q: np.ones((4, 3))})
except tf.ShapeError as err:
    late_message = str(err)
print(late_message)
assert "add" in late_message and "(2, 3)" in late_message and "(4, 3)" in late_message
assert total.where in late_message

# %% [markdown]
# ### Exercise 2: predict a broadcast shape
#
# Elementwise ops broadcast like numpy, with `None` meaning "not known yet". Before
# running the cell, predict the shape of `row + column`. Then try shapes that
# cannot broadcast, such as `(None, 4)` with `(3,)` (4 against 3, and neither is
# 1), and read the error. Careful: `(None, 4)` with `(3, 1)` *does* broadcast, to
# `(3, 4)`: the 1 stretches to 4, and the unknown dim must turn out to be 3 (or 1).

# %%
row = tf.placeholder(tf.float32, (None, 1, 4), name="row")
column = tf.placeholder(tf.float32, (3, 1), name="column")
print("row + column:", (row + column).shape)
assert (row + column).shape == (None, 3, 4)

batch = tf.placeholder(tf.float32, (None, 4), name="batch")
assert (batch + column).shape == (3, 4)
try:
    batch + tf.placeholder(tf.float32, (3,), name="short")
    raise AssertionError("(None, 4) + (3,) should not broadcast")
except tf.ShapeError as err:
    print("ShapeError:", err)

# %% [markdown]
# ## What to remember
#
# * A graph is built from `Node`s; each knows its op, inputs, shape, dtype and
#   `where`. Nothing runs until `Session.run`, which compiles once per shape.
# * An op is one `OpDef` in `REGISTRY`: compute, infer, gradient, flags.
# * Shape errors name the op, the shapes and your line.
#
# Next: lesson 2 asks each op for its `gradient` and builds the backward graph.
