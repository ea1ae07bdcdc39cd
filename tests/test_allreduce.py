"""Collectives: ring and naive allreduce, broadcast, over threads, processes and MPI.

The thread tests check the algorithm in-process; the process and MPI tests run a
small child script (below) as N real ranks through `launch`, and the script checks
its own results against sums it computes locally, so a wrong answer is a non-zero
exit code. Faults: a rank killed mid-allreduce, a silent rank, mismatched sizes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tinyflow.allreduce import (
    CollectiveError,
    ThreadTransport,
    _tag,
    agree,
    broadcast,
    chunk_bounds,
    find_mpiexec,
    init_communicator,
    launch,
    naive_allreduce,
    ring_allreduce,
    ring_bytes_per_rank,
    ring_timeline_events,
    run_threads,
    spawn_local,
)
from tinyflow.errors import TinyFlowError

DTYPES = ["float32", "float64", "int64"]
ROOT = Path(__file__).resolve().parent.parent


def rank_data(rank: int, size: int, dtype: str) -> np.ndarray:
    """Each rank's input: random floats (or ints) that depend on the rank."""
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-50, 50, size).astype(dtype)
    return rng.standard_normal(size).astype(dtype)


def sizes_for(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 0), 7, 2 * n + 1, 1001})


@pytest.mark.parametrize("n, parts", [(10, 3), (2, 5), (0, 4), (7, 7), (1001, 4)])
def test_chunk_bounds_cut_like_array_split(n, parts):
    bounds = chunk_bounds(n, parts)
    pieces = np.array_split(np.arange(n), parts)
    assert [e - s for s, e in bounds] == [len(p) for p in pieces]
    assert bounds[0][0] == 0 and bounds[-1][1] == n


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_and_naive_equal_the_sum_on_threads(n, dtype):
    def rank(comm):
        out = []
        for size in sizes_for(n):
            data = rank_data(comm.rank, size, dtype)
            out.append((ring_allreduce(data.copy(), comm), naive_allreduce(data.copy(), comm)))
        return out

    results = run_threads(n, rank)
    for i, size in enumerate(sizes_for(n)):
        expected = sum(rank_data(r, size, dtype).astype(np.float64) for r in range(n))
        first_ring = results[0][i][0]
        for ring, naive in (per_rank[i] for per_rank in results):
            assert ring.dtype == np.dtype(dtype) and ring.shape == (size,)
            np.testing.assert_allclose(ring, expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(naive, ring, rtol=1e-5, atol=1e-5)
            # Replicas must agree bit for bit, or data-parallel models drift apart.
            assert ring.tobytes() == first_ring.tobytes()


def test_in_place_shapes_ops_and_copies():
    def rank(comm):
        matrix = np.full((3, 5), comm.rank + 1.0)
        same = ring_allreduce(matrix, comm, "mean")
        peak = ring_allreduce(np.array([comm.rank, -comm.rank]), comm, "max")
        base = np.arange(20.0) * (comm.rank + 1)
        reduced = ring_allreduce(base[::2], comm)   # not contiguous: a reduced copy
        return same is matrix, matrix, peak, reduced, base, comm.rank

    for is_same, matrix, peak, reduced, base, rank_ in run_threads(3, rank):
        assert is_same
        np.testing.assert_allclose(matrix, np.full((3, 5), 2.0))
        assert peak.tolist() == [2, 0]
        np.testing.assert_allclose(reduced, np.arange(20.0)[::2] * 6)
        np.testing.assert_allclose(base, np.arange(20.0) * (rank_ + 1))  # untouched


def test_mean_of_integers_is_refused():
    comm = init_communicator()
    with pytest.raises(TypeError, match="mean"):
        ring_allreduce(np.arange(4), comm, "mean")
    with pytest.raises(ValueError, match="op must be"):
        ring_allreduce(np.ones(4), comm, "product")


@pytest.mark.parametrize("n, count", [(4, 4096), (3, 1001), (5, 3)])
def test_bytes_sent_match_theory(n, count):
    def rank(comm):
        ring_allreduce(np.ones(count, np.float32), comm)
        ring_bytes = comm.bytes_sent
        naive_allreduce(np.ones(count, np.float32), comm)
        return ring_bytes, comm.bytes_sent - ring_bytes

    results = run_threads(n, rank)
    nbytes = count * 4
    ring = [r for r, _ in results]
    # Each phase moves every chunk N-1 times, so all ranks together send 2(N-1) arrays;
    # per rank, that is 2(N-1)/N of the array when the chunks are equal.
    assert sum(ring) == 2 * (n - 1) * nbytes
    if count % n == 0:
        assert ring == [ring_bytes_per_rank(nbytes, n)] * n
    assert [naive for _, naive in results] == [(n - 1) * nbytes] + [nbytes] * (n - 1)


def test_record_shows_the_ring_turning():
    def rank(comm):
        record: list[dict] = []
        ring_allreduce(np.ones(9), comm, record=record)
        return record

    n = 3
    for r, record in enumerate(run_threads(n, rank)):
        assert [s["phase"] for s in record] == ["reduce-scatter"] * 2 + ["all-gather"] * 2
        assert all(s["src"] == r and s["dst"] == (r + 1) % n for s in record)
        assert [s["chunk"] for s in record] == [r, (r - 1) % n, (r + 1) % n, r]
        assert all(s["bytes"] == 24 and s["end"] >= s["start"] for s in record)
        events = ring_timeline_events(record, t0=record[0]["start"], stream=2)
        assert events[0]["start"] == 0.0 and events[0]["stream"] == 2
        assert events[1]["args"] == {"chunk": (r - 1) % n, "src": r, "dst": (r + 1) % n,
                                     "phase": "reduce-scatter"}


def test_broadcast_copies_the_root():
    def rank(comm):
        return broadcast(np.full(5, float(comm.rank)), comm, root=2)

    for value in run_threads(4, rank):
        assert value.tolist() == [2.0] * 5


def test_mismatched_sizes_raise_collective_error():
    def rank(comm):
        return ring_allreduce(np.ones(10 + 2 * comm.rank, np.float32), comm)

    with pytest.raises(CollectiveError, match="disagree") as info:
        run_threads(3, rank, timeout=10)
    assert "allreduce of 1" in str(info.value) and info.value.operation == "allreduce"


def test_mismatched_dtypes_raise_collective_error():
    def rank(comm):
        return ring_allreduce(np.ones(8, np.float32 if comm.rank else np.float64), comm)

    with pytest.raises(CollectiveError, match="float64"):
        run_threads(2, rank, timeout=10)


def test_a_silent_rank_times_out_naming_it():
    release = []

    def rank(comm):
        if comm.rank == 1:       # never joins; waits until the others gave up
            while not release:
                time.sleep(0.01)
            return None
        try:
            return ring_allreduce(np.ones(6), comm)
        finally:
            release.append(True)

    with pytest.raises(CollectiveError, match="rank 1") as info:
        run_threads(2, rank, timeout=0.3)
    assert info.value.peer == 1


def _catching(fn):
    """fn(comm) on each thread rank; each rank returns its CollectiveError (or None)."""
    def rank(comm):
        try:
            fn(comm)
        except CollectiveError as err:
            return err
        return None
    return rank


@pytest.mark.parametrize("ops", [("sum", "max", "sum"), ("sum", "mean", "sum"),
                                 ("max", "max", "min")])
def test_ranks_that_disagree_on_the_op_all_raise(ops):
    """issue 14.13: sum on one rank and max on another used to finish silently."""
    errors = run_threads(3, _catching(
        lambda comm: ring_allreduce(np.ones(6), comm, ops[comm.rank])), timeout=10)
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert any("disagree" in str(e) for e in errors)


def test_ranks_that_disagree_on_the_broadcast_root_all_raise():
    roots = (0, 1, 0)
    errors = run_threads(3, _catching(
        lambda comm: broadcast(np.full(4, float(comm.rank)), comm, roots[comm.rank])),
        timeout=10)
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert all("root=1" in str(e) and "root=0" in str(e) for e in errors)


def test_a_broadcast_root_outside_the_group_is_a_clear_error():
    errors = run_threads(3, _catching(lambda comm: broadcast(np.ones(2), comm, root=7)))
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert "root 7" in str(errors[0]) and "0..2" in str(errors[0])


def test_the_rank_that_hangs_is_named_not_its_neighbour():
    """issue 14.14: rank 1 of 3 never joins. Rank 0 receives from rank 2, which waits
    for rank 1: rank 0 used to blame rank 2. Both waiting ranks must name rank 1."""
    release = []

    def rank(comm):
        if comm.rank == 1:
            while not release:
                time.sleep(0.01)
            return None
        try:
            ring_allreduce(np.ones(6), comm)
        except CollectiveError as err:
            return err
        finally:
            release.append(True)

    errors = run_threads(3, rank, timeout=0.5)
    for r in (0, 2):
        assert isinstance(errors[r], CollectiveError), errors
        assert errors[r].peer == 1, (r, str(errors[r]))
        assert "rank 1" in str(errors[r])


def test_a_failed_thread_rank_is_reported_to_the_others():
    def rank(comm):
        if comm.rank == 0:
            raise ValueError("bad batch")
        return ring_allreduce(np.ones(4), comm)

    with pytest.raises(ValueError, match="bad batch") as info:
        run_threads(3, rank, timeout=30)
    assert "rank 0" in info.value.__notes__[0]


def test_a_world_of_one_needs_no_peers():
    comm = init_communicator()
    assert (comm.rank, comm.size) == (0, 1)
    x = np.arange(5.0)
    assert ring_allreduce(x, comm, "mean") is x and x.tolist() == [0, 1, 2, 3, 4]
    assert naive_allreduce(x, comm).tolist() == x.tolist() and comm.bytes_sent == 0


def test_thread_group_needs_a_rank():
    with pytest.raises(ValueError):
        ThreadTransport.group_of(0)


LONG_LABEL = "a_fairly_long_label_naming_this_bucket_of_grads" * 2  # tags past 64 bytes


def test_long_tags_are_compared_whole():
    """A socket header holds a readable prefix of the tag; `agree` used to compare
    only the first 64 bytes too, so tags that differ after them "agreed"."""
    run_threads(2, lambda comm: ring_allreduce(np.ones(4), comm, label=LONG_LABEL),
                timeout=10)
    errors = run_threads(3, _catching(lambda comm: agree(comm, LONG_LABEL + str(comm.rank))),
                         timeout=10)
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert all("disagree" in str(e) for e in errors)


def test_byte_orders_are_told_apart():
    """float32 and its byte-swapped twin share `dtype.name`: the tag (all MPI checks)
    must still differ, and the message must show the difference."""
    swapped = np.dtype(np.float32).newbyteorder()
    assert _tag("allreduce", np.ones(4, np.float32)) != _tag("allreduce", np.ones(4, swapped))
    errors = run_threads(2, _catching(lambda comm: ring_allreduce(
        np.ones(4, swapped if comm.rank else np.float32), comm)), timeout=10)
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert all(swapped.str in str(e) for e in errors), errors


@pytest.mark.parametrize("bad", [0, -3, float("nan"), float("inf"), "5", True])
def test_bad_timeouts_are_refused_naming_the_argument(bad):
    """timeout=-3 made a healthy allreduce fail ("waited -3 s"), 0 raced."""
    for make in (lambda: ThreadTransport.group_of(2, bad),
                 lambda: run_threads(2, lambda comm: None, timeout=bad),
                 lambda: init_communicator(timeout=bad)):
        with pytest.raises(TinyFlowError, match="timeout") as info:
            make()
        assert repr(bad) in str(info.value)


@pytest.fixture
def empty_script(tmp_path):
    script = tmp_path / "empty.py"
    script.write_text("")
    return str(script)


@pytest.mark.parametrize("kwargs, name", [
    ({"n": "2"}, "n"), ({"n": 2.5}, "n"), ({"n": 0}, "n"), ({"n": True}, "n"),
    ({"timeout": -3}, "timeout"), ({"timeout": 0}, "timeout"),
    ({"timeout": "abc"}, "timeout"), ({"use_mpi": "yes"}, "use_mpi")])
def test_launch_refuses_bad_arguments_up_front(empty_script, kwargs, name):
    kwargs = {"n": 2, "use_mpi": False, **kwargs}
    with pytest.raises(TinyFlowError, match=f"launch: {name} ") as info:
        launch(script=empty_script, **kwargs)
    assert repr(kwargs[name]) in str(info.value)


@pytest.mark.parametrize("text", ["abc", "-1", "0", "nan"])
def test_a_bad_timeout_variable_is_named(empty_script, monkeypatch, text):
    """TINYFLOW_TIMEOUT=abc was a raw ValueError in every rank, naming nothing."""
    monkeypatch.setenv("TINYFLOW_TIMEOUT", text)
    with pytest.raises(TinyFlowError, match=f"TINYFLOW_TIMEOUT={text!r}"):
        init_communicator()
    with pytest.raises(TinyFlowError, match=f"TINYFLOW_TIMEOUT={text!r}"):
        launch(2, empty_script, use_mpi=False)   # once, before any rank starts
    assert init_communicator(timeout=5).timeout == 5   # an explicit timeout wins


@pytest.mark.parametrize("rank, size, name", [("0", "0", "TINYFLOW_SIZE"),
                                              ("0", "two", "TINYFLOW_SIZE"),
                                              ("2", "2", "TINYFLOW_RANK"),
                                              ("-1", "2", "TINYFLOW_RANK")])
def test_a_bad_rank_environment_is_named(monkeypatch, tmp_path, rank, size, name):
    """TINYFLOW_SIZE=0 read "rank 0 is not in 0..-1"."""
    monkeypatch.setenv("TINYFLOW_RANK", rank)
    monkeypatch.setenv("TINYFLOW_SIZE", size)
    monkeypatch.setenv("TINYFLOW_ADDR", str(tmp_path))
    with pytest.raises(TinyFlowError, match=name):
        init_communicator(timeout=1)


# ----------------------------------------------------------------------------------
# Real ranks: processes (sockets) and MPI, through a child script
# ----------------------------------------------------------------------------------

CHILD = r'''
import hashlib, json, os, sys, time
import numpy as np
from tinyflow.allreduce import (CollectiveError, broadcast, init_communicator,
                                naive_allreduce, ring_allreduce)

mode, out_dir = sys.argv[1], sys.argv[2]
comm = init_communicator(timeout=float(sys.argv[3]))

if mode == "fail":          # rank 1 fails after starting; the others would linger
    if comm.rank == 1:
        sys.exit(3)
    time.sleep(30)
    open(os.path.join(out_dir, "survivor%d" % comm.rank), "w").close()
    sys.exit(0)

def report(**info):
    info["transport"] = type(comm).__name__
    with open(os.path.join(out_dir, "rank%d.json" % comm.rank), "w") as f:
        json.dump(info, f)

def data(rank, size, dtype):
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-50, 50, size).astype(dtype)
    return rng.standard_normal(size).astype(dtype)

if mode == "check":
    n, digests = comm.size, []
    for size in sorted({0, 1, max(n - 1, 0), 7, 2 * n + 1, 1001, 100000}):
        for dtype in ("float32", "float64", "int64"):
            expected = sum(data(r, size, dtype).astype(np.float64) for r in range(n))
            before = comm.bytes_sent
            ring = ring_allreduce(data(comm.rank, size, dtype), comm)
            ring_bytes = comm.bytes_sent - before
            naive = naive_allreduce(data(comm.rank, size, dtype), comm)
            np.testing.assert_allclose(ring, expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(naive, ring, rtol=1e-5, atol=1e-5)
            assert ring.dtype == np.dtype(dtype)
            digests.append(hashlib.sha1(ring.tobytes()).hexdigest())
            if size % n == 0:
                nbytes = size * np.dtype(dtype).itemsize
                assert ring_bytes == 2 * (n - 1) * nbytes // n, (ring_bytes, size, n)
    root = broadcast(np.full(3, float(comm.rank)), comm, root=n - 1)
    assert root.tolist() == [n - 1.0] * 3
    report(digests=digests)
elif mode == "hang":         # rank 1 never joins; the others must name it
    if comm.rank == 1:      # (it leaves once both have reported, or after 60 s)
        others = [os.path.join(out_dir, "rank%d.json" % r) for r in (0, 2)]
        waited = time.monotonic()
        while not all(map(os.path.exists, others)) and time.monotonic() - waited < 60:
            time.sleep(0.05)
        os._exit(0)
    try:
        ring_allreduce(np.ones(6), comm)
        report(error=None)
    except CollectiveError as err:
        report(error=str(err), peer=err.peer)
elif mode == "sleep":        # the ranks connect, say who they are, and wait
    open(os.path.join(out_dir, "pid%d" % os.getpid()), "w").close()
    time.sleep(120)
elif mode == "mismatch":
    try:
        ring_allreduce(np.ones(10 + 2 * comm.rank, np.float32), comm)
        report(error=None)
    except CollectiveError as err:
        report(error=str(err), peer=err.peer)
elif mode == "late":         # rank 1's receive completes while its send still waits
    tag, small, large = "late", np.arange(8.0), np.ones(1 << 20)  # 8 MiB: rendezvous
    if comm.rank == 0:
        comm.send(1, small, tag)
        time.sleep(0.3)     # past the wait board's POST_AFTER: rank 1's wait is posted
        comm.recv(1, large, tag)
        report(error=None)
    else:
        got = np.empty(8)
        try:
            comm.exchange([(0, large)], [(0, got)], tag)
            report(error=None, got=got.tolist())
        except CollectiveError as err:
            report(error=str(err), peer=err.peer)
elif mode == "longtag":     # a label past the header's 64-byte readable prefix
    label = "a_fairly_long_label_naming_this_bucket_of_grads" * 2
    same = ring_allreduce(np.ones(4), comm, label=label).tolist()
    try:                    # labels that differ only at their end
        ring_allreduce(np.ones(4), comm, label=label + str(comm.rank))
        report(same=same, error=None)
    except CollectiveError as err:
        report(same=same, error=str(err))
elif mode == "byteorder":   # the same bytes, in the other byte order on rank 1
    swapped = np.dtype(np.float32).newbyteorder()
    x = np.ones(4, swapped if comm.rank == 1 else np.float32)
    try:
        report(error=None, got=ring_allreduce(x, comm).tolist())
    except CollectiveError as err:
        report(error=str(err), swapped=swapped.str)
elif mode == "die":         # the last rank dies in the middle of the second allreduce
    x = np.ones(1 << 15)
    ring_allreduce(x, comm)
    if comm.rank == comm.size - 1:
        real, calls = comm.sendrecv, []
        def die_on_second_step(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os._exit(7)
            return real(*args, **kwargs)
        comm.sendrecv = die_on_second_step
    try:
        ring_allreduce(x, comm)
        report(error=None)
    except CollectiveError as err:
        report(error=str(err), peer=err.peer)
'''


@pytest.fixture
def child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return script


def reports(folder, n) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(n)]


def check_ranks(child, folder, n, use_mpi):
    assert launch(n, str(child), ["check", str(folder), "30"], use_mpi=use_mpi) == 0
    found = reports(folder, n)
    assert {r["transport"] for r in found} == {
        "MPITransport" if use_mpi else "ProcessTransport"}
    assert all(r["digests"] == found[0]["digests"] for r in found)  # bitwise equal


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_ring_on_processes(child, tmp_path, n):
    check_ranks(child, tmp_path, n, use_mpi=False)


def test_mismatched_sizes_on_processes(child, tmp_path):
    assert launch(3, str(child), ["mismatch", str(tmp_path), "20"], use_mpi=False) == 0
    found = reports(tmp_path, 3)
    assert all(r["error"] for r in found)       # every rank raised, none hung
    assert any("disagree" in r["error"] for r in found)


def check_long_tags(child, folder, use_mpi):
    """The same long label works; labels that differ after byte 64 fail everywhere
    (over processes the first always failed: the header cut the tag at 64 bytes)."""
    assert launch(2, str(child), ["longtag", str(folder), "20"], use_mpi=use_mpi) == 0
    for found in reports(folder, 2):
        assert found["same"] == [2.0] * 4, found
        assert found["error"] and "disagree" in found["error"], found


def test_long_tags_on_processes(child, tmp_path):
    check_long_tags(child, tmp_path, use_mpi=False)


def test_a_rank_killed_mid_allreduce_makes_the_others_raise(child, tmp_path):
    procs, addr = spawn_local(3, [sys.executable, str(child), "die", str(tmp_path), "20"])
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(addr, ignore_errors=True)  # spawn_local's caller removes it
    assert codes == [0, 0, 7]
    survivors = reports(tmp_path, 2)
    assert all(r["error"] for r in survivors)
    # Rank 0 receives from rank 2, the one that died: its error names it.
    assert survivors[0]["peer"] == 2 and "rank 2" in survivors[0]["error"]
    assert survivors[1]["peer"] in (0, 2)


def test_launch_stops_the_others_when_a_rank_fails(child, tmp_path):
    assert launch(3, str(child), ["fail", str(tmp_path), "30"], use_mpi=False) == 3
    assert not list(tmp_path.glob("survivor*"))   # terminated, never finished


def test_a_hung_process_rank_is_named_by_every_waiting_rank(child, tmp_path):
    procs, addr = spawn_local(3, [sys.executable, str(child), "hang", str(tmp_path), "1.5"])
    try:
        for r in (0, 2):
            procs[r].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(addr, ignore_errors=True)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 2)]
    assert all(r["peer"] == 1 and "rank 1" in r["error"] for r in found), found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill_survivors(pids: list[int]) -> list[int]:
    """The pids still alive, which are then killed (a failing test leaves no orphans)."""
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return survivors


def _launch_then_signal(child, tmp_path, n, sig, use_mpi):
    """Start `tinyflow launch -n n child sleep`, wait until every rank is up, send
    `sig` to the launcher; return the ranks' pids and the launcher's temp dir."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(ROOT)}
    code = ("import sys; from tinyflow.allreduce import launch; "
            f"sys.exit(launch({n}, sys.argv[1], sys.argv[2:], use_mpi={use_mpi}))")
    launcher = subprocess.Popen([sys.executable, "-c", code, str(child), "sleep",
                                 str(tmp_path), "30"], env=env)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.name[3:]) for p in tmp_path.glob("pid*")]
    assert len(pids) == n, "the ranks did not start"
    os.kill(launcher.pid, sig)
    try:
        launcher.wait(timeout=30)
    finally:   # (a launcher that hangs must not outlive the test either)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids, temp


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signalled_launcher_takes_its_ranks_and_socket_folder(child, tmp_path, sig):
    """issue 14.15: the ranks outlived a killed launcher (ppid 1) and the
    tinyflow-ranks-* socket folder stayed in the temp directory."""
    pids, temp = _launch_then_signal(child, tmp_path, 2, sig, use_mpi=False)
    survivors = _kill_survivors(pids)
    assert not survivors, "ranks outlived their launcher"
    assert not list(temp.glob("tinyflow-ranks-*"))


def test_process_ranks_connect_under_a_long_temp_folder(tmp_path):
    """CI's temp folders are deep: `addr/rank0.sock` was longer than a Unix socket
    address holds and every rank died with a bare `OSError: AF_UNIX path too long`."""
    from tinyflow.transports import ProcessTransport
    addr = tmp_path / ("a-long-folder-name-" * 8)
    addr.mkdir()
    assert len(str(addr / "rank0.sock")) > 108

    def rank(r):
        comm = ProcessTransport(r, 2, str(addr), timeout=20)
        try:
            return ring_allreduce(np.full(5, r + 1.0), comm, "sum")
        finally:
            comm.close()

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, [0, 1]))
    for got in results:
        np.testing.assert_array_equal(got, np.full(5, 3.0))
    assert not list(addr.glob("rank*.sock"))


def test_launch_reports_a_missing_script(tmp_path):
    with pytest.raises(FileNotFoundError):
        launch(2, str(tmp_path / "nope.py"))


needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or find_mpiexec() is None,
    reason="mpi4py or mpiexec not installed (pip install 'tinyflow[dist]')")


@needs_mpi
@pytest.mark.parametrize("n", [2, 4])
def test_ring_on_mpi(child, tmp_path, n):
    check_ranks(child, tmp_path, n, use_mpi=True)


@needs_mpi
def test_mpi_launch_stops_the_others_when_a_rank_fails(child, tmp_path):
    assert launch(3, str(child), ["fail", str(tmp_path), "30"], use_mpi=True) != 0
    assert not list(tmp_path.glob("survivor*"))


@needs_mpi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signalled_mpi_launcher_takes_its_ranks(child, tmp_path, sig):
    pids, _ = _launch_then_signal(child, tmp_path, 2, sig, use_mpi=True)
    assert not _kill_survivors(pids), "MPI ranks outlived their launcher"


@needs_mpi
def test_a_hung_mpi_rank_is_named_by_every_waiting_rank(child, tmp_path, monkeypatch):
    # Rank 0 waits for rank 2, which waits for rank 1: both must name rank 1 (the
    # wait board `launch` gives MPI ranks), not their direct peer. The board goes in
    # a temporary folder of this test's own, so that the boards of launches in other
    # test workers running at the same time are not taken for one left behind.
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
    launch(3, str(child), ["hang", str(tmp_path), "1.5"], use_mpi=True)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 2)]
    assert all(r["peer"] == 1 and "rank 1 is late" in r["error"] for r in found), found
    assert not list(own_tmp.glob("tinyflow-board-*")), "launch left its wait board"


@needs_mpi
def test_a_finished_mpi_receive_keeps_its_message_while_the_send_waits(child, tmp_path):
    # Posting a long wait on the board asked which request was pending with a Test
    # that freed the finished receive; the message then "had 0 bytes and tag #-1".
    assert launch(2, str(child), ["late", str(tmp_path), "20"], use_mpi=True) == 0
    found = reports(tmp_path, 2)
    assert found[1] == {"error": None, "got": list(range(8)),
                        "transport": "MPITransport"}, found


@needs_mpi
def test_long_tags_on_mpi(child, tmp_path):
    check_long_tags(child, tmp_path, use_mpi=True)


@needs_mpi
def test_mixed_byte_orders_on_mpi_raise(child, tmp_path):
    """MPI moves bytes without a dtype: '<f4' and '>f4' arrays reduced to garbage."""
    assert launch(2, str(child), ["byteorder", str(tmp_path), "20"], use_mpi=True) == 0
    found = reports(tmp_path, 2)
    assert all(r["error"] and "disagree" in r["error"] for r in found), found
    assert found[1]["swapped"] in found[1]["error"]


@needs_mpi
def test_mismatched_sizes_on_mpi(child, tmp_path):
    assert launch(2, str(child), ["mismatch", str(tmp_path), "20"], use_mpi=True) == 0
    found = reports(tmp_path, 2)
    assert all(r["error"] for r in found)


# ----------------------------------------------------------------------------------
# NCCL: needs two GPUs (NCCL refuses two ranks on one device)
# ----------------------------------------------------------------------------------

def _gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


NCCL_CHILD = r'''
import sys
import cupy as cp
import numpy as np
from tinyflow.allreduce import NCCLTransport, init_communicator, ring_allreduce
bootstrap = init_communicator(timeout=60)
comm = NCCLTransport(bootstrap)
for size in (0, 1, 7, 1001, 1 << 20):
    for dtype in ("float32", "float64"):
        x = cp.arange(size, dtype=dtype) * (comm.rank + 1)
        reference = comm.native_allreduce(x.copy())
        ring = ring_allreduce(x, comm)
        assert ring is x
        cp.testing.assert_allclose(ring, reference, rtol=1e-6)
        cp.testing.assert_allclose(ring, cp.arange(size, dtype=dtype) * 3, rtol=1e-6)
'''


@pytest.mark.skipif(_gpu_count() < 2, reason="NCCL needs 2 GPUs (one rank per GPU); "
                    "this machine has fewer, or no CuPy")
def test_ring_on_nccl(tmp_path):
    script = tmp_path / "nccl_child.py"
    script.write_text(NCCL_CHILD)
    assert launch(2, str(script), use_mpi=False) == 0


def test_cli_style_launch_runs_a_script(tmp_path):
    """`launch` as the CLI calls it: the ranks see their rank and size."""
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nfrom tinyflow.allreduce import init_communicator\n"
                      "c = init_communicator()\n"
                      "open(os.path.join(sys.argv[1], f'r{c.rank}of{c.size}'), 'w').close()\n")
    assert launch(2, str(script), [str(tmp_path)], use_mpi=False) == 0
    assert sorted(p.name for p in tmp_path.glob("r*of*")) == ["r0of2", "r1of2"]
    assert subprocess.run([sys.executable, str(script), str(tmp_path)]).returncode == 0
    assert (tmp_path / "r0of1").exists()


def test_the_launchers_signal_handler_only_notes_the_signal():
    # A SIGTERM handler that raised could land inside Popen.poll between its lock's
    # acquire and its try: the lock stayed held, the next wait() on a rank blocked
    # forever, and the launcher hung with its dead ranks unreaped (seen under load:
    # this file's signalled-launcher test left such a launcher behind). The handler
    # now only notes the signal; the wait loop returns 128 + signal.
    from tinyflow import launcher
    with launcher._signals_noted() as noted:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.getsignal(sig)(sig, None)     # must not raise
        assert noted == [signal.SIGTERM, signal.SIGINT]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert launcher._watch([sleeper], tempfile.mkdtemp(), [signal.SIGTERM]) == 143
        assert sleeper.wait(timeout=10) is not None   # stopped and reaped
    finally:
        sleeper.kill()
