"""Fused elementwise programs as generated CUDA kernels (through CuPy).

A ``fused_elementwise`` node (fusion.py) holds a small *program*: instructions
``(op, operands, attrs)`` over registers ``x0, x1, ...`` (the node's inputs) and
``t0, t1, ...`` (the instructions' results). On the CPU each instruction is still
one numpy call. On a GPU one call per instruction is one kernel launch each, and
every launch reads its operands from device memory and writes its result back: a
chain of n ops moves every element about 2n times, and elementwise kernels are
bound by exactly that traffic. This module writes the whole program as ONE kernel:
each thread reads its element of every input once, keeps the temporaries in
registers (C local variables) and writes the output once. It is the loop fusion of
Theano's elemwise, XLA and TVM (and what ``cupy.fuse`` does for Python functions)
in its smallest form: a C template per op, filled in along the program::

    program   t0 = mul(x0, x1); t1 = add(t0, x2); t2 = relu(t1)

    kernel    float t0 = x0 * x1;  /* t0 = mul(x0, x1) */
              float t1 = t0 + x2;  /* t1 = add(t0, x2) */
              y = (t1 > 0.0f || isnan(t1)) ? t1 : 0.0f;  /* t2 = relu(t1) */

``cupy.ElementwiseKernel`` supplies the rest: the loop over elements, numpy
broadcasting of the inputs, and the compilation (NVRTC, cached on disk). A program
that ends in a reduction (``sum``, ``mean`` or ``max`` over axes) becomes a
``cupy.ReductionKernel`` instead: the elementwise part is its map expression (a
``__device__`` function), so the tensor being reduced is never stored at all.

Types follow numpy, so the kernel computes what the CPU path computes: every
register has the dtype its op's own rule gives it (the registry is the one source
of truth), operands are converted to that type as numpy's ufunc loops convert them,
float16 is computed in float and rounded at every store, and inside composite ops
(sigmoid, gelu) at every step, constants included, as numpy's op-by-op float16
computes them; maximum, minimum and relu pass NaN through as numpy's do (C's fmaxf
would drop it), and sign(-0.0) is +0.0 as in numpy.

Precision on the device: kernels are compiled with ``--fmad=false`` (NVRTC would
otherwise contract ``a * b + c`` into one FMA, one rounding where numpy has two).
CuPy adds ``-ftz=true`` to every compile, so float32 subnormals flush to zero on
the GPU; CUDA's transcendental functions are within a few ulps of numpy's.
Where a template would not compute what numpy does (``pow`` of two ints is an
integer power in numpy, ``add`` of two bools a logical or), no kernel is generated:
`KernelGenerationError`, and the node runs op by op.

Two layers:

* source generation, `kernel_source(program, dtypes)`: a pure function from the
  program and its input dtypes to plain strings (`ElementwiseSource`,
  `ReductionSource`). It needs no GPU: tests/test_gpu.py interprets the generated C
  with numpy, tests/test_gpu_hostc.py compiles it with the system C compiler, and
  `gpu_compile.py` has CuPy and NVRTC compile it for sm_80 and sm_90;
* `fused_compute(xp, *arrays, out=None, program=())`: the fused op's compute on
  CuPy: the kernel for this program and these input dtypes, generated and compiled
  once and cached by that signature, launched into the planned `out`.

Nothing here imports cupy at import time: kernels are built with the `xp` the
executor passes (the cupy module itself), or with a lazy ``import cupy``.
"""

from __future__ import annotations

import inspect
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyflow.graph import TinyFlowError
from tinyflow.ops import _GELU_A, _GELU_C, REGISTRY, Mismatch

Program = tuple  # ((op, (operand, ...), ((attr, value), ...)), ...), as fusion.py


class KernelGenerationError(TinyFlowError):
    """The program holds an op or a dtype the generator has no template for."""


# numpy dtype -> the C type a kernel stores it in. float16 is CuPy's own class
# (cupy/float16.cuh), converted to float for arithmetic.
C_TYPES = {
    "bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short",
    "uint16": "unsigned short", "int32": "int", "uint32": "unsigned int",
    "int64": "long long", "uint64": "unsigned long long", "float16": "float16",
    "float32": "float", "float64": "double",
}
REDUCTIONS = ("sum", "mean", "max")


def c_type(dtype: Any) -> str:
    """The C type of numpy `dtype` in a kernel."""
    name = np.dtype(dtype).name
    if name not in C_TYPES:
        raise KernelGenerationError(f"no C type for dtype {name}")
    return C_TYPES[name]


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype arithmetic on `dtype` is done in: float for float16 (as numpy's
    float16 loops do), the dtype itself otherwise."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def literal(value: float, dtype: Any) -> str:
    """`value` as a C literal of `dtype`: ``0.5f`` (float), ``0.5`` (double), ``1``.
    A float literal is the shortest decimal that reads back as the same float32, so
    the kernel's constant is bit for bit numpy's (a Python float cast to float32)."""
    dtype = compute_dtype(dtype)
    if dtype == np.float64:
        return repr(float(value))
    if dtype == np.float32:
        return f"{str(np.float32(value))}f"
    if dtype == np.bool_:
        return "true" if value else "false"
    return str(int(value))


def _convert(name: str, have: np.dtype, want: np.dtype) -> str:
    """Register `name` (stored as `have`) read as `want`: a C cast where they differ."""
    return name if c_type(have) == c_type(want) else f"({c_type(want)}){name}"


# ----------------------------------------------------------------------------------
# One C template per op
# ----------------------------------------------------------------------------------

class _Emitter:
    """What a template needs to write one instruction: literals and math functions
    of the instruction's compute type, and local variables for values it reuses."""

    def __init__(self, dtype: np.dtype, index: int, stored: np.dtype | None = None) -> None:
        self.dtype = dtype            # the type the expression computes in
        self.index = index            # the instruction's number, for unique locals
        self.stored = dtype if stored is None else stored  # the type the result is kept in
        self.lines: list[str] = []    # declarations that must come before it

    def step(self, expr: str) -> str:
        """`expr` rounded as numpy rounds one step of a composite op (sigmoid, gelu):
        numpy computes those op by op on float16 arrays, so every step is rounded to
        float16; computing them in float and rounding once can differ in the last
        bit. Other types need no rounding. Parenthesized either way, so steps nest."""
        if self.stored == np.float16:
            return f"((float)(float16)({expr}))"
        return f"({expr})"

    def lit(self, value: float) -> str:
        # A constant meets a float16 array as a float16 in numpy (a Python float
        # takes the array's type), so it is rounded to float16 first.
        if self.stored == np.float16:
            value = float(np.float16(value))
        return literal(value, self.dtype)

    def fn(self, name: str) -> str:
        """CUDA's math function for this type: expf for float, exp for double."""
        return name + "f" if self.dtype == np.float32 else name

    def local(self, name: str, expr: str) -> str:
        var = f"{name}{self.index}"
        self.lines.append(f"{c_type(self.dtype)} {var} = {expr};")
        return var

    def maximum(self, a: str, b: str) -> str:
        # numpy's maximum returns NaN when either side is NaN; so does this.
        if self.dtype.kind == "f":
            return f"({a} > {b} || isnan({a})) ? {a} : {b}"
        return f"{a} > {b} ? {a} : {b}"

    def minimum(self, a: str, b: str) -> str:
        if self.dtype.kind == "f":
            return f"({a} < {b} || isnan({a})) ? {a} : {b}"
        return f"{a} < {b} ? {a} : {b}"


def _sigmoid(e: _Emitter, a: str) -> str:
    # As ops._sigmoid_compute, step by step: exp(-|x|) <= 1 never overflows.
    one = e.lit(1)
    ex = e.local("e", e.step(f"{e.fn('exp')}(-{e.fn('fabs')}({a}))"))
    denominator = e.step(f"{one} + {ex}")
    pos = e.local("p", e.step(f"{one} / {denominator}"))
    return f"{a} >= {e.lit(0)} ? {pos} : {e.step(f'{ex} * {pos}')}"


def _gelu(e: _Emitter, a: str) -> str:
    # As ops._gelu_compute, in the same order of operations, each step rounded as
    # numpy rounds it (`e.step`: a no-op but for float16).
    r = e.step
    ax = r(f"{e.lit(_GELU_A)} * {a}")
    cube = r(f"{r(f'{ax} * {a}')} * {a}")
    inner = r(f"{e.lit(_GELU_C)} * {r(f'{a} + {cube}')}")
    tanh = r(f"{e.fn('tanh')}({inner})")
    half = r(f"{e.lit(0.5)} * {a}")
    return f"{half} * {r(f'{e.lit(1)} + {tanh}')}"


def _abs(e: _Emitter, a: str) -> str:
    return f"{e.fn('fabs')}({a})" if e.dtype.kind == "f" else f"{a} < 0 ? -{a} : {a}"


@dataclass(frozen=True)
class Template:
    """How one op becomes C.

    operands  what the operands are converted to before `emit` sees them:
              "result": the instruction's result type (arithmetic, as numpy's ufunc
              loops do); "common": the operands' common type (comparisons, whose
              result is bool); "where": the condition as bool, the two values to
              the result type; "own": each stays as it is (cast); "none": unused
    emit      (emitter, *operands) -> a C expression
    floating  the template computes in floating point: refused unless the result
              is a float type (numpy's power of two ints is an integer power)
    """

    operands: str
    emit: Callable[..., str]
    floating: bool = False


def _compare(symbol: str) -> Template:
    return Template("common", lambda e, a, b: f"{a} {symbol} {b}")


def _math(name: str) -> Template:
    return Template("result", lambda e, a: f"{e.fn(name)}({a})", floating=True)


TEMPLATES: dict[str, Template] = {
    "add": Template("result", lambda e, a, b: f"{a} + {b}"),
    "sub": Template("result", lambda e, a, b: f"{a} - {b}"),
    "mul": Template("result", lambda e, a, b: f"{a} * {b}"),
    "div": Template("result", lambda e, a, b: f"{a} / {b}", floating=True),
    "maximum": Template("result", lambda e, a, b: e.maximum(a, b)),
    "minimum": Template("result", lambda e, a, b: e.minimum(a, b)),
    "pow": Template("result", lambda e, a, b: f"{e.fn('pow')}({a}, {b})", floating=True),
    "neg": Template("result", lambda e, a: f"-{a}"),
    "exp": _math("exp"),
    "log": _math("log"),
    "sqrt": _math("sqrt"),
    "tanh": _math("tanh"),
    "sigmoid": Template("result", _sigmoid, floating=True),
    "gelu": Template("result", _gelu, floating=True),
    "relu": Template("result", lambda e, a: e.maximum(a, e.lit(0))),
    "abs": Template("result", _abs),
    # numpy's sign(-0.0) is +0.0 (and 1 / sign(-0.0) is +inf); NaN stays NaN.
    "sign": Template("result", lambda e, a: f"{a} > {e.lit(0)} ? {e.lit(1)} : "
                                            f"({a} < {e.lit(0)} ? {e.lit(-1)} : "
                                            f"({a} == {e.lit(0)} ? {e.lit(0)} : {a}))"),
    "less": _compare("<"),
    "less_equal": _compare("<="),
    "greater": _compare(">"),
    "greater_equal": _compare(">="),
    "equal": _compare("=="),
    "not_equal": _compare("!="),
    "where": Template("where", lambda e, c, a, b: f"{c} ? {a} : {b}"),
    "cast": Template("own", lambda e, a: f"({c_type(e.dtype)}){a}"),
    "zeros_like": Template("none", lambda e, a: e.lit(0)),
    "ones_like": Template("none", lambda e, a: e.lit(1)),
    "stop_gradient": Template("own", lambda e, a: a),
}


# ----------------------------------------------------------------------------------
# Source generation (pure: strings in, strings out)
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ElementwiseSource:
    """The arguments of ``cupy.ElementwiseKernel(in_params, out_params, operation,
    name)``: the inputs ``x0, x1, ...`` and the output ``y``, typed."""

    name: str
    in_params: str
    out_params: str
    operation: str

    def listing(self) -> str:
        """The kernel as a person reads it (the debugger and `tf.explain` show it)."""
        return (f"// {self.name}: ElementwiseKernel\n// in:  {self.in_params}\n"
                f"// out: {self.out_params}\n{self.operation}")


@dataclass(frozen=True)
class ReductionSource:
    """The arguments of ``cupy.ReductionKernel(in_params, out_params, map_expr,
    reduce_expr, post_map_expr, identity, name, reduce_type, preamble=...)``, and the
    `axis` and `keepdims` each launch passes. In CuPy's expressions ``a`` and ``b``
    are partial results; ``_in_ind.size() / _out_ind.size()`` is the number of
    elements reduced into each output."""

    name: str
    in_params: str
    out_params: str
    map_expr: str
    reduce_expr: str
    post_map_expr: str
    identity: str
    reduce_type: str
    preamble: str
    axis: Any
    keepdims: bool

    def listing(self) -> str:
        return (f"// {self.name}: ReductionKernel over axis={self.axis}, "
                f"keepdims={self.keepdims}\n// in:  {self.in_params}\n"
                f"// out: {self.out_params}\n{self.preamble}\n"
                f"// map: {self.map_expr}\n// reduce: {self.reduce_expr} "
                f"(identity {self.identity}, in {self.reduce_type})\n"
                f"// post: {self.post_map_expr}")


def _register(name: str, defined: int, num_inputs: int) -> int:
    """Operand ``x3`` -> 3, ``t2`` -> num_inputs + 2; an error unless already defined."""
    kind, digits = name[:1], name[1:]
    if kind not in ("x", "t") or not digits.isdigit():
        raise KernelGenerationError(f"operand {name!r} is not a register (x<i> or t<k>)")
    index = int(digits) if kind == "x" else num_inputs + int(digits)
    if (kind == "x" and index >= num_inputs) or index >= defined:
        raise KernelGenerationError(f"operand {name!r} is read before it is written")
    return index


def _op_text(k: int, op: str, operands: Sequence[str], attrs: Sequence) -> str:
    args = list(operands) + [f"{key}={value}" for key, value in attrs]
    return f"t{k} = {op}({', '.join(args)})"


def _result_dtype(k: int, op: str, operands: Sequence[str], attrs: Sequence,
                  have: Sequence[np.dtype], template: Template) -> np.dtype:
    """The dtype of instruction k by its op's own rule; a malformed instruction
    (wrong operand count, missing attribute, types the rule rejects) or a type the
    template cannot compute in is a KernelGenerationError naming it, never the
    rule's internal error."""
    wanted = len(inspect.signature(template.emit).parameters) - 1  # less the emitter
    where = f"instruction {_op_text(k, op, operands, attrs)}"
    if len(operands) != wanted:
        raise KernelGenerationError(f"{where}: {op} takes {wanted} operand(s), "
                                    f"got {len(operands)}")
    try:
        _, result = REGISTRY[op].infer([()] * len(have), list(have), dict(attrs))
        result = np.dtype(result)
    except (TinyFlowError, Mismatch, LookupError, TypeError, ValueError) as err:
        raise KernelGenerationError(f"{where} on {', '.join(d.name for d in have)}: "
                                    f"{type(err).__name__}: {err}") from None
    c_type(result)
    where = f"{op} of {', '.join(d.name for d in have)} (instruction t{k})"
    if template.floating and result.kind != "f":
        raise KernelGenerationError(
            f"{where}: its C template computes in floating point, but numpy's "
            f"result is {result.name}; no kernel is generated (it runs op by op)")
    if template.operands == "result" and result.kind not in "fiu":
        raise KernelGenerationError(f"{where}: no arithmetic on {result.name}")
    return result


def _operand_types(template: Template, result: np.dtype, have: Sequence[np.dtype]
                   ) -> tuple[list[np.dtype], np.dtype]:
    """(the type each operand is converted to, the type the expression computes in),
    by the template's `operands` rule (see Template)."""
    if template.operands == "result":
        return [compute_dtype(result)] * len(have), compute_dtype(result)
    if template.operands == "common":
        return [compute_dtype(np.result_type(*have))] * len(have), np.dtype(np.bool_)
    if template.operands == "where":
        return [np.dtype(np.bool_)] + [compute_dtype(result)] * 2, compute_dtype(result)
    if template.operands == "own":
        return [compute_dtype(d) for d in have], result
    return list(have), compute_dtype(result)  # "none": only the result's type matters


def _statements(program: Sequence, dtypes: Sequence[Any], output: str | None
                ) -> tuple[list[str], list[np.dtype]]:
    """C statements computing every instruction, and the dtype of every register.

    Instruction k declares local ``t<k>``; when `output` is given, the last one
    assigns `output` instead. Each statement ends with the instruction it comes
    from, as a block comment (CuPy pastes the body into its own loop: a line
    comment could swallow what it appends on the same line).
    """
    num_inputs = len(dtypes)
    reg_dtypes = [np.dtype(d) for d in dtypes]
    for dtype in reg_dtypes:
        c_type(dtype)  # every input has a C type
    lines: list[str] = []
    for k, (op, operands, attrs) in enumerate(program):
        template = TEMPLATES.get(op)
        if template is None:
            raise KernelGenerationError(f"no CUDA template for op {op!r} (instruction "
                                        f"{_op_text(k, op, operands, attrs)})")
        regs = [_register(r, len(reg_dtypes), num_inputs) for r in operands]
        have = [reg_dtypes[r] for r in regs]
        result = _result_dtype(k, op, operands, attrs, have, template)
        want, expr_dtype = _operand_types(template, result, have)
        args = [_convert(name, d, w) for name, d, w in zip(operands, have, want)]
        emitter = _Emitter(expr_dtype, k, result)
        expr = template.emit(emitter, *args)
        if c_type(expr_dtype) != c_type(result):
            expr = f"({c_type(result)})({expr})"  # round to the stored type (float16)
        lines.extend(emitter.lines)
        target = output if output is not None and k == len(program) - 1 \
            else f"{c_type(result)} t{k}"
        lines.append(f"{target} = {expr};  /* {_op_text(k, op, operands, attrs)} */")
        reg_dtypes.append(result)
    return lines, reg_dtypes


def kernel_name(program: Sequence) -> str:
    """``tinyflow_mul_add_relu``: the ops, so a profiler's kernel list reads as the
    graph; long programs are named by their length and a checksum instead, plus the
    final reduction when there is one: CuPy's CUB path rewrites a mean's
    ``_in_ind.size()`` only when the kernel's name says "mean"."""
    name = "tinyflow_" + "_".join(op for op, _, _ in program)
    if len(name) <= 48:
        return name
    short = f"tinyflow_fused{len(program)}_{zlib.crc32(repr(tuple(program)).encode()):08x}"
    last = program[-1][0]
    return f"{short}_{last}" if last in REDUCTIONS else short


def _in_params(dtypes: Sequence[Any]) -> str:
    return ", ".join(f"{np.dtype(d).name} x{i}" for i, d in enumerate(dtypes))


def elementwise_source(program: Sequence, dtypes: Sequence[Any]) -> ElementwiseSource:
    """The ElementwiseKernel computing `program` on inputs of `dtypes`.

    Raises KernelGenerationError for an op without a template or a dtype the op's
    rule and numpy would disagree on.
    """
    if not program:
        raise KernelGenerationError("an empty program has no kernel")
    lines, reg_dtypes = _statements(program, dtypes, output="y")
    return ElementwiseSource(kernel_name(program), _in_params(dtypes),
                             f"{reg_dtypes[-1].name} y", "\n".join(lines))


def _minus_infinity(dtype: np.dtype) -> str:
    """-inf as a CUDA expression: the bit pattern, through CUDA's reinterpreting
    intrinsics (no header needed, exact)."""
    if dtype == np.float64:
        return "__longlong_as_double(0xfff0000000000000LL)"
    return "__int_as_float(0xff800000)"


def reduction_source(program: Sequence, dtypes: Sequence[Any]) -> ReductionSource:
    """The ReductionKernel computing `program`, whose last instruction is a sum,
    mean or max (attributes ``axis``, ``keepdims``) of the instruction before it.

    The elementwise instructions become a ``__device__`` function, called as the
    map expression. The reduction runs in the stored float type (float for
    float16, as numpy's float16 reductions accumulate in float32); integers and
    booleans are refused (they run op by op).
    """
    if not program or program[-1][0] not in REDUCTIONS:
        raise KernelGenerationError("a reduction kernel needs a program ending in "
                                    f"{' / '.join(REDUCTIONS)}")
    *body, (op, operands, attrs) = program
    attrs = dict(attrs)
    num_inputs = len(dtypes)
    lines, reg_dtypes = _statements(body, dtypes, output=None)
    if len(operands) != 1:
        raise KernelGenerationError(f"{op} takes one operand, got {operands}")
    reduced = _register(operands[0], len(reg_dtypes), num_inputs)
    if body and reduced != len(reg_dtypes) - 1:
        raise KernelGenerationError(f"the {op} must read the last elementwise result "
                                    f"(t{len(body) - 1}), not {operands[0]}")
    dtype = reg_dtypes[reduced]
    if dtype.kind != "f":
        raise KernelGenerationError(f"{op} of {dtype.name}: the reduction templates are "
                                    "for floats (numpy sums integers in int64; the max "
                                    "starts from -inf); not generated")
    accumulate = compute_dtype(dtype)
    name = kernel_name(program)
    value = _convert(operands[0], dtype, accumulate)
    if body:
        params = ", ".join(f"{c_type(d)} x{i}" for i, d in enumerate(dtypes))
        preamble = (f"__device__ {c_type(accumulate)} {name}_map({params}) {{\n"
                    + "".join(f"    {line}\n" for line in lines)
                    + f"    return {value};\n}}")
        map_expr = f"{name}_map({', '.join(f'x{i}' for i in range(num_inputs))})"
    else:
        preamble, map_expr = "", value
    if op == "max":
        reduce_expr = "(a > b || isnan(a)) ? a : b"  # NaN wins, as in numpy's max
        identity = _minus_infinity(accumulate)
    else:
        reduce_expr, identity = "a + b", "0"
    result = "a"
    if op == "mean":
        result = f"a / ({c_type(accumulate)})(_in_ind.size() / _out_ind.size())"
    if c_type(accumulate) != c_type(dtype):
        result = f"({c_type(dtype)})({result})"
    return ReductionSource(name, _in_params(dtypes), f"{dtype.name} y", map_expr,
                           reduce_expr, f"y = {result}", identity, c_type(accumulate),
                           preamble, attrs.get("axis"), bool(attrs.get("keepdims", False)))


def kernel_source(program: Sequence, dtypes: Sequence[Any]
                  ) -> ElementwiseSource | ReductionSource:
    """The kernel source of `program` on inputs of `dtypes`: a reduction kernel when
    the program ends in a sum, mean or max, an elementwise kernel otherwise."""
    if program and program[-1][0] in REDUCTIONS:
        return reduction_source(program, dtypes)
    return elementwise_source(program, dtypes)


# ----------------------------------------------------------------------------------
# Building, caching and launching kernels (CuPy)
# ----------------------------------------------------------------------------------

# What every generated kernel is compiled with, besides CuPy's own options.
# NVRTC contracts ``a * b + c`` into one fused multiply-add by default: one rounding
# where numpy rounds twice, so results would differ from the CPU's in the last bit.
# ``--fmad=false`` keeps the two roundings (at a small cost in speed). CuPy itself
# always adds ``-ftz=true``: float32 subnormals flush to zero on the GPU, where numpy
# keeps them (float64 is not affected).
COMPILE_OPTIONS = ("--fmad=false",)


def build_kernel(source: ElementwiseSource | ReductionSource, cupy: Any = None) -> Any:
    """The CuPy kernel object for `source` (CuPy compiles it at its first launch, for
    each set of argument dtypes and ranks, and keeps the binary on disk)."""
    if cupy is None:
        import cupy
    if isinstance(source, ElementwiseSource):
        return cupy.ElementwiseKernel(source.in_params, source.out_params,
                                      source.operation, source.name,
                                      options=COMPILE_OPTIONS)
    return cupy.ReductionKernel(source.in_params, source.out_params, source.map_expr,
                                source.reduce_expr, source.post_map_expr, source.identity,
                                source.name, reduce_type=source.reduce_type,
                                preamble=source.preamble, options=COMPILE_OPTIONS)


@dataclass
class CompiledKernel:
    """A program's kernel for one list of input dtypes; `kernel` is None when the
    generator refused the program (`reason` says why) and it runs op by op."""

    source: ElementwiseSource | ReductionSource | None
    kernel: Any
    reason: str = ""


_kernels: dict[tuple, CompiledKernel] = {}
_last: dict[int, tuple[Any, tuple, CompiledKernel]] = {}
_lock = threading.Lock()
MAX_KERNELS = 1024  # distinct (program, dtypes) kept; beyond that the cache restarts

# Counters for tests and benchmarks: kernels built, launches of generated kernels,
# and runs of programs that had no kernel (op by op).
stats = {"built": 0, "launches": 0, "unfused_runs": 0}


def get_kernel(program: Sequence, dtypes: Sequence[Any], cupy: Any = None) -> CompiledKernel:
    """The cached kernel of `program` for inputs of `dtypes`, built on first use.

    The signature is the program (plain, hashable data: two fused nodes with equal
    programs share a kernel, even across graphs) and the input dtypes. Shapes are
    not part of it: one ElementwiseKernel serves every shape and broadcast.
    """
    key = (tuple(program), tuple(np.dtype(d).str for d in dtypes))
    entry = _kernels.get(key)
    if entry is None:
        try:
            source = kernel_source(program, dtypes)
        except KernelGenerationError as err:
            entry = CompiledKernel(None, None, str(err))
        else:
            entry = CompiledKernel(source, build_kernel(source, cupy))
            stats["built"] += 1
        with _lock:
            if len(_kernels) >= MAX_KERNELS:
                _kernels.clear()
                _last.clear()
            _kernels[key] = entry
    return entry


def _lookup(xp: Any, program: Sequence, arrays: Sequence[Any]) -> CompiledKernel:
    """`get_kernel`, with a first check by the program's identity: a fused node runs
    its one program on the same dtypes every time, and comparing dtypes is cheaper
    than hashing the nested program on every launch."""
    dtypes = tuple(a.dtype for a in arrays)
    hit = _last.get(id(program))
    if hit is not None and hit[0] is program and hit[1] == dtypes:
        return hit[2]
    entry = get_kernel(program, dtypes, xp)
    _last[id(program)] = (program, dtypes, entry)
    return entry


def run_unfused(xp: Any, arrays: Sequence[Any], program: Sequence, out: Any = None) -> Any:
    """Run `program` one op at a time, each op's own compute: the path for programs
    the generator refuses (correct, one kernel per op)."""
    registers = list(arrays)
    num_inputs = len(arrays)
    for op, operands, attrs in program:
        values = [registers[_register(r, len(registers), num_inputs)] for r in operands]
        registers.append(REGISTRY[op].compute(xp, *values, **dict(attrs)))
    result = registers[-1]
    if out is None:
        return result
    out[...] = result
    return out


def fused_compute(xp: Any, *arrays: Any, out: Any = None, program: Sequence = ()) -> Any:
    """The compute of a fused node on the GPU: one launch of the program's generated
    kernel, writing into `out` (the planned memory) when given.

    `xp` is the cupy module. A program with no kernel runs op by op instead.
    """
    entry = _lookup(xp, program, arrays)
    if entry.kernel is None:
        stats["unfused_runs"] += 1
        return run_unfused(xp, arrays, program, out)
    stats["launches"] += 1
    source = entry.source
    if isinstance(source, ReductionSource):
        return entry.kernel(*arrays, out=out, axis=source.axis, keepdims=source.keepdims)
    if out is None:
        return entry.kernel(*arrays)
    entry.kernel(*arrays, out)
    return out


def clear_cache() -> None:
    """Forget every built kernel (CuPy's own on-disk cache of binaries remains)."""
    with _lock:
        _kernels.clear()
        _last.clear()
