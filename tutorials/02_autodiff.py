# %% [markdown]
# # Lesson 2: automatic differentiation, as graph nodes
#
# Reverse-mode autodiff walks the graph from the output back to the inputs and
# applies the chain rule one op at a time: each op's registry entry has a
# `gradient(node, grad_of_output)` rule that returns the gradients of its inputs.
# In TinyFlow those gradients are *new graph nodes*, not numbers. So the gradient
# graph is an ordinary graph: passes optimise it, the planner plans it, and
# `tf.gradients` can differentiate it again.
#
# In this lesson you will
#
# 1. build a gradient graph by hand with the chain rule;
# 2. get the same graph from `tf.gradients`, and check it against finite
#    differences;
# 3. differentiate twice (tanh'') and compute a Hessian-vector product without
#    ever forming the Hessian;
# 4. see `Node.phase`, which marks what `gradients` built as "backward".
#
# **Read along:** `tinyflow/autodiff.py` (all of it: under a hundred lines) and the
# gradient rules in `tinyflow/ops.py` (search for `_unary("tanh"` and `_binary("mul"`).

# %%
import numpy as np

import tinyflow as tf
from tinyflow.backend import set_blas_threads
from tinyflow.gradcheck import check_gradients
from tinyflow.graph import topological_order

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

sess = tf.Session()
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. The chain rule by hand
#
# Take `loss = sum(tanh(x * w))` for vectors `x`, `w`. With `t = tanh(x * w)`:
#
#     d loss / d t = 1,   d t / d (x*w) = 1 - t*t,   d (x*w) / d w = x
#
# so `d loss / d w = x * (1 - t*t)`. We can write that as graph nodes ourselves,
# reusing the forward node `t` (no recomputation of tanh):

# %%
x = tf.placeholder(tf.float64, (5,), name="x")
w = tf.placeholder(tf.float64, (5,), name="w")
t = tf.tanh(x * w)
loss = tf.reduce_sum(t)

grad_w_by_hand = x * (1.0 - t * t)

feed = {x: rng.normal(size=5), w: rng.normal(size=5)}
by_hand = sess.run(grad_w_by_hand, feed)
print("by hand:     ", by_hand)

# %% [markdown]
# ## 2. The same with `tf.gradients`
#
# `tf.gradients(loss, [w])` does exactly that walk: in reverse topological order,
# it asks each op's `gradient` rule for its inputs' gradients and sums the
# contributions of a node used twice. Open `ops.py` and compare tanh's rule,
# `lambda n, g: [g * (1.0 - n * n)]`, with the line we wrote above.

# %%
(grad_w,) = tf.gradients(loss, [w])
automatic = sess.run(grad_w, feed)
print("tf.gradients:", automatic)
assert np.allclose(automatic, by_hand)

# %% [markdown]
# Is it right? A central finite difference, `(f(w + h e_i) - f(w - h e_i)) / 2h`,
# estimates each partial derivative using only the forward graph. How closely
# should it agree? The formula's own error, about `h² |f'''| / 6`, is below 1e-12
# for `h = 1e-6`; the larger part is rounding: each float64 `tanh` term of `f` is
# off by up to about `eps` (2.2e-16) times its size, and dividing the difference
# of two such `f`s by `2h` magnifies that to about `eps * sum|tanh(x w)| / h`, a
# few 1e-10 here. The line below prints that estimate beside what we got.

# %%
def finite_difference(f, point: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of scalar function `f` at `point`, one coordinate at a time."""
    grad = np.zeros_like(point)
    for i in range(point.size):
        step = np.zeros_like(point)
        step[i] = h
        grad[i] = (f(point + step) - f(point - step)) / (2 * h)
    return grad


numeric = finite_difference(lambda wv: sess.run(loss, {x: feed[x], w: wv}), feed[w])
print("finite diff: ", numeric)
rounding = np.finfo(np.float64).eps * np.abs(sess.run(t, feed)).sum() / 1e-6
print(f"largest difference: {np.abs(numeric - automatic).max():.2e} "
      f"(float64 rounding alone allows about {rounding:.1e})")
assert np.allclose(numeric, automatic, atol=1e-7)

# %% [markdown]
# The library ships this check as `check_gradients` (tinyflow/gradcheck.py, as
# minitorch ships its `grad_check`): give it a function that builds a node from
# placeholders and float64 values for them. It checks every element of every
# argument and, when one disagrees, raises an error naming the op, the argument,
# the element, the expected (finite-difference) and the got (autodiff) value.

# %%
check_gradients(lambda xv, wv: tf.reduce_sum(tf.tanh(xv * wv)),
                [feed[x], feed[w]])
print("check_gradients: sum(tanh(x * w)) agrees with finite differences")

# %% [markdown]
# ## 3. Gradients of gradients
#
# `grad_w` is a graph, so we can differentiate it. For `y = tanh(x)`:
# `tanh'(x) = 1 - tanh(x)^2` and `tanh''(x) = -2 tanh(x) (1 - tanh(x)^2)`.

# %%
u = tf.placeholder(tf.float64, (7,), name="u")
(d1,) = tf.gradients(tf.tanh(u), [u])
(d2,) = tf.gradients(d1, [u])

points = np.linspace(-3, 3, 7)
first, second = sess.run([d1, d2], {u: points})
th = np.tanh(points)
print("tanh''  :", np.round(second, 4))
assert np.allclose(first, 1 - th**2)
assert np.allclose(second, -2 * th * (1 - th**2))

# %% [markdown]
# ### Hessian-vector products
#
# For `f(w) = 1/2 w^T A w + sum(exp(w))` the Hessian is `H = A + diag(exp(w))`.
# Forming `H` costs n^2 memory; Pearlmutter's trick gets `H v` for the cost of two
# gradients: `H v = d/dw (grad f(w) . v)`. Optimizers such as Newton-CG and the
# curvature checks in research code use exactly this.

# %%
A = np.array([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]])
wv = tf.placeholder(tf.float64, (3,), name="w3")
v = tf.placeholder(tf.float64, (3,), name="v")
f = 0.5 * tf.reduce_sum(wv * tf.reshape(tf.matmul(tf.constant(A), tf.reshape(wv, (3, 1))),
                                        (3,))) + tf.reduce_sum(tf.exp(wv))
(grad_f,) = tf.gradients(f, [wv])
(hvp,) = tf.gradients(tf.reduce_sum(grad_f * v), [wv])

w_value, v_value = np.array([0.1, -0.2, 0.3]), np.array([1.0, 0.0, -1.0])
got = sess.run(hvp, {wv: w_value, v: v_value})
expected = (A + np.diag(np.exp(w_value))) @ v_value
print("H v =", got, " expected", expected)
assert np.allclose(got, expected)

# %% [markdown]
# ## 4. `Node.phase`: which nodes are the backward pass
#
# `gradients` marks every node it builds with `phase = "backward"`. Gradient
# checkpointing (lesson 4) reads it to tell activations (forward values the
# backward pass reads) from their consumers, and the debugger colours by it.

# %%
nodes = topological_order([hvp])
phases = {"forward": 0, "backward": 0}
for node in nodes:
    phases[node.phase] += 1
print(f"the Hessian-vector product graph: {len(nodes)} nodes, {phases}")
print("f is", f.phase, "; grad_f is", grad_f.phase, "; hvp is", hvp.phase)
assert f.phase == "forward" and grad_f.phase == "backward" and hvp.phase == "backward"

# %% [markdown]
# ### Exercise: the sigmoid's derivative
#
# Show that `d sigmoid(z) / dz = s (1 - s)` with `s = sigmoid(z)`, and that the
# second derivative is `s (1 - s) (1 - 2 s)`. (The solution is filled in; try
# deriving `d/dz log(sigmoid(z))` next and check it against `1 - s`.)

# %%
z = tf.placeholder(tf.float64, (4,), name="z")
(ds,) = tf.gradients(tf.sigmoid(z), [z])
(dds,) = tf.gradients(ds, [z])
z_value = np.array([-2.0, -0.5, 0.5, 2.0])
s = 1 / (1 + np.exp(-z_value))
got_1, got_2 = sess.run([ds, dds], {z: z_value})
assert np.allclose(got_1, s * (1 - s))
assert np.allclose(got_2, s * (1 - s) * (1 - 2 * s))
print("sigmoid' and sigmoid'' match the formulas")

# %% [markdown]
# ## What to remember
#
# * A gradient rule maps (node, gradient of its output) to gradient *nodes* of
#   its inputs; `gradients` applies the rules in reverse topological order.
# * Because gradients are graphs, grad-of-grad and Hessian-vector products are
#   just more calls to `tf.gradients`.
# * Check gradients with central finite differences in float64
#   (`tinyflow.gradcheck.check_gradients` does it for every element).
#
# Next: lesson 3 shows what the compiler's passes do to these graphs.
