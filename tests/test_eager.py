"""Eager mode (tinyflow/eager.py): Tensors over the registry, the tape, tracing, and
the caching allocator.

The anchors: every op's eager gradient equals its graph gradient (driven by the
same GRAD_CASES table as the finite-difference checks, so a new op cannot skip
it); a traced step equals the eager step bitwise on the tutorial models; the
allocator's bookkeeping is proven by its validator after every random sequence.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyflow as tf
from tinyflow import eager as E
from tinyflow import tracing
from tinyflow.allocator import Block
from tinyflow.eager import CachingAllocator, EagerError, GraphBreak, Tensor

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tutorials"))

from test_ops import GRAD_CASES, Fixed, _rng_for

F64 = np.float64


# ----------------------------------------------------------------------------------
# Gradients: eager == graph for every op in the table
# ----------------------------------------------------------------------------------

def _graph_grads(case, values, free, weights):
    phs = [tf.placeholder(v.dtype, v.shape) for v in values]
    y = case.build(*phs)
    w = tf.placeholder(F64, weights.shape)
    loss = tf.reduce_sum(tf.cast(y, F64) * w)
    grads = tf.gradients(loss, [phs[i] for i in free])
    sess = tf.Session(passes=[], memory=None)
    return sess.run([y] + [g for g in grads if g is not None],
                    {**dict(zip(phs, values)), w: weights})


def _eager_grads(case, values, free):
    tensors = [E.tensor(v, requires_grad=i in free) for i, v in enumerate(values)]
    y = case.build(*tensors)
    return y, tensors


@pytest.mark.parametrize("op", sorted(GRAD_CASES))
def test_eager_gradient_equals_graph_gradient(op):
    """Same rule, run two ways: built into a graph and run, or interpreted at once."""
    rng = _rng_for(op)
    for case in GRAD_CASES[op](rng):
        values = [a.value if isinstance(a, Fixed) else a for a in case.args]
        free = [i for i, a in enumerate(case.args) if not isinstance(a, Fixed)]
        y, tensors = _eager_grads(case, values, free)
        weights = np.random.default_rng(1).standard_normal(y.shape)
        loss = tf.reduce_sum(tf.cast(y, F64) * E.tensor(weights))
        loss.backward()
        expected = _graph_grads(case, values, free, weights)
        np.testing.assert_array_equal(y.numpy(), expected[0], err_msg=f"{op} forward")
        got = [tensors[i].grad for i in free]
        got = [g.numpy() for g in got if g is not None]
        assert len(got) == len(expected) - 1, f"{op}: {len(got)} eager grads, " \
                                              f"{len(expected) - 1} graph grads"
        for index, (g, want) in enumerate(zip(got, expected[1:])):
            np.testing.assert_array_equal(
                g, want, err_msg=f"{op}{case.label and ' ' + case.label}: gradient of "
                                 f"argument {free[index]}")


def test_grad_of_grad_eager_equals_graph():
    """create_graph=True records the backward pass, so it can be differentiated."""
    values = np.array([0.3, -1.2, 2.0])
    x = E.tensor(values, requires_grad=True)
    y = (tf.tanh(x) * x * x).sum()
    y.backward(create_graph=True)
    first = x.grad
    x.grad = None
    first.sum().backward()
    xs = tf.placeholder(F64, (3,))
    g = tf.gradients(tf.reduce_sum(tf.tanh(xs) * xs * xs), xs)[0]
    gg = tf.gradients(tf.reduce_sum(g), xs)[0]
    want_g, want_gg = tf.Session(passes=[]).run([g, gg], {xs: values})
    np.testing.assert_array_equal(first.numpy(), want_g)
    np.testing.assert_array_equal(x.grad.numpy(), want_gg)


def test_ten_thousand_deep_chain():
    x = E.tensor(np.array([0.5]), requires_grad=True)
    y = x
    for _ in range(10_000):
        y = y * 1.0001
    y.backward()
    assert math.isclose(x.grad.item(), 1.0001 ** 10_000, rel_tol=1e-9)
    del y  # freeing the chain must not overflow the stack either


# ----------------------------------------------------------------------------------
# PyTorch's semantics
# ----------------------------------------------------------------------------------

def test_backward_twice_needs_retain_graph_and_then_accumulates():
    x = E.tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0])
    y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 8.0])  # accumulated
    with pytest.raises(EagerError, match="retain_graph=True"):
        y.backward()


def _while_other_thread(inside_other, body):
    """Run `inside_other(inside, done)` in a new thread; once it sets `inside`,
    run body() here, then set `done` and join."""
    import threading
    inside, done = threading.Event(), threading.Event()
    other = threading.Thread(target=inside_other, args=(inside, done))
    other.start()
    try:
        assert inside.wait(10)
        return body()
    finally:
        done.set()
        other.join()


def test_grad_mode_is_per_thread():
    # Regression: no_grad in one thread (an evaluation loop beside training) kept
    # another thread's ops off the tape, and its backward found no gradient.
    def evaluate(inside, done):
        with E.no_grad():
            inside.set()
            done.wait(10)

    def train():
        x = E.tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
        (x * x).sum().backward()
        assert np.array_equal(x.grad.numpy(), [2.0, -4.0, 6.0])

    _while_other_thread(evaluate, train)


def test_tracing_in_one_thread_leaves_another_threads_ops_eager():
    # The tracer is per thread too: a function being traced in one thread took the
    # eager ops of every other thread into its graph (they came out symbolic).
    @tf.function
    def waits_while_traced(v, inside, done):
        inside.set()
        done.wait(10)
        return v * 2.0

    def trace(inside, done):
        waits_while_traced(E.tensor(np.ones(2)), inside, done)

    def eager_op():
        y = E.tensor(np.array([1.0, 2.0])) + 1.0
        assert y.numpy().tolist() == [2.0, 3.0]

    _while_other_thread(trace, eager_op)


def test_threads_that_first_call_a_function_at_once_trace_it_once():
    # Each traced while the first was still tracing: three traces of one signature
    # ("first call" three times) and three copies of its program in the cache.
    import threading
    import time
    inside = threading.Event()

    @tf.function
    def slow(v):
        inside.set()
        time.sleep(0.3)   # the others call meanwhile
        return v * 2.0

    results = []
    first = threading.Thread(target=lambda: results.append(slow(E.tensor(np.ones(2)))))
    first.start()
    assert inside.wait(10)
    others = [threading.Thread(target=lambda: results.append(slow(E.tensor(np.ones(2)))))
              for _ in range(2)]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join()
    assert [r.numpy().tolist() for r in results] == [[2.0, 2.0]] * 3
    assert [t["reason"] for t in slow.traces] == ["first call"]
    assert sum(len(programs) for programs in slow.cache.values()) == 1


def test_each_thread_allocates_from_its_own_allocator():
    # Two threads' mallocs interleaving in one allocator could hand out one block
    # twice (the allocator's Python is no single step). A Tensor freed in another
    # thread goes back to its own allocator at that allocator's next malloc.
    import threading
    made, theirs = [], []

    def make():
        theirs.append(E.allocator())
        made.append(E.tensor(np.arange(4.0)))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert theirs[0] is not E.allocator() and theirs[0].thread == thread.ident
    before = theirs[0].allocated
    assert before > 0
    made.clear()   # its last reference dies here, in this thread
    assert theirs[0].allocated == before and len(theirs[0].deferred) == 1
    theirs[0].validate()


def test_a_tensor_dropped_by_a_thread_that_never_ran_an_eager_op_waits_for_its_owner():
    # Regression (a review of the per-thread allocators): a thread that only held
    # and dropped main's Tensors freed their blocks into main's allocator at once,
    # while main could be in the middle of a malloc (a block lost from the bins).
    import threading
    main_alloc = E.allocator()
    held = [E.tensor(np.arange(5.0))]
    block = held[0]._block
    before = main_alloc.allocated
    thread = threading.Thread(target=held.clear)   # no eager op: just drops it
    thread.start()
    thread.join()
    assert main_alloc.allocated == before and block in main_alloc.deferred
    E.tensor(np.ones(2))   # main's next malloc frees it
    assert block not in main_alloc.deferred and not block.allocated
    main_alloc.validate()


def test_a_record_leaves_out_the_blocks_of_another_threads_tensors(tmp_path):
    # Regression: a Tensor made in another thread, read by recorded ops, was listed
    # with its block, whose id and segment are its own allocator's: a KeyError at
    # the end of the record (no file), or main's own input hidden by an id clash.
    import threading
    from tinyflow import trace
    made = {}

    def worker():
        made["small"] = E.tensor(np.ones(16, np.float32))
        made["big"] = E.tensor(np.ones(300_000, np.float32))   # its segment 1

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    x = E.tensor(np.ones(16, np.float32))
    path = tmp_path / "r.tfdbg.json"
    with tf.debug.record(path):
        y = (made["big"].sum() + made["small"].sum() + x.sum()) * 2.0
    assert y.item() == 2.0 * (300_000 + 16 + 16)
    tensors = trace.load(path)["memory_plan"]["tensors"]
    inputs = [t for t in tensors if t["kind"] != "intermediate"]
    assert [t["nbytes"] for t in inputs] == [x._block.size]   # main's input, listed once


def test_tinyflow_trace_records_the_main_threads_eager_ops(tmp_path):
    # Regression: with per-thread allocators, TINYFLOW_TRACE's record (every
    # thread's) followed whichever thread ran an eager op first: a warm-up thread
    # took it, and main's whole training was left out.
    import subprocess
    from tinyflow import trace
    script = tmp_path / "warm_then_train.py"
    script.write_text(
        "import threading\nimport numpy as np\nfrom tinyflow import eager as E\n"
        "t = threading.Thread(target=lambda: E.tensor(np.ones(4)) * 2.0)\n"
        "t.start(); t.join()\n"
        "w = E.tensor(np.ones((8, 8)), requires_grad=True)\n"
        "loss = ((E.tensor(np.ones((4, 8))) @ w) ** 2.0).sum()\n"
        "loss.backward()\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "TINYFLOW_TRACE": str(tmp_path / "t.json")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ops = [n["op"] for n in trace.load(tmp_path / "t.json")["graphs"][0]["nodes"]]
    assert "matmul" in ops and "pow" in ops


def test_threads_training_side_by_side_get_their_own_answers():
    # Regression: a backward (and an optimizer step) runs under no_grad, which was
    # the whole process's: another thread's forward ops in the meantime were not
    # taped, and its backward failed ("does not require grad").
    import sys
    import threading
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, 16)) for _ in range(3)]
    w0 = rng.standard_normal((16, 16))

    def train(x, steps):
        w = E.tensor(w0, requires_grad=True)
        out = []
        for _ in range(steps):
            y = tf.reduce_sum(tf.tanh(tf.nn.relu(E.tensor(x) @ w) * 2.0 + 1.0))
            y.backward()
            out.append((y.item(), w.grad.numpy().copy()))
            w.grad = None
        E.allocator().validate()
        return out

    alone = [train(x, 1)[0] for x in xs]
    results, errors = {}, []

    def run(k):
        try:
            results[k] = train(xs[k], 60)
        except Exception as err:   # (reported below, with the others')
            errors.append(repr(err))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as CPython will
    try:
        threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    for k in range(len(xs)):
        for loss, grad in results[k]:
            assert loss == alone[k][0] and np.array_equal(grad, alone[k][1])


def test_no_grad_and_in_place_rules():
    w = E.tensor(np.ones(3), requires_grad=True)
    with E.no_grad():
        y = w * 2.0
    assert not y.requires_grad
    with pytest.raises(EagerError, match="does not require grad"):
        y.sum().backward()
    with pytest.raises(EagerError, match="in-place write to a leaf"):
        w.sub_(1.0)
    with E.no_grad():
        w.sub_(1.0)
    np.testing.assert_array_equal(w.numpy(), [0.0, 0.0, 0.0])



SPECIALS = np.array([0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, np.nan, 3e38, -1e-45])


@pytest.mark.parametrize("method", ["sub_", "add_", "mul_"])
@pytest.mark.parametrize("value", [
    pytest.param(lambda: E.tensor(SPECIALS[::-1].astype(np.float32)), id="tensor"),
    pytest.param(lambda: E.tensor(np.float32([-0.0])), id="broadcast"),
    pytest.param(lambda: np.float32(-0.0), id="numpy-literal"),
    pytest.param(lambda: 0.1, id="python-float"),
    pytest.param(lambda: E.tensor(SPECIALS[::-1]), id="float64-tensor"),
])
def test_in_place_updates_equal_assigning_the_result(method, value):
    # Under no_grad, sub_/add_/mul_ write the ufunc's result straight into the
    # Tensor's block when it has the Tensor's shape and dtype; otherwise (a float64
    # value: the result is float64) they assign the op's result. Both must give the
    # bits of `assign_(self <op> value)`, for every special value.
    op = {"sub_": "__sub__", "add_": "__add__", "mul_": "__mul__"}[method]
    p = E.tensor(SPECIALS.astype(np.float32))
    q = E.tensor(SPECIALS.astype(np.float32))
    with E.no_grad(), np.errstate(all="ignore"):
        got = getattr(p, method)(value())
        q.assign_(getattr(q, op)(value()))
    assert got is p and p.dtype == np.float32
    np.testing.assert_array_equal(p.numpy().view(np.uint32), q.numpy().view(np.uint32))


def test_an_in_place_update_under_no_grad_takes_no_new_block():
    p = E.tensor(np.ones((64, 64), np.float32))
    g = E.tensor(np.full((64, 64), 0.5, np.float32))
    alloc = E.allocator()
    with E.no_grad():
        alloc.peak_allocated = alloc.allocated
        p.sub_(g)
        assert alloc.peak_allocated == alloc.allocated    # nothing was allocated
        p.add_(E.tensor(np.ones(64, np.float32)))        # a broadcast value: in place too
    np.testing.assert_array_equal(p.numpy(), np.full((64, 64), 1.5, np.float32))
    block = p._block
    with E.no_grad():
        p.mul_(2.0)
    assert p._block is block


@pytest.mark.parametrize("method", ["sub_", "add_"])
@pytest.mark.parametrize("alpha", [0.1, -0.0, np.float32(3.0), np.float64(1e-3)])
@pytest.mark.parametrize("value", [
    pytest.param(lambda n: E.tensor(np.resize(SPECIALS[::-1], n).astype(np.float32)),
                 id="tensor"),
    pytest.param(lambda n: E.tensor(np.float32([-0.5])), id="broadcast"),
    pytest.param(lambda n: E.tensor(np.resize(SPECIALS, n)), id="float64-tensor"),
    pytest.param(lambda n: 0.25, id="number"),
])
def test_scaled_in_place_updates_equal_the_unfused_expression(method, alpha, value,
                                                               monkeypatch):
    # p.sub_(g, alpha=lr) (PyTorch's spelling of SGD's update) runs alpha * g and
    # the update slice by slice through a scratch block; the bits must be those of
    # `p.assign_(p - alpha * g)`, for every special value, with slices that do not
    # divide the Tensor (here 8 elements a slice, 37 elements).
    monkeypatch.setattr(E, "SCALED_SLICE_BYTES", 32)
    n = 37
    op = {"sub_": "__sub__", "add_": "__add__"}[method]
    start = np.resize(SPECIALS, n).astype(np.float32)
    p, q = E.tensor(start), E.tensor(start)
    with E.no_grad(), np.errstate(all="ignore"):
        got = getattr(p, method)(value(n), alpha=alpha)
        q.assign_(getattr(q, op)(alpha * value(n)))
    assert got is p and p.dtype == np.float32
    np.testing.assert_array_equal(p.numpy().view(np.uint32), q.numpy().view(np.uint32))


def test_a_scaled_update_takes_only_a_slice_of_scratch_and_works_traced(tmp_path):
    from tinyflow import trace
    p = E.tensor(np.ones((512, 512), np.float32))
    g = E.tensor(np.full((512, 512), 0.5, np.float32))
    alloc = E.allocator()
    with E.no_grad():
        alloc.peak_allocated = alloc.allocated
        p.sub_(g, alpha=0.1)
        assert alloc.peak_allocated - alloc.allocated == E.SCALED_SLICE_BYTES
    np.testing.assert_array_equal(p.numpy(), np.float32(1) - np.float32(0.1) * g.numpy())
    path = tmp_path / "update.tfdbg.json"
    with tf.debug.record(path), E.no_grad():
        p.sub_(g, alpha=0.1)
    record = trace.load(path)
    trace.validate(record)
    (node,) = record["graphs"][0]["nodes"][-1:]
    assert node["op"] == "sub" and node["attrs"] == {"in_place": True, "alpha": 0.1}
    # the scratch slice, beside p and g (listed: made before recording)
    assert sorted(t["kind"] for t in record["memory_plan"]["tensors"]) == [
        "scratch", "variable", "variable"]

    @tracing.function
    def step(w, grad):
        with E.no_grad():
            w.sub_(grad, alpha=0.1)
        return w

    w = E.tensor(np.ones((4, 3), np.float32))
    step(w, E.tensor(np.full((4, 3), 0.5, np.float32)))
    np.testing.assert_array_equal(w.numpy(), np.float32(1) - np.float32(0.1) * np.float32(0.5))


def test_scaled_updates_by_numbers_arrays_and_tensor_alphas_match_the_expression(tmp_path):
    # Regressions found in review: a number or array value got a product typed on
    # its own (float32 for a float64 target, int32 wrapping around for an int64
    # one); a bool target failed; a Tensor alpha failed inside tf.debug.record after
    # updating; numpy set to raise left the update half done.
    p = E.tensor(np.zeros(3))
    with E.no_grad():
        p.sub_(np.ones(3), alpha=0.1)
    assert p.numpy()[0] == -0.1 * 1.0
    q = E.tensor(np.zeros(3, np.int64))
    with E.no_grad():
        q.add_(2 ** 20, alpha=2 ** 20)
    assert (q.numpy() == 2 ** 40).all()
    flags = E.tensor(np.array([True, False, True]))
    with E.no_grad(), pytest.raises(EagerError, match="float32, which this bool Tensor "
                                                      "cannot hold"):
        flags.sub_(E.tensor(np.ones(3, bool)), alpha=0.5)   # (PyTorch refuses too)
    w = E.tensor(np.ones(3, np.float32))
    with tf.debug.record(tmp_path / "alpha.tfdbg.json"), E.no_grad():
        w.sub_(E.tensor(np.ones(3, np.float32)), alpha=E.tensor(np.float32(0.05)))
    np.testing.assert_array_equal(w.numpy(), np.float32(1) - np.float32(0.05))
    big = E.tensor(np.full(8, 3e38, np.float32))
    with E.no_grad(), np.errstate(over="raise"), pytest.raises(EagerError):
        big.sub_(E.tensor(np.full(8, 3e38, np.float32)), alpha=10.0)
    assert (big.numpy() == np.float32(3e38)).all()     # untouched


def test_a_scaled_update_of_a_leaf_that_requires_grad_needs_no_grad():
    p = E.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(EagerError, match="in-place write to a leaf"):
        p.sub_(E.tensor(np.ones(3)), alpha=0.5)

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64,
                                   np.uint8, np.bool_])
@pytest.mark.parametrize("number", [0.5, -0.0, 0.0, 3, -2, True, np.float32(0.25),
                                    np.int64(7), np.float64(-0.0)])
def test_a_literal_beside_a_tensor_is_typed_as_in_the_graph(dtype, number):
    # A number beside one Tensor takes a shortcut to its remembered constant
    # (_with_literals): on either side, before and after it is remembered, the
    # result has the dtype and the bits the graph gives for the same expression.
    value = np.array([1, 0, 1], dtype)
    x = E.tensor(value)
    p = tf.placeholder(value.dtype, value.shape)
    for build in (lambda t: t * number, lambda t: number - t):
        try:
            graph_node = build(p)
        except tf.TinyFlowError as refused:   # (-2 beside uint8, bool - bool): eager too
            with pytest.raises(type(refused)):
                build(x)
            continue
        with np.errstate(all="ignore"):
            want = tf.Session(passes=[]).run(graph_node, {p: value})
            for _ in range(2):        # made, then remembered
                got = build(x).numpy()
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_a_symbolic_tensor_used_outside_its_trace_is_a_clear_error():
    # Regression: a Tensor that stands for a node of a traced function, kept past the
    # call and used eagerly, failed inside eager.py ("'NoneType' object has no
    # attribute 'shape'").
    kept = []

    @tracing.function
    def double(x):
        y = x * 2.0
        kept.append(y)
        return y

    double(E.tensor(np.ones(3, np.float32)))
    for use in (lambda t: t * 0.5, lambda t: t + E.tensor(np.ones(3, np.float32)),
                lambda t: -t):
        with pytest.raises(EagerError, match="at test_eager.py:.*symbolic Tensor"):
            use(kept[0])


def test_the_operator_shortcut_fails_as_apply_does_and_keeps_no_block():
    # apply_unary/apply_binary run a remembered ufunc themselves; when it raises
    # (numpy set to raise on overflow), the op goes to apply, whose error names the
    # line, and the shortcut's block is given back.
    big = E.tensor(np.full(4, 3e38, np.float32))
    with E.no_grad():
        for op in (lambda t: t * 10.0, lambda t: t * t, lambda t: tf.exp(t)):
            op(E.tensor(np.ones(4, np.float32)))    # the kernel is remembered now
            before = E.allocator().allocated
            with np.errstate(over="raise"), pytest.raises(EagerError,
                                                          match="at test_eager.py:"):
                op(big)
            assert E.allocator().allocated == before


def test_a_kernel_failure_in_the_operator_shortcut_runs_once():
    # Regression (review of the shortcut): a failing ufunc was run again by apply,
    # so numpy's error callback ran twice, a recording allocator logged two
    # alloc/free pairs, and the EagerError's cause had a second FloatingPointError
    # in its chain.
    calls = []

    def callback(kind, flag):
        calls.append(kind)
        raise FloatingPointError(kind)

    alloc = CachingAllocator(record=True)
    old = E.set_allocator(alloc)
    try:
        x = E.tensor(np.array([1.0, 0.0]))
        with E.no_grad(), np.errstate(all="call"):
            old_call = np.seterrcall(callback)
            try:
                for op in (lambda: x / 0.0, lambda: -(x / x)):
                    for _ in range(2):     # the second time through the shortcut
                        calls.clear()
                        before = len(alloc.events)
                        with pytest.raises(EagerError, match="at test_eager.py:") as failure:
                            op()
                        assert calls and len(set(calls)) == len(calls), calls
                        cause = failure.value.__cause__
                        assert isinstance(cause, FloatingPointError)
                        assert cause.__context__ is None and cause.__cause__ is None
                        assert len(alloc.events) - before <= 2 * len(calls) + 2
            finally:
                np.seterrcall(old_call)
        alloc.validate()
    finally:
        E.set_allocator(old)


# ----------------------------------------------------------------------------------
# Writing over a dying operand (apply_over): nn.Linear's bias, gradients in backward
# ----------------------------------------------------------------------------------

@pytest.fixture
def over_any_size(monkeypatch):
    """apply_over writes over operands of any size (by default only from
    MIN_OVER_BYTES up), so that these small cases take the path."""
    monkeypatch.setattr(E, "MIN_OVER_BYTES", 0)


def _linear_case(seed=0):
    rng = np.random.default_rng(seed)
    x = E.tensor(rng.standard_normal((6, 5)))
    w = E.tensor(rng.standard_normal((5, 4)), requires_grad=True)
    b = E.tensor(rng.standard_normal(4), requires_grad=True)
    return x, w, b


def test_make_over_writes_the_bias_into_the_product_and_keeps_the_bits(over_any_size):
    x, w, b = _linear_case()
    product = x @ w
    block = product._block
    y = tf.ops.make_over("add", product, b)
    assert y._block is block and product._block is None   # the product's block, taken
    expected = (x @ w) + b
    assert np.array_equal(y.numpy(), expected.numpy())
    (y * y).sum().backward()
    grads = [w.grad.numpy().copy(), b.grad.numpy().copy()]
    w.grad = b.grad = None
    (expected * expected).sum().backward()
    assert np.array_equal(grads[0], w.grad.numpy()) and np.array_equal(grads[1], b.grad.numpy())
    E.allocator().validate()


def test_a_linear_output_frees_its_block_when_it_dies(over_any_size):
    # Regression (review of apply_over): the product, kept on the tape as the bias
    # add's input, still pointed at the output's array, so an output dropped before
    # any backward held its block until the next malloc (allocated did not return).
    layer = E.to_eager(tf.nn.Linear(5, 4))
    x = E.tensor(np.ones((6, 5), np.float32))
    before = E.allocator().allocated
    y = layer(x)
    assert y._inputs[0]._block is None    # the product's block is the output's
    del y
    assert E.allocator().allocated == before and not E.allocator().deferred


def test_apply_over_leaves_small_operands_to_apply():
    x, w, b = _linear_case()
    product = x @ w
    assert product.data.nbytes < E.MIN_OVER_BYTES
    block = product._block
    y = tf.ops.make_over("add", product, b)
    assert product._block is block and y._block is not block
    big = E.tensor(np.ones((E.MIN_OVER_BYTES // 8, 1)))
    block = big._block
    assert tf.ops.make_over("add", big, 1.5 * E.tensor(np.ones(1)))._block is block


def test_nn_linear_eager_equals_graph_bitwise():
    rng = np.random.default_rng(1)
    layer = tf.nn.Linear(5, 3)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    ph = tf.placeholder(tf.float32, (4, 5))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        graph_y, w, b = sess.run([layer(ph), layer.weight, layer.bias], {ph: x})
    eager = E.to_eager(tf.nn.Linear(5, 3))
    with E.no_grad():
        eager.weight.assign_(w)
        eager.bias.assign_(b)
    assert np.array_equal(eager(E.tensor(x)).numpy(), graph_y)


@pytest.mark.parametrize("case", ["a view of it lives", "its op's rule reads its output",
                                  "this op's rule reads it", "a literal", "another layout"])
def test_apply_over_takes_the_general_path_when_the_value_is_still_needed(case, over_any_size):
    # Each case would be silently wrong (or refused) if written over: the result
    # and every gradient must equal those of the plain op, and what the caller
    # still sees must not change.
    x, w, b = _linear_case(2)

    def run(over):
        w.grad = b.grad = None
        made = {"a view of it lives": lambda: x @ w,
                "its op's rule reads its output": lambda: tf.tanh(x @ w),
                "this op's rule reads it": lambda: x @ w,
                "a literal": lambda: x @ w,
                "another layout": lambda: (x @ w)[:1]}[case]()
        op, other = {"this op's rule reads it": ("mul", b), "a literal": ("add", 2.0),
                     "another layout": ("add", E.tensor(np.ones((6, 4))))}.get(case, ("add", b))
        view = made.data[1:] if case == "a view of it lives" else None  # (numpy() copies)
        seen = None if view is None else view.copy()
        y = tf.ops.make_over(op, made, other) if over else E.apply(op, (made, other), {})
        (y * y).sum().backward()
        if view is not None:
            assert np.array_equal(view, seen)
        b_grad = None if b.grad is None else b.grad.numpy().copy()
        return y.numpy().copy(), w.grad.numpy().copy(), b_grad

    for got, want in zip(run(True), run(False)):
        assert (got is None and want is None) or np.array_equal(got, want)


def test_a_gradient_handed_to_two_inputs_is_not_written_over(over_any_size):
    # add's rule hands the same gradient Tensor to both inputs. relu's rule, the
    # only reader of the gradient it gets, may write over a gradient that is the
    # backward's alone; here that Tensor is also a's .grad, which must not change.
    a = E.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    x = E.tensor(np.array([-1.0, 2.0, -3.0]), requires_grad=True)
    y = a + tf.nn.relu(x)
    (y * E.tensor(np.array([1.0, 10.0, 100.0]))).sum().backward()
    assert np.array_equal(a.grad.numpy(), [1.0, 10.0, 100.0])
    assert np.array_equal(x.grad.numpy(), [0.0, 10.0, 0.0])


def test_the_callers_gradient_is_not_written_over(over_any_size):
    x = E.tensor(np.array([-1.0, 2.0]), requires_grad=True)
    seed = E.tensor(np.array([5.0, 7.0]))
    tf.nn.relu(x * 1.0).backward(seed)
    assert np.array_equal(seed.numpy(), [5.0, 7.0])
    assert np.array_equal(x.grad.numpy(), [0.0, 7.0])


def test_backward_writes_relus_gradient_over_the_incoming_one(over_any_size):
    # The in-place reuse happens (it is what the MLP step gains), and the values
    # are those of the graph's gradient.
    rng = np.random.default_rng(3)
    x = E.tensor(rng.standard_normal((8, 4)))
    w = E.tensor(rng.standard_normal((4, 4)), requires_grad=True)
    over = []
    original = E.apply_over

    def spy(op, inputs, dying, attrs=None):
        block = inputs[dying]._block
        result = original(op, inputs, dying, attrs)
        over.append((op, result._block is block))
        return result

    E.apply_over = spy
    try:
        tf.reduce_sum(tf.nn.relu(x @ w) @ w).backward()
    finally:
        E.apply_over = original
    assert ("mul", True) in over
    phx, phw = tf.placeholder(tf.float64, (8, 4)), tf.placeholder(tf.float64, (4, 4))
    grad = tf.gradients(tf.reduce_sum(tf.nn.relu(phx @ phw) @ phw), [phw])[0]
    with tf.Session() as sess:
        want = sess.run(grad, {phx: x.numpy(), phw: w.numpy()})
    assert np.array_equal(w.grad.numpy(), want)


@pytest.mark.parametrize("activation", ["relu", "tanh", "gelu"])
def test_an_mlp_writes_its_activations_over_the_linear_outputs(activation, monkeypatch):
    # The MLP knows a hidden Linear's output is read by the activation alone, so
    # eagerly the activation takes its block (relu by OpDef.inplace, tanh as a
    # ufunc), but for gelu, whose gradient reads that input (with grad on: under
    # no_grad it too writes there). Output and gradients keep every bit.
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 5))
    model = E.to_eager(tf.nn.MLP([5, 7, 7, 3], activation=activation), dtype=np.float64)

    def run(min_bytes):
        monkeypatch.setattr(E, "MIN_OVER_BYTES", min_bytes)
        for p in E.parameters(model):
            p.grad = None
        y = model(E.tensor(x))
        (y * y).sum().backward()
        return [y.numpy().copy()] + [p.grad.numpy().copy() for p in E.parameters(model)]

    got = run(0)
    y = model(E.tensor(x))
    stack, activations = [y], []
    while stack:    # the tape, back from y: each activation's input is a Linear's
        t = stack.pop()
        activations += [t] if t._op == activation else []
        stack += [i for i in (t._inputs or ()) if isinstance(i, E.Tensor)]
    assert len(activations) == 2
    taken = [a._inputs[0]._block is None for a in activations]
    assert taken == [activation != "gelu"] * 2
    for a, b in zip(got, run(1 << 40), strict=True):
        assert np.array_equal(a, b)
    E.allocator().validate()


def test_a_hand_built_sequential_writes_relu_over_the_linear_output(over_any_size):
    # The rule is Sequential's (MLP is one): a Linear's output there is read by the
    # next layer alone.
    model = E.to_eager(tf.nn.Sequential(tf.nn.Linear(5, 4), tf.nn.ReLU()), dtype=np.float64)
    y = model(E.tensor(np.random.default_rng(5).standard_normal((3, 5))))
    assert y._op == "relu" and y._inputs[0]._block is None


def test_an_mlp_calls_an_activation_subclass_with_its_own_call(over_any_size):
    # Regression (review): MLP handed every ReLU to ops.make_over("relu"), so a
    # user's subclass with its own __call__ was skipped, in graph mode too.
    class ClippedReLU(tf.nn.ReLU):
        def __call__(self, x, training=True):
            return tf.minimum(tf.nn.relu(x), 1.0)

    model = tf.nn.MLP([4, 8, 2])
    model.layers[1] = ClippedReLU()
    x = np.full((3, 4), 10.0)
    ph = tf.placeholder(tf.float64, (3, 4))
    out = model(ph)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for p in model.parameters():
            sess.variables[p] = np.full(sess.variables[p].shape, 0.5)
        assert sess.run(out, {ph: x}).tolist() == [[4.5, 4.5]] * 3
    E.to_eager(model, dtype=np.float64)
    with E.no_grad():
        for p in E.parameters(model):
            p.assign_(np.full(p.shape, 0.5))
    assert model(E.tensor(x)).numpy().tolist() == [[4.5, 4.5]] * 3


def test_relu_gradient_through_its_output_at_signed_zeros_nan_inf_and_ints():
    # relu's rule reads y = max(x, 0): y > 0 exactly where x > 0, also for -0.0,
    # NaN (max keeps it: NaN > 0 is False either way), infinities and integers.
    x = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, -1.5, 2.5])
    g = np.arange(1.0, 8.0)
    want = g * (x > 0)
    ph = tf.placeholder(tf.float64, (7,))
    with tf.Session() as sess:
        got = sess.run(tf.gradients(tf.nn.relu(ph), ph, grad_ys=tf.constant(g))[0],
                       {ph: x})
    assert np.array_equal(got, want)
    t = E.tensor(x, requires_grad=True)
    tf.nn.relu(t).backward(E.tensor(g))
    assert np.array_equal(t.grad.numpy(), want)
    ints = tf.placeholder(tf.int32, (3,))
    y = tf.nn.relu(ints)
    with tf.Session() as sess:
        assert sess.run(y, {ints: np.array([-2, 0, 3], np.int32)}).tolist() == [0, 0, 3]


def test_a_recorded_tensor_is_not_named_after_a_dead_one_with_its_id(tmp_path):
    # Regression: the record named Tensors by id(), so a new Tensor given a dead
    # one's id (CPython reuses the memory at once) was drawn as that op's output.
    from tinyflow import trace
    with tf.debug.record(tmp_path / "ids.tfdbg.json"):
        x, kept = E.tensor(np.ones(4)), []
        for _ in range(1000):   # (CPython hands a freed object's memory out again
            y = tf.nn.relu(x)   # soon, but other objects may take it first)
            dead = id(y)
            del y
            z = E.tensor(np.full(4, 2.0))
            if id(z) == dead:
                break
            kept.append(z)
        assert id(z) == dead, "no Tensor got a dead one's id in 1000 tries"
        tf.tanh(z)
    record = trace.load(tmp_path / "ids.tfdbg.json")
    nodes = {n["id"]: n for n in record["graphs"][0]["nodes"]}
    (tanh,) = [n for n in nodes.values() if n["op"] == "tanh"]
    assert [nodes[i]["op"] for i in tanh["inputs"]] == ["placeholder"]
    assert len({n["id"] for n in record["graphs"][0]["nodes"]}) == len(nodes)


def test_the_operator_shortcut_records_history_and_debug_events(tmp_path):
    x = E.tensor(np.array([0.5, -1.0]), requires_grad=True)
    for _ in range(2):   # made, then remembered: both times on the tape
        x.grad = None
        y = -(x * 3.0 + x)
        tf.tanh(y).sum().backward()
        want = -4.0 * (1.0 - np.tanh(-4.0 * x.numpy()) ** 2)
        np.testing.assert_allclose(x.grad.numpy(), want)
    with tf.debug.record(tmp_path / "ops.tfdbg.json"), E.no_grad():
        tf.tanh(-(x * 3.0 + x))
    from tinyflow import trace
    record = trace.load(tmp_path / "ops.tfdbg.json")
    assert [n["op"] for n in record["graphs"][0]["nodes"]
            if n["op"] not in ("constant", "placeholder")] == ["mul", "add", "neg", "tanh"]


def test_remembered_literals_keep_the_sign_of_zero_and_their_type():
    """Regression: literals were remembered by (type, value, dtype), and 0.0 == -0.0
    in Python, so `x * -0.0` after `x * 0.0` reused the +0.0 constant and gave +0."""
    x = E.tensor(np.ones(2, np.float32))
    for zero, negative_zero in [(0.0, -0.0), (np.float32(0.0), np.float32(-0.0)),
                                (np.float64(0.0), np.float64(-0.0))]:
        assert not np.signbit((x * zero).numpy()).any()
        assert np.signbit((x * negative_zero).numpy()).all()
        assert not np.signbit((x * zero).numpy()).any()
    n = E.tensor(np.arange(3, dtype=np.int32))
    assert (n + 1).dtype == np.int32 and (n + True).dtype == np.int32
    assert (n + 1.0).dtype.kind == "f"   # int32 + 1.5-like: a float, not the int literal


def test_shape_error_names_op_shapes_and_line():
    a, b = E.tensor(np.ones((2, 3))), E.tensor(np.ones((4, 5)))
    with pytest.raises(tf.ShapeError, match=r"matmul: .*\(2, 3\), \(4, 5\).*test_eager.py:\d+"):
        a @ b


def test_optimizer_zero_grad_and_step():
    w = E.tensor(np.array([1.0, -1.0]), requires_grad=True)
    opt = E.SGD([w], lr=0.5)
    (w * w).sum().backward()
    opt.step()
    np.testing.assert_array_equal(w.numpy(), [0.0, 0.0])
    opt.zero_grad()
    assert w.grad is None


# ----------------------------------------------------------------------------------
# Tracing
# ----------------------------------------------------------------------------------

def _mlp(seed):
    return E.to_eager(tf.nn.MLP([12, 16, 16, 4]), dtype=F64)


def _cnn(seed):
    import train_cnn

    class CNN:
        def __init__(self):
            self.w1 = train_cnn.uniform_variable((4, 1, 3, 3), 9, "w1", seed + 1)
            self.b1 = tf.Variable(tf.zeros((4,)), name="b1")
            self.w2 = train_cnn.uniform_variable((6, 4, 3, 3), 36, "w2", seed + 2)
            self.b2 = tf.Variable(tf.zeros((6,)), name="b2")
            self.fc = train_cnn.uniform_variable((24, 4), 24, "fc", seed + 3)

        def __call__(self, x):
            h = train_cnn.conv_block(x, self.w1, self.b1)
            h = train_cnn.conv_block(h, self.w2, self.b2)
            return tf.matmul(tf.reshape(h, (-1, 24)), self.fc)
    return E.to_eager(CNN(), dtype=F64)


def _charlm(seed):
    from train_charlm import CharTransformer
    model = CharTransformer(11, 6, 8, 2, 2, seed=seed)
    positions = E.tensor(np.arange(6))
    E.to_eager(model, dtype=F64)
    return lambda ids: model(ids, positions), model


def _data(kind, rng):
    if kind == "mlp":
        return E.tensor(rng.standard_normal((10, 12))), E.tensor(rng.integers(0, 4, 10))
    if kind == "cnn":
        return E.tensor(rng.standard_normal((5, 1, 8, 8))), E.tensor(rng.integers(0, 4, 5))
    ids = rng.integers(0, 11, (3, 6))
    return E.tensor(ids), E.tensor(ids.reshape(-1))


@pytest.mark.parametrize("kind", ["mlp", "cnn", "charlm"])
def test_traced_step_equals_eager_step_bitwise(kind):
    """The same step, eager and traced (passes, planner, executor): equal bits in
    the loss, every gradient and every updated parameter, for several steps."""
    if kind == "charlm":
        forward, model = _charlm(3)
    else:
        model = _mlp(3) if kind == "mlp" else _cnn(3)
        forward = model
    params = E.parameters(model)
    initial = [p.numpy() for p in params]

    def run(traced):
        with E.no_grad():
            for p, value in zip(params, initial):
                p.assign_(value)
        opt = E.Adam(params, lr=1e-2)

        def step(x, y):
            opt.zero_grad()
            loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(forward(x), y)
            loss.backward()
            opt.step()
            return loss
        step = tracing.function(step) if traced else step
        rng = np.random.default_rng(0)
        losses = [step(*_data(kind, rng)).numpy() for _ in range(3)]
        return losses, [p.numpy() for p in params], [p.grad.numpy() for p in params], step

    eager_losses, eager_params, eager_grads, _ = run(traced=False)
    traced_losses, traced_params, traced_grads, step = run(traced=True)
    assert len(step.traces) == 1
    for a, b in zip(eager_losses, traced_losses):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(eager_grads, traced_grads):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(eager_params, traced_params):
        np.testing.assert_array_equal(a, b)


def test_retrace_on_new_shapes_is_counted_and_explained():
    w = E.tensor(np.ones((3, 2)), requires_grad=True)

    @tracing.function
    def forward(x):
        return tf.reduce_sum(x @ w)

    forward(E.tensor(np.ones((4, 3))))
    forward(E.tensor(np.ones((4, 3))))
    assert len(forward.traces) == 1
    assert forward(E.tensor(np.ones((5, 3)))).item() == 30.0
    assert len(forward.traces) == 2
    text = forward.explain()
    assert "2 trace(s)" in text and "argument 0 is ((5, 3)" in text


def test_a_python_float_argument_retraces_on_its_sign_and_not_on_each_nan():
    # Regression: the guard compared Python arguments with ==, so a call with -0.0
    # reused the program traced for 0.0 (traced x * -0.0 gave +0.0 where eager gives
    # -0.0), and NaN, unequal to itself, retraced on every call.
    def scale(x, factor):
        return x * factor

    traced = tracing.function(scale)
    x = E.tensor(np.array([1.0, -2.0], np.float32))
    for factor in [0.0, -0.0, float("nan"), float("nan"), 0.0, (0.5, -0.0)[1],
                   -float("nan")]:
        got, want = traced(x, factor).numpy(), scale(x, factor).numpy()
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
        np.testing.assert_array_equal(got, want)
    assert len(traced.traces) == 4      # 0.0, -0.0, NaN and -NaN, each once
    assert "argument 1 is ('float', '-0.0')" in traced.explain()


def test_graph_break_names_the_line():
    @tracing.function
    def relu_if_positive(x):
        if x.sum() > 0:  # Python control flow on a tensor value
            return x
        return -x

    with pytest.raises(GraphBreak, match=r"graph break at test_eager.py:\d+"):
        relu_if_positive(E.tensor(np.ones(3)))
    assert "graph break" in relu_if_positive.explain()


def test_traced_in_place_writes_to_arguments_and_inner_values_match_eager():
    # Regression: a traced function that wrote into its argument failed after the
    # run ("'NoneType' object does not support item assignment"), and a read after
    # an in-place write to a value made inside the trace saw the old value.
    def step(w, grad):
        h = w * 2.0
        with E.no_grad():
            w.sub_(0.5 * grad)       # the caller's Tensor is updated, as in eager
            h.add_(1.0)              # an inner value: later reads see the write
        return w + 0.0, h

    start = np.arange(12, dtype=np.float32).reshape(4, 3)
    grad = E.tensor(np.full((4, 3), 0.25, np.float32))
    eager_w, traced_w = E.tensor(start), E.tensor(start)
    want = step(eager_w, grad)
    traced = tracing.function(step)
    got = traced(traced_w, grad)
    for a, b in [(want[0], got[0]), (want[1], got[1]), (eager_w, traced_w)]:
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    traced(traced_w, grad)              # the compiled program writes back again
    step(eager_w, grad)
    np.testing.assert_array_equal(eager_w.numpy(), traced_w.numpy())
    with pytest.raises(EagerError, match="argument 0, a numpy array"):
        tracing.function(step)(start.copy(), grad)


def test_a_traced_in_place_write_into_a_grad_from_outside_is_kept():
    # Regression (review): eager backward, then a traced "scale the gradient and
    # step": the traced write into w.grad was dropped, and reads inside the trace
    # saw the old gradient.
    def run(traced):
        w = E.tensor(np.ones(3, np.float32), requires_grad=True)
        opt = E.SGD([w], 0.1)

        def scale_and_step():
            with E.no_grad():
                w.grad.mul_(0.5)
            opt.step()
            return w.grad * 1.0

        step = tracing.function(scale_and_step) if traced else scale_and_step
        (w * E.tensor(np.array([1.0, 2.0, 3.0], np.float32))).sum().backward()
        seen = step()
        return w.numpy(), w.grad.numpy(), seen.numpy()

    for want, got in zip(run(False), run(True)):
        np.testing.assert_array_equal(want, got)


def test_traced_writes_through_aliases_match_eager_and_retrace_when_aliasing_changes():
    # Regression (review): one Tensor passed as two arguments, or passed and also
    # used from outside: a traced write through one name was not seen through the
    # other. Now it is, and a call whose aliasing differs traces again.
    def through(a, b):
        with E.no_grad():
            a.add_(1.0)
        return b * 1.0

    traced = tracing.function(through)
    x, y = E.tensor(np.zeros(3, np.float32)), E.tensor(np.zeros(3, np.float32))
    np.testing.assert_array_equal(traced(x, x).numpy(), np.ones(3))      # eager: 1
    np.testing.assert_array_equal(traced(x, y).numpy(), np.zeros(3))     # distinct
    np.testing.assert_array_equal(traced(y, y).numpy(), np.ones(3))
    assert len(traced.traces) == 2 and "the same as argument 0" in traced.explain()

    outside = E.tensor(np.zeros(3, np.float32))

    def reaches_out(a):
        with E.no_grad():
            a.add_(1.0)
        return outside * 1.0

    traced = tracing.function(reaches_out)
    np.testing.assert_array_equal(traced(outside).numpy(), np.ones(3))
    other = E.tensor(np.zeros(3, np.float32))
    np.testing.assert_array_equal(traced(other).numpy(), np.ones(3))     # outside: 1
    assert other.numpy().tolist() == [1, 1, 1] and outside.numpy().tolist() == [1, 1, 1]
    assert "no longer a Tensor the function also uses from outside" in traced.explain()


def _eager_and_traced(run):
    """run(traced) -> a tuple of arrays; both ways must give the same bits."""
    for want, got in zip(run(False), run(True)):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def test_traced_gradients_and_grad_edits_follow_eager_semantics():
    # Regressions found in a second review. (1) An in-place write into a .grad read
    # before the .grad was replaced went into the new .grad. (2) A leaf passed as an
    # argument (alone, or also used from outside) got no gradient from a backward
    # inside the trace. (3) Eager backward gave two leaves one .grad Tensor (a + b):
    # scaling a.grad in place scaled b.grad too; PyTorch gives each its own.
    def stale(traced):
        w = E.tensor(np.array([1., -2., 3.], np.float32), requires_grad=True)
        x = E.tensor(np.array([0.5, 1.5, -2.], np.float32))
        opt = E.SGD([w], 0.1)
        (w * x).sum().backward()

        def step(a):
            old = w.grad
            opt.zero_grad()
            (w * a).sum().backward()
            with E.no_grad():
                old.mul_(0.0)           # the old gradient, no longer w.grad
            opt.step()

        (tracing.function(step) if traced else step)(x)
        return w.numpy(), w.grad.numpy()

    def argument_leaf(traced):
        w = E.tensor(np.array([1., 2.], np.float32), requires_grad=True)
        opt = E.SGD([w], 0.1)

        def step(p, x):
            opt.zero_grad()
            (p * x).sum().backward()
            opt.step()
            return p.grad * 1.0

        f = tracing.function(step) if traced else step
        x = E.tensor(np.array([3., -3.], np.float32))
        return f(w, x).numpy(), f(w, x).numpy(), w.numpy()

    def shared(traced):
        a = E.tensor(np.ones(3, np.float32), requires_grad=True)
        b = E.tensor(np.ones(3, np.float32), requires_grad=True)
        (a + b).sum().backward()

        def halve():
            with E.no_grad():
                for p in (a, b):
                    p.grad.mul_(0.5)

        (tracing.function(halve) if traced else halve)()
        return a.grad.numpy(), b.grad.numpy()

    for run in (stale, argument_leaf, shared):
        _eager_and_traced(run)
    assert shared(False)[0].tolist() == [0.5, 0.5, 0.5]


def test_an_arguments_grad_is_the_grad_of_each_calls_argument():
    # Regressions (third review): a trace read and wrote the .grad of the first
    # call's argument on every later call; a fresh requires-grad argument made it
    # trace again on every call; Tensor(w) inside a trace passed gradient into w.
    def update(p):
        with E.no_grad():
            p.sub_(p.grad * 0.1)

    traced = tracing.function(update)
    b1, b2 = (E.tensor(np.zeros(3, np.float32), requires_grad=True) for _ in range(2))
    b1.grad, b2.grad = E.tensor(np.ones(3, np.float32)), E.tensor(np.full(3, 5.0, np.float32))
    traced(b1)
    traced(b2)
    np.testing.assert_array_equal(b2.numpy(), np.float32(0) - np.float32(5) * np.float32(0.1))
    assert len(traced.traces) == 1

    w = E.tensor(np.array([1.0, 2.0, 3.0], np.float32))

    def input_gradient(x):
        (x * w).sum().backward()
        return x.grad * 1.0

    traced = tracing.function(input_gradient)
    for _ in range(3):
        x = E.tensor(np.ones(3, np.float32), requires_grad=True)
        np.testing.assert_array_equal(traced(x).numpy(), w.numpy())
        assert x.grad is not None
    assert len(traced.traces) == 1

    def copy_then_backward(v, x):
        loss = (E.tensor(v) * x).sum() + (v * x).sum()
        loss.backward()
        grad = v.grad * 1.0
        v.grad = None
        return grad

    _eager_and_traced(lambda traced: [
        (tracing.function(copy_then_backward) if traced else copy_then_backward)(
            E.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True),
            E.tensor(np.array([1.0, 2.0], np.float32))).numpy()])


def test_traced_backward_stops_where_eager_records_no_history():
    # Regressions (fourth review): a backward in a trace reached through values made
    # under no_grad, written with assign_, or copied (Tensor(x), x.detach()): eager
    # records no history for them. They now stand behind tf.stop_gradient.
    def made_without_grad(traced):
        w = E.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)

        def step(x):
            with E.no_grad():
                y = w * 2.0
            frozen = E.tensor(np.zeros(3, np.float32))
            with E.no_grad():       # (with grad on, writing w * 3 into it is an error)
                frozen.assign_(w * 3.0)
            loss = (y * w).sum() + (frozen * w).sum() + (w.detach() * w).sum()
            loss.backward()
            grad = w.grad * 1.0
            w.grad = None
            with E.no_grad():
                w.sub_(x)
            return grad, w.detach() * 1.0

        f = tracing.function(step) if traced else step
        x = E.tensor(np.ones(3, np.float32))
        return [a.numpy() for call in range(2) for a in f(x)]

    _eager_and_traced(made_without_grad)


def test_a_tensor_reached_from_outside_and_passed_later_is_guarded():
    # Regression (fourth review): w used from outside (w.grad, Tensor(w), w.detach())
    # while also the first call's argument stayed bound to "argument 0" afterwards.
    for body in (lambda w: lambda a: a * 1.0 + w.grad,
                 lambda w: lambda a: a * 1.0 + E.Tensor(w),
                 lambda w: lambda a: a * 1.0 + w.detach()):
        def run(traced, body=body):
            w = E.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
            v = E.tensor(np.array([10.0, 20.0, 30.0], np.float32), requires_grad=True)
            w.grad, v.grad = E.tensor(np.ones(3, np.float32)), E.tensor(np.full(3, 5.0, np.float32))
            f = tracing.function(body(w)) if traced else body(w)
            return f(w).numpy(), f(v).numpy()

        _eager_and_traced(run)


def test_arguments_traces_cannot_follow_are_clear_errors():
    w = E.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)

    def backward_through(a):
        (a * 3.0).sum().backward()

    with pytest.raises(EagerError, match="argument 0, a Tensor with a history"):
        tracing.function(backward_through)(w * 2.0)
    # a float64 .grad: its own dtype (one of another shape is refused when set)
    w.grad = E.tensor(np.full(3, 2.0))
    assert tracing.function(lambda a: a * 1.0 + w.grad)(E.tensor(np.float32(1.0))).dtype \
        == np.float64


def test_traced_leaves_and_histories_match_eager():
    # Regressions (fifth review): requires_grad_() inside a trace got no .grad; an op
    # result in a trace said it was a leaf; assign_ into a leaf then backward sent the
    # gradient into what was assigned; a .grad read back in the trace had a history
    # (as if create_graph were set). Each now matches eager bitwise.
    def leaves(traced):
        w = E.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
        p = E.tensor(np.array([4.0, 5.0, 6.0], np.float32), requires_grad=True)
        q = E.tensor(np.array([1.0, 1.0, 2.0], np.float32), requires_grad=True)

        def step(x):
            inner = (w * 2.0).detach().requires_grad_()
            (inner * inner).sum().backward()
            with E.no_grad():
                p.assign_(q * 2.0)
            (p * x).sum().backward()
            g = w.grad if w.grad is not None else x * 0.0
            (w * w).sum().backward()
            again = w.grad * 1.0
            w.grad = None
            (g * w).sum().backward()
            return inner.grad * 1.0, (w * 2.0).is_leaf, again

        f = tracing.function(step) if traced else step
        out = f(E.tensor(np.array([1.0, -1.0, 2.0], np.float32)))
        return (out[0].numpy(), out[1], out[2].numpy(), w.grad.numpy(), p.grad.numpy(),
                q.grad is None)

    _eager_and_traced(leaves)


def test_histories_a_trace_cannot_follow_are_clear_errors_when_a_backward_reaches_them():
    # Backward through a Tensor with a history outside the function, or through an
    # in-place write into an op's result that requires grad (eager keeps its old
    # history), cannot be traced: a clear error, raised only when a backward in the
    # trace reaches them (the sixth review found earlier versions raising on any use,
    # and on forward-only writes).
    w = E.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
    h = w * 2.0                                   # a history outside the function

    with pytest.raises(EagerError, match="reaches a .3,. Tensor from outside with a history"):
        tracing.function(lambda: (h * 3.0).sum().backward())()

    def fit(x):                                   # uses h only detached: fine
        loss = ((w * x - h.detach()) ** 2).sum()
        loss.backward()
        return loss

    _eager_and_traced(lambda traced: [(tracing.function(fit) if traced else fit)(
        E.tensor(np.ones(3, np.float32))).numpy()])

    def predict(x):                               # forward only: an in-place add is fine
        out = x * w
        out.add_(1.0)
        return out

    _eager_and_traced(lambda traced: [(tracing.function(predict) if traced else predict)(
        E.tensor(np.ones(3, np.float32))).numpy()])

    def write_into_result(x):
        y = w * x
        with E.no_grad():
            y.assign_(w * 5.0)
        y.sum().backward()

    with pytest.raises(EagerError, match="reaches an in-place write into an op's result"):
        tracing.function(write_into_result)(E.tensor(np.ones(3, np.float32)))
    with pytest.raises(EagerError, match="create_graph=True"):
        tracing.function(lambda: (w * w).sum().backward(create_graph=True))()


def test_requires_grad_on_a_traced_argument_or_result_matches_eager():
    # Regressions (sixth review): requires_grad_() on a result that already required
    # grad cut its history; on an argument it lost the argument's .grad.
    def run(traced, grad_before):
        w = E.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
        x = E.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=grad_before)

        def step(a):
            y = (w * a).requires_grad_()
            a.requires_grad_()
            (y * y).sum().backward()
            return y * 1.0

        (tracing.function(step) if traced else step)(x)
        # (as in PyTorch, y's op saw `a` not requiring grad when grad_before is False:
        # no gradient reaches it through y)
        return w.grad.numpy(), x.grad is None or x.grad.numpy(), x.requires_grad

    for grad_before in (True, False):
        _eager_and_traced(lambda traced, before=grad_before: run(traced, before))


def test_requires_grad_false_and_writes_of_shared_values_in_a_trace_match_eager():
    # Regressions (seventh review): requires_grad_(False) on a symbolic Tensor was
    # ignored (the gradient went through it); assigning z into y flagged z itself,
    # so a backward through z alone raised.
    def run(traced):
        x = E.tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
        w = E.tensor(np.ones(3, np.float32), requires_grad=True)

        def step(a, b):
            y, z = a * 2.0, a * 3.0
            y.assign_(z)
            z.sum().backward()
            a.requires_grad_(False)
            u = a * b
            a.requires_grad_(True)          # (eighth review: u keeps no history)
            (u * b + a * b).sum().backward()
            a.requires_grad_(False)
            (a * b).sum().backward()

        (tracing.function(step) if traced else step)(x, w)
        return x.grad.numpy(), w.grad.numpy(), x.requires_grad

    _eager_and_traced(run)
    # A computed value's flag cannot be turned off (PyTorch's rule), eagerly or traced.
    x = E.tensor(np.ones(3, np.float32), requires_grad=True)
    for f in (lambda a: (a * 2.0).requires_grad_(False),
              tracing.function(lambda a: (a * 2.0).requires_grad_(False))):
        with pytest.raises(EagerError, match="only a leaf's flag can be turned off"):
            f(x)


def test_backward_reaches_the_inputs_that_required_grad_when_the_op_ran():
    # Regression (eighth review): eager backward asked the inputs' flags at backward
    # time, so an input that was made to require grad after an op got gradient
    # through it; PyTorch records the op's edges when it runs.
    a = E.tensor(np.array([1.0, 2.0, 3.0], np.float32))
    b = E.tensor(np.array([4.0, 5.0, 6.0], np.float32), requires_grad=True)
    u = a * b
    a.requires_grad_(True)
    (u + a * b).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), b.numpy())      # through a * b only
    np.testing.assert_array_equal(b.grad.numpy(), 2 * a.numpy())


def test_a_grad_reached_under_two_names_in_a_trace_is_a_clear_error():
    w = E.tensor(np.ones(3, np.float32), requires_grad=True)
    (w * 2.0).sum().backward()

    def step(g):
        with E.no_grad():
            g.mul_(0.5)
        return w.grad * 1.0

    with pytest.raises(EagerError, match="reaches the .grad of a Tensor both"):
        tracing.function(step)(w.grad)


def test_a_tensor_made_inside_a_traced_function_starts_afresh_each_call():
    # Regression (second review): it was taken for a Tensor from outside, so what one
    # call added into it was there at the next.
    def accumulate(a):
        acc = E.tensor(np.zeros(3, np.float32))
        with E.no_grad():
            acc.add_(a)
        return acc * 1.0

    traced = tracing.function(accumulate)
    x = E.tensor(np.ones(3, np.float32))
    assert [traced(x).numpy().tolist() for _ in range(3)] == [[1.0, 1.0, 1.0]] * 3


def test_scaled_updates_by_lists_and_under_warnings_as_errors(monkeypatch):
    # Regressions (second review): a list value was repeated as a Python list; with
    # RuntimeWarnings as errors an overflow in a later slice left the Tensor half
    # updated.
    p = E.tensor(np.zeros(3, np.float32))
    with E.no_grad():
        p.sub_([1.0, 2.0, 3.0], alpha=0.5)
    np.testing.assert_array_equal(p.numpy(), [-0.5, -1.0, -1.5])
    monkeypatch.setattr(E, "SCALED_SLICE_BYTES", 16)
    big = np.ones(64, np.float32)
    big[-1] = 3e38
    q = E.tensor(np.zeros(64, np.float32))
    import warnings
    with warnings.catch_warnings(), E.no_grad():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(EagerError, match="overflow"):
            q.sub_(E.tensor(big), alpha=10.0)
    assert not q.numpy().any()      # untouched, as the unfused expression leaves it


def test_traced_function_sees_new_parameter_values():
    """Captured Tensors are fed on every call, not baked in as constants."""
    w = E.tensor(np.array([2.0]))
    double = tracing.function(lambda x: x * w)
    assert double(E.tensor(np.array([3.0]))).item() == 6.0
    with E.no_grad():
        w.assign_(np.array([5.0]))
    assert double(E.tensor(np.array([3.0]))).item() == 15.0


# ----------------------------------------------------------------------------------
# The caching allocator
# ----------------------------------------------------------------------------------

def test_allocator_splits_reuses_and_merges_a_hand_computed_case():
    a = CachingAllocator(fast_bins=False)   # PyTorch's scheme alone
    x = a.malloc(1000)           # rounded to 1024, from a new 2 MiB small segment
    y = a.malloc(3000)           # 3072, split from the rest of that segment
    assert (x.segment, x.offset, x.size) == (0, 0, 1024)
    assert (y.segment, y.offset, y.size) == (0, 1024, 3072)
    assert a.reserved == 2 << 20 and a.allocated == 4096
    a.free(x)
    z = a.malloc(512)            # best fit: the 1024-byte hole, split to 512
    assert (z.offset, z.size) == (0, 512)
    assert a.allocated == 3584
    assert math.isclose(a.fragmentation(), 1 - 3584 / (2 << 20))
    a.free(y)
    a.free(z)                    # everything merges back into one free block
    a.validate()
    assert a.allocated == 0 and len(a.free_small) == 1 and a.free_small[0][0] == 2 << 20
    big = a.malloc(5 << 20)      # large pool: a 20 MiB segment
    assert big.segment == 1 and a.reserved == (2 << 20) + (20 << 20)
    assert a.events[-1]["event"] == "alloc" and "new segment" in a.events[-1]["reason"]


def test_fast_bins_hand_back_a_freed_block_whole_and_merge_before_a_new_segment():
    a = CachingAllocator()
    x = a.malloc(1000)           # 1024 B at offset 0 of a new 2 MiB segment
    y = a.malloc(3000)           # 3072 B at 1024
    a.free(x)                    # waits whole in the 1024-byte bin: no merge
    assert a.bins == {1024: [x]} and x.binned and not x.allocated
    z = a.malloc(512)            # no 512-byte bin: best fit splits the remainder
    assert (z.offset, z.size) == (4096, 512)
    again = a.malloc(900)        # rounds to 1024: the binned block, whole
    assert again is x and (again.offset, again.size) == (0, 1024) and a.bins == {1024: []}
    assert a.events[-1]["reason"].startswith("fast bin: block #")
    a.free(again)
    a.free(y)                    # y and z wait in bins too: nothing merges
    a.free(z)
    a.validate()
    assert {size: len(blocks) for size, blocks in a.bins.items()} == {512: 1, 1024: 1, 3072: 1}
    assert a.allocated == 0
    assert len(a.free_small) == 1 and a.free_small[0][0] == (2 << 20) - 4608
    fill = [a.malloc(1 << 20), a.malloc((1 << 20) - 4608)]   # the pool is empty now
    assert not a.free_small
    # A request that no bin and no pooled block fits merges the bins first (glibc's
    # consolidation): x, y and z become one 4608-byte block again, reused, so no
    # second segment is reserved.
    whole = a.malloc(4608)
    assert not any(a.bins.values())
    assert (whole.segment, whole.offset, whole.size) == (0, 0, 4608)
    assert a.reserved == 2 << 20 and len(a.segments) == 1
    for block in [whole, *fill]:
        a.free(block)
    a.validate()


def test_empty_cache_releases_segments_whose_blocks_wait_in_bins():
    a = CachingAllocator()
    a.free(a.malloc(100))
    assert a.bins and a.reserved == 2 << 20
    a.empty_cache()
    assert not any(a.bins.values()) and a.reserved == 0
    a.validate()


def test_the_validator_finds_a_free_block_outside_its_pool_and_bins():
    a = CachingAllocator()
    x = a.malloc(100)
    a.malloc(100)
    a.free(x)
    a.bins.clear()               # lost: free, binned, yet in no bin
    with pytest.raises(tf.TinyFlowError, match="in a bin: False, in its pool: False"):
        a.validate()
    # Listed twice (two mallocs would get the same block), under another size, or a
    # block of no segment: each is found (found in review).
    a.bins[512] = [x, x]
    with pytest.raises(tf.TinyFlowError, match="listed twice in a bin"):
        a.validate()
    a.bins = {1024: [x]}
    with pytest.raises(tf.TinyFlowError, match="of 512 B is listed in a bin as 1024 B"):
        a.validate()
    a.bins = {512: [x]}
    a.validate()
    ghost = Block(0, 0, 4096, a.free_small, 99)
    ghost.binned = True
    a.bins[4096] = [ghost]
    with pytest.raises(tf.TinyFlowError, match="in no segment"):
        a.validate()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3 << 20)), min_size=1, max_size=60),
       st.booleans())
def test_allocator_never_overlaps_live_blocks(script, fast_bins):
    a = CachingAllocator(fast_bins=fast_bins)
    live = []
    for allocate, size in script:
        if allocate or not live:
            live.append(a.malloc(size))
        else:
            a.free(live.pop(size % len(live)))
        a.validate()
        spans = sorted((b.segment, b.offset, b.offset + b.size) for b in live)
        for (s1, _, end), (s2, start, _) in zip(spans, spans[1:]):
            assert s1 != s2 or end <= start
        assert a.allocated == sum(b.size for b in live)


def test_a_reused_block_hands_out_a_view_of_the_shape_and_dtype_asked_now():
    """Blocks keep their last ndarray view (making one costs more than a small op);
    a block reused for another shape or dtype must give a fresh view of its bytes."""
    a = CachingAllocator()
    x, block = a.array((2, 3), np.float32)
    assert a.view_as(block, ((2, 3), np.dtype(np.float32))) is x   # the kept view
    a.free(block)
    y, again = a.array((6,), np.int32)          # the same 512-byte block, best fit
    assert again is block and y.shape == (6,) and y.dtype == np.int32
    z, other = a.array((3,), np.float64)        # a live neighbour: no shared bytes
    y[:] = 7
    z[:] = 1.5
    assert (y == 7).all() and (z == 1.5).all()
    assert y.ctypes.data == a.segments[0].buffer.ctypes.data + block.offset
    assert z.ctypes.data == a.segments[0].buffer.ctypes.data + other.offset


def test_freed_blocks_are_poisoned():
    a = CachingAllocator(poison=True)
    old = E.set_allocator(a)
    try:
        t = E.tensor(np.ones(4))
        block = t._block
        del t
        # the bytes of a dead Tensor are NaN now (seen through the allocator: an
        # array of the Tensor's held here would have kept the block alive)
        assert np.isnan(a.view(block, 32, np.float64)).all()
    finally:
        E.set_allocator(old)


def test_an_array_taken_from_a_tensor_keeps_its_memory_after_the_tensor_dies():
    # The block went back to the allocator when the Tensor died, while `.data` (or a
    # slice of it) was still held: the next op of that size wrote into it, and
    # `y = (a + b).data` silently became a - b.
    a = CachingAllocator(poison=True)
    old = E.set_allocator(a)
    try:
        x, y = E.tensor(np.ones(4)), E.tensor(np.full(4, 2.0))
        whole = (x + y).data
        part = (x * y).data[1:]
        turned = (x - y).data.reshape(2, 2).T
        for _ in range(3):
            _ = x / y
        np.testing.assert_array_equal(whole, [3.0] * 4)
        np.testing.assert_array_equal(part, [2.0] * 3)
        np.testing.assert_array_equal(turned, [[-1.0] * 2] * 2)
        assert a.allocated == 6 * 512       # x, y, the last quotient and the three held
        del whole, part, turned, _
        probe = E.tensor(np.zeros(1))       # (freed at the next malloc)
        assert a.allocated == 3 * 512 and not a.deferred   # x, y and the probe
        assert probe.numpy().tolist() == [0.0]
        a.validate()
    finally:
        E.set_allocator(old)


@pytest.mark.parametrize("record", [False, True])
def test_a_tensor_collected_inside_malloc_is_freed_at_the_next_malloc(monkeypatch, record):
    # Regression: CPython may collect garbage at any allocation of a Python object,
    # and so inside malloc (the Block that a split makes). A Tensor collected there
    # freed its block into the pools malloc was changing: the block it had just
    # taken merged with its neighbour ("free neighbours ... were not merged").
    import gc
    from tinyflow import allocator as A

    class Holder:
        pass

    alloc = A.CachingAllocator(record=record)
    old, was_enabled = E.set_allocator(alloc), gc.isenabled()
    gc.disable()
    try:
        free_first = E.tensor(np.ones(1_500_000, np.float32))   # 6 MB: the large pool
        cycle = Holder()
        cycle.me, cycle.t = cycle, E.tensor(np.ones(1_500_000, np.float32))
        del free_first, cycle   # a free block, then a live one that a collection frees
        split = A.CachingAllocator._split

        def split_after_a_collection(self, block, size):
            gc.collect()   # what CPython may do at the Block that _split makes
            return split(self, block, size)

        monkeypatch.setattr(A.CachingAllocator, "_split", split_after_a_collection)
        taken = E.tensor(np.ones(500_000, np.float32))   # best fit in the free block
        monkeypatch.undo()
        alloc.validate()
        assert len(alloc.deferred) == 1
        small = E.tensor(np.ones(3))   # the next malloc frees the collected block
        assert not alloc.deferred
        alloc.validate()
        assert alloc.allocated == taken._block.size + small._block.size
    finally:
        E.set_allocator(old)
        if was_enabled:
            gc.enable()


def test_a_tensor_collected_while_a_free_makes_a_new_bin_keeps_its_block():
    # Regression: the first free of a size made the bin's list, and a collection
    # there (any allocation of a Python object may run one) freed a Tensor of the
    # same size, whose new bin the first then replaced: its block was lost. The
    # dict below runs the collection where the list is made, before it is stored.
    import gc
    from tinyflow import allocator as A

    class Holder:
        pass

    class CollectsOnce(dict):
        collected = False

        def _collect(self):
            if not self.collected:
                self.collected = True
                gc.collect()

        def __setitem__(self, key, value):
            self._collect()
            super().__setitem__(key, value)

        def setdefault(self, key, default=None):
            self._collect()
            return super().setdefault(key, default)

    alloc = A.CachingAllocator(record=False)
    old, was_enabled = E.set_allocator(alloc), gc.isenabled()
    gc.disable()
    try:
        first = E.tensor(np.ones(100, np.float32))
        cycle = Holder()
        cycle.me, cycle.t = cycle, E.tensor(np.ones(100, np.float32))   # the same size
        del cycle
        alloc.bins = CollectsOnce(alloc.bins)
        del first   # its bin is made here, and the collection frees the other
        alloc.validate()
        assert alloc.allocated == 0
        assert [len(blocks) for blocks in alloc.bins.values() if blocks] == [2]
    finally:
        E.set_allocator(old)
        if was_enabled:
            gc.enable()


def test_eager_ops_allocate_through_the_allocator_and_free_on_release():
    a = CachingAllocator()
    old = E.set_allocator(a)
    try:
        x = E.tensor(np.ones((64, 64)))
        y = x * 2.0
        live = a.allocated
        del y
        assert a.allocated < live
        assert {e["event"] for e in a.events} >= {"alloc", "free", "segment_alloc"}
        assert Tensor  # the Tensor class is what ops return
        assert isinstance(x + 1.0, Tensor)
    finally:
        E.set_allocator(old)


def test_an_eager_run_records_for_the_debugger(tmp_path):
    """tf.debug.record in eager mode: the ops as a graph, their timeline, and the
    allocator's blocks as the memory view's plan, each with its reason."""
    from tinyflow import trace
    model = E.to_eager(tf.nn.MLP([8, 6, 3]))
    opt = E.SGD(E.parameters(model), 0.1)
    x, y = E.tensor(np.ones((4, 8), np.float32)), E.tensor(np.array([0, 1, 2, 0]))
    path = tmp_path / "eager.tfdbg.json"
    with tf.debug.record(path) as rec:
        opt.zero_grad()
        loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        rec.scalar("loss", 0, loss.item())
    record = trace.load(path)
    trace.validate(record)
    nodes = {n["id"]: n for n in record["graphs"][0]["nodes"]}
    assert nodes["matmul_0"]["where"].startswith("test_eager.py:")
    assert {n["phase"] for n in nodes.values()} == {"forward", "backward"}
    assert len(record["schedule"]) == len(record["timelines"][0]["events"])
    plan = record["memory_plan"]
    assert plan["strategy"] == "caching allocator" and plan["arena_bytes"] >= 2 << 20
    reasons = [t["reason"] for t in plan["tensors"] if t["kind"] == "intermediate"]
    assert all(r.startswith(("best fit", "new segment", "fast bin")) for r in reasons), reasons[:3]
    # (backward's seed, ones, is made by tensor(), not by an op: listed from its step)
    assert [t["kind"] for t in plan["tensors"] if t["reason"].startswith("made by")] == ["feed"]
    # The blocks made before recording (weights, the batch) are listed too, alive
    # from step 0: the plan's live bytes reach the allocator's peak, which counted
    # them while the memory view drew their bytes as free.
    earlier = [t for t in plan["tensors"] if t["kind"] == "variable"]
    assert len(earlier) == len(opt.params) + 2 and all(t["first_step"] == 0 for t in earlier)
    steps = range(len(record["schedule"]))
    live = max(sum(t["nbytes"] for t in plan["tensors"]
                   if t["first_step"] <= s <= t["last_step"]) for s in steps)
    assert live == plan["lower_bound_bytes"]
    assert record["scalars"]["loss"][0][1] == pytest.approx(loss.item())
    # SGD's updates are written into the weights' own blocks: recorded as in-place
    # optimizer ops, each with its node and event but no block of its own
    updates = [n for n in nodes.values() if n["attrs"].get("in_place")]
    assert len(updates) == len(opt.params) and all(
        n["op"] == "sub" and n["attrs"].get("optimizer_step") for n in updates)
    # (parameters this small take p.sub_(lr * g) unsliced: no block of their own)
    assert not {n["id"] for n in updates} & {t["node"] for t in plan["tensors"]}


def test_an_eager_conv_takes_its_scratch_from_the_caching_allocator(tmp_path):
    # conv2d's im2col matrix (OpDef.scratch) is a block of the caching allocator for
    # the length of the call, as a traced program's plan places it in its arena: the
    # allocator's figures count it, and a recorded run shows it as a scratch block.
    from tinyflow import trace
    from tinyflow.ops import REGISTRY
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((5, 3, 3, 3)).astype(np.float32)
    attrs = {"stride": (1, 1), "padding": 1}
    scratch = REGISTRY["conv2d"].scratch(np, [x.shape, w.shape], [x.dtype, w.dtype], attrs)
    fresh = CachingAllocator(record=True)
    old = E.set_allocator(fresh)
    try:
        xt, wt = E.tensor(x), E.tensor(w)
        before = len(fresh.events)
        y = tf.nn.conv2d(xt, wt, padding=1)
        events = [e for e in fresh.events[before:] if e["event"] in ("alloc", "free")]
        assert [e["event"] for e in events] == ["alloc", "alloc", "free"]  # y, scratch
        assert events[1]["requested"] == scratch and events[2]["block"] == events[1]["block"]
        fresh.validate()
        path = tmp_path / "conv.tfdbg.json"
        with tf.debug.record(path):
            tf.nn.conv2d(xt, wt, padding=1)
    finally:
        E.set_allocator(old)
    np.testing.assert_allclose(y.numpy(), tf.Session(passes=[]).run(
        tf.nn.conv2d(tf.constant(x), tf.constant(w), padding=1)), rtol=1e-6)
    record = trace.load(path)
    trace.validate(record)
    kinds = {t["kind"] for t in record["memory_plan"]["tensors"]}
    assert kinds == {"intermediate", "scratch", "variable"}   # (x and w: made before)
    (entry,) = [t for t in record["memory_plan"]["tensors"] if t["kind"] == "scratch"]
    assert entry["first_step"] == entry["last_step"] and entry["nbytes"] >= scratch
    assert entry["reason"].startswith(("best fit", "new segment", "fast bin"))


def test_in_place_writes_never_give_a_silently_wrong_gradient():
    # Found against PyTorch: y.mul_(3) on a computed y kept y's old history, so x.grad
    # was 2, not 6; a constant changed after a mul used it gave the gradient of the
    # new value; c.add_(x) lost x's gradient; an int Tensor took a float result cast
    # back; a backward seed of another shape was broadcast.
    x = E.tensor(np.array([0.5, -1.5, 2.0]), requires_grad=True)
    y = x * 2.0
    y.mul_(3.0)                                   # forward use is fine ...
    np.testing.assert_array_equal(y.numpy(), [3.0, -9.0, 12.0])
    with pytest.raises(EagerError, match=r"backward reaches a Tensor written in place at "
                                         r"test_eager.py:\d+"):
        tf.reduce_sum(y).backward()               # ... a backward through it is refused
    w = E.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    c = E.tensor(np.array([1.0, 2.0, 3.0]))
    loss = tf.reduce_sum(w * c)
    c.add_(10.0)
    with pytest.raises(EagerError, match="gradient of mul needs its input 1 as the op saw it"):
        loss.backward()
    loss = tf.reduce_sum(w + c)                   # add's gradient reads no value: fine
    c.add_(1.0)
    loss.backward()
    np.testing.assert_array_equal(w.grad.numpy(), [1.0, 1.0, 1.0])
    t = tf.tanh(x)
    with E.no_grad():
        t.mul_(2.0)
    with pytest.raises(EagerError, match="gradient of tanh needs its result"):
        tf.reduce_sum(t).backward()
    total = E.tensor(np.zeros(3))
    with pytest.raises(EagerError, match="value that requires grad into a Tensor that does not"):
        total.add_(x)
    with pytest.raises(EagerError, match="float64, which this int64 Tensor cannot hold"):
        E.tensor(np.array([1, 2, 3])).mul_(0.5)
    with pytest.raises(EagerError, match=r"the gradient has shape \(2, 3\), the Tensor "
                                         r"\(3,\)"):
        (x * x).backward(E.tensor(np.ones((2, 3))))
    single = E.tensor(np.ones(3, np.float32), requires_grad=True)
    (single * single).backward(E.tensor(np.ones(3)))   # a float64 seed is cast (PyTorch)
    assert single.grad.dtype == np.float32


def test_version_check_skips_values_read_for_their_shape_only():
    # Review: sum, mean, reshape, getitem and concat read their input only for its
    # shape in their gradient, yet a write after use was an error (PyTorch computes).
    builds = [tf.reduce_sum, tf.reduce_mean, lambda a: tf.reduce_sum(tf.reshape(a, (3, 1))),
              lambda a: tf.reduce_sum(a[1:]), lambda a: tf.reduce_sum(tf.concat([a, a], 0))]
    for build, expected in zip(builds, [[1.0] * 3, [1 / 3] * 3, [1.0] * 3, [0.0, 1.0, 1.0],
                                        [2.0] * 3]):
        x = E.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        a = x * 1.0
        y = build(a)
        with E.no_grad():
            a.add_(1.0)
        y.backward()
        np.testing.assert_allclose(x.grad.numpy(), expected)


def test_review_fixes_for_keywords_dropout_tensors_and_list_conditions():
    @tracing.function
    def scaled(x, scale=2.0, *, bias=0.0):     # a keyword-only default, not passed
        return x * scale + bias

    np.testing.assert_array_equal(scaled(E.tensor(np.array([1.0, 2.0])), scale=3.0).numpy(),
                                  [3.0, 6.0])
    kept = tf.nn.dropout(E.tensor(np.ones(64, np.float32)), E.tensor(np.float32(0.5)), seed=1)
    assert set(np.unique(kept.numpy())) == {0.0, 2.0}     # a keep_prob Tensor, eagerly
    picked = tf.Session().run(tf.where([True, False, True], tf.ones((3, 2)), tf.zeros((3, 2))))
    np.testing.assert_array_equal(picked, [[1, 1], [0, 0], [1, 1]])


def test_iterating_a_tensor_gives_its_rows_and_nested_functions_trace_through():
    # Iteration fell back to __getitem__ until an out-of-range ShapeError (a crash);
    # a tf.function called inside another failed deep in numpy ("Cannot cast ufunc
    # 'multiply' output from dtype('O')").
    t = E.tensor(np.arange(6.0).reshape(2, 3))
    assert [row.numpy().tolist() for row in t] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    with pytest.raises(TypeError, match="0-d Tensor"):
        iter(E.tensor(1.0)).__next__()
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d Tensor"):
        len(E.tensor(1.0))
    rows = tracing.function(lambda a: [r * 2.0 for r in a][1])
    np.testing.assert_array_equal(rows(t).numpy(), [6.0, 8.0, 10.0])
    inner = tracing.function(lambda a: a * 2.0)
    outer = tracing.function(lambda a: inner(a) + 1.0)
    for _ in range(2):
        np.testing.assert_array_equal(outer(E.tensor(np.ones(3))).numpy(), [3.0] * 3)
    assert len(outer.traces) == 1 and not inner.traces
    with pytest.raises(TypeError, match="is not iterable"):
        list(tf.placeholder(tf.float32, (2,)))


def test_freezing_a_parameter_after_tracing_retraces():
    # The trace kept sending gradient to a global parameter after
    # W.requires_grad_(False) (eager gives it none), without tracing again.
    w = E.tensor(np.array([1.0, 2.0]), requires_grad=True)
    x = E.tensor(np.array([3.0, 4.0]))

    def step(x):
        y = w * x
        if y.requires_grad:        # a Python bool: part of the trace, not a break
            y.sum().backward()
        return y

    f = tracing.function(step)
    f(x)
    np.testing.assert_array_equal(w.grad.numpy(), [3.0, 4.0])
    w.grad = None
    w.requires_grad_(False)
    f(x)
    assert w.grad is None and len(f.traces) == 2
    assert "requires_grad=False now, True when traced" in f.traces[-1]["reason"]


def test_traced_functions_take_keyword_arguments():
    # f(x, scale=2.0) was a TypeError (only positional arguments were accepted).
    @tracing.function
    def scaled(x, scale=1.0, shift=0.0):
        return x * scale + shift

    x = E.tensor(np.array([1.0, 2.0]))
    np.testing.assert_array_equal(scaled(x, scale=2.0).numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(scaled(x, shift=1.0, scale=3.0).numpy(), [4.0, 7.0])
    np.testing.assert_array_equal(scaled(x, 2.0, 0.0).numpy(), [2.0, 4.0])   # same trace
    assert len(scaled.traces) == 2

    @tracing.function
    def only_keyword(x, *, scale):
        return x * scale

    with pytest.raises(EagerError, match=r"keyword-only arguments \['scale'\]"):
        only_keyword(x, scale=2.0)


def test_create_graph_records_the_backward_even_inside_no_grad():
    # Inside no_grad, backward(create_graph=True) left .grad without history, so a
    # second derivative was impossible (PyTorch records it); E.enable_grad is
    # PyTorch's way back into recording.
    x = E.tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x * x * x).sum()
    with E.no_grad():
        y.backward(create_graph=True)
        with E.enable_grad():
            assert (x * 1.0).requires_grad
        assert not (x * 1.0).requires_grad
    assert x.grad.requires_grad
    first = x.grad
    x.grad = None
    first.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, 12.0])


def _grad_three_ways(step, eager_inputs, graph_build):
    """x.grad of `step` eager and traced (default and plain options), and the graph's."""
    got = [step(*eager_inputs()).numpy(),
           tf.function(step)(*eager_inputs()).numpy(),
           tf.function(step, passes=[], memory=None)(*eager_inputs()).numpy()]
    fetch, feeds = graph_build()
    got.append(np.asarray(tf.Session(passes=[], memory=None).run(fetch, feeds)))
    for value in got[1:]:
        assert value.dtype == got[0].dtype and np.array_equal(value, got[0]), got
    return got[0]


def test_eager_backward_types_a_rules_literals_by_the_incoming_gradient():
    # Review (differential test): erf of a float16 x read by a float64 consumer gets
    # a float64 gradient; eager built erf's rule for a float16 gradient, so its
    # literal 2/sqrt(pi) was float16 (1.1279296875): 1.28544 where the graph,
    # traced and eager-by-hand give 1.28596.
    xv, iv = np.array(-0.75, np.float16), np.array([0], np.int64)

    def step(x, i):
        y = tf.erf(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float64)) + tf.reduce_sum(y - tf.reduce_sum(i))
        loss.backward()
        return x.grad

    def graph():
        x, i = tf.placeholder(tf.float16, ()), tf.placeholder(tf.int64, (1,))
        y = tf.erf(x)
        (g,) = tf.gradients(tf.reduce_sum(tf.cast(y, tf.float64))
                            + tf.reduce_sum(y - tf.reduce_sum(i)), [x])
        return g, {x: xv, i: iv}

    grad = _grad_three_ways(step, lambda: (E.tensor(xv, requires_grad=True), E.tensor(iv)),
                            graph)
    assert grad.dtype == np.float64 and grad == pytest.approx(1.28595555, abs=1e-8)


def test_a_cast_to_the_same_dtype_is_the_tensor_itself():
    # tf.cast(x, x.dtype) returned x in the graph but recorded a cast eagerly and
    # when traced; traced, its gradient then came back float32 where eager and the
    # graph give float64, and the graph summed gradients in another order.
    xv, dv = np.array([0.5, 1.5], np.float32), np.array([0.1, 0.3])
    x = E.tensor(xv, requires_grad=True)
    assert tf.cast(x, tf.float32) is x

    def step(x, d):
        (tf.reduce_sum(tf.cast(x, tf.float32) * d)).backward()
        return x.grad

    def graph():
        x, d = tf.placeholder(tf.float32, (2,)), tf.placeholder(tf.float64, (2,))
        (g,) = tf.gradients(tf.reduce_sum(tf.cast(x, tf.float32) * d), [x])
        return g, {x: xv, d: dv}

    grad = _grad_three_ways(step, lambda: (E.tensor(xv, requires_grad=True), E.tensor(dv)),
                            graph)
    np.testing.assert_array_equal(grad, dv)


def test_softmax_of_a_scalar_is_refused_when_built():
    # It built, then failed at run time with an IndexError from inside numpy.
    for build in (tf.nn.softmax, tf.nn.log_softmax):
        with pytest.raises(tf.ShapeError, match="rank >= 1"):
            build(tf.constant(1.0))
        with pytest.raises(tf.ShapeError, match="rank >= 1"):
            build(E.tensor(np.float32(1.0)))


def test_eager_tensors_hold_numbers_only():
    # Review (adversarial probe): an object array (None, Fraction, 10**30, a ragged
    # list) became a Tensor; written into the allocator's recycled float memory its
    # "pointers" crashed the interpreter (segmentation fault). tf.constant refuses them.
    E.tensor(np.full(4, 1.5, np.float32))     # (memory for the next one to reuse)
    for value in (None, 10**30, [None, None], np.array([1, 2], dtype=object), "1.5"):
        with pytest.raises(tf.ArgumentError, match="tensor: needs numbers"):
            E.tensor(value)
    with pytest.raises(tf.ArgumentError, match="not an array of numbers"):
        E.tensor([[1, 2], [3]])               # (and no "Exception ignored in __del__")
    with pytest.raises(EagerError, match="cannot require grad"):
        E.tensor([1, 2], requires_grad=True)  # PyTorch: only float Tensors can


def test_eager_checks_attributes_as_the_graph_does():
    # Eager ops ran the shape rule but not the attribute checks: a pool stride of 0
    # reached the kernel as a ZeroDivisionError, a reshape to (-1, -1) numpy's
    # "negative dimensions"; `t + 10**400` an OverflowError from the literal cache.
    x = E.tensor(np.zeros((1, 2, 4, 4), np.float32))
    with pytest.raises(tf.ShapeError, match="max_pool2d: stride .* must be >= 1"):
        tf.nn.max_pool(x, ksize=[1, 1, 1, 1], strides=[1, 1, 0, 1], padding="VALID")
    with pytest.raises(tf.ShapeError, match="more than one -1"):
        tf.reshape(x, [-1, -1])
    with pytest.raises(tf.ShapeError, match="add: operand"):
        x + 10**400
    with pytest.raises(tf.ShapeError, match="add: operand"):
        x + (-10**400)
    with pytest.raises(EagerError, match="item\\(\\) needs a Tensor of one element"):
        x.item()


def test_backward_of_many_elements_needs_a_gradient():
    # backward() on a non-scalar seeded ones silently (PyTorch refuses: "grad can be
    # implicitly created only for scalar outputs").
    w = E.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(EagerError, match="implicit \\(ones\\) only for one element"):
        (w * 2).backward()
    (w * 2).backward(np.ones(3))             # explicit: fine
    np.testing.assert_array_equal(w.grad.numpy(), [2.0, 2.0, 2.0])
    (w * 2).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [4.0, 4.0, 4.0])


@pytest.mark.parametrize("make_optimizer, message", [
    (lambda p: E.Adam(p, lr=float("nan")), "lr must be a finite number"),
    (lambda p: E.SGD(p, lr=-1.0), "lr must be >= 0"),
    (lambda p: E.SGD(p, lr=0.1, momentum=float("nan")), "momentum must be a finite"),
    (lambda p: E.Adam(p, beta1=1.0), "beta1 must be in \\[0, 1\\)"),
])
def test_eager_optimizers_check_their_hyperparameters(make_optimizer, message):
    # A NaN learning rate made every weight NaN; a negative one climbed the loss
    # (the graph's optimizers and PyTorch's refuse both).
    with pytest.raises(tf.ArgumentError, match=message):
        make_optimizer([E.tensor(np.ones(3), requires_grad=True)])


def test_one_hot_and_where_check_their_inputs():
    # one_hot(idx, -1) gave an empty last axis; float indices matched nothing;
    # tf.where took a float condition as "nonzero" (TF1 refuses all three).
    idx = tf.constant([0, 2])
    with pytest.raises(tf.ArgumentError, match="depth must be >= 0"):
        tf.one_hot(idx, -1)
    with pytest.raises(tf.ArgumentError, match="indices must be integers"):
        tf.one_hot(tf.constant([0.5]), 3)
    x = tf.constant([1.0, -2.0])
    with pytest.raises(tf.ShapeError, match="the condition must be boolean"):
        tf.where(x, x, -x)
    with pytest.raises(tf.ShapeError, match="the condition must be boolean"):
        tf.where(E.tensor([1.0, 0.0]), E.tensor([1.0, 2.0]), E.tensor([3.0, 4.0]))
    # a literal condition is a boolean constant of its own
    np.testing.assert_array_equal(tf.Session().run(tf.where([True, False], x, -x)),
                                  [1.0, 2.0])


def test_a_literal_too_large_for_the_dtype_is_refused_and_a_huge_int_is_a_float():
    # x * 1e300 on float32 gave inf (numpy's "overflow encountered in cast" warning
    # from inside ops.py), where a feed of 1e300 into float32 is refused; 10**30, which
    # float32 holds, was refused as "not a number" (numpy makes it an object).
    for x in (tf.placeholder(tf.float32, (2,)), E.tensor(np.ones(2, np.float32))):
        with pytest.raises(tf.ShapeError, match="too large for float32 \\(it would be inf"):
            x * 1e300
        y = x + 10**30
        value = y.numpy() if isinstance(y, Tensor) else tf.Session().run(y, {x: [1, 2]})
        np.testing.assert_array_equal(value, np.float32(1e30))


def test_an_int_tensor_cannot_be_made_to_require_grad_afterwards_either():
    # Review: the constructor refused requires_grad=True for ints, but
    # requires_grad_() and the attribute did not, and backward gave an int grad.
    t = E.tensor([1, 2, 3])
    with pytest.raises(EagerError, match="cannot require grad"):
        t.requires_grad_()
    t.requires_grad = True                    # set directly: caught at backward
    with pytest.raises(EagerError, match="cannot require grad"):
        (t * 2).sum().backward()


def test_backward_of_many_elements_is_refused_traced_as_eagerly():
    # Review: eager refused backward() of a non-scalar, the traced function seeded
    # ones silently (w.grad [1, 1, 1]).
    @tracing.function
    def step(w):
        (w * 1.0).backward()
        return w.grad

    with pytest.raises(EagerError, match="implicit \\(ones\\) only for one element"):
        step(E.tensor(np.ones(3), requires_grad=True))


def test_a_traced_function_called_with_the_wrong_arguments_says_so():
    # Found by the adversarial probe: too many arguments, or an unknown keyword, gave
    # Python's TypeError from inside the trace or inspect.
    @tracing.function
    def f(a, b):
        return a * b

    x = E.tensor(np.ones(2, np.float32))
    with pytest.raises(tf.ArgumentError, match="f: too many positional arguments"):
        f(x, x, x)
    with pytest.raises(tf.ArgumentError, match="unexpected keyword argument 'c'"):
        f(x, b=x, c=x)
    np.testing.assert_array_equal(f(x, b=x).numpy(), [1.0, 1.0])


def test_numpy_cannot_read_a_tensor_that_requires_grad():
    # Review (eager probe): np.exp(w) read w's values through __array__ and gave back
    # an array without history, so (w * np.exp(w)).sum().backward() left a wrong
    # w.grad without a word. PyTorch refuses ("Can't call numpy() on Tensor that
    # requires grad"); the traced version was a graph break already.
    w = E.tensor(np.array([0.5, 1.0]), requires_grad=True)
    with pytest.raises(EagerError, match=r"test_eager.py:\d+.*requires grad.*tf.exp.*"
                                         r"detach\(\)"):
        (w * np.exp(w)).sum().backward()
    assert w.grad is None
    with pytest.raises(EagerError, match=r"np.asarray\(\) at test_eager.py:\d+"):
        np.asarray(w, np.float32)
    # The tf op keeps the history; the values can be read explicitly, or under no_grad.
    (w * tf.exp(w)).sum().backward()
    e = np.exp(w.numpy())
    np.testing.assert_array_equal(w.grad.numpy(), e + w.numpy() * e)
    np.testing.assert_array_equal(np.exp(w.detach()), e)
    with E.no_grad():
        np.testing.assert_array_equal(np.asarray(w), w.numpy())
    np.testing.assert_array_equal(np.asarray(w.grad), w.grad.numpy())   # (no grad of its own)


def _adam_by_hand(p, grads, dtype, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    """Adam as eager.Adam computes it, op by op, every number in `dtype` (TF1's form:
    the bias correction folded into the step size)."""
    def c(x):
        return np.asarray(x, dtype)
    p, t = c(p), c(0.0)
    m, v = np.zeros_like(p), np.zeros_like(p)
    for g in grads:
        g = c(g)
        t = t + c(1.0)
        step = c(lr) * np.sqrt(c(1.0) - np.power(c(beta2), t)) / (
            c(1.0) - np.power(c(beta1), t))
        m = m * c(beta1) + (c(1.0) - c(beta1)) * g
        v = v * c(beta2) + (c(1.0) - c(beta2)) * g * g
        p = p - step * m / (np.sqrt(v) + c(eps))
    return p


def test_adam_steps_each_parameter_in_its_own_dtype():
    # Review (eager probe): the step count and step size were in the first
    # parameter's dtype, so a float64 parameter listed after a float32 one took a
    # float32-rounded step (README: Adam computes its step in each variable's dtype).
    rng = np.random.default_rng(7)
    a0, b0 = rng.normal(size=3).astype(np.float32), rng.normal(size=2)
    grads = [(rng.normal(size=3).astype(np.float32), rng.normal(size=2)) for _ in range(4)]
    want_a = _adam_by_hand(a0, [ga for ga, _ in grads], np.float32, 0.1)
    want_b = _adam_by_hand(b0, [gb for _, gb in grads], np.float64, 0.1)
    for first_f32, traced in ((True, False), (False, False), (True, True)):
        a, b = E.tensor(a0, requires_grad=True), E.tensor(b0, requires_grad=True)
        opt = E.Adam([a, b] if first_f32 else [b, a], lr=0.1)
        step = tracing.function(opt.step) if traced else opt.step
        for ga, gb in grads:
            a.grad, b.grad = E.tensor(ga), E.tensor(gb)
            step()
        assert not traced or len(step.traces) == 1
        assert (a.dtype, b.dtype) == (np.float32, np.float64)
        np.testing.assert_array_equal(a.numpy(), want_a)
        np.testing.assert_array_equal(b.numpy(), want_b)


def test_a_grad_is_set_only_to_a_tensor_of_the_same_shape_and_kind():
    # Review (eager probe): `w.grad = x` took any shape, dtype or type; the next
    # backward broadcast into it and SGD failed with numpy's error. PyTorch refuses
    # ("assigned grad has data of a different size").
    w = E.tensor(np.array([[1.0], [2.0]]), requires_grad=True)
    with pytest.raises(EagerError, match=r"test_eager.py:\d+.*\(2,\).*\(2, 1\)"):
        w.grad = E.tensor(np.zeros(2))
    with pytest.raises(EagerError, match=r"test_eager.py:\d+.*int64.*float64"):
        w.grad = E.tensor(np.zeros((2, 1), np.int64))
    with pytest.raises(EagerError, match=r"test_eager.py:\d+.*a Tensor or None.*ndarray"):
        w.grad = np.zeros((2, 1))
    assert w.grad is None
    w.grad = E.tensor(np.ones((2, 1), np.float32))   # same shape and kind: fine
    (w * 3.0).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [[4.0], [4.0]])
    w.grad = None
    assert w.grad is None


def test_assign_checks_numbers_and_arrays_as_ops_check_their_literals():
    # Review (eager probe): assign_ checked Tensor values only. A float array or
    # number into an int Tensor was truncated, 1e300 into float32 stored inf, 2**40
    # into int32 was numpy's OverflowError, and a shape that does not broadcast was
    # numpy's ValueError (the traced write: a ShapeError naming the line).
    i32 = E.tensor(np.array([1, 2], np.int32))
    for value in (np.array([1.5, 2.5]), 1.5, E.tensor([1.5, 2.5])):
        with pytest.raises(EagerError, match=r"test_eager.py:\d+.*int32 Tensor cannot hold"):
            i32.assign_(value)
    with pytest.raises(tf.ShapeError, match=r"out of range for int32 \(at test_eager.py:\d+"):
        i32.assign_(2**40)
    f32 = E.tensor(np.ones(2, np.float32))
    with pytest.raises(tf.ShapeError, match=r"too large for float32 .*test_eager.py:\d+"):
        f32.assign_(1e300)
    with pytest.raises(tf.ShapeError, match=r"\(3,\), \(2,\).*test_eager.py:\d+"):
        E.tensor(np.zeros(2)).assign_(E.tensor(np.ones(3)))
    with pytest.raises(tf.ShapeError, match=r"\(2, 3\), \(3,\).*test_eager.py:\d+"):
        E.tensor(np.zeros(3)).add_(E.tensor(np.ones((2, 3))))
    with E.no_grad(), pytest.raises(tf.ShapeError, match=r"\(2, 3\), \(3,\)"):
        E.tensor(np.zeros(3)).add_(np.ones((2, 3)))     # (the no_grad fast path too)
    np.testing.assert_array_equal(i32.numpy(), [1, 2])
    np.testing.assert_array_equal(f32.numpy(), [1.0, 1.0])
    # What a copy may do still: broadcast, a same-kind dtype, a lower kind, a number
    f32.assign_(np.array([0.1, 0.2]))
    np.testing.assert_array_equal(f32.numpy(), np.array([0.1, 0.2]).astype(np.float32))
    i32.assign_(np.array([3, 4], np.int64))
    np.testing.assert_array_equal(i32.numpy(), [3, 4])
    i32.assign_(7)
    f32.assign_(np.array([True, False]))
    np.testing.assert_array_equal(f32.numpy(), [1.0, 0.0])
    rows = E.tensor(np.zeros((2, 3))).assign_(np.arange(3.0))
    np.testing.assert_array_equal(rows.numpy(), [[0.0, 1.0, 2.0]] * 2)
    np.testing.assert_array_equal(i32.zero_().numpy(), [0, 0])


@pytest.mark.parametrize("read", [bool, float, int])
def test_python_values_of_a_tensor_need_one_element(read):
    # Review (eager probe): bool(), float() and int() of several elements, or of
    # none, raised numpy's ValueError and TypeError; .item() named the shape.
    for value in (np.array([1.0, 2.0]), np.zeros((0, 3))):
        with pytest.raises(EagerError, match=r"needs a Tensor of one element, this one "
                                             r"has shape .*test_eager.py:\d+"):
            read(E.tensor(value))
    assert read(E.tensor(np.array([[3.0]]))) == read(3.0)


def test_a_constant_of_a_tensor_that_requires_grad_takes_its_values():
    # tf.constant(w) went through numpy's __array__, which now refuses a Tensor
    # that requires grad: a constant keeps no history, as torch.tensor(w) copies.
    w = E.tensor(np.array([1.5, -2.0]), requires_grad=True)
    np.testing.assert_array_equal(tf.Session().run(tf.constant(w)), [1.5, -2.0])


def test_a_numpy_function_on_a_tensor_that_requires_grad_names_the_users_line():
    # The message named numpy's own numeric.py:2477, the frame that called __array__.
    w = E.tensor(np.ones(2), requires_grad=True)
    with pytest.raises(EagerError, match=r"np.asarray\(\) at test_eager.py:\d+"):
        np.allclose(w, 1.0)
