"""First-class collectives (reduce-scatter, all-gather) and tree allreduce, over thread
ranks (the algorithms) and local processes (the exchange primitive on sockets)."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from tinyflow.allreduce import chunk_bounds, launch, ring_allreduce
from tinyflow.collectives import (
    all_gather,
    allreduce,
    binary_tree,
    choose_algorithm,
    double_binary_trees,
    reduce_scatter,
    tree_allreduce,
    tree_bytes_per_rank,
)
from tinyflow.transports import CollectiveError, run_threads


def data(rank: int, count: int, dtype: str = "float64") -> np.ndarray:
    rng = np.random.default_rng(50 + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-9, 9, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_binary_trees_span_every_rank_once(n):
    for parents, children in [binary_tree(n), *double_binary_trees(n)]:
        roots = [r for r in range(n) if r not in parents]
        assert len(roots) == 1
        assert sorted(c for cs in children.values() for c in cs) == sorted(parents)
        assert all(len(cs) <= 2 for cs in children.values())
        for r in range(n):  # every rank reaches the root without a cycle
            seen, p = set(), r
            while p in parents:
                assert p not in seen
                seen.add(p)
                p = parents[p]
            assert p == roots[0]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 9])
def test_double_trees_are_complementary(n):
    """No rank is an inner node of both trees: that is what bounds its bytes by 2S."""
    (_, first), (_, second) = double_binary_trees(n)
    assert not {r for r in range(n) if first[r]} & {r for r in range(n) if second[r]}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("trees", [1, 2])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_tree_allreduce_matches_the_reduction_on_every_rank(n, trees, op):
    reduce = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
    for count in (0, 1, n + 1, 101):
        expected = reduce(np.stack([data(r, count) for r in range(n)]), axis=0)
        results = run_threads(n, lambda c, count=count: tree_allreduce(
            data(c.rank, count), c, op, trees=trees), timeout=20)
        for got in results:
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
            assert got.tobytes() == results[0].tobytes()  # bitwise identical


def test_tree_allreduce_of_integers_is_exact_and_in_place():
    def rank(comm):
        x = data(comm.rank, 33, "int64")
        return x, tree_allreduce(x, comm)

    for x, result in run_threads(4, rank):
        assert result is x
        assert result.tolist() == sum(data(r, 33, "int64") for r in range(4)).tolist()


@pytest.mark.parametrize("n", [3, 4, 8])
@pytest.mark.parametrize("trees", [1, 2])
def test_tree_bytes_stay_within_theory(n, trees):
    count = 4096

    def rank(comm):
        tree_allreduce(np.ones(count, np.float32), comm, trees=trees)
        return comm.bytes_sent

    sent = run_threads(n, rank)
    assert max(sent) <= tree_bytes_per_rank(count * 4, n, trees)
    if trees == 2 and n >= 4:  # the busiest rank sends 2S, exactly the bound
        assert max(sent) == 2 * count * 4


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("count", [0, 1, 5, 6, 37])
def test_reduce_scatter_then_all_gather_is_an_allreduce(n, count):
    expected = sum(data(r, count) for r in range(n))

    def rank(comm):
        mine = reduce_scatter(data(comm.rank, count), comm)
        return mine, all_gather(mine, comm, total=count)

    results = run_threads(n, rank)
    for r, (mine, whole) in enumerate(results):
        start, end = chunk_bounds(count, n)[r]
        np.testing.assert_allclose(mine, expected[start:end], rtol=1e-12)
        np.testing.assert_allclose(whole, expected, rtol=1e-12)
        assert whole.tobytes() == results[0][1].tobytes()


def test_reduce_scatter_mean_and_bytes():
    def rank(comm):
        out = reduce_scatter(np.full(8, float(comm.rank)), comm, "mean")
        return out, comm.bytes_sent

    for out, sent in run_threads(4, rank):
        assert out.tolist() == [1.5, 1.5]
        assert sent == 3 * 2 * 8  # (N-1) chunks of 2 float64


def test_all_gather_checks_the_part_size():
    def rank(comm):
        return all_gather(np.ones(3), comm, total=10)  # 10 over 2 ranks: 5 each

    with pytest.raises(ValueError, match="holds 3 elements"):
        run_threads(2, rank)


def test_auto_picks_the_tree_for_small_arrays_and_the_ring_for_large():
    assert choose_algorithm(8 << 10, 8) == "tree"
    assert choose_algorithm(16 << 20, 8) == "ring"
    assert choose_algorithm(8 << 10, 2) == "ring"  # two ranks: one exchange either way
    ring_at = [s for s in (1 << k for k in range(10, 30)) if choose_algorithm(s, 8) == "ring"]
    assert ring_at and all(choose_algorithm(s, 8) == "ring" for s in (1 << k for k in
                                                                      range(20, 30)))


@pytest.mark.parametrize("algorithm", ["ring", "tree", "auto"])
def test_allreduce_dispatches(algorithm):
    results = run_threads(4, lambda c: allreduce(data(c.rank, 40), c, "sum", algorithm))
    np.testing.assert_allclose(results[0], sum(data(r, 40) for r in range(4)), rtol=1e-12)
    with pytest.raises(ValueError, match="algorithm"):
        run_threads(1, lambda c: allreduce(np.ones(2), c, algorithm="butterfly"))


def test_ranks_on_different_algorithms_all_raise():
    def rank(comm):
        try:
            allreduce(np.ones(8), comm, algorithm="ring" if comm.rank else "tree")
        except CollectiveError as err:
            return err

    errors = run_threads(3, rank, timeout=10)
    assert all(isinstance(e, CollectiveError) for e in errors), errors


def test_a_hung_rank_in_the_tree_is_named():
    release = []

    def rank(comm):
        if comm.rank == 1:
            while not release:
                time.sleep(0.01)
            return None
        try:
            tree_allreduce(np.ones(8), comm)
        except CollectiveError as err:
            return err
        finally:
            release.append(True)

    errors = run_threads(4, rank, timeout=0.5)
    assert all(errors[r].peer == 1 for r in (0, 2, 3)), [str(e) for e in errors]


CHILD = r'''
import sys
import numpy as np
from tinyflow.allreduce import init_communicator, ring_allreduce
from tinyflow.collectives import all_gather, reduce_scatter, tree_allreduce
comm = init_communicator(timeout=30)
n, r = comm.size, comm.rank
for count in (0, 3, 1000, 300001):
    x = np.arange(count, dtype=np.float64) * (r + 1)
    expected = np.arange(count, dtype=np.float64) * n * (n + 1) / 2
    for trees in (1, 2):
        assert np.array_equal(tree_allreduce(x.copy(), comm, trees=trees), expected)
    part = reduce_scatter(x.copy(), comm)
    assert np.array_equal(all_gather(part, comm, total=count), expected)
'''


def test_collectives_on_processes(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    assert launch(4, str(script), use_mpi=False) == 0
    assert sys.executable  # (the ranks ran this interpreter)


def test_ring_and_tree_agree():
    def rank(comm):
        x = data(comm.rank, 64)
        return ring_allreduce(x.copy(), comm), tree_allreduce(x.copy(), comm)

    for ring, tree in run_threads(5, rank):
        np.testing.assert_allclose(ring, tree, rtol=1e-12)
