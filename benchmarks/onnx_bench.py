"""An imported ONNX model run by TinyFlow, against ONNX Runtime running the same file.

``onnx_import_run_vs_ort``
    A LeNet-style CNN written with onnx.helper (Conv 1->16 3x3 + BatchNormalization +
    Relu + MaxPool, Conv 16->32 3x3 + Relu + MaxPool, Flatten, Gemm to 10; batch 32
    of 1x28x28, float32), imported with `tinyflow.onnx_io.load` and run through
    `Session.run` (default passes, memory plan), divided by ONNX Runtime's
    `InferenceSession.run` of the same model file (CPU provider, all graph
    optimizations). One thread each (ORT's intra/inter-op pools and BLAS through
    threadpoolctl; $TINYFLOW_BENCH_THREADS changes both). Both outputs are checked to
    agree (rtol 1e-4) before timing; rounds are interleaved; the figure is the median
    of the per-round ratios.

    The note says what the gap is made of, from one traced TinyFlow run: the share of
    the time in conv2d steps (im2col: every window copied into a matrix, then one
    GEMM; ORT's MLAS convolves in a blocked NCHWc layout without that copy), in the
    other steps, and the rest (the executor's per-run work: feeds, fetch copies).

``onnx_import_compile_ms``
    Milliseconds from the .onnx bytes to the first result: `load` (translation),
    `Session` compile (passes, plan) and one run; the note gives ORT's session
    creation plus first run for the same file.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack

import numpy as np
from core_bench import bench_threads, limit_threads, paired_ratio, time_interleaved

SEED = 0


def lenet_model(batch_dim: str = "N"):
    """The benchmark's CNN as an ONNX ModelProto (weights drawn from SEED)."""
    from onnx import helper, numpy_helper
    r = np.random.default_rng(SEED)

    def init(name, *shape, scale=0.2):
        return numpy_helper.from_array((r.standard_normal(shape) * scale).astype(np.float32),
                                       name)

    inits = [init("c1_w", 16, 1, 3, 3), init("c1_b", 16),
             numpy_helper.from_array(r.uniform(0.5, 1.5, 16).astype(np.float32), "bn_s"),
             init("bn_b", 16), init("bn_m", 16, scale=0.1),
             numpy_helper.from_array(r.uniform(0.5, 2.0, 16).astype(np.float32), "bn_v"),
             init("c2_w", 32, 16, 3, 3, scale=0.1), init("c2_b", 32),
             init("fc_w", 32 * 7 * 7, 10, scale=0.05), init("fc_b", 10)]
    nodes = [
        helper.make_node("Conv", ["x", "c1_w", "c1_b"], ["c1"], name="conv1",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_s", "bn_b", "bn_m", "bn_v"], ["bn"],
                         name="bn1"),
        helper.make_node("Relu", ["bn"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p1", "c2_w", "c2_b"], ["c2"], name="conv2",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], name="pool2", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "lenet", [helper.make_tensor_value_info("x", 1, [batch_dim, 1, 28, 28])],
        [helper.make_tensor_value_info("logits", 1, [batch_dim, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _ort_session(data: bytes, threads: int):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _breakdown(model, feeds: dict) -> str:
    """Where one traced TinyFlow run spends its time, as a sentence for the note."""
    sess = model.session(trace=True)
    fetches = list(model.outputs.values())
    sess.run(fetches, feeds)
    start = time.perf_counter()
    sess.run(fetches, feeds)
    total = time.perf_counter() - start
    events = sess.last_program.last_timeline
    by_op: dict[str, float] = {}
    for e in events:
        by_op[e["op"]] = by_op.get(e["op"], 0.0) + e["end"] - e["start"]
    steps = sum(by_op.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:4]
    shares = ", ".join(f"{op} {100 * t / total:.0f}%" for op, t in top)
    return (f"traced TinyFlow run {1e3 * total:.2f} ms: {shares}; outside the steps "
            f"(feeds, fetch copies, the run loop) {100 * (total - steps) / total:.0f}%")


def figures(quick: bool = False) -> list[dict]:
    """onnx_import_run_vs_ort and onnx_import_compile_ms (see the module docstring)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as err:
        return [{"name": name, "value": float("nan"), "goal": goal, "unit": unit,
                 "note": f"skipped: {err.name} not installed (pip install 'tinyflow[onnx]')"}
                for name, goal, unit in [("onnx_import_run_vs_ort", "<= 3", "x"),
                                         ("onnx_import_compile_ms", "<= 200", "ms")]]
    from tinyflow import onnx_io
    batch = 4 if quick else 32
    rounds = 5 if quick else 200
    data = lenet_model().SerializeToString()
    x = np.random.default_rng(1).standard_normal((batch, 1, 28, 28)).astype(np.float32)
    threads = bench_threads()
    with ExitStack() as stack:
        threads_note = limit_threads(stack, threads)
        start = time.perf_counter()
        model = onnx_io.load(data)
        sess = model.session()
        fetch, feeds = model.output, {model.input: x}
        first = sess.run(fetch, feeds)
        compile_ms = 1e3 * (time.perf_counter() - start)
        start = time.perf_counter()
        ort_sess = _ort_session(data, threads)
        (expected,) = ort_sess.run(None, {"x": x})
        ort_ms = 1e3 * (time.perf_counter() - start)
        np.testing.assert_allclose(first, expected, rtol=1e-4, atol=1e-4)

        times = time_interleaved({"tinyflow": lambda: sess.run(fetch, feeds),
                                  "ort": lambda: ort_sess.run(None, {"x": x})},
                                 warmup=2 if quick else 20, rounds=rounds)
        ratio = paired_ratio(times["tinyflow"], times["ort"])
        breakdown = _breakdown(model, feeds)
    tf_ms = 1e3 * statistics.median(times["tinyflow"])
    ort_run_ms = 1e3 * statistics.median(times["ort"])
    return [
        {"name": "onnx_import_run_vs_ort", "value": ratio, "goal": "<= 3", "unit": "x",
         "note": f"LeNet-style CNN, batch {batch}, float32, {threads_note}; median "
                 f"TinyFlow {tf_ms:.2f} ms vs ONNX Runtime {ort_run_ms:.2f} ms per run "
                 f"({rounds} interleaved rounds); {breakdown}"},
        {"name": "onnx_import_compile_ms", "value": compile_ms, "goal": "<= 200", "unit": "ms",
         "note": f"load + compile + first run of the same CNN; ONNX Runtime session "
                 f"creation + first run: {ort_ms:.1f} ms"},
    ]


if __name__ == "__main__":
    for row in figures():
        print(f"{row['name']}: {row['value']:.3f} {row['unit']} (goal {row['goal']})\n"
              f"  {row['note']}")
