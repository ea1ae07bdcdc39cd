"""Compile TinyFlow's generated CUDA kernels exactly as CuPy would, on a machine
with no GPU: the one check of the GPU path that needs no device.

`gpu.py` writes each fused program as the arguments of a ``cupy.ElementwiseKernel``
or ``cupy.ReductionKernel``. On a GPU, CuPy turns those into a full CUDA source at
the first launch (its loop, its ``CArray`` and ``CIndexer`` types, the parameter
list for the arguments' dtypes and ranks, the reduction's block loop, or CUB's
block reduction when ``CUPY_ACCELERATORS=cub``) and compiles it with NVRTC. Both
steps run without a device:

1. **CuPy's own code generation.** CuPy 13 exposes its source builders
   (``_get_elementwise_kernel_code``, ``_ReductionKernel_get_cached_function_code``
   and the CUB builder ``_SimpleCubReductionKernel_get_cached_function``); they are
   given the argument descriptions a launch would make. The last step,
   ``compile_with_cache``, adds CuPy's headers and options and hands them to
   ``cupy.cuda.compiler._compile_module_with_cache``, which is captured here
   instead of run (it would ask the device for its architecture). What comes out is
   the exact text and option list CuPy would give NVRTC.
2. **NVRTC**, from the ``nvidia-cuda-nvrtc-cu12`` wheel, called through ctypes with
   the options CuPy's compiler adds itself (``-ftz=true``,
   ``--device-as-default-execution-space``, the CUDA headers) and an explicit
   ``-arch=sm_80`` or ``sm_90`` (A100, H100), since no device can be asked.

What this proves: every kernel TinyFlow generates is valid CUDA for those GPUs as
CuPy assembles it, and its machine code (cubin) is produced; `Compiled` carries the
PTX and cubin sizes and ptxas's register count. What it cannot prove: that a launch
works (grid sizes, memory), the values on a real device, or any timing.

Compiles are cached by a hash of (source, options, arch) within the process, and
elementwise kernels (which share CuPy's header and nothing else) are compiled
several to a translation unit, which makes NVRTC's header parsing cost once per
batch instead of once per kernel; a batch that fails is compiled kernel by kernel,
so an error names its kernel.

Needs ``pip install -e ".[gpu-check]"`` (CuPy imports without a driver); `missing()`
says what is absent.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from tinyflow import gpu
from tinyflow.graph import TinyFlowError

ARCHS = ("sm_80", "sm_90")   # A100 and H100: what the compile tier targets
BATCH = 40                   # elementwise kernels per NVRTC translation unit

# Counters for the test tier's summary: compiles run (one kernel for one arch),
# compiles that failed, and compiles answered from the cache.
stats = {"compiled": 0, "failed": 0, "cached": 0}


class GpuCompileError(TinyFlowError):
    """CuPy or NVRTC is not installed, or a kernel did not compile (`log` says why)."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message + (f"\n{log}" if log else ""))
        self.log = log


@dataclass(frozen=True)
class CudaSource:
    """One CUDA translation unit as CuPy would hand it to NVRTC.

    name     the kernel's name (``extern "C"``), as a profiler would list it
    code     the full source, CuPy's headers included
    options  CuPy's options for it (its include paths, the C++ standard, ours)
    path     "elementwise", "reduction" (CuPy's block reduction) or "cub"
    """

    name: str
    code: str
    options: tuple[str, ...]
    path: str


@dataclass(frozen=True)
class Compiled:
    """What NVRTC made of one kernel for one architecture.

    ptx_bytes and cubin_bytes are those of the translation unit the kernel was
    compiled in, which held `batch` kernels (1 from `compile_one`)."""

    name: str
    arch: str
    ptx_bytes: int
    cubin_bytes: int
    registers: int | None    # ptxas's "Used N registers" (None when not reported)
    batch: int = 1
    log: str = field(default="", repr=False)


# ----------------------------------------------------------------------------------
# What is installed
# ----------------------------------------------------------------------------------

def missing() -> str:
    """Why kernels cannot be compiled here ("" when they can)."""
    try:
        _nvrtc()
        import cupy  # noqa: F401
        from cupy._core import _kernel  # noqa: F401
    except (ImportError, OSError, GpuCompileError) as err:
        return (f"{err}: pip install -e \".[gpu-check]\" (CuPy and NVRTC wheels; "
                "no GPU or driver needed)")
    return ""


@lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    """NVRTC from the nvidia-cuda-nvrtc-cu12 wheel, loaded RTLD_GLOBAL so that
    CuPy's own ``dlopen("libnvrtc.so.12")`` finds this copy (CuPy asks it for its
    version to choose include paths)."""
    try:
        import nvidia.cuda_nvrtc as wheel
    except ImportError:
        raise GpuCompileError("no NVRTC: the nvidia-cuda-nvrtc-cu12 wheel is not "
                              "installed") from None
    found = [path for root in wheel.__path__
             for path in glob.glob(os.path.join(root, "lib", "libnvrtc.so.*"))
             if ".alt." not in path]
    if not found:
        raise GpuCompileError(f"no libnvrtc.so in {list(wheel.__path__)}")
    lib = ctypes.CDLL(sorted(found)[0], mode=ctypes.RTLD_GLOBAL)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


# ----------------------------------------------------------------------------------
# CuPy's code generation, captured before it compiles
# ----------------------------------------------------------------------------------

class _Captured(Exception):
    """Raised by the stand-in for CuPy's compile step, carrying what it was given."""


_capture_lock = threading.Lock()


def _capture(build: Any, *args: Any) -> tuple[str, tuple[str, ...]]:
    """Run CuPy's `build(*args)` up to the NVRTC call; return (source, options)."""
    _nvrtc()  # loaded first: CuPy asks NVRTC its version on the way
    from cupy.cuda import compiler

    def stand_in(source: str, options: tuple = (), *rest: Any, **kwargs: Any) -> None:
        raise _Captured(source, tuple(options))

    with _capture_lock:
        real = compiler._compile_module_with_cache
        compiler._compile_module_with_cache = stand_in
        try:
            build(*args)
        except _Captured as captured:
            return captured.args
        finally:
            compiler._compile_module_with_cache = real
    raise GpuCompileError(f"CuPy's {build} returned without compiling")


def _compile_with_cache(code: str, options: tuple = ()) -> None:
    from cupy._core import core
    core.compile_with_cache(code, options)


def _ndarray(dtype: Any, ndim: int, contiguous: bool) -> Any:
    """CuPy's description of an ndarray argument (kind 1) with 32-bit indexing."""
    import cupy
    from cupy._core import _kernel
    return _kernel._ArgInfo(1, cupy.ndarray, np.dtype(dtype).type, ndim, contiguous, True)


def _indexer(ndim: int) -> Any:
    from cupy._core import _carray, _kernel
    return _kernel._ArgInfo(2, _carray.Indexer, None, ndim, True, True)


def _int32_scalar() -> Any:
    from cupy._core import _kernel, _scalar
    return _kernel._ArgInfo(3, _scalar.CScalar, np.int32, 0, True, True)


def _pointer() -> Any:
    from cupy._core import _kernel
    from cupy.cuda import memory
    return _kernel._ArgInfo(4, memory.MemoryPointer, None, 0, True, True)


def build(source: gpu.ElementwiseSource | gpu.ReductionSource, cupy: Any) -> Any:
    """The CuPy kernel object gpu.py builds (constructing one needs no device)."""
    return gpu.build_kernel(source, cupy)


def elementwise_cuda(source: gpu.ElementwiseSource, dtypes: Sequence[Any],
                     ndim: int = 2) -> CudaSource:
    """The CUDA source of `source`'s ElementwiseKernel for inputs of `dtypes`, as
    for a launch on `ndim`-dimensional arrays whose inputs broadcast (strided) into
    a contiguous output: the most general form CuPy generates."""
    import cupy
    from cupy._core import _kernel
    kernel = build(source, cupy)
    out_dtype = kernel.out_params[0].dtype
    _, _, type_map = _kernel._decide_params_type(kernel.in_params, kernel.out_params,
                                                 tuple(np.dtype(d).type for d in dtypes), ())
    args = tuple(_ndarray(d, ndim, False) for d in dtypes) + (
        _ndarray(out_dtype, ndim, True), _indexer(ndim))
    # CuPy keeps the options given to ElementwiseKernel in `kwargs` and passes them
    # on to its code generation and compile exactly so.
    code = _kernel._get_elementwise_kernel_code(args, type_map, kernel.params,
                                                kernel.operation, kernel.name,
                                                kernel.preamble, **kernel.kwargs)
    options = tuple(kernel.kwargs.get("options", ()))
    text, options = _capture(_compile_with_cache, code, options)
    return CudaSource(source.name, text, options, "elementwise")


def reduction_cuda(source: gpu.ReductionSource, dtypes: Sequence[Any],
                   ndim: int = 2) -> CudaSource:
    """The CUDA source of `source`'s ReductionKernel on CuPy's own block-reduction
    path, as for an `ndim`-dimensional input reduced to `ndim - 1` dimensions."""
    import cupy
    from cupy._core import _kernel, _reduction
    kernel = build(source, cupy)
    out_dtype = kernel.out_params[0].dtype
    args = tuple(_ndarray(d, ndim, False) for d in dtypes) + (
        _ndarray(out_dtype, ndim - 1, True), _indexer(ndim), _indexer(ndim - 1),
        _int32_scalar())
    type_map = _kernel._TypeMap((("IndexT", np.int32),))   # 32-bit indexing
    code = _reduction._ReductionKernel_get_cached_function_code(
        len(dtypes), 1, kernel._params, args, type_map, kernel.name, 512,
        kernel.reduce_type, kernel.identity, kernel.map_expr, kernel.reduce_expr,
        kernel.post_map_expr, kernel.preamble, kernel.options)
    text, options = _capture(_compile_with_cache, code, tuple(kernel.options))
    return CudaSource(source.name, text, options, "reduction")


def cub_reduction_cuda(source: gpu.ReductionSource, dtype: Any,
                       full_reduction: bool) -> list[CudaSource]:
    """The CUDA sources of `source` on CuPy's CUB path (``CUPY_ACCELERATORS=cub``,
    one input): one kernel reducing contiguous segments, or for a reduction over
    every axis two passes (blocks, then their partial results).

    CuPy decides this in Cython that cannot be called, so its preparation of the
    expressions is repeated here, step for step (cupy/_core/_cub_reduction.pyx,
    `_try_to_call_cub_reduction`, `_launch_cub`, `_cub_two_pass_launch`); the
    source itself is CuPy's builder's. Among the steps: a mean's ``_in_ind.size()``
    is rewritten only when the kernel's name contains "mean".
    """
    import cupy
    from cupy._core import _cub_reduction, _kernel
    kernel = build(source, cupy)
    if len(kernel.in_params) != 1:
        raise GpuCompileError(f"{source.name}: CuPy's CUB path takes one input")
    name, post_map = kernel.name, kernel.post_map_expr
    if not full_reduction and "mean" in name:
        post_map = post_map.replace("_in_ind.size()", "_segment_size")
        post_map = post_map.replace("_out_ind.size()", "1.0")
    params = (_kernel._get_param_info("T in0", True) + _kernel._get_param_info("T out0", False)
              + _kernel._get_param_info("int32 _segment_size", True)
              + _kernel._get_param_info("int32 _array_size", True))
    in_name, out_name = kernel.in_params[0].name, kernel.out_params[0].name
    map_expr = kernel.map_expr.replace(in_name, "in0")
    post_map = post_map.replace(out_name, "out0")
    out_dtype = kernel.out_params[0].dtype
    type_map = _kernel._TypeMap((("IndexT", np.int32), ("sizeT", "int32"),
                                 ("type_in0_raw", np.dtype(dtype).type),
                                 ("type_out0_raw", out_dtype)))
    builder = _cub_reduction._SimpleCubReductionKernel_get_cached_function.__wrapped__
    block, items = 256, 4
    scalars = (_int32_scalar(), _int32_scalar())

    def one(name: str, pre_map: str, post: str, args: tuple, options: tuple) -> CudaSource:
        text, opts = _capture(builder, pre_map, kernel.reduce_expr, post,
                              kernel.reduce_type, params, args, type_map, name, block,
                              kernel.identity, kernel.preamble, options,
                              (items, 1024, full_reduction))
        return CudaSource(name, text, opts, "cub")

    if not full_reduction:
        args = (_ndarray(dtype, 2, True), _ndarray(out_dtype, 1, True)) + scalars
        return [one(name, map_expr, post_map, args, ())]
    first = name + "_pass1"
    post1 = post_map
    if "mean" in first:
        post1 = post1.replace("_in_ind.size()", "1.0").replace("_out_ind.size()", "1.0")
    second = first[:-1] + "2"
    post2 = post_map
    if "mean" in second:
        post2 = post2.replace("_in_ind.size()", "_array_size").replace("_out_ind.size()",
                                                                        "1.0")
    return [one(first, map_expr, post1, (_ndarray(dtype, 1, True), _pointer()) + scalars,
                ("-DFIRST_PASS=1",)),
            one(second, "in0", post2, (_pointer(), _ndarray(out_dtype, 0, True)) + scalars,
                ("-DSECOND_PASS=1",))]


def cuda_sources(program: Sequence, dtypes: Sequence[Any], cub: bool = True
                 ) -> list[CudaSource]:
    """Every CUDA source CuPy would compile for `program` on inputs of `dtypes`:
    the elementwise kernel, or a reduction on CuPy's path and (one input, `cub`)
    on the CUB path, both one-pass and two-pass. KernelGenerationError when gpu.py
    refuses the program."""
    source = gpu.kernel_source(program, dtypes)
    if isinstance(source, gpu.ElementwiseSource):
        return [elementwise_cuda(source, dtypes)]
    found = [reduction_cuda(source, dtypes)]
    if cub and len(dtypes) == 1:
        found += cub_reduction_cuda(source, dtypes[0], full_reduction=False)
        found += cub_reduction_cuda(source, dtypes[0], full_reduction=True)
    return found


# ----------------------------------------------------------------------------------
# NVRTC
# ----------------------------------------------------------------------------------

def nvrtc_options(source: CudaSource, arch: str) -> tuple[str, ...]:
    """The options NVRTC gets: CuPy's for the source, then what CuPy's compiler adds
    (cupy/cuda/compiler.py: flush-to-zero, the CUDA runtime headers, CUDA 12's
    default execution space) and the architecture; ``-v`` for ptxas's register
    count."""
    from cupy.cuda import compiler
    return (source.options + ("-ftz=true",) + tuple(compiler._get_extra_include_dir_opts())
            + ("--device-as-default-execution-space", f"-arch={arch}", "-Xptxas=-v"))


def _check(status: int, what: str) -> None:
    if status != 0:
        message = _nvrtc().nvrtcGetErrorString(status).decode()
        raise GpuCompileError(f"NVRTC {what}: {message}")


def _read(lib: ctypes.CDLL, prog: ctypes.c_void_p, what: str) -> int:
    size = ctypes.c_size_t()
    _check(getattr(lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)), what)
    return size.value


def _run_nvrtc(code: str, options: Sequence[str], label: str) -> tuple[int, int, str]:
    """Compile `code`; (ptx bytes, cubin bytes, log), or GpuCompileError with the log."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), f"{label}.cu".encode(),
                                  0, None, None), "create")
    try:
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), argv)
        log = ctypes.create_string_buffer(_read(lib, prog, "ProgramLog"))
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if status != 0:
            raise GpuCompileError(f"NVRTC could not compile {label}", text)
        return _read(lib, prog, "PTX"), _read(lib, prog, "CUBIN"), text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_REGISTERS = re.compile(r"Compiling entry function '(?P<name>\w+)'.*?Used (?P<n>\d+) registers",
                        re.S)
_cache: dict[str, Compiled] = {}


def _key(source: CudaSource, arch: str) -> str:
    text = "\0".join((source.code, *source.options, arch))
    return hashlib.sha256(text.encode()).hexdigest()


def _registers(log: str) -> dict[str, int]:
    return {m["name"]: int(m["n"]) for m in _REGISTERS.finditer(log)}


def compile_one(source: CudaSource, arch: str = "sm_90") -> Compiled:
    """`source` compiled by NVRTC for `arch` (cached); GpuCompileError with NVRTC's
    log when it does not compile."""
    key = _key(source, arch)
    if key in _cache:
        stats["cached"] += 1
        return _cache[key]
    try:
        ptx, cubin, log = _run_nvrtc(source.code, nvrtc_options(source, arch), source.name)
    except GpuCompileError:
        stats["failed"] += 1
        raise
    stats["compiled"] += 1
    result = Compiled(source.name, arch, ptx, cubin, _registers(log).get(source.name),
                      log=log)
    _cache[key] = result
    return result


def _header() -> str:
    """CuPy's header, which every elementwise source starts with."""
    return _capture(_compile_with_cache, "")[0]


def _batches(sources: Sequence[CudaSource]) -> list[list[CudaSource]]:
    """Elementwise sources in groups of at most BATCH with distinct kernel names
    (two kernels of one name cannot share a translation unit)."""
    groups: list[list[CudaSource]] = []
    names: list[set[str]] = []
    for source in sources:
        for group, seen in zip(groups, names):
            if len(group) < BATCH and source.name not in seen:
                group.append(source)
                seen.add(source.name)
                break
        else:
            groups.append([source])
            names.append({source.name})
    return groups


def _compile_batch(group: Sequence[CudaSource], arch: str, header: str
                   ) -> list[Compiled] | None:
    """Compile elementwise sources sharing CuPy's header as one translation unit;
    None when NVRTC refuses it (the caller then compiles them one by one)."""
    code = header + "".join(s.code[len(header):] for s in group)
    try:
        ptx, cubin, log = _run_nvrtc(code, nvrtc_options(group[0], arch),
                                     f"batch of {len(group)}")
    except GpuCompileError:
        return None
    registers = _registers(log)
    done = []
    for source in group:
        result = Compiled(source.name, arch, ptx, cubin, registers.get(source.name),
                          len(group))
        _cache[_key(source, arch)] = result
        stats["compiled"] += 1
        done.append(result)
    return done


def compile_all(sources: Sequence[CudaSource], arch: str
                ) -> tuple[list[Compiled], list[tuple[CudaSource, GpuCompileError]]]:
    """Compile every source for `arch`: (what compiled, (source, error) for each
    failure). Elementwise sources with CuPy's header and the same options go in
    batches; a failed batch is retried source by source to name the culprits."""
    header = _header()
    unique = {_key(s, arch): s for s in sources}
    batchable = [s for key, s in unique.items() if key not in _cache
                 and s.path == "elementwise" and s.code.startswith(header)]
    alone = [s for s in unique.values() if s not in batchable]
    done: list[Compiled] = []
    for options in sorted({s.options for s in batchable}):
        for group in _batches([s for s in batchable if s.options == options]):
            compiled = _compile_batch(group, arch, header) if len(group) > 1 else None
            if compiled is None:
                alone.extend(group)  # compiled one by one: each failure with its log
            else:
                done.extend(compiled)
    failed: list[tuple[CudaSource, GpuCompileError]] = []
    for source in alone:
        try:
            done.append(compile_one(source, arch))   # a cached one is counted there
        except GpuCompileError as err:
            failed.append((source, err))
    return done, failed
