"""Allreduce and data-parallel figures: our ring against MPI's own, tree vs ring, overlap.

``ring_vs_mpi_n{N}_{S}MiB``
    Under ``mpiexec -n N``, a float32 array of S MiB is summed across the ranks by our
    `ring_allreduce` over `MPITransport` (nonblocking Isend/Irecv of each chunk, a
    polling wait with a deadline, numpy adds) and by MPI's own ``Allreduce`` (MPICH's
    C implementation), interleaved in the same run. Each call is timed between
    barriers as the slowest rank's time; the figure is MPI's median time / ours, i.e.
    our bandwidth / MPI's (goal >= 0.9: the algorithm in Python is as good as the
    library's, because the time is in moving and adding bytes, not in Python).
``ring_bytes_vs_theory``
    Payload bytes each rank sent in a ring allreduce of 4 Mi float32 over 4 thread
    ranks (the largest of the ranks), divided by 2(N-1)/N of the array (goal 1.0).
``tree_bytes_vs_theory``
    Payload bytes sent by the busiest rank in a double-binary-tree allreduce
    (`tinyflow.collectives.tree_allreduce`) of 1 Mi float32 over 4 and over 8 thread
    ranks, divided by 2S, the double tree's bound (an inner node of one tree sends
    S/2 up and S/2 to each of two children; it is a leaf of the other tree, S/2 up).
    The larger of the two ratios (goal <= 1.0).
``tree_vs_ring_8KiB_n4``, ``tree_vs_ring_16MiB_n4``
    4 local processes (`ProcessTransport`): median time of the double-tree allreduce
    / median time of the ring, alternating in the same run, each call timed between
    barriers as the slowest rank's. The tree takes 2*log2(4) = 4 rounds, the ring
    2(N-1) = 6, so for 8 KiB, where a round is mostly latency, the tree should win
    (< 1); the ring sends 2(N-1)/N = 1.5 S per rank in rounds of S/4 while our tree
    (not pipelined, unlike NCCL's) moves S/2 per message with an inner node sending
    1.5 S, so for 16 MiB, where bytes dominate, the ring should win (> 1). This is
    the rule `choose_algorithm` ("auto") encodes.
``dp_overlap_ratio``
    Data-parallel SGD on 2 local processes (`ProcessTransport`), an MLP 256-1024-1024-
    1024-10 (float32, 2.4 M parameters) on 16 examples per rank: step time with
    gradients allreduced in 1 MiB buckets on the executor's comm stream (overlapping
    backward) / step time with one allreduce of all gradients after backward (one
    bucket). Same graph, same run, alternating rounds, medians (goal <= 0.9).

The ranks run this file itself as a child (``mpi-child``, ``dp-child``). Every rank
uses one BLAS thread ($TINYFLOW_BENCH_THREADS), so two ranks fill the two cores of a
small machine instead of fighting over them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
MIB = 1 << 20


def _threads_env() -> dict[str, str]:
    threads = os.environ.get("TINYFLOW_BENCH_THREADS", "1")
    return {name: threads for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                       "MKL_NUM_THREADS")}


def _row(name: str, value: float, goal: str, unit: str, note: str) -> dict:
    return {"name": name, "value": float(value), "goal": goal, "unit": unit, "note": note}


def _run_child(command: list[str], timeout: float) -> dict:
    """Run a child job; return the JSON its rank 0 printed as its last line."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **_threads_env()})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])}... failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------
# Ring vs MPI (child runs under mpiexec)
# ----------------------------------------------------------------------------------

def mpi_child(sizes_mib: list[float], reps: int) -> None:
    from mpi4py import MPI

    from tinyflow.allreduce import MPITransport, ring_allreduce
    comm = MPITransport(timeout=120)
    world = comm.comm
    result = {}
    for size_mib in sizes_mib:
        count = int(size_mib * MIB) // 4
        base = np.full(count, 1.0 + world.rank, dtype=np.float32)
        work = np.empty_like(base)
        times: dict[str, list[float]] = {"ring": [], "mpi": []}
        calls = {"ring": lambda w=work: ring_allreduce(w, comm),
                 "mpi": lambda w=work: comm.native_allreduce(w)}
        for rep in range(reps + 2):               # two warm-up rounds
            for name in (("ring", "mpi") if rep % 2 else ("mpi", "ring")):
                work[...] = base
                world.Barrier()
                began = time.perf_counter()
                calls[name]()
                took = world.allreduce(time.perf_counter() - began, op=MPI.MAX)
                if rep >= 2:
                    times[name].append(took)
                expected = world.size * (world.size + 1) / 2
                if not np.allclose(work[:5], expected):
                    raise SystemExit(f"{name} allreduce gave {work[:5]}, not {expected}")
        result[str(size_mib)] = {k: statistics.median(v) for k, v in times.items()}
    if world.rank == 0:
        print(json.dumps({"size": world.size, "times": result}), flush=True)


def _ring_vs_mpi(quick: bool, want) -> list[dict]:
    from tinyflow.allreduce import find_mpiexec
    jobs = [(2, [1, 16, 64]), (4, [16])]
    names = [f"ring_vs_mpi_n{n}_{s}MiB" for n, sizes in jobs for s in sizes]
    if not any(want(name) for name in names):
        return []
    mpiexec = find_mpiexec()
    if importlib.util.find_spec("mpi4py") is None or mpiexec is None:
        return [_row(name, math.nan, ">= 0.9", "x", "skipped: mpi4py or mpiexec not "
                     "installed (pip install 'tinyflow[dist]')") for name in names]
    rows = []
    for n, sizes in jobs:
        sizes = [s for s in sizes if want(f"ring_vs_mpi_n{n}_{s}MiB")]
        if not sizes:
            continue
        reps = 3 if quick else 31  # (the machine is shared: more rounds, a steadier median)
        command = [mpiexec, "-n", str(n), sys.executable, str(HERE), "mpi-child",
                   "--reps", str(reps), "--sizes-mib", *map(str, sizes)]
        out = _run_child(command, timeout=600)
        for s in sizes:
            t = out["times"][str(float(s))]
            gbps = lambda sec, s=s: s * MIB / sec / 1e9  # noqa: E731
            rows.append(_row(
                f"ring_vs_mpi_n{n}_{s}MiB", t["mpi"] / t["ring"], ">= 0.9", "x",
                f"bandwidth of our ring over MPITransport / MPI Allreduce, float32, "
                f"{n} ranks, median of {reps}: ring {t['ring'] * 1e3:.2f} ms "
                f"({gbps(t['ring']):.2f} GB/s), MPI {t['mpi'] * 1e3:.2f} ms "
                f"({gbps(t['mpi']):.2f} GB/s)"))
    return rows


# ----------------------------------------------------------------------------------
# Bytes vs theory (threads, in process)
# ----------------------------------------------------------------------------------

def _bytes_vs_theory(quick: bool) -> dict:
    from tinyflow.allreduce import ring_allreduce, ring_bytes_per_rank, run_threads
    ranks, count = 4, (1 << 16 if quick else 1 << 22)

    def rank_bytes(comm):
        ring_allreduce(np.ones(count, np.float32), comm)
        return comm.bytes_sent

    sent = max(run_threads(ranks, rank_bytes))
    theory = ring_bytes_per_rank(count * 4, ranks)
    return _row("ring_bytes_vs_theory", sent / theory, "== 1.0", "x",
                f"max payload bytes sent per rank ({sent}) / 2(N-1)/N * array bytes "
                f"({theory:.0f}); {ranks} thread ranks, {count} float32")


def _tree_bytes_vs_theory(quick: bool) -> dict:
    from tinyflow.collectives import tree_allreduce
    from tinyflow.transports import run_threads
    count = 1 << (14 if quick else 20)
    ratios = {}
    for ranks in (4, 8):
        def rank_bytes(comm):
            tree_allreduce(np.ones(count, np.float32), comm)
            return comm.bytes_sent

        ratios[ranks] = max(run_threads(ranks, rank_bytes)) / (2 * count * 4)
    return _row("tree_bytes_vs_theory", max(ratios.values()), "<= 1.0", "x",
                "busiest rank's payload bytes / 2S in a double-binary-tree allreduce of "
                f"{count} float32 over thread ranks: "
                + ", ".join(f"N={n}: {r:.3f}" for n, r in ratios.items()))


# ----------------------------------------------------------------------------------
# Tree vs ring (child runs as 4 local processes)
# ----------------------------------------------------------------------------------

TREE_SIZES = {"8KiB": 8 << 10, "16MiB": 16 << 20}


def tree_child(reps: int) -> None:
    from tinyflow.allreduce import init_communicator, ring_allreduce
    from tinyflow.collectives import tree_allreduce
    comm = init_communicator(timeout=120)
    flag = np.zeros(1)

    def barrier():  # a tiny ring allreduce: every rank must arrive before any leaves
        ring_allreduce(flag, comm)

    def slowest(seconds: float) -> float:
        took = np.array([seconds])
        ring_allreduce(took, comm, "max")
        return float(took[0])

    result = {}
    for label, nbytes in TREE_SIZES.items():
        base = np.full(nbytes // 4, 1.0 + comm.rank, dtype=np.float32)
        work = np.empty_like(base)
        calls = {"ring": lambda w=work: ring_allreduce(w, comm),
                 "tree": lambda w=work: tree_allreduce(w, comm)}
        times: dict[str, list[float]] = {"ring": [], "tree": []}
        for rep in range(reps + 2):  # two warm-up rounds
            for name in (("ring", "tree") if rep % 2 else ("tree", "ring")):
                work[...] = base
                barrier()
                began = time.perf_counter()
                calls[name]()
                took = slowest(time.perf_counter() - began)
                if rep >= 2:
                    times[name].append(took)
                if work[0] != comm.size * (comm.size + 1) / 2:
                    raise SystemExit(f"{name} allreduce gave {work[0]}")
        result[label] = {k: statistics.median(v) for k, v in times.items()}
    if comm.rank == 0:
        print(json.dumps(result), flush=True)


def _tree_vs_ring(quick: bool, want) -> list[dict]:
    names = [f"tree_vs_ring_{label}_n4" for label in TREE_SIZES]
    if not any(want(name) for name in names):
        return []
    reps = 3 if quick else 21
    command = [sys.executable, "-c",
               "import sys; from tinyflow.allreduce import launch; "
               f"sys.exit(launch(4, {str(HERE)!r}, ['tree-child', '--reps', '{reps}'], "
               "use_mpi=False, timeout=120))"]
    out = _run_child(command, timeout=600)
    goals = {"8KiB": "< 1.0", "16MiB": "> 1.0"}
    return [_row(f"tree_vs_ring_{label}_n4", t["tree"] / t["ring"], goals[label], "x",
                 f"double-tree / ring allreduce time, {label} float32, 4 local processes, "
                 f"median of {reps}: tree {t['tree'] * 1e3:.3f} ms, ring "
                 f"{t['ring'] * 1e3:.3f} ms (< 1: the tree wins; it should at 8 KiB, "
                 "fewer rounds, and lose at 16 MiB, more bytes per round)")
            for label, t in out.items() if want(f"tree_vs_ring_{label}_n4")]


# ----------------------------------------------------------------------------------
# Data-parallel overlap (child runs as local processes)
# ----------------------------------------------------------------------------------

DP_SIZES = (256, 1024, 1024, 1024, 10)
DP_BATCH = 16


def dp_child(rounds: int, steps: int) -> None:
    import tinyflow as tf
    from tinyflow.allreduce import init_communicator
    from tinyflow.parallel import DistributedOptimizer, broadcast_variables
    comm = init_communicator(timeout=120)
    rng = np.random.default_rng(comm.rank)
    x = tf.placeholder(tf.float32, (DP_BATCH, DP_SIZES[0]))
    y = tf.placeholder(tf.int64, (DP_BATCH,))
    model = tf.nn.MLP(list(DP_SIZES))
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(model(x), y)
    train = {"bucketed": DistributedOptimizer(tf.train.SGD(0.01), comm,
                                              bucket_bytes=MIB).minimize(loss),
             "single": DistributedOptimizer(tf.train.SGD(0.01), comm,
                                            bucket_bytes=1 << 40).minimize(loss)}
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    broadcast_variables(sess, comm)
    feed = {x: rng.standard_normal((DP_BATCH, DP_SIZES[0])).astype(np.float32),
            y: rng.integers(0, DP_SIZES[-1], DP_BATCH)}
    times: dict[str, list[float]] = {"bucketed": [], "single": []}
    for round_index in range(rounds + 1):          # round 0 compiles and warms up
        order = ("bucketed", "single") if round_index % 2 else ("single", "bucketed")
        for name in order:
            began = time.perf_counter()
            for _ in range(steps):
                sess.run(train[name], feed)
            if round_index:
                times[name].append((time.perf_counter() - began) / steps)
    if comm.rank == 0:
        print(json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)


def _dp_overlap(quick: bool) -> dict:
    rounds, steps = (2, 3) if quick else (9, 10)
    command = [sys.executable, "-c",
               "import sys; from tinyflow.allreduce import launch; "
               f"sys.exit(launch(2, {str(HERE)!r}, ['dp-child', '--rounds', '{rounds}', "
               f"'--steps', '{steps}'], use_mpi=False, timeout=120))"]
    out = _run_child(command, timeout=600)
    params = sum(a * b + b for a, b in zip(DP_SIZES[:-1], DP_SIZES[1:]))
    return _row("dp_overlap_ratio", out["bucketed"] / out["single"], "<= 0.9", "x",
                f"DP SGD step, 2 local processes, MLP {'-'.join(map(str, DP_SIZES))} "
                f"({params / 1e6:.1f} M float32 params), batch {DP_BATCH}/rank: 1 MiB "
                f"buckets on the comm stream {out['bucketed'] * 1e3:.1f} ms / one "
                f"allreduce after backward {out['single'] * 1e3:.1f} ms")


def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    """The allreduce figures (see the module docstring); `only` keeps the figures
    whose name contains it."""
    want = lambda name: only is None or only in name  # noqa: E731
    rows = _ring_vs_mpi(quick, want)
    if want("ring_bytes_vs_theory"):
        rows.append(_bytes_vs_theory(quick))
    if want("tree_bytes_vs_theory"):
        rows.append(_tree_bytes_vs_theory(quick))
    rows += _tree_vs_ring(quick, want)
    if want("dp_overlap_ratio"):
        rows.append(_dp_overlap(quick))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode")
    mpi = sub.add_parser("mpi-child", help="(run by mpiexec) time ring vs MPI Allreduce")
    mpi.add_argument("--sizes-mib", type=float, nargs="+", required=True)
    mpi.add_argument("--reps", type=int, default=15)
    dp = sub.add_parser("dp-child", help="(run by launch) time bucketed vs single allreduce")
    dp.add_argument("--rounds", type=int, default=9)
    dp.add_argument("--steps", type=int, default=10)
    tree = sub.add_parser("tree-child", help="(run by launch) time tree vs ring allreduce")
    tree.add_argument("--reps", type=int, default=21)
    sub.add_parser("figures", help="print the figures as JSON (the default)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.mode == "mpi-child":
        mpi_child(args.sizes_mib, args.reps)
    elif args.mode == "tree-child":
        tree_child(args.reps)
    elif args.mode == "dp-child":
        dp_child(args.rounds, args.steps)
    else:
        for row in figures(quick=args.quick):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
