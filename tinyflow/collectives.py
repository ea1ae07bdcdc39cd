"""First-class collectives: reduce-scatter, all-gather, and tree allreduce.

allreduce.py has the ring (a reduce-scatter followed by an all-gather, fused). The
parallel schemes beyond data parallelism need the two halves on their own: ZeRO
reduce-scatters gradients so each rank keeps the sum of only its shard, and
all-gathers parameters before use (Rajbhandari et al. 2020). This module offers them,
and a second allreduce algorithm, the tree, for small messages:

* `reduce_scatter(x, comm)`: rank r returns chunk r (`chunk_bounds` layout) of the
  sum over ranks. A ring: N-1 steps, each rank sends (N-1)/N of the array.
* `all_gather(part, comm)`: every rank returns the concatenation of all ranks'
  parts. A ring: N-1 steps, each rank sends (N-1) parts.
* `tree_allreduce(x, comm, trees=2)`: reduce up a binary tree to its root, then
  broadcast the result back down. `trees=1` is the naive tree: one tree carries the
  whole array, so an inner node sends 3 arrays (one up, two down). `trees=2` is
  NCCL's **double binary tree** (Sanders, Speck & Träff 2009): two trees each carry
  half the array, built so that a rank that is an inner node of one tree is a leaf
  of the other; then no rank sends more than 2 arrays' worth, as much as the ring,
  but in 2*log2(N) rounds instead of the ring's 2(N-1) steps.
* `broadcast(x, comm, root)` (from allreduce.py): root's array on every rank, after
  the ranks `agree` on the call (a rank naming another root is an error everywhere).
* `allreduce(x, comm, algorithm="ring"|"tree"|"auto")`: "auto" asks the alpha-beta
  cost model (`choose_algorithm`): each round costs a latency alpha plus the bytes it
  moves times beta. The ring's 2(N-1) rounds of S/N bytes win for large arrays; the
  tree's 2*ceil(log2 N) rounds win when latency dominates. (NCCL also pipelines the
  tree over small chunks, which lets it win for large arrays too; we do not, so our
  tree moves S/2 per round and loses to the ring on bandwidth.)

Everything goes through `Transport.exchange` (several sends and receives at once: a
tree node hears from both children in one round), so it runs over threads, processes,
MPI and NCCL with the same error model: tags name the collective (op, size, dtype,
algorithm), timeouts name the late rank.
"""

from __future__ import annotations

import math
import time
from typing import Any

from tinyflow.allreduce import (
    REDUCTIONS,
    _check_op,
    _step_record,
    _tag,
    _working_array,
    broadcast,
    chunk_bounds,
    ring_allreduce,
)
from tinyflow.transports import Transport

__all__ = ["reduce_scatter", "all_gather", "broadcast", "tree_allreduce", "allreduce",
           "binary_tree", "double_binary_trees", "choose_algorithm", "tree_bytes_per_rank",
           "ALPHA", "BETA"]

# The alpha-beta model's defaults for "auto": a message's fixed cost (seconds) and the
# cost of one byte (seconds) between processes on one machine, measured on a laptop
# (`benchmarks/allreduce_bench.py` prints tree_vs_ring at 8 KiB and 16 MiB to check it).
ALPHA = 30e-6
BETA = 1 / 2e9


# ----------------------------------------------------------------------------------
# Reduce-scatter and all-gather (the two halves of the ring)
# ----------------------------------------------------------------------------------

def reduce_scatter(array: Any, comm: Transport, op: str = "sum", *, label: str = "",
                   record: list[dict] | None = None) -> Any:
    """Reduce `array` over the ranks and return this rank's chunk of the result: rank r
    gets elements chunk_bounds(array.size, N)[r] of the flattened reduction (a new
    array; `array` is used as scratch when it is a contiguous writeable array).

    The ring's first phase, shifted by one so that rank r ends owning chunk r: in
    step s rank r sends its partial sum of chunk (r - s - 1) to rank r+1 and adds the
    partial it receives, of chunk (r - s - 2), into its copy. "mean" divides the
    finished chunk by N. Every rank must call it with the same size, dtype and op
    (and `label`, which goes into the tag: a scheme names itself, e.g. "zero2").
    `record` (or `comm.trace` when it is None), if a list, gets one entry per step
    as ring_allreduce's do (phase "reduce-scatter"), so a timeline shows them.
    """
    xp = comm.xp
    work = _working_array(array, xp)
    _check_op(op, work.dtype)
    size, rank = comm.size, comm.rank
    flat = work.reshape(-1)
    bounds = chunk_bounds(flat.size, size)

    def chunk(i: int) -> Any:
        start, end = bounds[i % size]
        return flat[start:end]

    if size > 1:
        combine = getattr(xp, REDUCTIONS[op])
        scratch = xp.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
        right, left = (rank + 1) % size, (rank - 1) % size
        tag = _tag("reduce_scatter", flat, f"op={op} {label}".strip())
        record = comm.trace if record is None else record
        for step in range(size - 1):
            mine = chunk(rank - step - 2)
            incoming = scratch[:mine.size]
            began = time.perf_counter()
            comm.sendrecv(chunk(rank - step - 1), right, incoming, left, tag)
            combine(mine, incoming, out=mine)
            if record is not None:
                record.append(_step_record("reduce-scatter", step, (rank - step - 1) % size,
                                           rank, right, began, chunk(rank - step - 1).nbytes))
    owned = chunk(rank).copy()
    if op == "mean" and size > 1:
        xp.divide(owned, size, out=owned)
    return owned


def all_gather(part: Any, comm: Transport, total: int | None = None, *,
               label: str = "", record: list[dict] | None = None) -> Any:
    """Every rank's `part`, concatenated in rank order, on every rank (a new flat array).

    Parts follow the `chunk_bounds(total, N)` layout (the first total % N ranks hold
    one element more), which is what `reduce_scatter` returns; `total` defaults to
    N * part.size (equal parts). A ring: in step s rank r passes on part (r - s).
    `record` as in reduce_scatter (phase "all-gather").
    """
    xp = comm.xp
    size, rank = comm.size, comm.rank
    part = part.reshape(-1)
    total = part.size * size if total is None else int(total)
    bounds = chunk_bounds(total, size)
    if part.size != bounds[rank][1] - bounds[rank][0]:
        raise ValueError(f"all_gather: rank {rank} holds {part.size} elements, but parts "
                         f"of {total} over {size} ranks give it "
                         f"{bounds[rank][1] - bounds[rank][0]}")
    flat = xp.empty(total, dtype=part.dtype)

    def chunk(i: int) -> Any:
        start, end = bounds[i % size]
        return flat[start:end]

    chunk(rank)[...] = part
    right, left = (rank + 1) % size, (rank - 1) % size
    tag = _tag("all_gather", flat, label)
    record = comm.trace if record is None else record
    for step in range(size - 1):
        began = time.perf_counter()
        comm.sendrecv(chunk(rank - step), right, chunk(rank - step - 1), left, tag)
        if record is not None:
            record.append(_step_record("all-gather", step, (rank - step) % size, rank,
                                       right, began, chunk(rank - step).nbytes))
    return flat


# ----------------------------------------------------------------------------------
# Trees
# ----------------------------------------------------------------------------------

def binary_tree(size: int, order: list[int] | None = None
                ) -> tuple[dict[int, int], dict[int, list[int]]]:
    """An in-order binary tree over `size` ranks: ({rank: parent}, {rank: children}).

    Position p (0-based) in `order` (default: rank p) holds node v = p + 1; v's
    lowest set bit l gives its level; its parent is v with that bit cleared and the
    next one set ((v & ~(2l-1)) | 2l), climbing further while that is past `size`.
    The leaves are the odd v (even positions), about half the ranks. The root (the
    highest power of two <= size) has no parent.
    """
    order = list(range(size)) if order is None else order
    parents: dict[int, int] = {}
    for v in range(1, size + 1):
        p = v
        while True:
            low = p & -p
            p = (p & ~(2 * low - 1)) | (2 * low)
            if p <= size or low > size:
                break
        if p <= size:
            parents[order[v - 1]] = order[p - 1]
    children: dict[int, list[int]] = {r: [] for r in order}
    for child in order:  # in order: a node's left child comes first
        if child in parents:
            children[parents[child]].append(child)
    return parents, children


def double_binary_trees(size: int) -> list[tuple[dict[int, int], dict[int, list[int]]]]:
    """NCCL's two complementary trees: the second is the first mirrored (rank r sits
    where N-1-r sat) when N is even, shifted by one when N is odd, so the first tree's
    leaves (even ranks) are the second's inner nodes and the other way round."""
    second = list(range(size - 1, -1, -1)) if size % 2 == 0 else \
        [(p + 1) % size for p in range(size)]
    return [binary_tree(size), binary_tree(size, second)]


def _heights(children: dict[int, list[int]], parents: dict[int, int]) -> dict[int, int]:
    """Height above the deepest leaf below (leaves 0), computed bottom-up without
    recursion by visiting nodes in order of depth, deepest first."""
    depth = _depths(parents)
    height = dict.fromkeys(children, 0)
    for node in sorted(children, key=lambda r: -depth[r]):
        if node in parents:
            up = parents[node]
            height[up] = max(height[up], height[node] + 1)
    return height


def _depths(parents: dict[int, int]) -> dict[int, int]:
    ranks = set(parents) | set(parents.values())
    depth = {}
    for r in ranks:
        d, p = 0, r
        while p in parents:
            p, d = parents[p], d + 1
        depth[r] = d
    return depth


def tree_allreduce(array: Any, comm: Transport, op: str = "sum", trees: int = 2, *,
                   record: list[dict] | None = None) -> Any:
    """Allreduce by reducing up binary trees and broadcasting back down.

    `trees=2` splits the array in two halves, one per tree of `double_binary_trees`;
    `trees=1` sends the whole array through one tree (the naive tree). Both run in
    lock-step rounds, all trees at once: in up-round k every node of height k sends
    its partial result to its parent (which hears from all its children in the same
    exchange); in down-round k every node of depth k sends the finished result to its
    children. Every rank ends with its tree roots' results: bitwise identical.
    Same contract as `ring_allreduce` (in place when possible; `record` gets one
    entry per round: phase "tree-reduce" / "tree-broadcast", step, start, end, bytes).
    """
    if trees not in (1, 2):
        raise ValueError(f"tree_allreduce trees must be 1 (naive) or 2 (double), got {trees}")
    xp = comm.xp
    result = _working_array(array, xp)
    _check_op(op, result.dtype)
    size, rank = comm.size, comm.rank
    if size == 1:
        return result
    flat = result.reshape(-1)
    layout = double_binary_trees(size) if trees == 2 else [binary_tree(size)]
    halves = [flat[a:b] for a, b in chunk_bounds(flat.size, len(layout))]
    tag = _tag("allreduce", flat, f"op={op} tree{trees}")
    record = comm.trace if record is None else record
    _reduce_up(comm, layout, halves, getattr(xp, REDUCTIONS[op]), tag, record)
    if op == "mean":  # the roots divide; the broadcast spreads it
        for t, (parents, _) in enumerate(layout):
            if rank not in parents:
                xp.divide(halves[t], size, out=halves[t])
    _broadcast_down(comm, layout, halves, tag, record)
    return result


def _reduce_up(comm: Transport, layout: list, halves: list, combine: Any, tag: str,
               record: list[dict] | None) -> None:
    """Up-rounds: in round k every node of height k sends its partial result to its
    parent, which combines what all its children of height k sent."""
    rank = comm.rank
    heights = [_heights(children, parents) for parents, children in layout]
    inboxes = [[comm.xp.empty_like(half) for _ in children[rank]]
               for half, (_, children) in zip(halves, layout)]
    for k in range(max(max(h.values()) for h in heights)):
        sends, recvs, arrived = [], [], []
        for t, (parents, children) in enumerate(layout):
            if heights[t][rank] == k and rank in parents:
                sends.append((parents[rank], halves[t]))
            for c, box in zip(children[rank], inboxes[t]):
                if heights[t][c] == k:
                    recvs.append((c, box))
                    arrived.append((t, box))
        _round(comm, sends, recvs, tag, record, "tree-reduce", k)
        for t, box in arrived:
            combine(halves[t], box, out=halves[t])


def _broadcast_down(comm: Transport, layout: list, halves: list, tag: str,
                    record: list[dict] | None) -> None:
    """Down-rounds: in round k every node of depth k sends the finished result to
    its children."""
    rank = comm.rank
    depths = [_depths(parents) for parents, _ in layout]
    for k in range(max(max(d.values()) for d in depths)):
        sends = [(c, halves[t]) for t, (_, children) in enumerate(layout)
                 if depths[t][rank] == k for c in children[rank]]
        recvs = [(parents[rank], halves[t]) for t, (parents, _) in enumerate(layout)
                 if depths[t][rank] == k + 1]
        _round(comm, sends, recvs, tag, record, "tree-broadcast", k)


def _round(comm: Transport, sends: list, recvs: list, tag: str,
           record: list[dict] | None, phase: str, step: int) -> None:
    began = time.perf_counter()
    comm.exchange(sends, recvs, tag)
    if record is not None:
        record.append({"phase": phase, "step": step, "chunk": -1, "src": comm.rank,
                       "dst": [dst for dst, _ in sends], "start": began,
                       "end": time.perf_counter(),
                       "bytes": int(sum(a.nbytes for _, a in sends))})


def tree_bytes_per_rank(nbytes: int, size: int, trees: int = 2) -> float:
    """What theory says the busiest rank sends: 2S for the double tree (an inner node
    of one tree, S/2 up and 2 x S/2 down, is a leaf of the other, S/2 up); 3S for the
    naive tree's inner node (S up, 2S down); S for two ranks (one tree edge)."""
    if size <= 1:
        return 0.0
    if size == 2:
        return float(nbytes)
    return (2.0 if trees == 2 else 3.0) * nbytes


# ----------------------------------------------------------------------------------
# Choosing
# ----------------------------------------------------------------------------------

def choose_algorithm(nbytes: int, size: int, alpha: float = ALPHA, beta: float = BETA
                     ) -> str:
    """"ring" or "tree" for an allreduce of `nbytes` over `size` ranks: whichever the
    alpha-beta model says is faster.

        ring: 2(N-1) rounds, each moving S/N bytes:  2(N-1) alpha + 2(N-1)/N S beta
        tree: 2 ceil(log2 N) rounds, each moving S (two halves of S/2 in and out
              of an inner node):                    2 ceil(log2 N) (alpha + S beta)

    So the tree wins below roughly alpha/beta * (N - 1 - log2 N) / log2 N bytes
    (about 60 KiB for 8 ranks with the defaults), the ring above; with 2 ranks both
    are one exchange each way and the ring is chosen.
    """
    if size <= 2:
        return "ring"
    rounds = 2 * math.ceil(math.log2(size))
    ring = 2 * (size - 1) * alpha + 2 * (size - 1) / size * nbytes * beta
    tree = rounds * (alpha + nbytes * beta)
    return "tree" if tree < ring else "ring"


def allreduce(array: Any, comm: Transport, op: str = "sum", algorithm: str = "auto", *,
              record: list[dict] | None = None) -> Any:
    """Allreduce with the ring ("ring"), the double binary tree ("tree") or the one
    `choose_algorithm` picks for this size ("auto"). Every rank must pass the same
    algorithm ("auto" decides alike on every rank: it sees the same size)."""
    if algorithm not in ("ring", "tree", "auto"):
        raise ValueError(f"allreduce algorithm must be 'ring', 'tree' or 'auto', "
                         f"got {algorithm!r}")
    if algorithm == "auto":
        nbytes = getattr(array, "nbytes", 0)
        algorithm = choose_algorithm(nbytes, comm.size)
    if algorithm == "tree":
        return tree_allreduce(array, comm, op, record=record)
    return ring_allreduce(array, comm, op, record=record)
