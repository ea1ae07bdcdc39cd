"""Collectives: ring allreduce, naive allreduce and broadcast.

Data-parallel training needs every rank to end a step with the *sum* (or mean) of all
ranks' gradients. The obvious way, everyone sends to rank 0, which adds and sends
back, makes rank 0 move 2(N-1) whole arrays while the others idle. The ring
(Patarasuk & Yuan 2009; Baidu's 2017 allreduce, then Horovod and NCCL) makes every
rank move only 2(N-1)/N of the array, independent of N, in two phases over N chunks:

    reduce-scatter: N-1 steps; in step s rank r sends chunk (r - s) to rank r+1 and
                    adds the chunk it receives from rank r-1 into its own copy. After
                    N-1 steps rank r holds the complete sum of chunk (r + 1) (for a
                    mean it divides just that chunk by N: 1/N of the work).
    all-gather:     N-1 steps; rank r passes the complete chunks around the ring,
                    each received chunk overwriting the stale one.

Every rank ends with bitwise identical results (each chunk was summed once, on one
rank, then copied), which data parallelism needs: replicas that drift apart by
rounding would train different models.

The algorithms are written once against the transport interface of transports.py
(`sendrecv` to the next rank while receiving from the previous one), so the same
lines run over threads, processes, MPI and NCCL. Starting the ranks (`launch`,
`init_communicator`) is launcher.py; its names are re-exported here, where they first
lived.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyflow.errors import TinyFlowError  # noqa: F401  (importable here, as before)
from tinyflow.launcher import (  # noqa: F401  (public here too)
    find_mpiexec,
    init_communicator,
    launch,
    spawn_local,
)
from tinyflow.transports import (
    TAG_DIGEST_BYTES,
    TAG_PREFIX_BYTES,
    CollectiveError,
    MPITransport,
    NCCLTransport,
    ProcessTransport,
    ThreadTransport,
    Transport,
    run_threads,
    wire_tag,
)

__all__ = ["ring_allreduce", "naive_allreduce", "broadcast", "chunk_bounds",
           "ring_bytes_per_rank", "ring_timeline_events", "init_communicator", "launch",
           "find_mpiexec", "CollectiveError", "Transport", "ThreadTransport",
           "ProcessTransport", "MPITransport", "NCCLTransport", "run_threads"]

# The reductions an allreduce can apply, as the name of the array module's ufunc.
REDUCTIONS = {"sum": "add", "mean": "add", "max": "maximum", "min": "minimum"}


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` chunks covering n elements, as np.array_split cuts them:
    the first n % parts chunks have one element more; chunks may be empty (n < parts)."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_bytes_per_rank(nbytes: int, size: int) -> float:
    """What theory says each rank sends in a ring allreduce: 2(N-1)/N of the array.
    (Exact when the array splits into equal chunks; off by a chunk's rounding else.)"""
    return 2.0 * (size - 1) / size * nbytes


def _working_array(array: Any, xp: Any) -> Any:
    """The array to reduce in place: `array` itself when it is a contiguous, writeable
    array of the transport's module, else a contiguous copy."""
    writeable = getattr(getattr(array, "flags", None), "writeable", True)
    if isinstance(array, xp.ndarray) and array.flags.c_contiguous and writeable:
        return array
    return xp.array(array, copy=True, order="C")


def _check_op(op: str, dtype: np.dtype) -> None:
    if op not in REDUCTIONS:
        raise ValueError(f"allreduce op must be one of {sorted(REDUCTIONS)}, got {op!r}")
    if op == "mean" and dtype.kind not in "fc":
        raise TypeError(f"allreduce op='mean' needs a float array, got {dtype}: the "
                        "mean of integers is not an integer (reduce with 'sum' instead)")


def _tag(operation: str, flat: Any, detail: str = "") -> str:
    """The message tag: the whole collective (name, size, dtype, and the reduction op
    or root in `detail`), so that ranks calling different collectives fail the
    transport's header check instead of mixing data."""
    return (f"{operation} of {flat.size} {_dtype_name(flat.dtype)}"
            + (f" {detail}" if detail else ""))


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
    """`dtype.name`, with the byte order when it is not native ("float32 (>f4)"):
    float32 and its byte-swapped twin share a name, and MPI, which checks only the
    tag, reduced one rank's '<f4' with another's '>f4' into garbage. Remembered:
    numpy 2 computes the name in Python, 1.6 us a call, and 16 us as the first thing
    a rank does after a barrier (measured under mpiexec), which was 7% of a 1 MiB
    ring allreduce on 2 ranks."""
    return dtype.name if dtype.isnative else f"{dtype.name} ({dtype.str})"


def agree(comm: Transport, tag: str) -> None:
    """Check that every rank calls the same collective (the same `tag`); raise the
    same CollectiveError on every rank if not.

    A ring all-gather of the tags as the transports send them (a digest of the whole
    tag, compared, and a readable prefix, shown), N-1 steps of 80 bytes: every rank
    sees every rank's tag, so every rank decides alike (a plain header check would
    stop only the ranks that receive a mismatched message, and a broadcast whose
    ranks disagree on the root can otherwise finish silently on some of them).
    """
    size, rank = comm.size, comm.rank
    if size == 1:
        return
    tags = np.zeros((size, TAG_DIGEST_BYTES + TAG_PREFIX_BYTES), dtype=np.uint8)
    prefix, digest = wire_tag(tag)
    mine = digest + prefix.encode()
    tags[rank, :len(mine)] = np.frombuffer(mine, np.uint8)
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):  # pass on what arrived last step, as in all-gather
        comm.sendrecv(tags[(rank - step) % size], right, tags[(rank - step - 1) % size],
                      left, "agree")
    digests = [bytes(row[:TAG_DIGEST_BYTES]) for row in tags]
    if len(set(digests)) > 1:
        said = [bytes(row[TAG_DIGEST_BYTES:]).rstrip(b"\0").decode(errors="replace")
                for row in tags]
        calls = "; ".join(f"rank {r} calls '{t}'" for r, t in enumerate(said))
        first = next(r for r, d in enumerate(digests) if d != digests[0])
        raise CollectiveError(f"{_operation_of(tag)}: the ranks disagree on the "
                              f"collective: {calls}", peer=first,
                              operation=_operation_of(tag))


def _operation_of(tag: str) -> str:
    return tag.split(" ", 1)[0]


def _check_root(root: int, comm: Transport, operation: str) -> None:
    if not (isinstance(root, (int, np.integer)) and 0 <= root < comm.size):
        raise CollectiveError(f"{operation}: root {root!r} is not a rank of this group "
                              f"(ranks 0..{comm.size - 1})", operation=operation)


def ring_allreduce(array: Any, comm: Transport, op: str = "sum", *,
                   record: list[dict] | None = None, label: str = "") -> Any:
    """Reduce `array` across all ranks of `comm` with the ring; return the result.

    The reduction happens in place when `array` is a contiguous writeable array of
    `comm.xp` (numpy, or cupy for NCCL), and the same array is returned; otherwise a
    reduced copy is returned. Any length works, also fewer elements than ranks (some
    chunks are then empty); dtypes are whatever the array module can add. `op` is
    "sum", "mean" (float arrays only), "max" or "min". Every rank must call it with
    the same size, dtype and op (else CollectiveError); `label`, if given, joins
    the tag (a scheme calling it names itself, e.g. "zero1").

    `record` (or `comm.trace` when `record` is None), if a list, gets one entry per
    step this rank takes: {"phase": "reduce-scatter" | "all-gather", "step", "chunk",
    "src", "dst", "start", "end", "bytes"}: chunk `chunk` went from rank `src` (this
    one) to `dst`, between perf_counter() times start and end.
    """
    xp = comm.xp
    result = _working_array(array, xp)
    _check_op(op, result.dtype)
    size, rank = comm.size, comm.rank
    if size == 1:
        return result
    flat = result.reshape(-1)  # a view: chunks of it are views of `result`
    bounds = chunk_bounds(flat.size, size)
    combine = getattr(xp, REDUCTIONS[op])
    scratch = xp.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)  # largest chunk
    right, left = (rank + 1) % size, (rank - 1) % size
    tag = _tag("allreduce", flat, f"op={op} ring {label}".strip())
    record = comm.trace if record is None else record

    def chunk(i: int) -> Any:
        start, end = bounds[i % size]
        return flat[start:end]

    for step in range(size - 1):  # reduce-scatter
        send_index, recv_index = (rank - step) % size, (rank - step - 1) % size
        incoming = scratch[:chunk(recv_index).size]
        began = time.perf_counter()
        comm.sendrecv(chunk(send_index), right, incoming, left, tag)
        mine = chunk(recv_index)
        combine(mine, incoming, out=mine)
        if record is not None:
            record.append(_step_record("reduce-scatter", step, send_index, rank, right,
                                       began, chunk(send_index).nbytes))
    if op == "mean":  # divide the one chunk this rank finished; all-gather spreads it
        owned = chunk(rank + 1)
        xp.divide(owned, size, out=owned)
    for step in range(size - 1):  # all-gather: pass the finished chunks around
        send_index, recv_index = (rank + 1 - step) % size, (rank - step) % size
        began = time.perf_counter()
        comm.sendrecv(chunk(send_index), right, chunk(recv_index), left, tag)
        if record is not None:
            record.append(_step_record("all-gather", step, send_index, rank, right,
                                       began, chunk(send_index).nbytes))
    return result


def _step_record(phase: str, step: int, chunk: int, src: int, dst: int, start: float,
                 nbytes: int) -> dict:
    return {"phase": phase, "step": step, "chunk": chunk, "src": src, "dst": dst,
            "start": start, "end": time.perf_counter(), "bytes": int(nbytes)}


def naive_allreduce(array: Any, comm: Transport, op: str = "sum") -> Any:
    """Allreduce by gathering everything at rank 0, which reduces and sends the result
    back to each rank: rank 0 sends (N-1) whole arrays, the ring only 2(N-1)/N of one.
    Same contract as `ring_allreduce` (the results agree up to float rounding order)."""
    xp = comm.xp
    result = _working_array(array, xp)
    _check_op(op, result.dtype)
    size = comm.size
    if size == 1:
        return result
    flat = result.reshape(-1)
    tag = _tag("allreduce", flat, f"op={op} naive")
    if comm.rank == 0:
        combine = getattr(xp, REDUCTIONS[op])
        incoming = xp.empty_like(flat)
        for src in range(1, size):
            comm.recv(src, incoming, tag)
            combine(flat, incoming, out=flat)
        if op == "mean":
            xp.divide(flat, size, out=flat)
        for dst in range(1, size):
            comm.send(dst, flat, tag)
    else:
        comm.send(0, flat, tag)
        comm.recv(0, flat, tag)
    return result


def broadcast(array: Any, comm: Transport, root: int = 0) -> Any:
    """Every rank ends with `root`'s array: root sends it to each rank in turn.

    In place on a contiguous writeable array (returned), else into a returned copy.
    Used once at the start of data-parallel training, so the simple linear form is
    enough (a ring or tree broadcast pays off only for repeated, large broadcasts).
    The ranks first `agree` on the call (root, size, dtype): a rank that named another
    root would otherwise return its own data without a word.
    """
    _check_root(root, comm, "broadcast")
    result = _working_array(array, comm.xp)
    flat = result.reshape(-1)
    tag = _tag("broadcast", flat, f"root={root}")
    agree(comm, tag)
    if comm.rank == root:
        for dst in range(comm.size):
            if dst != root:
                comm.send(dst, flat, tag)
    else:
        comm.recv(root, flat, tag)
    return result


def ring_timeline_events(record: Sequence[dict], t0: float, stream: int,
                         node: str = "allreduce") -> list[dict]:
    """Ring step records (see `ring_allreduce`) as DebugRecord timeline events, times
    made relative to `t0` (the run's start), so a debugger can show the ring turning
    on the comm stream: one event per step, with chunk/src/dst/phase in "args"."""
    return [{"step": None, "node": f"{node}/{r['phase']}[{r['step']}]", "op": "ring_step",
             "stream": stream, "start": r["start"] - t0, "end": r["end"] - t0,
             "bytes": r["bytes"], "summary": None,
             "args": {"chunk": r["chunk"], "src": r["src"], "dst": r["dst"],
                      "phase": r["phase"]}}
            for r in record]
