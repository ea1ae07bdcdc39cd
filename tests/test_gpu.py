"""The GPU backend: kernel source generation, the backend shims, the clear error
without a GPU, and (only where a GPU is) the same programs on CUDA as on the CPU.

Most of this file needs no GPU. The kernel generator (tinyflow/gpu.py) is a pure
function from a fused program to C source, so it is checked two ways on the CPU:

* exactly: the source of a few programs is compared with the text a person wrote
  down and checked by eye;
* by value: a tiny C interpreter below (numpy underneath, C's typing rules on top)
  runs the generated kernel body, and the result is compared with the fused op's
  numpy compute on random inputs (NaN and Inf included). The interpreter refuses
  any identifier that is not declared, any type it does not know and any syntax it
  does not parse, so a malformed kernel fails here before it reaches NVRTC.

`FakeCupy` stands in for the cupy module: its ElementwiseKernel and ReductionKernel
run the kernel's C through the same interpreter, so `gpu.fused_compute`'s whole
path (the cache, the arguments, `out=`, the axis of a reduction) runs on the CPU.
What it cannot show is that NVRTC compiles the source and that CUDA's math
functions agree with numpy's: the tests marked `needs_gpu` do that, and skip
without a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import backend, gpu
from tinyflow.graph import TinyFlowError
from tinyflow.ops import REGISTRY

needs_gpu = pytest.mark.skipif(not backend.gpu_available(),
                               reason="no GPU: CuPy is not installed or sees no device")
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


@pytest.fixture(autouse=True)
def _fresh_kernel_cache():
    """Kernels built by FakeCupy must never be found by a later test (or a real GPU)."""
    gpu.clear_cache()
    yield
    gpu.clear_cache()


def fused_numpy(program, *arrays):
    """The reference: the fused op's own compute on the CPU."""
    with np.errstate(all="ignore"):
        return REGISTRY["fused_elementwise"].compute(np, *arrays, program=program)


# ----------------------------------------------------------------------------------
# A tiny C interpreter over numpy
# ----------------------------------------------------------------------------------

C_DTYPES = {c: np.dtype(name) for name, c in gpu.C_TYPES.items()}   # C type -> dtype
_TOKEN = re.compile(r"""\s*(?:
      (?P<number>0x[0-9a-fA-F]+(?:LL)?|\d+\.\d*(?:e[-+]?\d+)?f?|\d+e[-+]?\d+f?|\d+)
    | (?P<name>[A-Za-z_]\w*)
    | (?P<op>\|\||&&|==|!=|<=|>=|[-+*/<>?:!(),]))""", re.X)
BINARY = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4,
          "+": 5, "-": 5, "*": 6, "/": 6}
COMPARE = {"==": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal,
           ">": np.greater, ">=": np.greater_equal}
ARITHMETIC = {"+": np.add, "-": np.subtract, "*": np.multiply}


def _promote(dtype: np.dtype) -> np.dtype:
    """C's integer promotion (bool, char, short -> int); CuPy's float16 does its
    arithmetic in float."""
    if dtype.kind == "b" or (dtype.kind in "iu" and dtype.itemsize < 4):
        return np.dtype(np.int32)
    return F32 if dtype == F16 else dtype


def _common(a: np.dtype, b: np.dtype) -> np.dtype:
    """C's usual arithmetic conversions (for the types kernels use)."""
    a, b = _promote(a), _promote(b)
    if a == b:
        return a
    for floating in (F64, F32):
        if floating in (a, b):
            return floating
    if a.itemsize != b.itemsize:
        return a if a.itemsize > b.itemsize else b
    return a if a.kind == "u" else b


def _as(dtype):
    return lambda *args: [np.asarray(x).astype(dtype) for x in args]


def _math(fn, dtype):
    """A C math function of one argument: the argument converted to its type."""
    return lambda x: fn(x.astype(dtype))


MATH = [("exp", np.exp), ("log", np.log), ("sqrt", np.sqrt), ("tanh", np.tanh),
        ("fabs", np.abs)]
FUNCTIONS = {
    **{name + "f": _math(fn, F32) for name, fn in MATH},
    **{name: _math(fn, F64) for name, fn in MATH},
    "powf": lambda x, y: np.power(*_as(F32)(x, y)),
    "pow": lambda x, y: np.power(*_as(F64)(x, y)),
    "isnan": lambda x: np.isnan(x.astype(_promote(x.dtype))),
    "__int_as_float": lambda bits: bits.astype(np.uint32).view(np.float32),
    "__longlong_as_double": lambda bits: bits.astype(np.uint64).view(np.float64),
}


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise SyntaxError(f"cannot read C at {text[pos:pos + 20]!r} in {text!r}")
        kind = match.lastgroup
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


class CExpression:
    """Evaluate one C expression over numpy arrays (precedence climbing)."""

    def __init__(self, text: str, env: dict, functions: dict) -> None:
        self.tokens, self.pos, self.env, self.functions = _tokenize(text), 0, env, functions
        self.text = text

    def value(self) -> np.ndarray:
        result = self.expression(0)
        if self.pos != len(self.tokens):
            raise SyntaxError(f"unexpected {self.tokens[self.pos][1]!r} in {self.text!r}")
        return result

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.pos >= len(self.tokens) or (expected and self.peek() != expected):
            raise SyntaxError(f"expected {expected or 'more'} in {self.text!r}")
        self.pos += 1
        return self.tokens[self.pos - 1]

    def expression(self, min_precedence: int) -> np.ndarray:
        left = self.unary()
        while self.peek() in BINARY and BINARY[self.peek()] > min_precedence:
            _, op = self.take()
            left = self.binary(op, left, self.expression(BINARY[op]))
        if min_precedence == 0 and self.peek() == "?":
            self.take()
            yes = self.expression(0)
            self.take(":")
            no = self.expression(0)
            kind = yes.dtype if yes.dtype == no.dtype else _common(yes.dtype, no.dtype)
            left = np.asarray(np.where(left.astype(bool), yes.astype(kind), no.astype(kind)))
        return left

    @staticmethod
    def binary(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if op in ("&&", "||"):
            fn = np.logical_and if op == "&&" else np.logical_or
            return np.asarray(fn(a.astype(bool), b.astype(bool)))
        kind = _common(a.dtype, b.dtype)
        a, b = a.astype(kind), b.astype(kind)
        if op in COMPARE:
            return np.asarray(COMPARE[op](a, b))
        if op == "/":
            if kind.kind in "iu":
                return np.asarray(np.trunc(a / b)).astype(kind)  # C truncates
            return np.asarray(np.divide(a, b))
        return np.asarray(ARITHMETIC[op](a, b))

    def unary(self) -> np.ndarray:
        kind, text = self.take()
        if text == "-":
            operand = self.unary()
            return np.asarray(np.negative(operand.astype(_promote(operand.dtype))))
        if text == "!":
            return np.asarray(np.logical_not(self.unary().astype(bool)))
        if text == "(":
            end = self.pos
            while end < len(self.tokens) and self.tokens[end][0] == "name":
                end += 1
            words = " ".join(t for _, t in self.tokens[self.pos:end])
            if words in C_DTYPES and end < len(self.tokens) and self.tokens[end][1] == ")":
                self.pos = end + 1
                return self.unary().astype(C_DTYPES[words])  # a cast
            inner = self.expression(0)
            self.take(")")
            return inner
        if kind == "number":
            if text.startswith("0x"):
                return np.asarray(int(text.rstrip("L"), 16), dtype=np.uint64)
            if text.endswith("f"):
                return np.asarray(float(text[:-1]), dtype=F32)
            if "." in text or "e" in text:
                return np.asarray(float(text), dtype=F64)
            return np.asarray(int(text), dtype=np.int32)
        if kind == "name":
            if text in ("true", "false"):
                return np.asarray(text == "true")
            if self.peek() == "(":
                if text not in self.functions:
                    raise NameError(f"unknown function {text}() in {self.text!r}")
                self.take("(")
                args = [self.expression(0)]
                while self.peek() == ",":
                    self.take(",")
                    args.append(self.expression(0))
                self.take(")")
                return np.asarray(self.functions[text](*args))
            if text not in self.env:
                raise NameError(f"undeclared identifier {text!r} in {self.text!r}")
            return self.env[text]
        raise SyntaxError(f"unexpected {text!r} in {self.text!r}")


_RETURN = re.compile(r"^return\s+(?P<expr>.+)$", re.S)
_ASSIGN = re.compile(r"^(?P<name>[A-Za-z_]\w*)\s*=(?!=)\s*(?P<expr>.+)$", re.S)
_DECLARE = re.compile(r"^(?P<type>[A-Za-z_][\w ]*?)\s+(?P<name>[A-Za-z_]\w*)\s*=(?!=)"
                      r"\s*(?P<expr>.+)$", re.S)
_FUNCTION = re.compile(r"__device__\s+(?P<ret>[\w ]+?)\s+(?P<name>\w+)\((?P<params>[^)]*)\)"
                       r"\s*\{(?P<body>.*?)\n\}", re.S)


def run_statements(code: str, env: dict, functions: dict, outputs: dict):
    """Run C statements: declarations of typed locals, assignments to `outputs`
    (name -> dtype), ``return``. Returns the returned value, if any."""
    code = re.sub(r"/\*.*?\*/", "", code, flags=re.S)
    assert "//" not in code, "line comments in a kernel body"
    for statement in code.split(";"):
        statement = statement.strip()
        if not statement:
            continue
        if match := _RETURN.match(statement):
            return CExpression(match["expr"], env, functions).value()
        if match := _ASSIGN.match(statement):
            assert match["name"] in outputs, f"assignment to non-output {match['name']}"
            value = CExpression(match["expr"], env, functions).value()
            env[match["name"]] = value.astype(outputs[match["name"]])
            continue
        match = _DECLARE.match(statement)
        if match is None or match["type"] not in C_DTYPES:
            raise SyntaxError(f"not a statement the generator writes: {statement!r}")
        assert match["name"] not in env, f"{match['name']} declared twice"
        value = CExpression(match["expr"], env, functions).value()
        env[match["name"]] = value.astype(C_DTYPES[match["type"]])
    return None


def define_functions(preamble: str) -> dict:
    """The ``__device__`` functions of a preamble, callable from expressions."""
    defined = {}
    for match in _FUNCTION.finditer(preamble):
        params = [p.strip().rsplit(" ", 1) for p in match["params"].split(",")]
        ret, body = C_DTYPES[match["ret"]], match["body"]

        def call(*args, params=params, ret=ret, body=body):
            local = {name: np.asarray(a).astype(C_DTYPES[ctype])
                     for (ctype, name), a in zip(params, args)}
            return run_statements(body, local, FUNCTIONS, {}).astype(ret)
        defined[match["name"]] = call
    assert len(defined) == preamble.count("__device__"), f"unparsed preamble:\n{preamble}"
    return defined


def _params(text: str) -> list[tuple[np.dtype, str]]:
    return [(np.dtype(p.split()[0]), p.split()[1]) for p in text.split(",")]


def _bind(in_params: str, arrays) -> dict:
    params = _params(in_params)
    assert [a.dtype for a in arrays] == [d for d, _ in params], (in_params, arrays)
    return {name: np.asarray(a) for (_, name), a in zip(params, arrays)}


def run_elementwise(in_params, out_params, operation, arrays):
    """What cupy.ElementwiseKernel computes: the body once per broadcast element."""
    env = _bind(in_params, arrays)
    [(out_dtype, out_name)] = _params(out_params)
    with np.errstate(all="ignore"):
        run_statements(operation, env, FUNCTIONS, {out_name: out_dtype})
    shape = np.broadcast_shapes(*(np.shape(a) for a in arrays))
    return np.broadcast_to(env[out_name], shape).astype(out_dtype)


def run_reduction(in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                  reduce_type, preamble, arrays, axis=None, keepdims=False):
    """What cupy.ReductionKernel computes: map every element, fold the mapped values
    with the reduce expression from the identity (in reduce_type), post-map."""
    env = _bind(in_params, arrays)
    functions = {**FUNCTIONS, **define_functions(preamble)}
    [(out_dtype, out_name)] = _params(out_params)
    accumulate = C_DTYPES[reduce_type]
    shape = np.broadcast_shapes(*(np.shape(a) for a in arrays))
    with np.errstate(all="ignore"):
        mapped = np.broadcast_to(CExpression(map_expr, env, functions).value(), shape)
        mapped = mapped.astype(accumulate)
        axes = tuple(range(len(shape))) if axis is None else \
            tuple(sorted(a % len(shape) for a in ((axis,) if isinstance(axis, int) else axis)))
        moved = np.moveaxis(mapped, axes, range(-len(axes), 0)) if axes else mapped
        kept = moved.shape[:len(shape) - len(axes)]
        columns = moved.reshape(kept + (-1,))
        total = np.full(kept, CExpression(identity, {}, functions).value(), dtype=accumulate)
        for j in range(columns.shape[-1]):
            total = CExpression(reduce_expr, {"a": total, "b": columns[..., j]},
                                functions).value().astype(accumulate)
        post = post_map_expr.replace("_in_ind.size()", str(mapped.size)).replace(
            "_out_ind.size()", str(max(total.size, 1)))
        local = {"a": total}
        run_statements(post, local, functions, {out_name: out_dtype})
    result = local[out_name]
    return np.expand_dims(result, axes) if keepdims else result


def run_source(source, arrays):
    """Run a generated ElementwiseSource or ReductionSource on numpy arrays."""
    if isinstance(source, gpu.ElementwiseSource):
        return run_elementwise(source.in_params, source.out_params, source.operation, arrays)
    return run_reduction(source.in_params, source.out_params, source.map_expr,
                         source.reduce_expr, source.post_map_expr, source.identity,
                         source.reduce_type, source.preamble, arrays, source.axis,
                         source.keepdims)


def assert_matches(got, want, dtype, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got, want)
    if dtype == F16:
        tolerance = {"rtol": 1e-2, "atol": 1e-3}  # numpy rounds each float16 step
    else:
        tolerance = {"rtol": 1e-6, "atol": 1e-7}
    if got.dtype.kind in "bi":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, err_msg=what, **tolerance)


def test_interpreter_follows_c_typing_rules():
    """The checker is checked: C's casts, promotions, precedence and ternary."""
    env = {"h": np.asarray(1.5, F16), "i": np.asarray(7, np.int32),
           "x": np.asarray([-1.0, 2.0, np.nan], F32)}
    value = lambda text: CExpression(text, env, FUNCTIONS).value()  # noqa: E731
    assert value("h * 2.0f").dtype == F32 and value("i / 2").item() == 3
    assert value("i / 2.0").dtype == F64 and value("(float)i / 2").item() == 3.5
    assert value("1 + 2 * 3 - 4").item() == 3 and value("-(1 + 2) * 3").item() == -9
    np.testing.assert_array_equal(value("x > 0.0f || isnan(x) ? x : 0.0f"), [0, 2, np.nan])
    assert value("1 < 2 ? 3 : 4 < 5 ? 6 : 7").item() == 3
    assert value("__int_as_float(0xff800000)").item() == -math.inf
    with pytest.raises(NameError, match="undeclared identifier 'z'"):
        value("x + z")
    with pytest.raises(SyntaxError):
        value("x +* 2")


# ----------------------------------------------------------------------------------
# Generated source, checked exactly
# ----------------------------------------------------------------------------------

MUL_ADD_RELU = (("mul", ("x0", "x1"), ()), ("add", ("t0", "x2"), ()), ("relu", ("t1",), ()))


def test_source_of_mul_add_relu():
    source = gpu.kernel_source(MUL_ADD_RELU, [F32, F32, F32])
    assert isinstance(source, gpu.ElementwiseSource)
    assert source.name == "tinyflow_mul_add_relu"
    assert source.in_params == "float32 x0, float32 x1, float32 x2"
    assert source.out_params == "float32 y"
    assert source.operation == (
        "float t0 = x0 * x1;  /* t0 = mul(x0, x1) */\n"
        "float t1 = t0 + x2;  /* t1 = add(t0, x2) */\n"
        "y = (t1 > 0.0f || isnan(t1)) ? t1 : 0.0f;  /* t2 = relu(t1) */")


def test_source_converts_types_as_numpy_does():
    """float32 < float64 compares in double; where picks float32; a float16 result
    is computed in float and rounded when stored, each step of a float16 sigmoid
    rounded as numpy rounds it; sigmoid's locals are declared."""
    program = (("less", ("x0", "x1"), ()), ("where", ("t0", "x0", "x2"), ()),
               ("cast", ("t1",), (("dtype", "float16"),)), ("sigmoid", ("t2",), ()))
    source = gpu.kernel_source(program, [F32, F64, F32])
    assert source.out_params == "float16 y"
    assert source.operation == (
        "bool t0 = (double)x0 < x1;  /* t0 = less(x0, x1) */\n"
        "float t1 = t0 ? x0 : x2;  /* t1 = where(t0, x0, x2) */\n"
        "float16 t2 = (float16)t1;  /* t2 = cast(t1, dtype=float16) */\n"
        "float e3 = ((float)(float16)(expf(-fabsf((float)t2))));\n"
        "float p3 = ((float)(float16)(1.0f / ((float)(float16)(1.0f + e3))));\n"
        "y = (float16)((float)t2 >= 0.0f ? p3 : ((float)(float16)(e3 * p3)));"
        "  /* t3 = sigmoid(t2) */")


def test_source_of_a_chain_ending_in_a_mean():
    program = (("mul", ("x0", "x0"), ()), ("exp", ("t0",), ()),
               ("mean", ("t1",), (("axis", 1), ("keepdims", False))))
    source = gpu.kernel_source(program, [F64])
    assert isinstance(source, gpu.ReductionSource)
    assert (source.axis, source.keepdims, source.reduce_type) == (1, False, "double")
    assert source.preamble == (
        "__device__ double tinyflow_mul_exp_mean_map(double x0) {\n"
        "    double t0 = x0 * x0;  /* t0 = mul(x0, x0) */\n"
        "    double t1 = exp(t0);  /* t1 = exp(t0) */\n"
        "    return t1;\n}")
    assert source.map_expr == "tinyflow_mul_exp_mean_map(x0)"
    assert (source.reduce_expr, source.identity) == ("a + b", "0")
    assert source.post_map_expr == "y = a / (double)(_in_ind.size() / _out_ind.size())"


def test_max_reduction_starts_from_minus_infinity_and_keeps_nan():
    source = gpu.kernel_source((("neg", ("x0",), ()), ("max", ("t0",), (("axis", None),))),
                               [F32])
    assert source.identity == "__int_as_float(0xff800000)"
    assert source.reduce_expr == "(a > b || isnan(a)) ? a : b"
    assert source.post_map_expr == "y = a"


def test_long_programs_get_a_short_stable_name():
    program = tuple(("tanh", (f"t{k - 1}" if k else "x0",), ()) for k in range(12))
    name = gpu.kernel_name(program)
    assert name.startswith("tinyflow_fused12_") and len(name) <= 32
    assert gpu.kernel_name(program) == name
    assert gpu.kernel_name(program[:11]) != name


# ----------------------------------------------------------------------------------
# Generated source, checked by value against the fused op's numpy compute
# ----------------------------------------------------------------------------------

def test_every_fusable_op_has_a_template():
    """fuse_elementwise fuses every pure elementwise op: each needs a C template, or a
    GPU run of a graph using it falls back to one kernel per op."""
    fusable = {name for name, op in REGISTRY.items()
               if op.elementwise and op.pure and name != "fused_elementwise"}
    assert fusable <= set(gpu.TEMPLATES), f"no template for {sorted(fusable - set(gpu.TEMPLATES))}"


def _values(rng, shape, dtype, positive=False):
    """Random values with the awkward ones mixed in: 0, -0, +-Inf, NaN."""
    x = rng.standard_normal(shape) * 2
    if positive:
        x = np.abs(x) + 0.1
    flat = x.reshape(-1)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan] if not positive else [np.inf, np.nan]
    picks = rng.choice(flat.size, size=min(len(specials), flat.size // 4), replace=False)
    flat[picks] = specials[:len(picks)]
    return x.astype(dtype)


def _one_op_cases():
    """(op, program, arrays) for every template, float32 and float64 (and float16
    for a few): each op on its own, inputs broadcasting where it takes two."""
    rng = np.random.default_rng(6)
    unary = ["neg", "exp", "log", "sqrt", "tanh", "sigmoid", "gelu", "relu", "abs",
             "sign", "zeros_like", "ones_like", "stop_gradient"]
    binary = ["add", "sub", "mul", "div", "maximum", "minimum", "pow", "less",
              "less_equal", "greater", "greater_equal", "equal", "not_equal"]
    for dtype in (F32, F64, F16):
        for op in unary:
            yield op, ((op, ("x0",), ()),), [_values(rng, (5, 7), dtype)]
        for op in binary:
            a = _values(rng, (5, 7), dtype, positive=op == "pow")
            b = _values(rng, (7,), dtype)
            if op.endswith("equal"):
                b[:3] = a[0, :3]  # some equal pairs
            yield op, ((op, ("x0", "x1"), ()),), [a, b]
        cond = rng.random((5, 1)) > 0.5
        yield "where", (("where", ("x0", "x1", "x2"), ()),), [
            cond, _values(rng, (5, 7), dtype), _values(rng, (7,), dtype)]
        for target in ("float16", "float32", "float64", "bool"):
            yield "cast", (("cast", ("x0",), (("dtype", target),)),), [
                _values(rng, (5, 7), dtype)]
    ints = rng.integers(-9, 9, (4, 6)).astype(np.int32)
    for op in ("add", "mul", "maximum", "minimum", "less"):
        yield op, ((op, ("x0", "x1"), ()),), [ints, ints[::-1].copy()]
    for op in ("neg", "abs", "sign", "relu"):
        yield op, ((op, ("x0",), ()),), [ints]
    yield "cast", (("cast", ("x0",), (("dtype", "float32"),)),), [ints]


def test_each_op_template_computes_what_numpy_computes():
    seen = set()
    for op, program, arrays in _one_op_cases():
        seen.add(op)
        source = gpu.kernel_source(program, [a.dtype for a in arrays])
        got, want = run_source(source, arrays), fused_numpy(program, *arrays)
        assert_matches(got, want, arrays[0].dtype,
                       f"{op} on {[a.dtype.name for a in arrays]}\n{source.listing()}")
    assert seen == set(gpu.TEMPLATES)


def _random_program(rng, dtypes):
    """A random fused program over inputs of `dtypes`, shaped as fuse_elementwise
    makes them: instruction k reads t(k-1), so every temporary is used."""
    num_inputs = len(dtypes)
    unary = ["neg", "exp", "tanh", "sigmoid", "gelu", "relu", "abs", "sign", "sqrt", "log"]
    binary = ["add", "sub", "mul", "div", "maximum", "minimum", "pow"]
    program = []
    for k in range(int(rng.integers(1, 7))):
        last = f"t{k - 1}" if k else "x0"
        other = str(rng.choice([f"x{i}" for i in range(num_inputs)]
                               + [f"t{j}" for j in range(k - 1)]))
        kind = rng.choice(["unary", "binary", "compare", "cast", "fill"],
                          p=[0.4, 0.4, 0.1, 0.05, 0.05])
        if kind == "unary":
            program.append((str(rng.choice(unary)), (last,), ()))
        elif kind == "binary":
            pair = (last, other) if rng.random() < 0.5 else (other, last)
            program.append((str(rng.choice(binary)), pair, ()))
        elif kind == "compare":
            program.append((str(rng.choice(["less", "greater_equal", "equal"])),
                            (last, other), ()))
            program.append(("where", (f"t{k}", last, other), ()))
            break  # keep the register numbering simple: the where ends the program
        elif kind == "cast":
            target = str(rng.choice(["float32", "float64"]))
            program.append(("cast", (last,), (("dtype", target),)))
        else:
            program.append((str(rng.choice(["zeros_like", "ones_like"])), (last,), ()))
    return tuple(program)


def test_random_programs_compute_what_numpy_computes():
    rng = np.random.default_rng(2024)
    shapes = [(4, 5), (5,), (4, 1), ()]
    for trial in range(60):
        dtypes = [F32] * 3 if trial % 3 == 0 else [F32, F64, F32] if trial % 3 == 1 \
            else [F16] * 2
        arrays = [_values(rng, shapes[i] if i else (4, 5), d) for i, d in enumerate(dtypes)]
        program = _random_program(rng, dtypes)
        source = gpu.kernel_source(program, dtypes)
        got, want = run_source(source, arrays), fused_numpy(program, *arrays)
        assert_matches(got, want, dtypes[0], f"trial {trial}\n{source.listing()}")


@pytest.mark.parametrize("reduction", ["sum", "mean", "max"])
def test_reduction_kernels_compute_what_numpy_computes(reduction):
    rng = np.random.default_rng(len(reduction))
    for dtype in (F32, F64, F16):
        for axis, keepdims in [(None, False), (1, False), ((0, 2), True), (-1, True)]:
            a = rng.standard_normal((3, 4, 5)).astype(dtype)
            b = rng.standard_normal((4, 1)).astype(dtype)
            program = (("mul", ("x0", "x1"), ()), ("tanh", ("t0",), ()),
                       (reduction, ("t1",), (("axis", axis), ("keepdims", keepdims))))
            source = gpu.kernel_source(program, [dtype, dtype])
            got, want = run_source(source, [a, b]), fused_numpy(program, a, b)
            assert_matches(got, want, dtype, f"{reduction} axis={axis}\n{source.listing()}")
        # A NaN met first must survive the fold; a row of negatives must not meet 0.
        awkward = np.array([[np.nan, 1.0, 2.0], [-3.0, -2.0, -5.0]], dtype)
        program = ((reduction, ("x0",), (("axis", 1), ("keepdims", False))),)
        got = run_source(gpu.kernel_source(program, [dtype]), [awkward])
        assert np.isnan(got[0])
        assert_matches(got[1:], fused_numpy(program, awkward)[1:], dtype, "negatives")


@pytest.mark.parametrize("program, dtypes, message", [
    ((("pow", ("x0", "x1"), ()),), [np.int32, np.int32], "pow of int32, int32 .*floating"),
    ((("add", ("x0", "x1"), ()),), [np.bool_, np.bool_], "no arithmetic on bool"),
    ((("exp", ("x0",), ()), ("matmul", ("t0", "x1"), ())), [F32, F32],
     "no CUDA template for op 'matmul' \\(instruction t1 = matmul\\(t0, x1\\)\\)"),
    ((("exp", ("t3",), ()),), [F32], "'t3' is read before it is written"),
    ((("sum", ("x0",), (("axis", 0),)),), [np.int64], "sum of int64: .* are for floats"),
    ((("exp", ("x0",), ()), ("sum", ("x0",), ())), [F32], "must read the last"),
    ((("exp", ("x0",), ()),), [np.complex64], "no C type for dtype complex64"),
])
def test_refused_programs_name_the_reason(program, dtypes, message):
    with pytest.raises(gpu.KernelGenerationError, match=message):
        gpu.kernel_source(program, dtypes)


# ----------------------------------------------------------------------------------
# Building, caching, launching: through a stand-in for cupy
# ----------------------------------------------------------------------------------

class FakeCupy:
    """The cupy module's kernel classes, running the kernels' C through the
    interpreter; every other attribute is numpy's. It records what was built."""

    def __init__(self) -> None:
        self.built: list[str] = []

    def __getattr__(self, name):
        return getattr(np, name)

    def ElementwiseKernel(self, in_params, out_params, operation, name,  # noqa: N802
                          options=()):
        self.built.append(name)
        nin = len(in_params.split(","))

        def launch(*args):
            result = run_elementwise(in_params, out_params, operation, args[:nin])
            if len(args) > nin:
                args[nin][...] = result
                return args[nin]
            return result
        return launch

    def ReductionKernel(self, in_params, out_params, map_expr, reduce_expr,  # noqa: N802
                        post_map_expr, identity, name, reduce_type=None, preamble="",
                        options=()):
        self.built.append(name)

        def launch(*arrays, out=None, axis=None, keepdims=False):
            result = run_reduction(in_params, out_params, map_expr, reduce_expr,
                                   post_map_expr, identity, reduce_type, preamble, arrays,
                                   axis, keepdims)
            if out is None:
                return result
            out[...] = result
            return out
        return launch


def test_kernels_are_built_once_per_program_and_input_dtypes():
    fake = FakeCupy()
    a32, a64 = np.ones((2, 3), F32), np.ones((2, 3), F64)
    for _ in range(3):
        gpu.fused_compute(fake, a32, a32, a32, program=MUL_ADD_RELU)
    assert fake.built == ["tinyflow_mul_add_relu"]
    same_program = tuple(tuple(i) for i in MUL_ADD_RELU)  # equal, not identical
    gpu.fused_compute(fake, a32, a32, a32, program=same_program)
    assert len(fake.built) == 1, "an equal program shares the kernel"
    gpu.fused_compute(fake, a64, a64, a64, program=MUL_ADD_RELU)
    assert len(fake.built) == 2, "other input dtypes: another kernel"


def test_fused_compute_writes_into_out_and_reduces_over_the_program_axis():
    fake = FakeCupy()
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(F32) for s in [(4, 3), (4, 3), (3,)])
    out = np.empty((4, 3), F32)
    launches = gpu.stats["launches"]
    result = gpu.fused_compute(fake, x, w, b, out=out, program=MUL_ADD_RELU)
    assert result is out and gpu.stats["launches"] == launches + 1
    np.testing.assert_allclose(out, fused_numpy(MUL_ADD_RELU, x, w, b), rtol=1e-6)
    program = (("mul", ("x0", "x1"), ()), ("sum", ("t0",), (("axis", 0), ("keepdims", True))))
    summed = gpu.fused_compute(fake, x, w, program=program)
    assert summed.shape == (1, 3)
    np.testing.assert_allclose(summed, (x * w).sum(axis=0, keepdims=True), rtol=1e-5)


def test_a_refused_program_runs_op_by_op():
    """bool + bool is numpy's logical or, an int sum is int64 in numpy: no template
    covers them, so the node runs each op's own compute instead, with the same
    result, and no kernel is built."""
    fake = FakeCupy()
    either = (("add", ("x0", "x1"), ()),)
    a, b = np.array([True, False, False]), np.array([True, True, False])
    entry = gpu.get_kernel(either, [a.dtype, b.dtype], fake)
    assert entry.kernel is None and "no arithmetic on bool" in entry.reason
    unfused = gpu.stats["unfused_runs"]
    np.testing.assert_array_equal(gpu.fused_compute(fake, a, b, program=either), a | b)
    total = (("abs", ("x0",), ()), ("sum", ("t0",), (("axis", 0), ("keepdims", False))))
    ints = np.array([[1, -2], [-3, 4]], np.int64)
    out = np.empty(2, np.int64)
    assert gpu.fused_compute(fake, ints, out=out, program=total) is out
    np.testing.assert_array_equal(out, [4, 6])
    assert gpu.stats["unfused_runs"] == unfused + 2 and fake.built == []


# ----------------------------------------------------------------------------------
# Backend shims (numpy side) and the error without a GPU
# ----------------------------------------------------------------------------------

def test_scatter_add_sums_repeated_indices():
    target = np.zeros((4, 2), F32)
    backend.scatter_add(np, target, np.array([1, 3, 1]), np.ones((3, 2), F32))
    np.testing.assert_array_equal(target[:, 0], [0, 2, 0, 1])


def test_as_strided_errstate_and_host_copies():
    x = np.arange(6, dtype=F32)
    windows = backend.as_strided(np, x, (4, 3), (4, 4))
    np.testing.assert_array_equal(windows[2], [2, 3, 4])
    with backend.errstate(np, all="raise"), pytest.raises(FloatingPointError):
        np.divide(x, 0)
    copy = backend.to_host(x)
    copy[0] = 99
    assert x[0] == 0 and not backend.is_device_array(x)


def test_uploader_clock_and_random_on_numpy():
    upload = backend.Uploader(np)
    feed = np.ones(3, F32)
    assert upload(feed) is feed  # nothing to copy on the CPU
    clock = backend.step_clock(np)
    clock.start()
    first = clock.mark()
    events = [{"start": first, "end": clock.mark()}]
    clock.resolve(events)
    assert 0 <= events[0]["start"] <= events[0]["end"]
    draw = backend.draw_random(np, np.random.default_rng(3), "normal", (2, 2), F32, 1.0, 2.0)
    want = np.random.default_rng(3).normal(1.0, 2.0, size=(2, 2)).astype(F32)
    np.testing.assert_array_equal(draw, want)  # the same numbers as ops' CPU draw
    assert backend.device_copy(np, object(), feed) is feed
    with pytest.raises(ValueError, match="unknown random kind"):
        backend.draw_random(np, np.random.default_rng(3), "gamma", (2,), F32)


def _chain():
    x = tf.placeholder(tf.float32, (4,))
    return x, tf.nn.relu(x * 2.0 + 1.0)


@pytest.mark.parametrize("cupy_module", [None, "raises", "no_device"])
def test_device_cuda_without_a_gpu_raises_a_clear_error(monkeypatch, cupy_module):
    if cupy_module is None:
        monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails
        message = "needs CuPy: pip install 'tinyflow\\[gpu\\]'"
    else:
        def count():
            if cupy_module == "raises":
                raise RuntimeError("cudaErrorNoDevice")
            return 0
        fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=count)))
        monkeypatch.setitem(sys.modules, "cupy", fake)
        message = "no GPU is usable \\(cudaErrorNoDevice\\)" if cupy_module == "raises" \
            else "sees no GPU"
    assert not backend.gpu_available()
    x, y = _chain()
    with pytest.raises(TinyFlowError, match=message):
        tf.compile([y], {x: ((4,), np.float32)}, {}, device="cuda")
    with pytest.raises(TinyFlowError, match=message):
        tf.Session(device="cuda").run(y, {x: np.ones(4, np.float32)})
    with pytest.raises(TinyFlowError, match=message):
        backend.array_module("cuda")
    assert backend.array_module("cpu") is np


def _load_gpu_bench():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_bench.py"
    # gpu_bench imports core_bench as a sibling script: its folder goes on sys.path,
    # as when it is run directly (without this the test passed only in a worker where
    # test_benchmarks had already put it there).
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("benchmarks.gpu_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stream_overlap_of_a_timeline():
    bench = _load_gpu_bench()
    events = [{"stream": 0, "start": 0.0, "end": 4.0}, {"stream": 0, "start": 4.0, "end": 6.0},
              {"stream": 1, "start": 3.0, "end": 7.0}, {"stream": 2, "start": 9.0, "end": 9.5}]
    # stream 0 busy [0, 6], stream 1 [3, 7]: 3 s together of the shorter 4 s.
    assert bench.stream_overlap(events, 0, 1) == pytest.approx(0.75)
    assert bench.stream_overlap(events, 0, 2) == 0.0
    assert math.isnan(bench.stream_overlap(events, 0, 5))


# ----------------------------------------------------------------------------------
# On a GPU: the same programs on CUDA as on the CPU (skipped without one)
# ----------------------------------------------------------------------------------

@needs_gpu
def test_gpu_generated_kernels_match_numpy():
    import cupy
    for op, program, arrays in _one_op_cases():
        if op == "cast" and program[0][2][0][1] != "bool" and arrays[0].dtype.kind == "f":
            arrays = [np.nan_to_num(a) for a in arrays]  # NaN -> int is undefined in C
        got = gpu.fused_compute(cupy, *[cupy.asarray(a) for a in arrays], program=program)
        want = fused_numpy(program, *arrays)
        # CUDA's expf, tanhf, powf are within 2-4 ulp of numpy's, not equal to them.
        tolerance = {"rtol": 1e-2, "atol": 1e-3} if arrays[0].dtype == F16 else \
            {"rtol": 1e-5, "atol": 1e-6}
        np.testing.assert_allclose(cupy.asnumpy(got), want, **tolerance,
                                   err_msg=f"{op} on {[a.dtype.name for a in arrays]}")
    assert gpu.stats["unfused_runs"] == 0


@needs_gpu
def test_gpu_op_gradients_match_finite_differences(monkeypatch):
    import test_ops
    monkeypatch.setattr(test_ops, "SESSION_OPTIONS", {"device": "cuda"})
    for op in sorted(test_ops.GRAD_CASES):
        rng = test_ops._rng_for(op)
        for case in test_ops.GRAD_CASES[op](rng):
            test_ops.check_gradient(op, case, rng)


def _run_case_on_gpu(case, **options):
    """random_graphs.run_case with the variables placed on the device and the
    results brought back (its own version works on numpy arrays only)."""
    import cupy
    from tinyflow import ops
    ops._generators.clear()
    session = tf.Session(device="cuda", **options)
    for var, value in case.init_values.items():
        session.variables[var] = cupy.asarray(value)
    fetched = session.run(case.fetches, case.feed_dict)
    finals = [backend.to_host(session.variables[v]) for v in case.variables]
    return [np.asarray(a) for a in fetched] + finals


@needs_gpu
def test_gpu_random_graphs_match_cpu_on_1_2_4_streams():
    from hypothesis import given, settings
    from random_graphs import assert_same_results, random_graph_cases, run_case

    @settings(max_examples=30)
    @given(random_graph_cases())
    def check(case):
        expected = run_case(case, passes=[], memory=None)
        for streams in (1, 2, 4):
            got = _run_case_on_gpu(case, streams=streams, memory="auto")
            assert_same_results(got, expected, case, f"cuda, {streams} streams",
                                rtol=1e-5, atol=1e-6)
    check()


def _digits_mlp_losses(device, steps=20):
    from tinyflow.data import load_digits
    data = load_digits()
    x_train, y_train = data[0], data[1]
    rng = np.random.default_rng(0)
    x = tf.placeholder(tf.float32, (64, 64))
    labels = tf.placeholder(tf.int64, (64,))
    sizes = [64, 128, 128, 10]
    weights = [tf.Variable(rng.uniform(-0.1, 0.1, (a, b)).astype(F32)) for a, b in
               zip(sizes[:-1], sizes[1:])]
    biases = [tf.Variable(np.zeros(b, F32)) for b in sizes[1:]]
    h = x
    for k, (w, b) in enumerate(zip(weights, biases)):
        h = tf.matmul(h, w) + b
        h = tf.nn.relu(h) if k < len(weights) - 1 else h
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(logits=h,
                                                                         labels=labels))
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    session = tf.Session(device=device)
    session.run(tf.global_variables_initializer())
    losses = []
    for step in range(steps):
        rows = slice(64 * step, 64 * step + 64)
        value, _ = session.run([loss, train], {x: x_train[rows], labels: y_train[rows]})
        losses.append(float(value))
    return losses, [backend.to_host(session.variables[w]) for w in weights]


@needs_gpu
def test_gpu_digits_mlp_trains_like_the_cpu():
    cpu_losses, cpu_weights = _digits_mlp_losses("cpu")
    gpu_losses, gpu_weights = _digits_mlp_losses("cuda")
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    for got, want in zip(gpu_weights, cpu_weights):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
    assert cpu_losses[-1] < cpu_losses[0]


@needs_gpu
def test_gpu_fused_chain_is_one_kernel_launch():
    x = tf.placeholder(tf.float32, (256, 256))
    y = tf.tanh(tf.nn.relu(x * 2.0 + 1.0) - 0.5) * 3.0
    program = tf.compile([y], {x: ((256, 256), np.float32)}, {}, device="cuda")
    fused = [s for s in program.steps if s.node.op == "fused_elementwise"]
    assert len(fused) == 1, [s.node.op for s in program.steps]
    value = np.random.default_rng(1).standard_normal((256, 256)).astype(F32)
    before = gpu.stats["launches"]
    got = program.run({x: value}, {})[0]
    assert gpu.stats["launches"] == before + 1  # needs fusion.py to call gpu.fused_compute
    np.testing.assert_allclose(got, np.tanh(np.maximum(value * 2 + 1, 0) - 0.5) * 3,
                               rtol=1e-5, atol=1e-6)


@needs_gpu
def test_gpu_fused_assign_updates_the_variable_in_place():
    """An update fused into its variable (fuse_assign) writes the device buffer the
    Session holds, one generated kernel, and matches the CPU."""
    start = np.random.default_rng(2).standard_normal((64, 32)).astype(F32)
    results = {}
    for device in ("cpu", "cuda"):
        v = tf.Variable(start)
        g = tf.placeholder(tf.float32, (64, 32))
        old = tf.exp(v) * 1.0                  # a reader: must see the value before
        step = tf.assign(v, v * 0.9 - 0.1 * tf.tanh(g))
        session = tf.Session(device=device)
        session.run(tf.global_variables_initializer())
        buffer = session.variables[v]
        got_old, _ = session.run([old, step], {g: start * 0.5})
        assert [s.node.op for s in session.last_program.steps].count("fused_assign") == 1
        assert session.variables[v] is buffer
        results[device] = (backend.to_host(got_old), backend.to_host(session.variables[v]))
    for got, want in zip(results["cuda"], results["cpu"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
