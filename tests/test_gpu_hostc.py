"""The generated kernel bodies compiled with the system C compiler and run against
numpy: a differential test of what gpu.py writes, under C's semantics (the
semantics CUDA C++ gives the same statements on a GPU, less what the device adds:
see below), over about 2,000 random programs and the awkward values (+-0, +-inf,
NaN, subnormals, float16 overflow, integer extremes).

Each `ElementwiseSource.operation` becomes the body of a C loop, exactly as CuPy
pastes it into its kernel: inputs ``x0, x1, ...`` are the elements, ``y`` the
output. ``float16`` is GCC's ``_Float16`` (IEEE binary16, round to nearest even,
as CuPy's ``float16``). Compiled with ``-ffp-contract=off`` (no FMA: gpu.py compiles
with ``--fmad=false``) and ``-fwrapv`` (integers wrap, as on the GPU and in numpy).

What differs on a real GPU and is not tested here: CuPy's ``-ftz=true`` flushes
float32 subnormals to zero, and CUDA's expf/tanhf/... are not glibc's (both are
within a few ulps). So programs of exactly rounded ops (+ - * / sqrt, comparisons,
casts, max/min, ...) must match numpy bit for bit, signed zeros included; a program
ending in a transcendental op (exp, log, tanh, pow, sigmoid, gelu) matches within a
few ulps, with NaN and infinities exactly where numpy has them. Float-to-int casts
of NaN, infinities and out-of-range values are undefined in C and differ across
numpy, C and CUDA: they are not generated. Skips when there is no C compiler.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

import gpu_tier
from tinyflow import gpu

from test_gpu import fused_numpy  # noqa: E402  (tests/ is on sys.path)

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler (cc) on this machine")

FLOATS = ["float16", "float32", "float64"]
INTS = ["int8", "uint8", "int16", "int32", "int64", "uint32"]
EXACT_UNARY = ["neg", "abs", "sign", "relu", "sqrt"]
EXACT_BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]
TRANSCENDENTAL = ["exp", "log", "tanh", "sigmoid", "gelu"]
ZERO_SIGN_SENSITIVE = {"div", "pow"}   # 1 / -0.0 is -inf
# numpy's maximum(0.0, -0.0) (and so relu(-0.0)) is -0.0 for float32 and float64
# but +0.0 for float16 (its SIMD and scalar loops break the tie differently): the
# sign of a zero out of these has no single right answer.
TIES = {"maximum", "minimum", "relu"}
N_VALUES = 64

HEADER = """#include <math.h>
#include <stdbool.h>
typedef _Float16 float16;
"""


def special_values(dtype: str, rng: np.random.Generator) -> np.ndarray:
    """N_VALUES values of `dtype`: the awkward ones first, then random ones."""
    d = np.dtype(dtype)
    if d.kind == "f":
        tiny = np.finfo(d).smallest_subnormal
        big = np.finfo(d).max
        awkward = [0.0, -0.0, np.inf, -np.inf, np.nan, tiny, -tiny, 3 * tiny, big, -big,
                   1.0, -1.0, 0.5, 2.0, 300.0, -300.0, 60000.0, 1e-3]
        rest = rng.standard_normal(N_VALUES - len(awkward)) * rng.choice([1, 10, 1e-3], 1)
        return np.concatenate([awkward, rest]).astype(d)
    info = np.iinfo(d)
    awkward = [0, 1, info.max, info.min, info.max - 1, 2, 3] + ([-1, -2] if info.min else [])
    rest = rng.integers(max(info.min, -100), min(info.max, 100), N_VALUES - len(awkward))
    return np.concatenate([np.array(awkward, dtype=np.int64), rest]).astype(d)


def random_program(rng: np.random.Generator, dtypes: list[str], transcendental: bool):
    """Exactly rounded ops chained from x0 (each reads the last result and maybe
    another register); with `transcendental`, one transcendental op ends it. After a
    max/min/relu no div or pow follows (numpy's sign of a max(0.0, -0.0) tie varies by
    dtype, so 1 / that zero has no single right answer; see TIES)."""
    n = len(dtypes)
    floating = np.dtype(dtypes[0]).kind == "f"
    program, banned = [], set()
    for k in range(int(rng.integers(1, 6))):
        last = f"t{k - 1}" if k else "x0"
        other = str(rng.choice([f"x{i}" for i in range(n)] + [f"t{j}" for j in range(k)]))
        kind = rng.choice(["unary", "binary", "compare", "cast"], p=[0.35, 0.45, 0.1, 0.1])
        if kind == "unary":
            choices = EXACT_UNARY if floating else ["neg", "abs", "sign", "relu"]
            op = str(rng.choice(choices))
            program.append((op, (last,), ()))
            if op in TIES:
                banned |= ZERO_SIGN_SENSITIVE
        elif kind == "binary":
            choices = [op for op in EXACT_BINARY if op not in banned
                       and (floating or op != "div")]
            op = str(rng.choice(choices))
            pair = (last, other) if rng.random() < 0.5 else (other, last)
            program.append((op, pair, ()))
            if op in TIES:
                banned |= ZERO_SIGN_SENSITIVE
        elif kind == "compare":
            op = str(rng.choice(["less", "greater_equal", "equal", "not_equal"]))
            program.append((op, (last, other), ()))
            program.append(("where", (f"t{k}", last, other), ()))
            break
        else:
            targets = FLOATS if floating else FLOATS + INTS
            program.append(("cast", (last,), (("dtype", str(rng.choice(targets))),)))
            if not floating:
                floating = np.dtype(program[-1][2][0][1]).kind == "f"
    if transcendental:
        last = f"t{len(program) - 1}"
        program.append((str(rng.choice(TRANSCENDENTAL)), (last,), ()))
    return tuple(program)


def c_function(index: int, source: gpu.ElementwiseSource, dtypes: list[str]) -> str:
    """The kernel body in a C loop over contiguous inputs, as CuPy runs it per element."""
    params = ", ".join(f"const {gpu.c_type(d)} *x{i}_" for i, d in enumerate(dtypes))
    out = gpu.c_type(source.out_params.split()[0])
    loads = "".join(f"    const {gpu.c_type(d)} x{i} = x{i}_[i];\n"
                    for i, d in enumerate(dtypes))
    return (f"void kernel{index}(long n, {params}, {out} *y_) {{\n"
            f"  for (long i = 0; i < n; i++) {{\n{loads}    {out} y;\n"
            f"    {source.operation}\n    y_[i] = y;\n  }}\n}}\n")


def build_library(functions: list[str], tmp_path) -> ctypes.CDLL:
    path = tmp_path / "kernels.c"
    path.write_text(HEADER + "\n".join(functions))
    library = tmp_path / "kernels.so"
    result = subprocess.run([CC, "-O1", "-std=c11", "-ffp-contract=off", "-fwrapv",
                             "-fno-fast-math", "-fexcess-precision=standard", "-shared",
                             "-fPIC", str(path), "-o", str(library), "-lm"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        if "_Float16" in result.stderr:
            pytest.skip(f"{CC} has no _Float16 (GCC 12+ or Clang 15+ on x86-64)")
        raise AssertionError(f"{CC} could not compile the kernels:\n{result.stderr[:3000]}")
    return ctypes.CDLL(str(library))


def run_c(library: ctypes.CDLL, index: int, arrays: list[np.ndarray],
          out_dtype: np.dtype) -> np.ndarray:
    out = np.empty(arrays[0].shape, out_dtype)
    pointers = [a.ctypes.data_as(ctypes.c_void_p) for a in arrays]
    getattr(library, f"kernel{index}")(ctypes.c_long(out.size), *pointers,
                                       out.ctypes.data_as(ctypes.c_void_p))
    return out


def mismatches(got: np.ndarray, want: np.ndarray, exact: bool, zero_sign: bool
               ) -> np.ndarray:
    """Elements that differ: bit for bit (NaN == NaN; -0.0 != 0.0 when `zero_sign`),
    or for a transcendental ending within a few ulps, NaN and inf exactly."""
    if want.dtype.kind != "f":
        return got != want
    nan = np.isnan(got) | np.isnan(want)
    same_nan = np.isnan(got) & np.isnan(want)
    if exact:
        equal = got == want
        if zero_sign:
            equal &= np.signbit(got) == np.signbit(want)
        return ~(same_nan | (~nan & equal))
    rtol = {"float16": 2e-3, "float32": 4e-6, "float64": 1e-13}[want.dtype.name]
    atol = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-13}[want.dtype.name]
    finite = np.isfinite(got) & np.isfinite(want)
    close = np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                       atol=atol)
    return ~(same_nan | np.where(finite, close, got == want))


DTYPE_SETS = [["float32"] * 3, ["float64", "float32"], ["float16"] * 2,
              ["float16", "float32"], ["int32", "int32"], ["int8", "int16"],
              ["uint8", "int64"], ["float32", "int32"]]


@pytest.mark.parametrize("part", range(4))
def test_kernel_bodies_in_c_compute_what_numpy_computes(part, tmp_path):
    """500 random programs per part (2,000 in all), each on the awkward values."""
    rng = np.random.default_rng(1000 + part)
    cases, functions = [], []
    while len(cases) < 500:
        dtypes = DTYPE_SETS[int(rng.integers(len(DTYPE_SETS)))]
        transcendental = np.dtype(dtypes[0]).kind == "f" and rng.random() < 0.3
        program = random_program(rng, dtypes, transcendental)
        try:
            source = gpu.kernel_source(program, dtypes)
        except gpu.KernelGenerationError:
            continue  # refused programs run op by op (tests/test_gpu.py)
        columns = [special_values(d, rng) for d in dtypes]
        # every pairing of the awkward values: input i cycles at its own rate
        arrays = [np.ascontiguousarray(np.resize(c, N_VALUES * 4)[
            (np.arange(N_VALUES * 4) * (1 + 3 * i)) % (N_VALUES * 4)])
            for i, c in enumerate(columns)]
        functions.append(c_function(len(cases), source, dtypes))
        cases.append((program, dtypes, source, arrays, transcendental))
    library = build_library(functions, tmp_path)
    bad = []
    for index, (program, _, source, arrays, transcendental) in enumerate(cases):
        want = np.asarray(fused_numpy(program, *arrays))
        if any(a.dtype.kind == "f" and want.dtype.kind in "iu" for a in arrays):
            continue  # float -> int casts of NaN/inf are undefined (never generated)
        got = run_c(library, index, arrays, want.dtype)
        zero_sign = not any(op in TIES for op, _, _ in program)
        wrong = mismatches(got, want, not transcendental, zero_sign)
        gpu_tier.add("host-C programs")
        gpu_tier.add("host-C values", got.size)
        if wrong.any():
            gpu_tier.add("host-C mismatches", int(wrong.sum()))
            i = int(np.flatnonzero(wrong)[0])
            bad.append(f"{source.listing()}\n  inputs {[a[i] for a in arrays]}: "
                       f"C {got[i]!r}, numpy {want[i]!r} ({int(wrong.sum())} values)")
    assert not bad, f"{len(bad)} programs differ; first ones:\n\n" + "\n\n".join(bad[:4])
