"""Compile time per node, and how it grows, on four graph families up to 50k nodes.

Families (each built to about n nodes):

* chain     x -> *0.5 -> tanh -> *0.5 -> ...: one long path
* wide      n/2 placeholders summed by a balanced tree of adds: one wide node
            when fused, a deep reduction otherwise
* gradchain the gradient of a tanh chain (forward, backward, their fusion)
* diamond   y = tanh(y) + 0.5 * y repeated: every value read twice

Each is compiled (``tf.compile``: specialize, passes, schedule, memory plan and
its validation, binding) with three option sets: the defaults, ``passes=[]`` (every
node a step) and ``streams=2`` (the multi-stream schedule, its happens-before
plan and validator). Every compile runs in a fresh subprocess, so one neither
warms nor pollutes the next, and its peak RSS is its own.

Figures:

``compile_us_per_node_50k_max``
    The worst family and option set at 50k nodes: compile seconds / nodes, in us.
``compile_per_node_50k_over_1k_max``
    The worst growth of that per-node time from 1k to 50k nodes (1 is linear;
    an O(n^2) step shows up as ~50).
``compile_peak_rss_50k_mb``
    The largest peak RSS of a 50k-node compile subprocess (graph building included).

``--quick`` (the smoke test) uses 300 and 1,500 nodes instead of 1k and 50k; the
notes give every measurement. Run this file directly for the whole table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("chain", "wide", "gradchain", "diamond")
OPTION_SETS = {"default": {}, "passes=[]": {"passes": []}, "streams=2": {"streams": 2}}
TIMEOUT_S = 600


def build(family: str, n: int):
    """(fetches, feeds) of a graph of about `n` nodes of `family`."""
    import numpy as np

    import tinyflow as tf
    spec = ((4,), np.float32)
    x = tf.placeholder(tf.float32, (4,))
    if family == "wide":
        level = [tf.placeholder(tf.float32, (4,)) for _ in range(max(n // 2, 2))]
        feeds = {p: spec for p in level}
        while len(level) > 1:
            level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i]
                     for i in range(0, len(level), 2)]
        return [level[0]], feeds
    y, half = x, tf.constant(np.float32(0.5))
    if family == "chain":
        for i in range(n - 2):
            y = tf.tanh(y) if i % 2 else y * half
        return [y], {x: spec}
    if family == "gradchain":   # ~4 nodes per layer once differentiated
        for _ in range(n // 4):
            y = tf.tanh(y)
        return tf.gradients(tf.reduce_sum(y), [x]), {x: spec}
    if family == "diamond":     # tanh, mul, add per layer
        for _ in range(n // 3):
            y = tf.tanh(y) + half * y
        return [y], {x: spec}
    raise ValueError(f"unknown family {family!r}")


def measure_one(family: str, n: int, options: str) -> dict:
    """Build and compile one graph in this process: seconds, nodes, peak RSS."""
    import tinyflow as tf
    from tinyflow.graph import reachable
    fetches, feeds = build(family, n)
    nodes = len(reachable(fetches))
    start = time.perf_counter()
    program = tf.compile(fetches, feeds, {}, **OPTION_SETS[options])
    seconds = time.perf_counter() - start
    return {"family": family, "n": n, "options": options, "nodes": nodes,
            "steps": len(program.steps), "seconds": seconds,
            "us_per_node": 1e6 * seconds / nodes, "rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's own peak resident memory, in MiB.

    Linux's VmHWM (/proc/self/status), the high-water mark of this program's own
    memory: getrusage's ru_maxrss is not, in a subprocess, since Linux carries
    the parent's peak across the fork and exec into it (a 100-node compile
    reported 412 MiB, its parent's size; the figure read the benchmark runner's
    530-660 MiB for a 50k-node compile of 381). ru_maxrss elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024      # kB
    except OSError:
        pass
    import resource   # (Unix only, as ru_maxrss)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(family: str, n: int, options: str) -> dict:
    """`measure_one` in a fresh subprocess (one thread for BLAS; a timeout)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + env.get("PYTHONPATH", "").split(os.pathsep))
    try:
        done = subprocess.run([sys.executable, __file__, "--one", family, str(n), options],
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                              check=True)
    except subprocess.TimeoutExpired:
        return {"family": family, "n": n, "options": options, "nodes": n,
                "seconds": float("inf"), "us_per_node": float("inf"), "rss_mb": float("nan"),
                "timeout": True}
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"compiling {family} {n} {options} failed: "
                           f"{err.stderr.strip().splitlines()[-1:]}") from err
    return json.loads(done.stdout.strip().splitlines()[-1])


def figures(quick: bool = False, only: str | None = None) -> list[dict]:
    """The compile-time figures (module docstring); `quick`: 300 and 1,500 nodes."""
    small, big = (300, 1500) if quick else (1000, 50000)
    names = ["compile_us_per_node_50k_max", "compile_per_node_50k_over_1k_max",
             "compile_peak_rss_50k_mb"]
    if only is not None and not any(only in name for name in names):
        return []
    runs = {(f, o, n): measure(f, n, o) for f in FAMILIES for o in OPTION_SETS
            for n in (small, big)}
    per_node = {(f, o): (runs[f, o, small]["us_per_node"], runs[f, o, big]["us_per_node"])
                for f in FAMILIES for o in OPTION_SETS}
    worst = max(per_node, key=lambda k: per_node[k][1])
    growth = {k: big_us / small_us for k, (small_us, big_us) in per_node.items()}
    steepest = max(growth, key=growth.get)
    fattest = max((runs[f, o, big] for f in FAMILIES for o in OPTION_SETS),
                  key=lambda r: r["rss_mb"])
    table = "; ".join(f"{f} {o}: {a:.0f}->{b:.0f}" for (f, o), (a, b) in per_node.items())
    sizes = f"{small} -> {big} nodes"
    rows = [
        {"name": "compile_us_per_node_50k_max", "value": per_node[worst][1], "goal": "<= 100",
         "unit": "us", "note": f"worst: {worst[0]} with {worst[1]} at {big} nodes; us/node "
                               f"per family and options ({sizes}): {table}"},
        {"name": "compile_per_node_50k_over_1k_max", "value": growth[steepest],
         "goal": "<= 2", "unit": "x",
         "note": f"worst growth of us/node {sizes}: {steepest[0]} with {steepest[1]}"},
        {"name": "compile_peak_rss_50k_mb", "value": fattest["rss_mb"], "goal": "<= 100000",
         "unit": "MB", "note": f"largest peak RSS of a {big}-node compile subprocess: "
                               f"{fattest['family']} with {fattest['options']} (report)"}]
    return [r for r in rows if only is None or only in r["name"]]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        family, n, options = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        print(json.dumps(measure_one(family, n, options)))
    else:
        for row in figures(quick="--quick" in sys.argv):
            print(f"{row['name']:34} {row['value']:10.2f} {row['unit']:3} goal {row['goal']:8}"
                  f" {row['note']}")
