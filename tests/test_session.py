"""Session and compile contracts from issue 14: bad feeds and options are named errors,
runs are thread-safe, threads and programs end with their Session, errors name the
op that raised (also inside a fused kernel or a folded constant), node names stay
unique, a recorder never overrides the user's options, and the planner never changes
a float32 reduction."""

import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.executor import ExecutionError, NumericsError, OptionError
from tinyflow.session import SessionClosedError
from tinyflow.graph import FeedError, TinyFlowError
from tinyflow.ops import make

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(bits(got), bits(want))


# -- item 3: planned and unplanned float32 reductions are bitwise equal --------------

@pytest.mark.parametrize("options", [{}, {"passes": []}, {"streams": 2},
                                     {"memory": "greedy_by_size", "poison": True}])
def test_float32_reduction_of_a_transpose_is_the_same_with_and_without_a_plan(options):
    x = tf.placeholder(tf.float32, (64, 33))
    summed = tf.reduce_sum(tf.transpose(x) * 1.0001, axis=1)  # a Fortran-ordered product
    column = tf.reduce_sum(tf.transpose(x), axis=0)          # a view, summed
    product = tf.matmul(tf.transpose(x) * 2.0, x)
    value = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32) * 1000
    want = tf.Session(passes=[], memory=None).run([summed, column, product], {x: value})
    got = tf.Session(**options).run([summed, column, product], {x: value})
    for g, w in zip(got, want):
        assert_bitwise(g, w)


# -- item 9: feeds that the placeholder's dtype cannot hold ---------------------------

@pytest.mark.parametrize("dtype, value, words", [
    (tf.int32, np.array([1, 2**40 + 5]), "1099511627781"),
    (tf.int32, [-(2**31) - 1], "-2147483649"),
    (np.uint8, np.array([3, 300], np.uint16), "300"),
    (tf.float32, np.array([1.0, 1e300]), "1e+300"),
    (tf.float16, np.array([70000]), "70000"),
])
def test_feed_out_of_the_placeholders_range_is_refused(dtype, value, words):
    x = tf.placeholder(dtype, (None,), name="ids")
    with pytest.raises(FeedError, match="ids") as info:
        tf.Session().run(x * 1, {x: value})
    assert words in str(info.value) and "cannot hold" in str(info.value)


def test_feed_of_nan_and_inf_or_in_range_values_is_accepted():
    x = tf.placeholder(tf.float32, (4,))
    got = tf.Session().run(x, {x: np.array([np.inf, -np.inf, np.nan, 1e30])})
    assert np.isinf(got[:2]).all() and np.isnan(got[2]) and got[3] == np.float32(1e30)
    i = tf.placeholder(tf.int32, (2,))
    got = tf.Session().run(i, {i: np.array([2**31 - 1, -(2**31)], np.int64)})
    assert got.dtype == np.int32 and got.tolist() == [2**31 - 1, -(2**31)]


# -- item 11: Session.run from several threads -----------------------------------------

@pytest.mark.parametrize("streams", [1, 2])
def test_session_run_from_four_threads_gives_each_its_own_answer(streams):
    x = tf.placeholder(tf.float64, (32, 32))
    w = tf.constant(np.random.default_rng(0).standard_normal((32, 32)) / 8)
    a, b = tf.matmul(x, w), tf.matmul(tf.tanh(x), w)
    out = tf.reduce_sum(tf.matmul(a, w) + tf.matmul(b, w) * 2.0, axis=1)
    sess = tf.Session(streams=streams)
    feeds = [np.full((32, 32), k / 7.0) for k in range(4)]
    reference = tf.Session(passes=[], memory=None)
    want = [reference.run(out, {x: f}) for f in feeds]
    wrong: list = []

    def worker(k):
        for _ in range(40):
            got = sess.run(out, {x: feeds[k]})
            if not np.array_equal(got, want[k]):
                wrong.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


# -- item 16: threads and programs end with their Session ------------------------------

def _two_branch_net():
    x = tf.placeholder(tf.float64, (None, 16))
    rng = np.random.default_rng(0)
    a = b = x
    for _ in range(3):
        a = tf.matmul(a, tf.constant(rng.standard_normal((16, 16))))
        b = tf.matmul(b, tf.constant(rng.standard_normal((16, 16))))
    return x, a + b


def _settle(count: int, timeout: float = 5.0) -> int:
    """threading.active_count(), once it has come down to `count` (threads need a
    moment to leave after being asked to)."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


def _force_streams(monkeypatch):
    from tinyflow import streams
    monkeypatch.setattr(streams, "HANDOFF_COST", 0)  # spread even tiny steps


def test_closed_session_ends_its_threads_and_refuses_to_run(monkeypatch):
    _force_streams(monkeypatch)
    x, out = _two_branch_net()
    before = threading.active_count()
    sess = tf.Session(streams=2)
    for batch in range(1, 9):
        sess.run(out, {x: np.ones((batch, 16))})
    assert threading.active_count() > before  # the programs' stream threads
    sess.close()
    assert _settle(before) == before
    with pytest.raises(SessionClosedError, match="closed Session") as info:
        sess.run(out, {x: np.ones((2, 16))})
    assert isinstance(info.value, TinyFlowError) and isinstance(info.value, RuntimeError)


def test_threads_end_with_a_with_block_and_when_the_session_is_collected(monkeypatch):
    _force_streams(monkeypatch)
    x, out = _two_branch_net()
    before = threading.active_count()
    with tf.Session(streams=2) as sess:
        sess.run(out, {x: np.ones((3, 16))})
        assert threading.active_count() > before
    assert _settle(before) == before
    sess = tf.Session(streams=2)
    sess.run(out, {x: np.ones((3, 16))})
    assert threading.active_count() > before
    del sess
    gc.collect()
    assert _settle(before) == before


def test_program_cache_is_a_bounded_lru(monkeypatch):
    _force_streams(monkeypatch)
    x, out = _two_branch_net()
    before = threading.active_count()
    sess = tf.Session(streams=2)
    monkeypatch.setattr(sess, "MAX_CACHED_PROGRAMS", 3)
    for batch in range(1, 21):
        sess.run(out, {x: np.ones((batch, 16))})
    assert len(sess._cache) == 3
    workers = threading.active_count() - before
    assert 1 <= workers <= 3  # one worker (stream 1) per cached program, no more
    first = sess.last_program
    sess.run(out, {x: np.ones((18, 16))})  # recently used: still cached
    assert len(sess._cache) == 3 and sess.last_program is not first
    np.testing.assert_array_equal(sess.run(out, {x: np.ones((2, 16))}),
                                  tf.Session(passes=[], memory=None).run(
                                      out, {x: np.ones((2, 16))}))
    sess.close()
    assert _settle(before) == before


def test_a_closed_program_runs_again_when_asked(monkeypatch):
    _force_streams(monkeypatch)
    x, out = _two_branch_net()
    sess = tf.Session(streams=2)
    want = sess.run(out, {x: np.ones((2, 16))})
    program = sess.last_program
    program.close()
    np.testing.assert_array_equal(program.run({x: np.ones((2, 16))}, sess.variables)[0], want)
    program.close()


# -- item 12: check mode names the real source of a NaN --------------------------------

def test_check_numerics_names_an_op_inside_a_constant_subgraph():
    x = tf.placeholder(tf.float32, (2,))
    bad = tf.log(tf.constant(np.array([0.0, -1.0], np.float32)))  # -inf and NaN
    out = x * bad
    with pytest.raises(NumericsError) as info:
        tf.Session(check_numerics=True).run(out, {x: np.ones(2, np.float32)})
    message = str(info.value)
    assert f"log {bad.name}" in message and bad.where in message
    assert out.where not in message


def test_check_numerics_names_a_feed_or_variable_holding_nan():
    x = tf.placeholder(tf.float32, (3,), name="images")
    v = tf.Variable(np.zeros(3, np.float32), name="weights")
    out = tf.exp(x) + v
    sess = tf.Session(check_numerics=True)
    sess.variables[v] = np.array([1.0, np.inf, 2.0], np.float32)  # as a bad step left it
    with pytest.raises(NumericsError, match="feed for placeholder 'images'") as info:
        sess.run(out, {x: np.array([1.0, np.nan, 0.0], np.float32)})
    assert x.where in str(info.value) and "exp" not in str(info.value)
    with pytest.raises(NumericsError, match="variable 'weights'") as info:
        sess.run(out, {x: np.zeros(3, np.float32)})
    assert sess.last_program.check_failure["where"] == v.where


def test_a_record_of_a_nan_feed_names_the_placeholder_and_validates(tmp_path):
    x = tf.placeholder(tf.float32, (2,), name="pixels")
    path = tmp_path / "nan_feed.tfdbg.json"
    with pytest.raises(NumericsError):
        with tf.debug.record(path, check_numerics=True):
            tf.Session().run(tf.sqrt(x), {x: np.array([np.nan, 1.0], np.float32)})
    record = tf.trace.load(path)
    assert "pixels" in record["check"]["message"] and record["check"]["where"] == x.where


# -- item 22: an error inside a fused kernel names the op that raised -------------------

def test_error_inside_a_fused_kernel_names_the_op_that_raised():
    x = tf.placeholder(tf.int64, (3,))
    powered = tf.pow(x, x - 5)               # integers to a negative power: raises
    out = powered * 2 + 1
    sess = tf.Session()
    with pytest.raises(ExecutionError) as info:
        sess.run(out, {x: np.array([1, 2, 3])})
    assert any(n.op == "fused_elementwise" for n in sess.last_program.graph.nodes)
    message = str(info.value)
    assert f"pow {powered.name}" in message and powered.where in message
    assert "negative integer powers" in message
    assert out.where not in message


def test_error_inside_a_fused_assign_names_the_op_that_raised():
    v = tf.Variable(np.array([1, 2, 3]), dtype=tf.int64)
    x = tf.placeholder(tf.int64, (3,))
    update = tf.assign(v, tf.pow(v, x) + 1)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    with pytest.raises(ExecutionError) as info:
        sess.run(update, {x: np.array([1, -1, 1])})
    assert "fused_assign" in {n.op for n in sess.last_program.graph.nodes}
    assert "pow" in str(info.value).split("failed")[0]


# -- item 23: a user node named like a pass-made one ------------------------------------

def test_user_node_named_like_a_pass_made_node_keeps_names_unique(tmp_path):
    """The fused node of y would be "fused_" + y.name, the folded constant
    "folded_" + c.name: users named nodes so first. Every snapshot's names stay
    unique, the record validates, and the answer is unchanged."""
    x = tf.placeholder(tf.float32, (4, 4))
    y = tf.tanh(x * 2.0 + 1.0)
    c = tf.constant(np.ones((4, 4), np.float32)) * 2.0
    like_fused = make("exp", x * 3.0 - 1.0, name="fused_" + y.name)
    like_folded = make("sigmoid", x, name="folded_" + c.name)
    out = y + like_fused + c + like_folded
    sess = tf.Session()
    path = tmp_path / "names.tfdbg.json"
    with tf.debug.record(path):
        got = sess.run(out, {x: np.ones((4, 4), np.float32)})
    want = tf.Session(passes=[], memory=None).run(out, {x: np.ones((4, 4), np.float32)})
    assert_bitwise(got, want)
    snapshots = sess.last_program.ctx.snapshots
    assert {"fuse_elementwise", "fold"} <= {name for name, _, _ in snapshots}
    for _, graph, _ in snapshots:
        names = [n.name for n in graph.nodes]
        assert len(names) == len(set(names))
    tf.trace.load(path)


# -- item 24: options are checked once, with the valid values ---------------------------

@pytest.mark.parametrize("options, words", [
    ({"checkpoint": "cube"}, "'sqrt'"),
    ({"checkpoint": -5}, "positive"),
    ({"passes": "cse"}, "list of pass names"),
    ({"passes": ["cse", "nope"]}, "unknown passes ['nope']"),
    ({"disable": "fold"}, "list of pass names"),
    ({"wait_timeout": -1}, "seconds > 0"),
    ({"wait_timeout": float("nan")}, "seconds > 0"),
    ({"streams": 0}, ">= 1"),
    ({"streams": 1.5}, ">= 1"),
    ({"memory": "best"}, "greedy_by_size"),
    ({"memory": ["naive"]}, "'auto'"),
    ({"debug": 3}, "file path"),
    ({"poison": "yes"}, "True or False"),
    ({"check_numerics": 1}, "True or False"),
    ({"stream": 2}, "unknown options ['stream']"),
])
def test_bad_options_are_refused_by_session_and_compile_alike(options, words):
    x = tf.placeholder(tf.float32, (2,))
    with pytest.raises(OptionError, match=None) as info:
        tf.Session(**options)
    assert words in str(info.value)
    assert isinstance(info.value, TinyFlowError)
    with pytest.raises(OptionError) as again:
        tf.compile([x * 2.0], {x: ((2,), np.float32)}, **options)
    assert words in str(again.value)


def test_good_options_are_accepted():
    x = tf.placeholder(tf.float32, (2,))
    for options in [{"passes": ["cse", "fold"]}, {"passes": ()}, {"memory": None},
                    {"memory": True}, {"checkpoint": "sqrt"}, {"checkpoint": 1 << 20},
                    {"wait_timeout": 5}, {"streams": np.int64(2)}, {"disable": ["fold"]}]:
        np.testing.assert_array_equal(tf.Session(**options).run(x * 2.0, {x: [1, 2]}),
                                      [2.0, 4.0])


# -- item 28: a recorder never turns off the user's options -----------------------------

def test_recording_keeps_the_users_check_numerics_and_trace_values(tmp_path):
    x = tf.placeholder(tf.float32, (2,))
    out = tf.log(x) * 2.0
    sess = tf.Session(check_numerics=True, trace_values=True)
    with pytest.raises(NumericsError):
        with tf.debug.record(tmp_path / "r.tfdbg.json"):
            sess.run(out, {x: np.array([-1.0, 1.0], np.float32)})
    record = tf.trace.load(tmp_path / "r.tfdbg.json")
    assert record["check"]["node"]
    # ... and trace_values: each event carries its summary.
    sess = tf.Session(trace_values=True)
    with tf.debug.record(tmp_path / "s.tfdbg.json"):
        sess.run(out, {x: np.array([1.0, 2.0], np.float32)})
    record = tf.trace.load(tmp_path / "s.tfdbg.json")
    assert all(e["summary"] for e in record["timelines"][-1]["events"])


def test_debug_run_keeps_the_users_check_numerics(tmp_path):
    script = tmp_path / "nan_script.py"
    script.write_text(
        "import numpy as np\nimport tinyflow as tf\n"
        "x = tf.placeholder(tf.float32, (2,))\n"
        "out = tf.log(x) * 2.0\n"
        "tf.Session(check_numerics=True).run(out, {x: np.array([-1.0, 1.0], np.float32)})\n"
        "print('NO ERROR')\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "TINYFLOW_TRACE": str(tmp_path / "t.json")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "NO ERROR" not in done.stdout
    assert "NumericsError" in done.stderr and "check_numerics" in done.stderr


@pytest.mark.parametrize("fetch,shown", [
    (None, "None"), ("y", "'y'"), (3, "3"), (np.ones(3), "a numpy array of shape (3,)"),
    ({"a": None}, "None"),
])
def test_fetching_what_is_not_a_node_is_an_argument_error(fetch, shown):
    # A plain TypeError before; ArgumentError is one too, and a TinyFlowError.
    x = tf.placeholder(tf.float32, (None, 3))
    with pytest.raises(tf.ArgumentError, match="Session.run: cannot fetch ") as info:
        tf.Session().run(fetch)
    assert f"cannot fetch {shown}:" in str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, tf.TinyFlowError)
    with pytest.raises(tf.ArgumentError, match="a set has no order: use a list"):
        tf.Session().run({tf.reduce_sum(x)})
