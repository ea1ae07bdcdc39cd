"""Every op fact lives in the registry (issue 15, item 1).

The layers above the op modules ask `OpDef` (source, mutates, cost,
dense_activation, reshape, effect_only, checkpoint_marker, random, ...), never a set
of op names or a chain of `node.op == ...`. These tests read the source to keep it
so, and show that a new op is one `register` call: a variable writer registered
here gets TF1's read-before-write order, stays out of the arena and updates the
Session's store, with no other file knowing its name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import memory, streams
from tinyflow.ops import REGISTRY, OpDef, make, register
from tinyflow.registry import mutated_input, source_kind, written_variable

PACKAGE = Path(tf.__file__).resolve().parent
# The op modules register ops; gpu.py, onnx_import.py and onnx_export.py translate op
# names into CUDA templates and ONNX nodes (translation tables, keyed by op name by
# design; onnx_io.py only names what those two define).
OP_MODULES = {"ops.py", "shape_ops.py", "nn_ops.py", "image_ops.py", "gpu.py",
              "onnx_import.py", "onnx_export.py"}
# Modules that must not test an op's name at all: they ask the registry.
NO_OP_TESTS = ["executor.py", "memory.py", "streams.py", "sublinear.py", "graph.py",
               "api.py", "nn.py", "eager.py", "backend.py", "registry.py"]


def _op_name_collections(tree: ast.Module) -> list[tuple[int, list[str]]]:
    """Module-level sets/tuples/lists of two or more strings, all registered op
    names (dicts are translation tables, `__all__` is an export list: not sets)."""
    found = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target",
                                                                             None)]
        if any(getattr(t, "id", "") == "__all__" for t in targets):
            continue
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") in (
                "set", "frozenset", "tuple") and value.args:
            value = value.args[0]
        if not isinstance(value, (ast.Set, ast.Tuple, ast.List)) or len(value.elts) < 2:
            continue
        names = [i.value for i in value.elts
                 if isinstance(i, ast.Constant) and isinstance(i.value, str)]
        if len(names) == len(value.elts) and all(n in REGISTRY for n in names):
            found.append((node.lineno, names))
    return found


def test_no_op_name_sets_outside_the_op_modules():
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name in OP_MODULES:
            continue
        for line, names in _op_name_collections(ast.parse(path.read_text())):
            offenders.append(f"{path.name}:{line} {names}")
    assert not offenders, f"op-name sets outside the registry: {offenders}"


def test_the_set_finder_finds_a_set():
    """(The test above can fail: it finds the kind of set it forbids.)"""
    tree = ast.parse('WRITERS = {"assign", "fused_assign"}\nOTHER = ("x", 1)\n'
                     'KINDS = ("variable", "feed")\nACTS = frozenset(("relu", "tanh"))\n')
    assert _op_name_collections(tree) == [(1, ["assign", "fused_assign"]),
                                          (4, ["relu", "tanh"])]


def _op_name_tests(tree: ast.AST) -> list[int]:
    """Lines comparing `<something>.op` to a string (==, !=, in, startswith)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "op" for s in sides) and any(
                    isinstance(s, (ast.Constant, ast.Tuple, ast.Set, ast.List, ast.Name))
                    and not (isinstance(s, ast.Constant) and s.value is None)
                    for s in sides if not isinstance(s, ast.Attribute)):
                lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("startswith", "endswith")
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "op"):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", NO_OP_TESTS)
def test_no_op_name_tests_in_the_layers_that_ask_the_registry(module):
    lines = _op_name_tests(ast.parse((PACKAGE / module).read_text()))
    assert not lines, f"{module} tests op names at lines {lines}: ask OpDef instead"


def test_the_op_test_finder_finds_op_tests():
    source = 'if node.op == "matmul": pass\nif n.op in WRITERS: pass\nn.op.startswith("c")\n'
    assert _op_name_tests(ast.parse(source)) == [1, 2, 3]


def test_sources_and_writers_are_registry_facts():
    x = tf.placeholder(tf.float32, (2,))
    v = tf.Variable(np.zeros(2, np.float32))
    c = tf.constant(np.ones(2, np.float32))
    update = tf.assign(v, x + c)
    assert [source_kind(n) for n in (x, v, c, update)] == ["feed", "variable", "constant",
                                                           None]
    assert mutated_input(update) == 0 and written_variable(update) is v
    assert written_variable(x + c) is None
    with pytest.raises(ValueError, match="source="):
        OpDef("bad", lambda xp: None, lambda s, d, a: ((), None), source="disk")


def test_stream_cost_comes_from_the_opdef():
    a = tf.placeholder(tf.float32, (8, 16))
    w = tf.placeholder(tf.float32, (16, 4))
    assert streams.estimate_cost(tf.matmul(a, w)) == streams.STEP_OVERHEAD + 2.0 * 8 * 4 * 16
    assert streams.estimate_cost(a + 1.0) == streams.STEP_OVERHEAD + 8 * 16


@pytest.fixture
def scaled_assign():
    """An op no other file names: writes input 1 * scale into variable input 0."""
    def compute(xp, var, value, out=None, scale=1.0):
        var[...] = value * scale
        return var

    def infer(shapes, dtypes, attrs):
        return tuple(shapes[1]), dtypes[0]
    register(OpDef("scaled_assign_for_test", compute, infer, None, pure=False,
                   differentiable=False, mutates=0, doc="var = value * scale"))
    yield "scaled_assign_for_test"
    del REGISTRY["scaled_assign_for_test"]


@pytest.mark.parametrize("mem", ["auto", None])
def test_a_new_variable_writer_is_one_register_call(scaled_assign, mem):
    v = tf.Variable(np.array([1.0, 2.0], np.float32))
    read = v * 1.0
    write = make(scaled_assign, v, v + 1.0, scale=2.0)
    with tf.Session(memory=mem) as sess:
        sess.run(tf.global_variables_initializer())
        got_read, got_v, _ = sess.run([read, v, write])
        program = sess.last_program
        # Readers run before the writer (TF1): they see the value from before.
        np.testing.assert_array_equal(got_read, [1.0, 2.0])
        np.testing.assert_array_equal(got_v, [1.0, 2.0])
        np.testing.assert_array_equal(sess.run(v), [4.0, 6.0])
    if mem is not None:
        writer = [s for s in program.steps if s.node.op == scaled_assign]
        assert writer and not writer[0].planned  # the variable's own buffer
        assert not memory.in_arena(writer[0].node)
