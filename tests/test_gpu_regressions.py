"""Regression tests for the value and error bugs that compiling and running TinyFlow's
generated CUDA kernels off a GPU found (issue 21): each failed before its fix.

The values are checked with tests/test_gpu.py's C interpreter, which evaluates the
generated C with numpy's own float32 functions, so a generated kernel must match the
fused op's numpy compute bit for bit here (NaN payloads aside).
"""

from __future__ import annotations

import numpy as np
import pytest

from tinyflow import gpu
from tinyflow.graph import TinyFlowError

from test_gpu import fused_numpy, run_source  # noqa: E402  (tests/ is on sys.path)


def _same_bits(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise: equal values with equal sign bits (so -0.0 != +0.0), NaN == NaN."""
    got, want = np.asarray(got), np.asarray(want)
    both_nan = np.isnan(got) & np.isnan(want)
    return both_nan | ((got == want) & (np.signbit(got) == np.signbit(want)))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_sign_of_minus_zero_is_plus_zero_as_in_numpy(dtype):
    x = np.array([-0.0, 0.0, -2.0, 3.0, np.nan, -np.inf], dtype)
    program = (("sign", ("x0",), ()), ("div", ("x1", "t0"), ()))  # 1 / sign(x)
    source = gpu.kernel_source(program, [x.dtype, x.dtype])
    one = np.ones_like(x)
    got, want = run_source(source, [x, one]), fused_numpy(program, x, one)
    assert want[0] == np.inf  # numpy: sign(-0.0) is +0.0, so 1 / sign(-0.0) is +inf
    assert _same_bits(got, want).all(), f"got {got}, numpy {want}\n{source.listing()}"


ALL_FLOAT16 = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def _numpy_half_exp_off_by_rounding(x: np.ndarray) -> np.ndarray:
    """Where numpy's float16 exp(x) is not float32 exp(x) rounded to float16. Nowhere
    on most CPUs; on those with AVX512-FP16 (Intel Sapphire Rapids and later) numpy 2
    computes half-precision exp natively and misses the rounded value by one unit in
    the last place for a few inputs (4 of the 65,536), where a kernel computing in
    float32, as CUDA's half-precision math does, cannot agree with it."""
    with np.errstate(all="ignore"):
        native = np.exp(x)
        rounded = np.exp(x.astype(np.float32)).astype(np.float16)
    return ~_same_bits(native, rounded)


# The inputs of each op where numpy's own float16 exp may be off (see above).
HALF_EXP_ARGUMENT = {"gelu": None, "sigmoid": lambda x: -np.abs(x)}


@pytest.mark.parametrize("op", ["gelu", "sigmoid"])
def test_float16_composite_ops_round_every_step_as_numpy_does(op):
    """numpy computes gelu and sigmoid on float16 one ufunc at a time, rounding each
    step (and its constants) to float16; the kernel must too: checked on every one of
    the 65,536 float16 bit patterns, except where this CPU's numpy float16 exp itself
    is not the rounded float32 value (_numpy_half_exp_off_by_rounding)."""
    program = ((op, ("x0",), ()),)
    source = gpu.kernel_source(program, [np.float16])
    got, want = run_source(source, [ALL_FLOAT16]), fused_numpy(program, ALL_FLOAT16)
    same = _same_bits(got, want)
    if HALF_EXP_ARGUMENT[op] is not None:
        off = _numpy_half_exp_off_by_rounding(HALF_EXP_ARGUMENT[op](ALL_FLOAT16))
        assert off.sum() <= 16, f"numpy's float16 exp is off at {off.sum()} inputs"
        same |= off
    bad = np.flatnonzero(~same)
    assert same.all(), (f"{bad.size} of 65536 differ, e.g. x={ALL_FLOAT16[bad[:3]]}: "
                        f"kernel {got[bad[:3]]}, numpy {want[bad[:3]]}")


@pytest.mark.parametrize("program, dtypes, message", [
    ((("cast", ("x0",), ()),), ["float32"], "KeyError: 'dtype'"),
    ((("where", ("x0", "x1"), ()),), ["bool", "float32"], "where takes 3 operand"),
    ((("add", ("x0",), ()),), ["float32"], "add takes 2 operand"),
    ((("cast", ("x0",), (("dtype", "nonsense"),)),), ["float32"], "not understood"),
    ((("mul", ("x0", "x0"), ()), ("sum", ("t0", "x0"), ())), ["float32"], "one operand"),
])
def test_malformed_programs_are_a_kernel_generation_error(program, dtypes, message):
    """Never the op rule's internal error (KeyError, TypeError, ops.Mismatch)."""
    with pytest.raises(gpu.KernelGenerationError, match=message) as caught:
        gpu.kernel_source(program, dtypes)
    assert isinstance(caught.value, TinyFlowError)


def test_a_shortened_reduction_name_still_names_its_reduction():
    """CuPy's CUB path rewrites a mean's `_in_ind.size()` only when the kernel's name
    contains "mean": a long program's checksum name must keep it (the NVRTC tier,
    tests/test_gpu_compile.py, compiles these on the CUB path)."""
    body = tuple(("tanh", (f"t{k - 1}" if k else "x0",), ()) for k in range(11))
    for op in gpu.REDUCTIONS:
        program = body + ((op, ("t10",), (("axis", None), ("keepdims", False))),)
        name = gpu.kernel_source(program, [np.float32]).name
        assert name.startswith("tinyflow_fused12_") and name.endswith("_" + op)
