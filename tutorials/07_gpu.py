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
# 2. **generated kernels**: a fused elementwise node becomes *one* CUDA kernel,
#    generated from its program (on the CPU it is one Python function calling
#    numpy per instruction);
# 3. **CUDA streams**: `CudaStreams` issues every step from one host thread, each
#    on its stream, with `stream.wait_event` where the schedule says "wait".
#
# This lesson runs the GPU part where a GPU is (`tinyflow.backend.gpu_available()`)
# and explains it otherwise; the CPU part always runs.
#
# **Read along:** `tinyflow/backend.py` (the module docstring's table of the few
# calls numpy and CuPy spell differently), `compile(device=...)` in
# `tinyflow/executor.py`, `CudaStreams` in `tinyflow/streams.py`,
# `generated_source` in `tinyflow/fusion.py` and the module docstring and
# `kernel_source` of `tinyflow/gpu.py`.

# %%
import inspect

import numpy as np

import tinyflow as tf
from tinyflow import fusion, gpu, ops
from tinyflow.backend import gpu_available, set_blas_threads

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

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
# same lines launch CUDA kernels. (Where the two libraries spell something
# differently, `np.add.at` against `cupyx.scatter_add` for instance, the op calls
# a shim in `backend.py` that takes `xp` first.)

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
# Python function: still one numpy call per instruction, with the temporaries
# reused.

# %%
fused = next(s.node for s in cpu.steps if s.node.op == "fused_elementwise")
program = fused.attrs["program"]
input_dtypes = [i.dtype for i in fused.inputs]
print(fusion.format_program(program))
print(fusion.generated_source(program, [i.shape for i in fused.inputs], input_dtypes))

# %% [markdown]
# On a GPU, one call per instruction would be one kernel launch each, and every
# launch reads its operands from device memory and writes its result back: four
# trips through memory for four instructions, and elementwise kernels are bound
# by exactly that traffic. `tinyflow/gpu.py` writes the whole program as *one*
# CUDA kernel instead: each thread reads its element of every input once, keeps
# the temporaries in registers (C local variables) and writes the output once.
# Generating the source needs no GPU:

# %%
source = gpu.kernel_source(program, input_dtypes)
print(source.listing())
assert isinstance(source, gpu.ElementwiseSource)
assert source.operation.count("/* t") == len(program)    # one line per instruction

# %% [markdown]
# ### What CuPy compiles, and what NVRTC makes of it
#
# Those strings are not yet a CUDA program: at the first launch CuPy wraps them in
# its own loop (`CUPY_FOR` over the elements, `CArray` and `CIndexer` for
# broadcasting and strides), adds its headers and options, and hands the whole
# source to NVRTC, NVIDIA's runtime compiler. `tinyflow/gpu_compile.py` runs
# exactly that code generation without a GPU (only the final compile call is
# intercepted) and compiles the result with NVRTC for an H100 (`sm_90`). The test
# tier does this for every kernel TinyFlow can generate; here is the one above.
# (This needs the `gpu-check` wheels, part of `pip install -e ".[all]"`; a GPU is
# not needed.)

# %%
from tinyflow import gpu_compile

why_not = gpu_compile.missing()
if why_not:
    print("Cannot compile here:", why_not)
else:
    cuda = gpu_compile.cuda_sources(program, input_dtypes)[0]
    header_end = cuda.code.index("extern")     # CuPy's #includes come first
    print(cuda.code[:header_end].strip(), "\n...")
    print(cuda.code[header_end:])
    print("NVRTC options:", " ".join(o for o in cuda.options if not o.startswith("-I")))
    compiled = gpu_compile.compile_one(cuda, "sm_90")
    print(f"sm_90: PTX {compiled.ptx_bytes} bytes, machine code (cubin) "
          f"{compiled.cubin_bytes} bytes, {compiled.registers} registers per thread")
    assert source.operation in cuda.code and compiled.registers

# %% [markdown]
# Registers matter on a GPU: each thread keeps its temporaries in them, and the
# fewer a kernel needs, the more threads fit on a multiprocessor at once to hide
# memory latency. `--fmad=false` is ours: it keeps `a * b + c` rounding twice, as
# numpy does (the README's *GPU* section says what that costs and what else
# differs on a device).
#
# Things to notice: each C type comes from the op's own shape/dtype rule (the
# registry is the one source of truth), and the kernel takes `cupy`'s numpy-style
# broadcasting for free (`x2` is the scalar constant 1.0). On the GPU, the fused
# op's compute (`gpu.fused_compute`) builds this kernel once per program and
# input dtypes, caches it, and launches it into the planned `out`.
#
# ### Exercise: a fused reduction
#
# A program that ends in a reduction becomes a `cupy.ReductionKernel`: the
# elementwise part is its *map* expression, so the tensor being reduced is never
# stored at all. Write the program for `sum((a - b) * (a - b))` and look at its
# kernel. (Solution filled in; then try `max` instead of `sum`, or float16 inputs,
# which the kernel computes in float and rounds at every store, as numpy does.)

# %%
squared_error = (("sub", ("x0", "x1"), ()),
                 ("mul", ("t0", "t0"), ()),
                 ("sum", ("t1",), (("axis", None), ("keepdims", False))))
reduction = gpu.kernel_source(squared_error, [np.dtype("float32")] * 2)
print(reduction.listing())
assert isinstance(reduction, gpu.ReductionSource)
assert "x0 - x1" in reduction.preamble and reduction.reduce_expr == "a + b"

# %% [markdown]
# ## 4. Running on the GPU
#
# `tf.compile(..., device="cuda")` (or `tf.Session(device="gpu")`, the original
# TinyFlow's spelling) makes `xp = cupy`: the arena is allocated on the GPU, feeds
# are copied there, fetched values are copied back. With `streams=2`, a graph with
# independent branches (lesson 5's) runs on `CudaStreams`: the same `Schedule` as
# on the CPU, its waits now CUDA events. (This model is one chain, so it keeps to
# one stream.) Where a GPU is, this cell runs the model there, checks it against
# the CPU and counts the generated kernels it launched; elsewhere it says what it
# would do, and runs the CPU side.

# %%
def describe_runner(program) -> str:
    """Which runner executes `program`'s streams (none when one stream is enough)."""
    if program.runner is None:
        return "runner: none (this graph is one chain, so every step stays on one stream)"
    return f"runner: {type(program.runner).__name__} on streams {program.schedule.names}"


if HAVE_GPU:
    launches = gpu.stats["launches"]
    on_gpu = tf.compile([loss, y], feeds, device="cuda", trace=True)
    gpu_loss, gpu_y = on_gpu.run(values, {})
    print(f"GPU: loss {gpu_loss:.6f} (CPU {cpu_loss:.6f}); {describe_runner(on_gpu)}; "
          f"arena: {type(on_gpu.arena).__module__}.{type(on_gpu.arena).__name__}")
    print(f"generated kernels launched: {gpu.stats['launches'] - launches}")
    for event in on_gpu.last_timeline:
        print(f"  {event['op']:<18} {(event['end'] - event['start']) * 1e6:8.1f} us")
    assert np.allclose(gpu_loss, cpu_loss, rtol=1e-4)
    assert np.allclose(gpu_y, cpu_y, rtol=1e-4, atol=1e-4)
    assert gpu.stats["launches"] > launches
else:
    print("On a GPU this cell would:\n"
          "  * compile with device='cuda': arena = one cupy.zeros(...) buffer in device\n"
          "    memory; the fused node runs as the generated kernel printed above;\n"
          "  * run it and compare loss and y with the CPU run (rtol 1e-4: GPU kernels\n"
          "    sum in a different order), and count the generated kernels launched;\n"
          "  * print the timeline, timed with CUDA events (backend.CudaClock): a kernel\n"
          "    launch returns before the kernel runs, so host clocks would time the\n"
          "    launch, not the work.")
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
