"""Array backends: numpy on the CPU, CuPy on an NVIDIA GPU.

Ops receive the array module as `xp` and never import cupy themselves; this file is
the one place that finds out whether a GPU is there, and the one place that knows
where numpy and CuPy spell the same thing differently. CuPy copies numpy's API, so
an op's compute runs unchanged with ``xp = cupy`` except for the few calls below;
each shim takes `xp` first and does the plain numpy thing when ``xp is numpy``::

    shim           numpy                               CuPy
    scatter_add    np.add.at                           cupy.add.at or cupyx.scatter_add
    as_strided     np.lib.stride_tricks.as_strided     cupy.lib.stride_tricks.as_strided
    errstate       np.errstate                         nothing to set: GPUs never trap
                                                       floating-point errors
    to_host        a copy                              ndarray.get() (device -> host)
    Uploader       the array itself                    host -> device, staged in
                                                       pinned (page-locked) memory
    draw_random    numpy Generator                     the same draw, copied over
    device_copy    the array itself                    one cached device copy
    step_clock     time.perf_counter                   CUDA events
    zeros_bytes    host_bytes: huge pages where Linux      cupy.zeros
                   has them

The executor sees one `Device` object (`device(name)`), which gathers what a
program needs of its hardware: the array module, feed uploads, where a variable's
value must live, the multi-stream runner and the step clock. So executor.py has no
``xp is np`` or ``device == "cuda"`` branch, and reads as CPU code.

Installing: ``pip install 'tinyflow[gpu]'`` installs ``cupy-cuda12x``, the CuPy
wheel built for CUDA 12.x (it needs an NVIDIA driver that supports CUDA 12). On a
machine with CUDA 11.x, install ``cupy-cuda11x`` instead. Without CuPy or without
a GPU, ``compile(..., device="cuda")`` raises the TinyFlowError of
`cuda_array_module`, and the GPU tests skip (`gpu_available`).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyflow.errors import TinyFlowError
from tinyflow.streams import CpuStreams, CudaStreams, Schedule


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def cuda_array_module() -> Any:
    """Return the cupy module, or raise a clear error when no GPU can be used."""
    try:
        import cupy
    except ImportError:
        raise TinyFlowError("device='cuda' needs CuPy: pip install 'tinyflow[gpu]' "
                            "on a machine with an NVIDIA GPU and CUDA 12") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        raise TinyFlowError(f"device='cuda': CuPy is installed but no GPU is usable ({err})"
                            ) from None
    if count == 0:
        raise TinyFlowError("device='cuda': CuPy is installed but sees no GPU")
    return cupy


def array_module(device: str) -> Any:
    """numpy for ``"cpu"``, cupy for ``"cuda"`` (or `cuda_array_module`'s error)."""
    if device == "cpu":
        return np
    if device == "cuda":
        return cuda_array_module()
    raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'")


def is_device_array(value: Any) -> bool:
    """True for a CuPy array (found by its type's module: cupy need not be imported)."""
    return type(value).__module__.split(".")[0] == "cupy"


# ----------------------------------------------------------------------------------
# Calls numpy and CuPy spell differently
# ----------------------------------------------------------------------------------

def scatter_add(xp: Any, target: Any, indices: Any, values: Any) -> None:
    """``target[indices] += values`` where repeated indices all add (numpy's
    ``np.add.at``): the gradient of a gather (the same row picked twice). Older
    CuPy has no ``ufunc.at``; its spelling is ``cupyx.scatter_add`` (atomic adds, so
    only the dtypes CUDA's atomicAdd supports: float32 and int32 everywhere)."""
    add_at = getattr(xp.add, "at", None)  # numpy; CuPy from the version with ufunc.at
    if add_at is not None:
        add_at(target, indices, values)
        return
    import cupyx
    cupyx.scatter_add(target, indices, values)


def as_strided(xp: Any, x: Any, shape: Sequence[int], strides: Sequence[int]) -> Any:
    """A view of `x` with the given shape and byte strides (no copy): the windows of
    im2col. numpy and CuPy keep it in their own ``lib.stride_tricks``."""
    if xp is np:
        return np.lib.stride_tricks.as_strided(x, shape=tuple(shape), strides=tuple(strides))
    import cupy.lib.stride_tricks
    return cupy.lib.stride_tricks.as_strided(x, shape=tuple(shape), strides=tuple(strides))


def errstate(xp: Any, **settings: str | None) -> contextlib.AbstractContextManager:
    """numpy's floating-point error context (``all="ignore"`` ...). On a GPU there is
    nothing to set: CUDA kernels never trap or warn on overflow or 0/0, they write
    Inf and NaN; check mode (executor.py) finds those by looking at the values."""
    return np.errstate(**settings) if xp is np else contextlib.nullcontext()


def errors_may_raise() -> bool:
    """Whether a floating-point error (overflow, invalid) could raise in a numpy ufunc
    now: numpy set to "raise" or "call", or RuntimeWarnings turned into errors
    (python -W error). A kernel that writes a result in slices, or over the value it
    updates, checks it first: raised halfway, it would leave a half-written value."""
    if any(mode in ("raise", "call") for mode in np.geterr().values()):
        return True
    return any(action == "error" and issubclass(RuntimeWarning, category)
               for action, _, category, _, _ in warnings.filters)


# Large host buffers (the static plan's arena, the caching allocator's segments) are
# maps of their own, aligned to 2 MiB and advised for huge pages where Linux's
# transparent huge pages allow it (THP "madvise" or "always"): a TLB entry then
# covers 2 MiB instead of 4 KiB, so a GEMM streaming through an activation (or, in
# eager mode, a weight) misses the TLB far less. numpy advises huge pages for its
# own buffers from 4 MiB up, but those come from malloc: unaligned, and in a
# long-running process from a heap already faulted in 4 KiB pages; buffers of 2-4
# MiB (the allocator's small segments) it does not advise at all. Graph-mode
# variables keep their own arrays. Measured, without and with alternated
# (benchmarks/run.py --only mlp_step, 3x): mlp_step_vs_torch 1.02-1.05 ->
# 0.99-1.01, eager_mlp_step_vs_torch 1.05-1.13 -> 1.04-1.06 (its worst after other
# figures' work had left the process a heap of 4 KiB pages); cnn_step_vs_torch
# 1.01-1.08 -> 0.94-0.98 (2x). The cost: a buffer's last huge page is resident whole
# once touched (at most 2 MiB more per buffer). PyTorch's CPU allocator has the same
# switch, off by default (THP_MEM_ALLOC_ENABLE=1). (2 MiB is x86-64's huge page and
# arm64's with 4 KiB pages; on other page sizes the alignment is merely harmless.)
HUGE_PAGE = 2 << 20


def host_bytes(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 numpy array of `nbytes`. From HUGE_PAGE up, where the
    platform can advise huge pages, it is a mapping of its own (anonymous memory,
    zero-filled by the OS, pages faulted in on first touch), aligned to HUGE_PAGE and
    advised for huge pages; it is unmapped when the last array viewing it goes. Else
    numpy's zeros. Raises MemoryError, as numpy does, when the memory is not there."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(nbytes, np.uint8)
    # private anonymous memory (mmap's default, a shared map of /dev/zero, is shmem,
    # which THP's "madvise" mode leaves in 4 KiB pages); + the slack to align the start
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as err:   # (ENOMEM: say it as np.zeros would, with the size)
        raise MemoryError(f"cannot map {nbytes} bytes of host memory: {err}") from err
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:   # (a kernel built without THP: ordinary pages)
        pass
    whole = np.frombuffer(region, np.uint8)   # (holds `region` open while viewed)
    start = -whole.ctypes.data % HUGE_PAGE
    return whole[start:start + nbytes]


def zeros_bytes(xp: Any, nbytes: int) -> Any:
    """A zero-filled uint8 array of `nbytes` of `xp`'s memory (host_bytes on the CPU)."""
    return host_bytes(nbytes) if xp is np else xp.zeros(nbytes, dtype=np.uint8)


def to_host(value: Any) -> np.ndarray:
    """A numpy copy of `value` (a numpy or CuPy array): what a fetch returns, so that
    later runs never change what the caller holds. CuPy's ``get()`` waits for the
    kernels that write `value` on the current stream, then copies device -> host."""
    if is_device_array(value):
        return value.get()
    return np.array(value, copy=True)


def synchronize(xp: Any) -> None:
    """Wait until the device has finished everything queued (no-op on the CPU).
    Kernel launches return at once; a timer read without this times the queueing."""
    if xp is not np:
        xp.cuda.Device().synchronize()


# Host -> device copies of at least this many bytes are staged in pinned memory.
# Pageable host memory cannot be read by the GPU's copy engine: the driver first
# copies it into its own pinned bounce buffer, synchronously. Below ~1 MB the fixed
# cost of a copy call dominates either way, and the plain copy is simpler.
PINNED_MIN_BYTES = 1 << 20


class Uploader:
    """Copy host arrays to the device, through reusable pinned staging buffers.

    One per Program: feeds arrive as numpy arrays every run, in the same shapes, so
    each (shape, dtype) keeps one pinned host buffer. `__call__` copies the feed into
    it (a host memcpy) and queues the device copy on the current stream
    (cudaMemcpyAsync), which can overlap kernels already queued. An event recorded
    after the copy guards the buffer: the next upload into it waits for the copy
    out of it to finish. With numpy there is nothing to copy: the array is returned.
    """

    def __init__(self, xp: Any, min_pinned_bytes: int = PINNED_MIN_BYTES) -> None:
        self.xp = xp
        self.min_pinned_bytes = min_pinned_bytes
        self.staging: dict[tuple, list] = {}   # (shape, dtype) -> [pinned array, event]
        self.lock = threading.Lock()

    def __call__(self, array: np.ndarray) -> Any:
        xp = self.xp
        if xp is np or is_device_array(array):
            return array
        array = np.ascontiguousarray(array)
        if array.nbytes < self.min_pinned_bytes:
            return xp.asarray(array)
        with self.lock:
            key = (array.shape, array.dtype.str)
            entry = self.staging.get(key)
            if entry is None:
                import cupyx
                entry = self.staging[key] = [cupyx.empty_pinned(array.shape, array.dtype),
                                             None]
            pinned, pending = entry
            if pending is not None:
                pending.synchronize()  # the last copy out of this buffer has finished
            pinned[...] = array
            stream = xp.cuda.get_current_stream()
            device = xp.empty(array.shape, dtype=array.dtype)
            device.set(pinned, stream=stream)
            entry[1] = xp.cuda.Event(disable_timing=True)
            entry[1].record(stream)
            return device


def to_device(xp: Any, array: Any) -> Any:
    """`array` on the device of `xp` (a plain copy; `Uploader` for repeated feeds)."""
    if xp is np:
        return np.asarray(array)
    return array if is_device_array(array) else xp.asarray(array)


def draw_random(xp: Any, rng: np.random.Generator, kind: str, shape: Sequence[int],
                dtype: Any, a: float = 0.0, b: float = 1.0) -> Any:
    """Random values of `kind` ("normal": mean a, std b; "truncated": the same, but
    draws more than 2 std from the mean are drawn again, TF1's truncated_normal;
    "uniform": [a, b); "random": [0, 1)) from the numpy Generator `rng`, as an
    array of `xp`.

    The draw is made on the host even for the GPU, then copied over. cuRAND would
    be faster, but it draws a different sequence from the same seed; drawing with
    the one numpy Generator keeps a seeded program's numbers identical on both
    devices, so a model initialized (or a dropout mask drawn) on the GPU replays on
    the CPU, and the CPU-vs-GPU differential tests compare equal values. The cost
    is the copy: 4 MB for a 1024x1024 float32 init, a fraction of a millisecond.
    """
    if kind == "normal":
        draw = rng.normal(a, b, size=tuple(shape))
    elif kind == "truncated":
        draw = rng.normal(a, b, size=tuple(shape))
        outside = np.abs(draw - a) > 2 * b
        while outside.any():      # ~4.6% of draws, so a few rounds at most
            draw[outside] = rng.normal(a, b, size=int(outside.sum()))
            outside = np.abs(draw - a) > 2 * b
    elif kind == "uniform":
        draw = rng.uniform(a, b, size=tuple(shape))
    elif kind == "random":
        draw = rng.random(tuple(shape))
    else:
        raise ValueError(f"unknown random kind {kind!r}; use normal, uniform or random")
    return to_device(xp, draw.astype(dtype, copy=False))


# Device copies of constants, by the identity of the object that owns the host
# array (a ConstValue: one per constant node, alive as long as its graph). The owner
# is kept in the entry, so its id cannot be reused while the entry exists.
_device_copies: dict[int, tuple[Any, Any]] = {}
_device_copies_lock = threading.Lock()
MAX_DEVICE_COPIES = 4096


def device_copy(xp: Any, owner: Any, array: np.ndarray) -> Any:
    """`array` (owned by `owner`, which never changes it) on the device, copied once.

    A constant node's value is a host array; copying it on every run would put a
    host -> device copy (and a synchronization) into every step that reads one.
    With numpy the array itself is returned.
    """
    if xp is np:
        return array
    hit = _device_copies.get(id(owner))
    if hit is not None and hit[0] is owner:
        return hit[1]
    copy = xp.asarray(array)
    with _device_copies_lock:
        if len(_device_copies) >= MAX_DEVICE_COPIES:
            _device_copies.clear()
        _device_copies[id(owner)] = (owner, copy)
    return copy


# ----------------------------------------------------------------------------------
# Timing steps for the timeline
# ----------------------------------------------------------------------------------

class HostClock:
    """Seconds since `start()` from the host's perf_counter: right on the CPU, where
    a step's work is done when its call returns."""

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter() - self.t0

    def seconds(self, mark: float) -> float:
        return mark

    def resolve(self, events: list[dict]) -> None:
        """Turn the marks in each event's "start" and "end" into seconds (in place)."""


class CudaClock:
    """Marks are CUDA events recorded on the current stream.

    A kernel launch returns before the kernel runs, so a host clock read around a
    step times the launch, not the work. An event is timestamped by the GPU when the
    stream reaches it: events recorded before and after a step's kernels, on the
    step's stream, bracket when they really ran, and steps on two streams show their
    real overlap. Reading them (`resolve`) waits for the events, so it is done once,
    after the run, not between steps.
    """

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def start(self) -> None:
        self.t0 = self.cupy.cuda.Event()
        self.t0.record()

    def mark(self) -> Any:
        event = self.cupy.cuda.Event()
        event.record()  # on the current stream: inside CudaStreams, the step's stream
        return event

    def seconds(self, mark: Any) -> float:
        mark.synchronize()
        return self.cupy.cuda.get_elapsed_time(self.t0, mark) / 1e3  # ms -> s

    def resolve(self, events: list[dict]) -> None:
        for event in events:
            for key in ("start", "end"):
                if not isinstance(event[key], float):
                    event[key] = self.seconds(event[key])


def step_clock(xp: Any) -> HostClock | CudaClock:
    """The clock a timeline of a program on `xp` is timed with."""
    return HostClock() if xp is np else CudaClock(xp)


# ----------------------------------------------------------------------------------
# Devices: what the executor asks of the hardware a program runs on
# ----------------------------------------------------------------------------------

class CpuDevice:
    """numpy on the host: feeds and variables are used as they are, several streams
    are threads (CpuStreams), and steps are timed by the host clock."""

    name = "cpu"
    xp: Any = np
    # Dropping a value once its last reader is issued is safe: on the CPU, issued
    # is done.
    frees_across_streams = True

    def upload(self, array: np.ndarray) -> Any:
        """A checked feed as the kernels take it (on the CPU: itself)."""
        return array

    def resident(self, value: Any) -> Any:
        """A variable's value where kernels can use it (on the CPU: itself)."""
        return value

    def stream_runner(self, schedule: Schedule, node_names: Sequence[str],
                      timeout: float) -> CpuStreams:
        return CpuStreams(schedule, node_names, timeout=timeout)

    def clock(self) -> HostClock:
        return HostClock()


class CudaDevice:
    """CuPy on an NVIDIA GPU: feeds are uploaded once per run (through pinned
    buffers), a value the user set on the host is copied over once, streams are
    CUDA streams, and steps are timed by CUDA events."""

    name = "cuda"
    # On a GPU with several streams, dropping a value once its last reader is
    # *issued* would let CuPy's pool hand its memory to another stream while the
    # reader still runs: values then live to the end of the run.
    frees_across_streams = False

    def __init__(self) -> None:
        self.xp = cuda_array_module()
        self.upload = Uploader(self.xp)  # one per program: its pinned buffers

    def resident(self, value: Any) -> Any:
        return value if is_device_array(value) else self.xp.asarray(value)

    def stream_runner(self, schedule: Schedule, node_names: Sequence[str],
                      timeout: float) -> CudaStreams:
        return CudaStreams(schedule, node_names, timeout=timeout)

    def clock(self) -> CudaClock:
        return CudaClock(self.xp)


Device = CpuDevice | CudaDevice


def device(name: str) -> Device:
    """The Device called `name`: "cpu" (numpy) or "cuda" (CuPy; a TinyFlowError
    saying what is missing when no GPU can be used)."""
    if name == "cpu":
        return CpuDevice()
    if name == "cuda":
        return CudaDevice()
    raise ValueError(f"unknown device {name!r}; use 'cpu' or 'cuda'")


# ----------------------------------------------------------------------------------
# CPU threads
# ----------------------------------------------------------------------------------

# What the training scripts and lessons run with unless told otherwise (--threads).
DEFAULT_BLAS_THREADS = 1


def set_blas_threads(threads: int | None = DEFAULT_BLAS_THREADS) -> str:
    """Give numpy's BLAS (and OpenMP) `threads` threads for the rest of the process;
    0 or None leaves the library's default (one per core). Returns what was done,
    for a script to print.

    Why one by default: the small models of the lessons gain little from a second
    BLAS thread, and on a machine whose cores are busy with other work, a BLAS call
    that splits itself over all cores waits for every one of them to be scheduled
    (on a loaded 2-core machine `train mlp` took 172 s instead of 12.7 s). A Session
    with several streams runs one kernel per stream at a time, each with this many
    BLAS threads. Uses threadpoolctl, which can change the limit after numpy has
    loaded its BLAS (OMP_NUM_THREADS and friends only work before)."""
    if not threads:
        return "BLAS threads: library default"
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return "BLAS threads: library default (threadpoolctl is not installed)"
    threadpool_limits(limits=int(threads))   # kept for the process: no restore
    return f"BLAS threads: {int(threads)}"
