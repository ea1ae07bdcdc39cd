"""Every kernel TinyFlow generates, compiled by NVRTC as CuPy would compile it, for
sm_80 and sm_90, on a machine without a GPU (tinyflow/gpu_compile.py).

Programs: each op on every dtype, every cast, random programs, the programs fused
when the tutorial models train, and every reduction on CuPy's block-reduction path
and on its CUB path (one pass and two). A program gpu.py refuses runs op by op on a
GPU and is counted as refused, not compiled. Skips, saying why, without the
``gpu-check`` wheels (CuPy, NVRTC).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

import gpu_tier
from tinyflow import fusion, gpu, gpu_compile
from tinyflow.gpu_compile import ARCHS, CudaSource, GpuCompileError

from test_gpu import _random_program  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.skipif(bool(gpu_compile.missing()), reason=gpu_compile.missing()
                                or "the gpu-check wheels are installed")

DTYPES = list(gpu.C_TYPES)   # all 12 dtypes a kernel can hold
FLOATS = ["float16", "float32", "float64"]
TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"


def sources_of(cases) -> list[CudaSource]:
    """The CUDA sources of (program, dtypes) cases, counting the refused ones."""
    found = []
    for program, dtypes in cases:
        try:
            found += gpu_compile.cuda_sources(program, dtypes, cub=False)
        except gpu.KernelGenerationError:
            gpu_tier.add("refused programs")
    return found


def compile_everywhere(sources, archs=ARCHS) -> int:
    """Compile `sources` for every arch; fail with NVRTC's log for any failure."""
    compiled = 0
    for arch in archs:
        done, failed = gpu_compile.compile_all(sources, arch)
        compiled += len(done)
        gpu_tier.add("kernels compiled", len(done))
        gpu_tier.add("compile failures", len(failed))
        assert not failed, "\n\n".join(
            f"{source.name} ({source.path}, {arch}):\n{err}" for source, err in failed[:3])
    return compiled


def one_op_cases():
    """Each template on every dtype (both operands alike, then beside float32 and
    int64 for numpy's mixed promotions), `where` on every dtype."""
    for op, template in gpu.TEMPLATES.items():
        if op == "cast":
            continue
        arity = {"where": 3}.get(op, 1 if template.emit.__code__.co_argcount == 2 else 2)
        for dtype in DTYPES:
            if arity == 1:
                yield ((op, ("x0",), ()),), [dtype]
            elif arity == 2:
                for other in (dtype, "float32", "int64"):
                    yield ((op, ("x0", "x1"), ()),), [dtype, other]
            else:
                yield ((op, ("x0", "x1", "x2"), ()),), ["bool", dtype, dtype]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_op_on_every_dtype_compiles(arch):
    sources = sources_of(one_op_cases())
    assert len(sources) > 200
    compile_everywhere(sources, [arch])


@pytest.mark.parametrize("arch", ARCHS)
def test_every_cast_compiles(arch):
    cases = [((("cast", ("x0",), (("dtype", to),)),), [dtype])
             for dtype in DTYPES for to in DTYPES]
    sources = sources_of(cases)
    assert len(sources) == len(DTYPES) ** 2   # every cast has a kernel
    compile_everywhere(sources, [arch])


@pytest.mark.parametrize("dtypes", [["float32"] * 3, ["float16"] * 2,
                                    ["float64", "float32", "float16"], ["int32", "float32"]],
                         ids=lambda d: "-".join(d))
def test_random_programs_compile(dtypes):
    rng = np.random.default_rng(len(dtypes) * 100 + len(dtypes[0]))
    cases = [(_random_program(rng, dtypes), dtypes) for _ in range(100)]
    compile_everywhere(sources_of(cases))


@pytest.mark.parametrize("script", ["train_mlp", "train_cnn", "train_charlm"])
def test_programs_fused_when_the_tutorial_models_train_compile(script, monkeypatch,
                                                               tmp_path):
    """Train each tutorial model briefly (--quick), recording every fused program the
    CPU executor plans (fusion._make_plan sees each with its input dtypes), then
    compile them all."""
    seen = {}
    plan = fusion._make_plan

    def recording(program, shapes, dtypes, *args, **kwargs):
        seen[tuple(program), tuple(np.dtype(d).name for d in dtypes)] = True
        return plan(program, shapes, dtypes, *args, **kwargs)

    monkeypatch.setattr(fusion, "_make_plan", recording)
    monkeypatch.syspath_prepend(str(TUTORIALS))
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(script)
    module.main(["--quick", "--epochs", "1", "--checkpoint", str(tmp_path / "model.npz")])
    sys.modules.pop(script, None)
    assert len(seen) >= 5, f"{script} fused only {len(seen)} programs"
    compile_everywhere(sources_of(seen))


REDUCTION_BODIES = [(), (("mul", ("x0", "x1"), ()), ("tanh", ("t0",), ()))]


def _reduction(op: str, body: tuple, axis=None) -> tuple:
    last = f"t{len(body) - 1}" if body else "x0"
    return body + ((op, (last,), (("axis", axis), ("keepdims", False))),)


def test_every_reduction_compiles_on_cupys_block_reduction_path():
    cases = [(_reduction(op, body), [dtype] * (2 if body else 1))
             for op in gpu.REDUCTIONS for dtype in FLOATS for body in REDUCTION_BODIES]
    sources = sources_of(cases)
    assert len(sources) == len(cases)
    compile_everywhere(sources)


@pytest.mark.parametrize("op", gpu.REDUCTIONS)
def test_every_reduction_compiles_on_the_cub_path(op):
    """CUPY_ACCELERATORS=cub: one input, one pass over segments, on every float type
    (sm_90), and the two passes of a full reduction (float32, sm_80). A CUB kernel
    parses CUB's headers, about 1.5 s of NVRTC each: these are the kernels whose
    text differs, not every arch times every dtype."""
    for dtype in FLOATS:
        source = gpu.kernel_source(_reduction(op, (("mul", ("x0", "x0"), ()),)), [dtype])
        compile_everywhere(gpu_compile.cub_reduction_cuda(source, dtype, False), ["sm_90"])
    source = gpu.kernel_source(_reduction(op, (("tanh", ("x0",), ()),)), ["float32"])
    compile_everywhere(gpu_compile.cub_reduction_cuda(source, "float32", True), ["sm_80"])


def test_a_long_mean_compiles_on_the_cub_path():
    """Regression: a long program's shortened name dropped "mean", so CuPy's CUB path
    left `_in_ind` in the kernel: NVRTC said 'identifier "_in_ind" is undefined'."""
    body = tuple(("tanh", (f"t{k - 1}" if k else "x0",), ()) for k in range(11))
    program = body + (("mean", ("t10",), (("axis", 1), ("keepdims", False))),)
    source = gpu.kernel_source(program, ["float32"])
    sources = (gpu_compile.cub_reduction_cuda(source, "float32", False)
               + gpu_compile.cub_reduction_cuda(source, "float32", True))
    compile_everywhere(sources, ["sm_90"])


def test_the_options_are_cupys_and_ours():
    """What the README says about precision is what NVRTC is told: no contraction
    into FMA (ours), and flush-to-zero (CuPy's, always)."""
    source = gpu_compile.cuda_sources((("mul", ("x0", "x1"), ()), ("add", ("t0", "x2"), ())),
                                      ["float32"] * 3)[0]
    options = gpu_compile.nvrtc_options(source, "sm_80")
    assert "--fmad=false" in source.options and "-ftz=true" in options
    assert "-arch=sm_80" in options
    assert source.code.startswith("#include <cupy/")  # CuPy's header, then its loop
    assert "CUPY_FOR" in source.code and "x0 * x1" in source.code


def test_a_kernel_that_does_not_compile_is_named_with_nvrtc_log():
    good = gpu_compile.cuda_sources(((("neg", ("x0",), ())),), ["float32"])[0]
    broken = CudaSource("tinyflow_broken", good.code.replace("-x0", "-undefined_x"),
                        good.options, "elementwise")
    other = gpu_compile.cuda_sources(((("abs", ("x0",), ())),), ["float64"])[0]
    done, failed = gpu_compile.compile_all([good, broken, other], "sm_90")
    assert [s.name for s, _ in failed] == ["tinyflow_broken"]
    assert {c.name for c in done} == {good.name, other.name}
    assert 'identifier "undefined_x" is undefined' in failed[0][1].log
    with pytest.raises(GpuCompileError, match="tinyflow_broken"):
        gpu_compile.compile_one(broken, "sm_80")


def test_one_kernel_reports_its_ptx_size_and_registers():
    source = gpu_compile.cuda_sources(((("gelu", ("x0",), ())),), ["float32"])[0]
    compiled = gpu_compile.compile_one(source, "sm_90")
    assert compiled.ptx_bytes > 1000 and compiled.cubin_bytes > 1000
    assert compiled.registers is not None and 8 <= compiled.registers <= 255
    assert gpu_compile.compile_one(source, "sm_90") is compiled   # cached by source hash
