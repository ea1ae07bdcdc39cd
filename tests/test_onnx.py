"""ONNX in and out (tinyflow/onnx_io.py), with ONNX Runtime as the oracle.

* Import: models written here with onnx.helper (an MLP, a small CNN with batch norm,
  a transformer block with LayerNormalization and causal attention, and a model of
  the remaining shape/reduction ops) give ONNX Runtime's outputs (float32, rtol 1e-5),
  and their gradients (float64 copies of the same models) match central differences.
* Export: every tutorial model (the digits MLP and CNN, the char transformer) is
  exported, passes onnx.checker's full check, runs in ONNX Runtime with TinyFlow's
  outputs (rtol 1e-5), and comes back through `load` bitwise equal.
* Errors: every unsupported operator type is listed with its nodes, both ways.

Skipped when onnx or onnxruntime is not installed (the `onnx` extra).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import cli, nn_ops, ops, trace

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tinyflow import onnx_io  # noqa: E402

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
INT_MAX = np.iinfo(np.int64).max


def ort_run(model, feeds: dict) -> list[np.ndarray]:
    """ONNX Runtime on one CPU thread (the reference)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    data = model if isinstance(model, (bytes, str)) else model.SerializeToString()
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def tf_run(model: onnx_io.OnnxModel, feeds: dict, **options) -> list[np.ndarray]:
    sess = model.session(**options)
    return sess.run(list(model.outputs.values()),
                    {model.inputs[k]: v for k, v in feeds.items()})


# ----------------------------------------------------------------------------------
# Models written with onnx.helper; `dt` is float32 (for ORT) or float64 (gradients)
# ----------------------------------------------------------------------------------

def _init(name, array, dt):
    return numpy_helper.from_array(np.asarray(array, dtype=dt), name)


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _model(nodes, inputs, outputs, inits, opset):
    graph = helper.make_graph(nodes, "test", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def _elem(dt):
    return TensorProto.FLOAT if dt == np.float32 else TensorProto.DOUBLE


def mlp_model(dt=np.float32):
    """x (N, 6) -> Gemm(transB) -> Relu -> MatMul+Add -> Gelu (both forms) -> Gemm(alpha,
    beta) -> LogSoftmax; plus Sigmoid and Tanh."""
    r = np.random.default_rng(1)
    inits = [_init("w1", r.standard_normal((8, 6)) * 0.5, dt), _init("b1", r.normal(size=8), dt),
             _init("w2", r.standard_normal((8, 8)) * 0.4, dt), _init("b2", r.normal(size=8), dt),
             _init("w3", r.standard_normal((8, 4)) * 0.4, dt), _init("b3", r.normal(size=4), dt)]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="fc1", transB=1),
        helper.make_node("Relu", ["h1"], ["a1"], name="relu1"),
        helper.make_node("MatMul", ["a1", "w2"], ["m2"], name="fc2"),
        helper.make_node("Add", ["m2", "b2"], ["h2"], name="fc2_bias"),
        helper.make_node("Gelu", ["h2"], ["g_exact"], name="gelu_exact"),
        helper.make_node("Gelu", ["h2"], ["g_tanh"], name="gelu_tanh", approximate="tanh"),
        helper.make_node("Sigmoid", ["g_exact"], ["s"], name="sig"),
        helper.make_node("Tanh", ["g_tanh"], ["t"], name="tanh"),
        helper.make_node("Add", ["s", "t"], ["a2"], name="mix"),
        helper.make_node("Gemm", ["a2", "w3", "b3"], ["logits"], name="fc3", alpha=0.5,
                         beta=2.0),
        helper.make_node("LogSoftmax", ["logits"], ["logp"], name="logsoftmax", axis=1),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", _elem(dt), ["N", 6])],
                  [helper.make_tensor_value_info("logp", _elem(dt), ["N", 4])], inits, 20)


def cnn_model(dt=np.float32):
    """x (N, 2, 6, 6) -> Conv(pads 1) + BatchNormalization + Relu -> MaxPool -> Conv(SAME,
    stride 2) -> AveragePool -> GlobalAveragePool -> Flatten -> Gemm -> Softmax."""
    r = np.random.default_rng(2)
    inits = [_init("c1_w", r.standard_normal((3, 2, 3, 3)) * 0.4, dt),
             _init("c1_b", r.normal(size=3), dt),
             _init("bn_scale", r.uniform(0.5, 1.5, 3), dt), _init("bn_bias", r.normal(size=3), dt),
             _init("bn_mean", r.normal(size=3) * 0.1, dt),
             _init("bn_var", r.uniform(0.5, 2.0, 3), dt),
             _init("c2_w", r.standard_normal((4, 3, 3, 3)) * 0.4, dt),
             _init("fc_w", r.standard_normal((4, 5)) * 0.5, dt),
             _init("fc_b", r.normal(size=5), dt)]
    nodes = [
        helper.make_node("Conv", ["x", "c1_w", "c1_b"], ["c1"], name="conv1",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean",
                                                "bn_var"], ["bn"], name="bn1", epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2],
                         strides=[1, 1]),
        helper.make_node("Conv", ["p1", "c2_w"], ["c2"], name="conv2", kernel_shape=[3, 3],
                         strides=[2, 2], auto_pad="SAME_UPPER"),
        helper.make_node("AveragePool", ["c2"], ["p2"], name="pool2", kernel_shape=[2, 2],
                         strides=[1, 1]),
        helper.make_node("GlobalAveragePool", ["p2"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", _elem(dt), ["N", 2, 6, 6])],
                  [helper.make_tensor_value_info("probs", _elem(dt), ["N", 5])], inits, 17)


def transformer_model(dt=np.float32, T=4, D=8, H=2):
    """A pre-norm transformer block as PyTorch exports it at opset 17: LayerNormalization,
    Q/K/V projections, heads by Reshape/Transpose, causal mask by Where, Softmax,
    residual adds, and an MLP whose GELU is written out with Erf."""
    r = np.random.default_rng(3)
    dh = D // H

    def w(name, *shape, scale=0.3):
        return _init(name, r.standard_normal(shape) * scale, dt)

    inits = [w("ln1_g", D, scale=0.2), w("ln1_b", D), w("wq", D, D), w("wk", D, D),
             w("wv", D, D), w("wo", D, D), w("ln2_g", D), w("ln2_b", D), w("w1", D, 4 * D),
             w("b1", 4 * D), w("w2", 4 * D, D), w("b2", D),
             _ints("heads_shape", [0, T, H, dh]), _ints("merge_shape", [0, T, D]),
             numpy_helper.from_array(np.tril(np.ones((T, T), bool)), "causal"),
             _init("neg_inf", -1e9, dt), _init("sqrt_dh", math.sqrt(dh), dt),
             _init("inv_sqrt2", 1 / math.sqrt(2), dt), _init("one", 1.0, dt),
             _init("half", 0.5, dt)]
    nodes = [helper.make_node("LayerNormalization", ["x", "ln1_g", "ln1_b"], ["ln1"],
                              name="ln1", axis=-1, epsilon=1e-5)]
    for part, perm in [("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])]:
        nodes += [helper.make_node("MatMul", ["ln1", f"w{part}"], [f"{part}_flat"],
                                   name=f"proj_{part}"),
                  helper.make_node("Reshape", [f"{part}_flat", "heads_shape"], [f"{part}_4d"],
                                   name=f"split_{part}"),
                  helper.make_node("Transpose", [f"{part}_4d"], [part], name=f"heads_{part}",
                                   perm=perm)]
    nodes += [
        helper.make_node("MatMul", ["q", "k"], ["qk"], name="scores"),
        helper.make_node("Div", ["qk", "sqrt_dh"], ["scaled"], name="scale"),
        helper.make_node("Where", ["causal", "scaled", "neg_inf"], ["masked"], name="mask"),
        helper.make_node("Softmax", ["masked"], ["attn"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["attn", "v"], ["ctx4"], name="context"),
        helper.make_node("Transpose", ["ctx4"], ["ctx_t"], name="merge_t", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "merge_shape"], ["ctx"], name="merge"),
        helper.make_node("MatMul", ["ctx", "wo"], ["attn_out"], name="proj_o"),
        helper.make_node("Add", ["x", "attn_out"], ["res1"], name="residual1"),
        helper.make_node("LayerNormalization", ["res1", "ln2_g", "ln2_b"], ["ln2"], name="ln2"),
        helper.make_node("MatMul", ["ln2", "w1"], ["f1"], name="fc1"),
        helper.make_node("Add", ["f1", "b1"], ["f1b"], name="fc1_bias"),
        helper.make_node("Mul", ["f1b", "inv_sqrt2"], ["gs"], name="gelu_scale"),
        helper.make_node("Erf", ["gs"], ["ge"], name="gelu_erf"),
        helper.make_node("Add", ["ge", "one"], ["g1"], name="gelu_add"),
        helper.make_node("Mul", ["f1b", "g1"], ["g2"], name="gelu_mul"),
        helper.make_node("Mul", ["g2", "half"], ["gelu"], name="gelu_half"),
        helper.make_node("MatMul", ["gelu", "w2"], ["f2"], name="fc2"),
        helper.make_node("Add", ["f2", "b2"], ["f2b"], name="fc2_bias"),
        helper.make_node("Add", ["res1", "f2b"], ["y"], name="residual2"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", _elem(dt), ["N", T, D])],
                  [helper.make_tensor_value_info("y", _elem(dt), ["N", T, D])], inits, 17)


def shapes_model(dt=np.float32):
    """The rest of the table: Slice, Gather (axis 0 and 1), Unsqueeze, Squeeze, Expand,
    Concat, ReduceSum/Mean/Max, Cast, Where, Pow, Sqrt, Exp, Log, Constant, Identity,
    Dropout (inference), Sub, Greater."""
    r = np.random.default_rng(4)
    inits = [_init("table", r.standard_normal((5, 3)), dt), _init("col", r.normal(size=(3, 1)), dt),
             _ints("rows", [4, 0]), _ints("starts", [1]), _ints("ends", [INT_MAX]),
             _ints("axes2", [2]), _ints("steps", [1]), _ints("axes1", [1]), _ints("axes0", [0]),
             _ints("expand_to", [3, 3]), _ints("pick", [2, 0]), _init("p", 1.5, dt)]
    c = helper.make_node("Constant", [], ["one"], name="const_one",
                         value=numpy_helper.from_array(np.asarray(1.0, dt), "v"))
    nodes = [
        c,
        helper.make_node("Slice", ["x", "starts", "ends", "axes2", "steps"], ["a"], name="slice"),
        helper.make_node("ReduceSum", ["a", "axes2"], ["s"], name="rsum", keepdims=0),
        helper.make_node("Unsqueeze", ["s", "axes1"], ["s1"], name="unsqueeze"),
        helper.make_node("Expand", ["col", "expand_to"], ["cx"], name="expand"),
        helper.make_node("Add", ["a", "cx"], ["a2"], name="add_col"),
        helper.make_node("Concat", ["a2", "s1"], ["cat"], name="concat", axis=1),
        helper.make_node("Gather", ["table", "rows"], ["emb"], name="gather_rows", axis=0),
        helper.make_node("Gather", ["cat", "pick"], ["cols"], name="gather_cols", axis=1),
        helper.make_node("ReduceMean", ["cols", "axes0"], ["cm"], name="rmean", keepdims=1),
        helper.make_node("Sub", ["cols", "cm"], ["centered"], name="center"),
        helper.make_node("Greater", ["centered", "one"], ["big"], name="greater"),
        helper.make_node("Cast", ["big"], ["bigf"], name="cast", to=_elem(dt)),
        helper.make_node("Abs", ["centered"], ["abs"], name="abs"),
        helper.make_node("Add", ["abs", "one"], ["abs1"], name="abs_plus_one"),
        helper.make_node("Pow", ["abs1", "p"], ["pw"], name="pow"),
        helper.make_node("Sqrt", ["pw"], ["sq"], name="sqrt"),
        helper.make_node("Log", ["sq"], ["lg"], name="log"),
        helper.make_node("Exp", ["centered"], ["ex"], name="exp"),
        helper.make_node("Where", ["big", "ex", "lg"], ["wh"], name="where"),
        helper.make_node("Mul", ["wh", "bigf"], ["whb"], name="mask_mul"),
        helper.make_node("Add", ["wh", "whb"], ["mix"], name="mix"),
        helper.make_node("Identity", ["mix"], ["ident"], name="identity"),
        helper.make_node("Dropout", ["ident"], ["drop"], name="dropout"),
        helper.make_node("ReduceMax", ["drop", "axes2"], ["rmax"], name="rmax", keepdims=1),
        helper.make_node("Squeeze", ["rmax", "axes2"], ["out"], name="squeeze"),
        helper.make_node("MatMul", ["emb", "col"], ["emb_col"], name="emb_matmul"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", _elem(dt), ["N", 3, 4])],
                  [helper.make_tensor_value_info("out", _elem(dt), ["N", 2]),
                   helper.make_tensor_value_info("emb_col", _elem(dt), [2, 1])], inits, 18)


MODELS = {"mlp": (mlp_model, (3, 6)), "cnn": (cnn_model, (2, 2, 6, 6)),
          "transformer": (transformer_model, (2, 4, 8)), "shapes": (shapes_model, (2, 3, 4))}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_imported_model_gives_onnx_runtime_outputs(name):
    build, shape = MODELS[name]
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    model = build()
    expected = ort_run(model, {"x": x})
    imported = onnx_io.load(model)
    got = tf_run(imported, {"x": x})
    assert list(imported.outputs) == [o.name for o in model.graph.output]
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_imported_model_same_under_every_option(name):
    """Passes, memory plan and streams do not change an imported model's outputs."""
    build, shape = MODELS[name]
    x = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    imported = onnx_io.load(build())
    plain = tf_run(imported, {"x": x}, passes=[], memory=None)
    optimized = tf_run(imported, {"x": x}, streams=2)
    for a, b in zip(plain, optimized):
        assert np.array_equal(a, b)


def _checked_elements(shape, rng, count=5):
    size = int(np.prod(shape))
    flat = rng.choice(size, min(count, size), replace=False)
    return [np.unravel_index(i, shape) for i in flat]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_imported_model_gradients_match_finite_differences(name):
    """d sum(w * outputs) / d (input and every weight), by autodiff on the imported
    float64 model, against central differences at a few elements of each."""
    build, shape = MODELS[name]
    rng = np.random.default_rng(7)
    imported = onnx_io.load(build(np.float64))
    x_node = imported.inputs["x"]
    outs = list(imported.outputs.values())
    terms = [tf.reduce_sum(o * tf.constant(rng.standard_normal(
        tuple(d or shape[0] for d in o.shape)), np.float64)) for o in outs]
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    wrt = [x_node] + list(imported.variables.values())
    grads = tf.gradients(loss, wrt)
    values = {x_node: rng.standard_normal(shape), **{v: a.copy() for v, a in
                                                      imported.values.items()}}
    sess = tf.Session()
    got = sess.run([g for g in grads], values)
    eps = 1e-6
    for node, grad in zip(wrt, got):
        array = values[node]
        assert grad.shape == array.shape
        for index in _checked_elements(array.shape, rng):
            saved = array[index]
            array[index] = saved + eps
            plus = sess.run(loss, values)
            array[index] = saved - eps
            minus = sess.run(loss, values)
            array[index] = saved
            expected = (plus - minus) / (2 * eps)
            assert np.isclose(grad[index], expected, rtol=1e-5, atol=1e-7), (
                f"{name}: d loss / d {node.name}{list(index)}: autodiff {grad[index]:.8g}, "
                f"central differences {expected:.8g}")


def test_unsupported_operators_are_all_listed():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok"),
             helper.make_node("Hardmax", ["a"], ["b"], name="hard1"),
             helper.make_node("Hardmax", ["b"], ["c"], name="hard2"),
             helper.make_node("Celu", ["c"], ["y"], name="celu")]
    graph = helper.make_graph(nodes, "bad", [helper.make_tensor_value_info("x", 1, [2, 3])],
                              [helper.make_tensor_value_info("y", 1, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(onnx_io.UnsupportedOpError) as err:
        onnx_io.load(model)
    text = str(err.value)
    assert "2 ONNX operator type(s)" in text
    assert "Hardmax: hard1, hard2" in text and "Celu: celu" in text


def test_unsupported_attribute_names_the_node():
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="grouped", group=2,
                              kernel_shape=[1, 1])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("y", 1, [1, 2, 3, 3])],
        [_init("w", np.ones((2, 1, 1, 1)), np.float32)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(onnx_io.OnnxError, match="Conv node 'grouped': group=2"):
        onnx_io.load(model)


def test_unreadable_file_is_an_onnx_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00not a protobuf\xff" * 3)
    with pytest.raises(onnx_io.OnnxError, match="bad.onnx: not a readable ONNX model"):
        onnx_io.load(bad)


# ----------------------------------------------------------------------------------
# Import against ONNX Runtime where the two type systems or axis rules differ (each
# case a silent wrong answer, or a crash from inside numpy, found by a differential
# test against ORT)
# ----------------------------------------------------------------------------------

I32, I64, F32 = TensorProto.INT32, TensorProto.INT64, TensorProto.FLOAT


def _one_node(op, inputs, outputs, opset=18, inits=(), **attrs):
    """A model of one `op` node; inputs/outputs are [(name, elem type, shape)]."""
    node = helper.make_node(op, [i[0] for i in inputs] + [i.name for i in inits],
                            [o[0] for o in outputs], **attrs)
    return _model([node], [helper.make_tensor_value_info(*i) for i in inputs],
                   [helper.make_tensor_value_info(*o) for o in outputs], list(inits), opset)


def _same_as_ort(model, feeds):
    (expected,) = ort_run(model, feeds)
    (got,) = tf_run(onnx_io.load(model), feeds)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_import_keeps_onnx_types_where_numpy_widens():
    # ReduceSum of int32 gave int64, ReduceMean of ints fractions in float64, and
    # Pow(float32, int64) float64 (numpy's promotion): ONNX keeps the input's type.
    x = np.array([[1, 2], [4, 5]], np.int32)
    _same_as_ort(_one_node("ReduceSum", [("x", I32, [2, 2])], [("y", I32, [])], 13,
                           keepdims=0), {"x": x})
    _same_as_ort(_one_node("ReduceMean", [("x", I32, [2, 2])], [("y", I32, [2])], 18,
                           inits=[_ints("axes", [1])], keepdims=0), {"x": x})
    _same_as_ort(_one_node("Pow", [("a", F32, [2]), ("b", I64, [2])], [("y", F32, [2])]),
                 {"a": np.array([1.1, 3.3], np.float32), "b": np.array([3, 2])})
    _same_as_ort(_one_node("Pow", [("a", I32, [2]), ("b", I64, [2])], [("y", I32, [2])]),
                 {"a": np.array([3, -5], np.int32), "b": np.array([3, 2])})


def test_import_follows_onnx_axis_rules():
    rng = np.random.default_rng(0)
    # SoftmaxCrossEntropyLoss: the classes are axis 1 of (N, C, d1), not the last
    for d1 in (3, 4):
        model = _one_node("SoftmaxCrossEntropyLoss", [("s", F32, [2, 3, d1]), ("l", I64, [2, d1])],
                          [("y", F32, [2, d1])], 13, reduction="none")
        feeds = {"s": rng.standard_normal((2, 3, d1)).astype(np.float32),
                 "l": rng.integers(0, 3, (2, d1))}
        (expected,) = ort_run(model, feeds)
        np.testing.assert_allclose(tf_run(onnx_io.load(model), feeds)[0], expected, rtol=1e-6)
    x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    # Flatten at axis == rank gives (size, 1); a 1-D input's default axis 1 too
    _same_as_ort(_one_node("Flatten", [("x", F32, [2, 3])], [("y", F32, [6, 1])], axis=2),
                 {"x": x})
    _same_as_ort(_one_node("Flatten", [("x", F32, [5])], [("y", F32, [5, 1])]),
                 {"x": np.arange(5.0, dtype=np.float32)})
    # noop_with_empty_axes and no axes input: the identity (it reduced everything)
    for op in ("ReduceSum", "ReduceMax", "ReduceMean"):
        _same_as_ort(_one_node(op, [("x", F32, [2, 3])], [("y", F32, [2, 3])],
                               noop_with_empty_axes=1), {"x": x})
    # Max of one input; Slice with attributes (opset 9)
    _same_as_ort(_one_node("Max", [("x", F32, [2, 3])], [("y", F32, [2, 3])]), {"x": x})
    _same_as_ort(_one_node("Slice", [("x", F32, [2, 3])], [("y", F32, [2, 2])], 9,
                           starts=[0, 1], ends=[2, 3], axes=[0, 1]), {"x": x})


def _unchecked(op, inputs, outputs, opset=18, **attrs):
    """As _one_node, without the checker: models that ONNX Runtime refuses."""
    node = helper.make_node(op, [i[0] for i in inputs], outputs, **attrs)
    graph = helper.make_graph([node], "bad", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(o, F32, None) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("model, message", [
    (_one_node("Div", [("a", I32, [2]), ("b", I32, [2])], [("y", I32, [2])]),
     "Div node 'y': Div of int32 .* is not supported"),
    (_unchecked("Softmax", [("x", F32, [2, 3])], ["y"], axis=5),
     "Softmax node 'y': axis 5 is out of range for an input of rank 2"),
    (_unchecked("Gather", [("x", F32, [2, 3]), ("i", I64, [1])], ["y"], axis=3),
     "Gather node 'y': axis 3 is out of range"),
    (_unchecked("Where", [("x", F32, [2, 3]), ("x2", F32, [2, 3])], ["y"]),
     "Where node 'y' has 2 inputs; Where takes 3 to 3"),
    (_unchecked("Relu", [("x", F32, [2, 3]), ("x2", F32, [2, 3])], ["y"]),
     "Relu node 'y' has 2 inputs"),
    (_unchecked("Relu", [("x", F32, [2, 3])], ["x"]), "writes tensor 'x', which is already"),
])
def test_import_refuses_what_onnx_runtime_refuses(model, message):
    # (each ran: modulo the rank, or failing later inside numpy)
    with pytest.raises(onnx_io.OnnxError, match=message):
        onnx_io.load(model)


def test_import_of_unreadable_inputs_is_an_onnx_error(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(onnx_io.OnnxError, match="empty.onnx: the model has no graph outputs"):
        onnx_io.load(empty)          # (it loaded as a model of nothing)
    with pytest.raises(onnx_io.OnnxError, match="got NoneType"):
        onnx_io.load(None)
    bad_init = numpy_helper.from_array(np.ones((2, 4), np.float32), "w")
    bad_init.dims[:] = [4, 3]        # 8 floats claiming to be 4 x 3
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F32, [1, 4])],
                              [helper.make_tensor_value_info("y", F32, [1, 3])], [bad_init])
    with pytest.raises(onnx_io.OnnxError, match="initializer 'w' of dims \\[4, 3\\] cannot "
                                                "be read"):
        onnx_io.load(helper.make_model(graph))
    seq = helper.make_tensor_sequence_value_info("x", F32, [2])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [seq],
                              [helper.make_tensor_value_info("y", F32, [2])])
    with pytest.raises(onnx_io.OnnxError, match="input 'x' is a sequence_type"):
        onnx_io.load(helper.make_model(graph))


def test_export_where_numpy_promotes_and_onnx_does_not(tmp_path):
    # int32 / int32 (float64 in TinyFlow), a sum of int32 (int64) and a negative
    # transpose axis were refused by ONNX's checker with bare type numbers; the
    # cross entropy of (N, T, C) logits used ONNX's axis 1 as the classes (a silent
    # wrong answer in ORT).
    a = tf.placeholder(tf.int32, (3,), name="a")
    x = tf.placeholder(tf.float32, (2, 3, 4), name="x")
    labels = tf.placeholder(tf.int64, (2, 3), name="labels")
    rng = np.random.default_rng(0)
    feeds = {a: np.array([7, -7, 3], np.int32), x: rng.standard_normal((2, 3, 4)).astype(
        np.float32), labels: rng.integers(0, 4, (2, 3))}
    cases = [a / a, tf.reduce_sum(a), a < 2.5, tf.transpose(x, (-1, 0, 1)),
             nn_ops.softmax_cross_entropy(x, labels)]
    sess = tf.Session()
    for k, y in enumerate(cases):
        used = [f for f in feeds if f in set(tf.graph.reachable([y]))]
        model = onnx_io.export(y, used, tmp_path / f"m{k}.onnx", session=sess)
        (got,) = ort_run(model, {f.name: feeds[f] for f in used})
        expected = sess.run(y, {f: feeds[f] for f in used})
        assert got.dtype == expected.dtype, k
        np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=str(k))
    unknown = tf.placeholder(tf.float32, name="unknown")
    with pytest.raises(onnx_io.OnnxError, match="placeholder 'unknown' .* has no known rank"):
        onnx_io.export(unknown * 2, [unknown], tmp_path / "u.onnx")


# ----------------------------------------------------------------------------------
# Export: the tutorial models, out and back
# ----------------------------------------------------------------------------------

def _tutorial(name):
    spec = importlib.util.spec_from_file_location(f"tutorial_{name}", TUTORIALS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _digits_mlp():
    x = tf.placeholder(tf.float32, shape=(None, 64), name="images")
    return tf.nn.MLP([64, 32, 32, 10])(x), [x], {"images": np.random.default_rng(0)
                                                 .random((5, 64), np.float32) * 16}


def _digits_cnn():
    x = tf.placeholder(tf.float32, shape=(None, 1, 8, 8), name="images")
    logits = _tutorial("train_cnn").build_model(x, (4, 8), seed=0)
    return logits, [x], {"images": np.random.default_rng(1).random((5, 1, 8, 8), np.float32)}


def _char_transformer():
    module = _tutorial("train_charlm")
    context = 8
    model = module.CharTransformer(vocab_size=20, context=context, dim=16, heads=2, layers=1,
                                   seed=0)
    ids = tf.placeholder(tf.int64, shape=(None, context), name="ids")
    positions = tf.placeholder(tf.int64, shape=(context,), name="positions")
    logits = model(ids, positions)
    feeds = {"ids": np.random.default_rng(2).integers(0, 20, (3, context)),
             "positions": np.arange(context, dtype=np.int64)}
    return logits, [ids, positions], feeds


TUTORIAL_MODELS = {"mlp": _digits_mlp, "cnn": _digits_cnn, "charlm": _char_transformer}


@pytest.mark.parametrize("name", sorted(TUTORIAL_MODELS))
def test_tutorial_model_round_trip(name, tmp_path):
    logits, inputs, feeds = TUTORIAL_MODELS[name]()
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    by_node = {node: feeds[node.name] for node in inputs}
    expected = sess.run(logits, by_node)

    path = tmp_path / f"{name}.onnx"
    model = onnx_io.export(logits, inputs, path, session=sess)
    onnx.checker.check_model(onnx.load(path), full_check=True)
    # Symbolic batch dims and user names survive; doc_strings carry file:line.
    first = model.graph.input[0]
    assert first.name == inputs[0].name
    assert first.type.tensor_type.shape.dim[0].dim_param == "N"
    if name == "mlp":  # the others reshape with -1, where inference loses the symbol
        assert model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "N"
    assert all(":" in n.doc_string for n in model.graph.node)
    weights = {i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT}
    assert weights and weights <= {v.name for v in tf.trainable_variables()}

    (got,) = ort_run(str(path), feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    imported = onnx_io.load(path)
    (again,) = tf_run(imported, feeds)
    assert np.array_equal(again, expected), "re-imported model differs bitwise"


def test_export_lists_every_unsupported_op(tmp_path):
    x = tf.placeholder(tf.float32, (None, 4), name="x")
    y = tf.nn.dropout(tf.nn.relu(x), 0.5, seed=1)
    z = tf.pad(y, dim=1, pad=2)
    with pytest.raises(onnx_io.UnsupportedOpError) as err:
        onnx_io.export(z, [x], tmp_path / "m.onnx")
    text = str(err.value)
    assert "dropout_mask" in text and "pad" in text and "test_onnx.py:" in text


def test_export_needs_the_variables_values(tmp_path):
    x = tf.placeholder(tf.float32, (None, 4), name="x")
    w = tf.Variable(np.ones((4, 2), np.float32), name="w")
    with pytest.raises(onnx_io.OnnxError, match="value of variable 'w'"):
        onnx_io.export(tf.matmul(x, w), [x], tmp_path / "m.onnx")


# ----------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------

def test_cli_exports_a_recorded_graph(tmp_path):
    """A DebugRecord holds the graph but not the weights: Variables become inputs."""
    x = tf.placeholder(tf.float32, (None, 4), name="x")
    labels = tf.placeholder(tf.int64, (None,), name="labels")
    w = tf.Variable(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32),
                    name="w")
    b = tf.Variable(np.zeros(3, np.float32), name="b")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        logits=tf.nn.relu(tf.matmul(x, w) + b), labels=labels))
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    xb = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    yb = np.arange(6) % 3
    record = tmp_path / "run.tfdbg.json"
    with tf.debug.record(record):
        sess.run([loss, train], {x: xb, labels: yb})
    out = tmp_path / "run.onnx"
    assert cli.main(["export", str(record), "--onnx", str(out)]) == 0
    model = onnx.load(out)
    onnx.checker.check_model(model, full_check=True)
    inputs = {i.name for i in model.graph.input}
    assert {"x", "labels", "w", "b"} <= inputs
    values = {"w": sess.run(w), "b": sess.run(b), "x": xb, "labels": yb}
    expected = sess.run(loss, {x: xb, labels: yb})
    feeds = {name: values[name] for name in inputs}
    (got,) = ort_run(model, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_cli_debug_records_an_imported_model(tmp_path, capsys):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn_model(), path)
    record = tmp_path / "cnn.tfdbg.json"
    assert cli.main(["debug", str(path), "--batch", "3", "--save", str(record)]) == 0
    data = trace.load(record)
    last = data["graphs"][-1]
    ops_used = {n["op"] for n in last["nodes"]}
    assert "conv2d" in ops_used or any(op.startswith("fused") for op in ops_used)
    first_input = next(n for n in data["graphs"][0]["nodes"] if n["op"] == "placeholder")
    assert first_input["shape"] == [3, 2, 6, 6]
    assert data["timelines"] and data["memory_plan"] is not None
    assert any(n["where"].startswith("cnn.onnx:") for n in last["nodes"])


def test_export_after_passes(tmp_path):
    """passes= exports the simplified graph: x * 1.0 and 2 * 3 are gone, same values."""
    x = tf.placeholder(tf.float32, (None, 4), name="x")
    w = tf.Variable(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32),
                    name="w")
    y = tf.nn.relu(tf.matmul(x, w) * 1.0 + tf.constant(2.0) * tf.constant(3.0))
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    xb = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    plain = onnx_io.export(y, [x], tmp_path / "plain.onnx", session=sess)
    folded = onnx_io.export(y, {x: xb}, tmp_path / "folded.onnx", session=sess,
                            passes=["simplify", "cse", "fold", "dce"])
    assert len(folded.graph.node) < len(plain.graph.node)
    assert "Mul" not in {n.op_type for n in folded.graph.node}
    expected = sess.run(y, {x: xb})
    (got,) = ort_run(folded, {"x": xb})
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    with pytest.raises(onnx_io.OnnxError, match="needs feeds as"):
        onnx_io.export(y, [x], tmp_path / "f.onnx", session=sess, passes=["fold"])


def test_export_of_bias_add_along_any_axis(tmp_path):
    """bias_add's axis becomes the Unsqueeze that ONNX's right-aligned Add needs."""
    x = tf.placeholder(tf.float32, (2, 3, 4, 5), name="x")
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    for axis in (0, 1, 2, 3, -1):
        bias = tf.constant(rng.standard_normal(xb.shape[axis]).astype(np.float32))
        y = ops.make("bias_add", x, bias, axis=axis)
        model = onnx_io.export(y, [x], tmp_path / f"bias{axis}.onnx", session=tf.Session())
        (got,) = ort_run(model, {"x": xb})
        np.testing.assert_array_equal(got, tf.Session().run(y, {x: xb}), err_msg=str(axis))


def test_pytorch_exported_model_imports(tmp_path):
    """A model as torch.onnx writes it (conv, batch norm folded in, max pool, Flatten,
    Gemm, GELU as Erf, LayerNormalization, Softmax; dynamic batch) gives PyTorch's and
    ONNX Runtime's outputs. Skipped without torch (not one of TinyFlow's extras)."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
            self.fc, self.ln = nn.Linear(4 * 4 * 4, 6), nn.LayerNorm(6)

        def forward(self, x):
            x = torch.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
            return torch.softmax(self.ln(nn.functional.gelu(self.fc(x.flatten(1)))), -1)

    net = Net().eval()
    x = torch.randn(3, 1, 8, 8)
    path = tmp_path / "torch.onnx"
    try:
        torch.onnx.export(net, (x,), str(path), dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}},
                          opset_version=17)
    except Exception as err:  # an exporter that needs packages we do not have
        pytest.skip(f"torch.onnx.export failed here: {err}")
    model = onnx_io.load(path)
    assert model.input.shape == (None, 1, 8, 8)
    (got,) = tf_run(model, {"x": x.numpy()})
    (expected,) = ort_run(str(path), {"x": x.numpy()})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, net(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_malformed_node_is_an_onnx_error_naming_it():
    """A node missing a required attribute (never a raw KeyError), and shapes that do
    not fit (TinyFlow's ShapeError, with the ONNX node's name)."""
    pool = helper.make_node("MaxPool", ["x"], ["y"], name="no_kernel")
    graph = helper.make_graph([pool], "m", [helper.make_tensor_value_info("x", 1, [1, 1, 4, 4])],
                              [helper.make_tensor_value_info("y", 1, None)])
    with pytest.raises(onnx_io.OnnxError, match="MaxPool node 'no_kernel': KeyError"):
        onnx_io.load(helper.make_model(graph))
    mm = helper.make_node("MatMul", ["x", "w"], ["y"], name="bad_matmul")
    graph = helper.make_graph([mm], "m", [helper.make_tensor_value_info("x", 1, ["N", 3])],
                              [helper.make_tensor_value_info("y", 1, None)],
                              [_init("w", np.ones((4, 2)), np.float32)])
    with pytest.raises(onnx_io.OnnxError, match="MatMul node 'bad_matmul'.*inner dimensions"):
        onnx_io.load(helper.make_model(graph))


def test_stop_gradient_exports_as_identity(tmp_path):
    x = tf.placeholder(np.float32, (2, 3), name="x")
    y = tf.stop_gradient(x * 2.0) + 1.0
    path = tmp_path / "stop.onnx"
    onnx_io.export(y, {x: (2, 3)}, path, passes=[])
    assert "Identity" in {n.op_type for n in onnx.load(str(path)).graph.node}
    got = ort.InferenceSession(str(path)).run(None, {"x": np.ones((2, 3), np.float32)})[0]
    np.testing.assert_array_equal(got, np.full((2, 3), 3.0, np.float32))


def test_min_and_argmin_export_and_import_through_onnx_runtime(tmp_path):
    x = tf.placeholder(np.float32, (3, 4), name="x")
    low = tf.reduce_min(x, 1, keepdims=True) + tf.expand_dims(
        tf.cast(tf.argmin(x, 1), tf.float32), 1)
    path = tmp_path / "min.onnx"
    onnx_io.export(low, {x: (3, 4)}, path, passes=[])
    assert {"ReduceMin", "ArgMin"} <= {n.op_type for n in onnx.load(str(path)).graph.node}
    value = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    expected = value.min(1, keepdims=True) + value.argmin(1).astype(np.float32)[:, None]
    got = ort.InferenceSession(str(path)).run(None, {"x": value})[0]
    np.testing.assert_array_equal(got, expected)
    imported = onnx_io.load(path)    # and back: ReduceMin and ArgMin import
    sess = tf.Session()
    sess.run(imported.initializer)
    np.testing.assert_array_equal(sess.run(imported.output, {imported.input: value}),
                                  expected)


@pytest.mark.parametrize("opset", [5, 0, -5, 99999, 18.0, True])
def test_an_opset_out_of_range_is_an_onnx_error(tmp_path, opset):
    # 5, 0 and -5 were a bare ValueError; 99999 wrote a model no reader opens.
    x = tf.placeholder(tf.float32, (None, 4), name="x")
    with pytest.raises(onnx_io.OnnxError, match=f"opset {opset!r} is out of range"):
        onnx_io.export(tf.nn.relu(x), [x], tmp_path / "m.onnx", opset=opset)
    assert not (tmp_path / "m.onnx").exists()
    onnx_io.check_opset(onnx.defs.onnx_opset_version())  # the newest is taken
    onnx_io.check_opset(np.int64(onnx_io.MIN_OPSET))


def test_export_to_a_path_that_cannot_be_written_is_an_onnx_error(tmp_path):
    x = tf.placeholder(tf.float32, (None, 4), name="x")
    (tmp_path / "afile").write_text("")
    for path, reason in ((tmp_path / "afile" / "m.onnx", "Not a directory"),
                         (tmp_path, "Is a directory")):
        with pytest.raises(onnx_io.OnnxError, match=f"cannot write .*{reason}"):
            onnx_io.export(tf.nn.relu(x), [x], path)


def test_cli_refuses_an_opset_out_of_range_before_exporting(tmp_path, capsys):
    record = Path(__file__).parent / "fixtures" / "mlp.record.json"
    for opset in ("5", "0", "-5", "99999"):
        with pytest.raises(SystemExit) as stop:
            cli.main(["export", str(record), "--onnx", str(tmp_path / "m.onnx"),
                      "--opset", opset])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"--opset: opset {opset} is out of range" in err and "Traceback" not in err
    assert not (tmp_path / "m.onnx").exists()


def test_cli_exports_an_eager_record_as_its_forward_model(tmp_path):
    # Review (debugger probe): exporting an eager record wrote the last Adam update
    # (the tape's last op, an in-place write) as the model. The model's outputs are
    # the forward values nothing else reads: here the loss.
    from tinyflow import eager as E
    model = E.to_eager(tf.nn.MLP([4, 5, 3]))
    opt = E.Adam(E.parameters(model), lr=0.1)
    x, y = E.tensor(np.ones((2, 4), np.float32)), E.tensor(np.array([0, 2]))
    record = tmp_path / "eager.tfdbg.json"
    with tf.debug.record(record):
        opt.zero_grad()
        loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
    out = tmp_path / "eager.onnx"
    assert cli.main(["export", str(record), "--onnx", str(out)]) == 0
    exported = onnx.load(out)
    onnx.checker.check_model(exported, full_check=True)
    ops_used = {n.op_type for n in exported.graph.node}
    assert "SoftmaxCrossEntropyLoss" in ops_used and "Sub" not in ops_used, ops_used
    assert len(exported.graph.output) == 1
