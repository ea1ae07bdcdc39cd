# %% [markdown]
# # Lesson 7: the same program on a GPU
#
# Nothing you have seen so far is specific to the CPU. Every kernel receives its
# array module as `xp`, numpy on the CPU and CuPy on an NVIDIA GPU, and the ops
# never import either; the schedule's streams and events map one to one onto CUDA
# streams and events. Moving a program to the GPU changes three things:
#
# 1. **`xp = cupy`**: arrays live in GPU memory and every `xp.*` call launches a
#    kernel (asynchronously: the host only queues it);
# 2. **generated kernels**: a fused elementwise node should be *one* GPU kernel
#    (on the CPU it is one Python function calling numpy per instruction);
# 3. **CUDA streams**: `CudaStreams` issues every step from one host thread, each
#    on its stream, with `stream.wait_event` where the schedule says "wait".
#
# This lesson runs the GPU part where a GPU is (`tinyflow.backend.gpu_available()`)
# and explains it otherwise; the CPU part always runs.
#
# **Read along:** `tinyflow/backend.py` (twenty lines), `compile(device=...)` in
# `tinyflow/executor.py`, `CudaStreams` in `tinyflow/streams.py`, and
# `_generate` / `generated_source` in `tinyflow/fusion.py`.

# %%
import inspect

import numpy as np

import tinyflow as tf
from tinyflow import fusion, ops
from tinyflow.backend import gpu_available

HAVE_GPU = gpu_available()
print("GPU available:", HAVE_GPU)
if not HAVE_GPU:
    print("(no CUDA device or no CuPy here: the GPU cells explain instead of running;\n"
          " on a machine with an NVIDIA GPU: pip install 'tinyflow[gpu]')")

# %% [markdown]
# ## 1. `xp`: one kernel, two array libraries
#
# A kernel is written against the numpy API, which CuPy copies. Here are two
# compute functions from `ops.py`; on the GPU they get `xp = cupy` and the very
# same lines launch CUDA kernels.

# %%
print(inspect.getsource(ops._relu_compute))
print(inspect.getsource(ops._matmul_compute))

# %% [markdown]
# `out=` is the planned memory (lesson 4): on the GPU the arena is one
# `cupy.zeros(...)` buffer in device memory, and each step writes into its view.
#
# ## 2. A model to move: one dense layer and an elementwise tail

# %%
rng = np.random.default_rng(0)
x = tf.placeholder(tf.float32, (512, 256), name="x")
w = tf.placeholder(tf.float32, (256, 256), name="w")
c = tf.placeholder(tf.float32, (512, 256), name="c")
h = tf.matmul(x, w)
y = tf.tanh(h * c + 1.0) - h          # an elementwise tree: fused into one node
loss = tf.reduce_mean(y * y)

feeds = {x: ((512, 256), np.float32), w: ((256, 256), np.float32),
         c: ((512, 256), np.float32)}
values = {x: rng.normal(size=(512, 256)).astype(np.float32),
          w: (rng.normal(size=(256, 256)) / 16).astype(np.float32),
          c: rng.normal(size=(512, 256)).astype(np.float32)}

cpu = tf.compile([loss, y], feeds, device="cpu")
cpu_loss, cpu_y = cpu.run(values, {})
print(f"CPU: loss {cpu_loss:.6f}; steps: {[s.node.op for s in cpu.steps]}")

# %% [markdown]
# ## 3. Generated kernels
#
# The fusion pass turned `tanh(h * c + 1) - h` into one `fused_elementwise` node
# that holds a small program. On the CPU, `fusion.py` writes that program as a
# Python function (one numpy call per instruction, temporaries reused):

# %%
fused = next(s.node for s in cpu.steps if s.node.op == "fused_elementwise")
program = fused.attrs["program"]
print(fusion.format_program(program))
print(fusion.generated_source(program, [i.shape for i in fused.inputs],
                              [i.dtype for i in fused.inputs]))

# %% [markdown]
# On a GPU each numpy call would be a separate kernel that reads and writes the
# whole array in GPU memory: four trips through memory for four instructions.
# A GPU compiler (XLA, TVM, Triton) instead generates *one* kernel whose loop body
# does all instructions on one element held in registers. For elementwise
# programs that code generator is short; here is one for CuPy's
# `ElementwiseKernel` (a CUDA C loop body per element):

# %%
CUDA_EXPRESSIONS = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}",
                    "div": "{0} / {1}", "neg": "-{0}", "exp": "exp({0})",
                    "log": "log({0})", "tanh": "tanh({0})", "sqrt": "sqrt({0})",
                    "relu": "max({0}, (T)0)", "sigmoid": "(T)1 / ((T)1 + exp(-{0}))"}


def cuda_kernel_body(program) -> str:
    """The CUDA C statements that compute `program` for one element: registers
    t0, t1, ... become local variables, inputs x0, x1, ... are the kernel's inputs."""
    lines = []
    for k, (op, operands, attrs) in enumerate(program):
        if op not in CUDA_EXPRESSIONS or attrs:
            raise NotImplementedError(f"no CUDA expression for {op} {attrs}")
        lines.append(f"T t{k} = {CUDA_EXPRESSIONS[op].format(*operands)};")
    lines.append(f"y = t{len(program) - 1};")
    return "\n".join(lines)


body = cuda_kernel_body(program)
inputs = ", ".join(f"T x{i}" for i in range(len(fused.inputs)))
print(f'cupy.ElementwiseKernel("{inputs}", "T y",\n"""\n{body}\n""")')
assert body.count("T t") == len(program)

# %% [markdown]
# To run such a kernel we need the fused node's inputs: here the matmul's output,
# the placeholder `c` and a constant. The same function gives them as numpy or
# CuPy arrays; on the CPU we check it against the fused node's own kernel.

# %%
fed = {"x": values[x], "w": values[w], "c": values[c]}


def fused_input_values(xp) -> list:
    """The values of the fused node's inputs, as arrays of array module `xp`."""
    arrays = []
    for node in fused.inputs:
        if node.op == "constant":
            arrays.append(xp.asarray(node.attrs["value"].array))
        elif node.op == "placeholder":
            arrays.append(xp.asarray(fed[node.name]))
        elif node.op == "matmul":
            arrays.append(xp.asarray(fed["x"]) @ xp.asarray(fed["w"]))
        else:
            raise NotImplementedError(f"input {node.name} ({node.op})")
    return arrays


on_cpu = ops.REGISTRY["fused_elementwise"].compute(np, *fused_input_values(np),
                                                    program=program)
assert np.allclose(on_cpu, cpu_y, rtol=1e-5, atol=1e-5)

# %% [markdown]
# ### Exercise: extend the code generator
#
# `cuda_kernel_body` knows a handful of ops. Add `abs` (CUDA's `fabs`) and check
# it on a program that uses it. (Solution filled in; then try an op with an
# attribute, such as `pow` with a constant exponent, and decide where the
# constant should go.)

# %%
CUDA_EXPRESSIONS["abs"] = "fabs({0})"
test_program = (("abs", ("x0",), ()), ("mul", ("t0", "x1"), ()))
print(cuda_kernel_body(test_program))
assert "fabs(x0)" in cuda_kernel_body(test_program)

# %% [markdown]
# ## 4. Running on the GPU
#
# `tf.compile(..., device="cuda")` (or `tf.Session(device="gpu")`, the original
# TinyFlow's spelling) makes `xp = cupy`: the arena is allocated on the GPU, feeds
# are copied there, fetched values are copied back. With `streams=2`, a graph with
# independent branches (lesson 5's) runs on `CudaStreams`: the same `Schedule` as
# on the CPU, its waits now CUDA events. (This model is one chain, so it keeps to
# one stream.)
# Where a GPU is, this cell runs the model there, checks it against the CPU, and
# runs our generated kernel; elsewhere it says what it would do.

# %%
def describe_runner(program) -> str:
    """Which runner executes `program`'s streams (none when one stream is enough)."""
    if program.runner is None:
        return "runner: none (this graph is one chain, so every step stays on one stream)"
    return f"runner: {type(program.runner).__name__} on streams {program.schedule.names}"


if HAVE_GPU:
    import cupy

    gpu = tf.compile([loss, y], feeds, device="cuda", streams=2)
    gpu_loss, gpu_y = gpu.run(values, {})
    print(f"GPU: loss {gpu_loss:.6f} (CPU {cpu_loss:.6f}); {describe_runner(gpu)}; "
          f"arena: {type(gpu.arena).__module__}.{type(gpu.arena).__name__}")
    assert np.allclose(gpu_loss, cpu_loss, rtol=1e-4)
    assert np.allclose(gpu_y, cpu_y, rtol=1e-4, atol=1e-4)

    kernel = cupy.ElementwiseKernel(inputs, "T y", body, "fused_tail")
    generated = cupy.asnumpy(kernel(*fused_input_values(cupy)))
    print("generated kernel matches the CPU:",
          np.allclose(generated, cpu_y, rtol=1e-4, atol=1e-4))
    assert np.allclose(generated, cpu_y, rtol=1e-4, atol=1e-4)
else:
    print("On a GPU this cell would:\n"
          "  * compile with device='cuda', streams=2: arena = cupy.zeros(...) on the\n"
          "    device, runner = CudaStreams (one host thread queues every step on its\n"
          "    stream; waits become stream.wait_event(event));\n"
          "  * run it and compare loss and y with the CPU run above (rtol 1e-4: GPU\n"
          "    kernels sum in a different order);\n"
          "  * compile the ElementwiseKernel printed above and check that it computes\n"
          "    the fused node's values in one kernel.")
    cpu2 = tf.compile([loss, y], feeds, device="cpu", streams=2)
    print(f"Meanwhile, with streams=2 on the CPU: loss {cpu2.run(values, {})[0]:.6f}; "
          f"{describe_runner(cpu2)}")
    assert np.allclose(cpu2.run(values, {})[0], cpu_loss)

# %% [markdown]
# ## What to remember
#
# * Kernels take `xp`; the device is a compile option, not a different program.
# * On a GPU, fusion pays off most as *one generated kernel* per fused node.
# * Streams and events are the same schedule on both devices.
#
# Next: lesson 8 records everything a run did and opens it in the debugger.
