"""Run TinyFlow's benchmarks and print one table of figures against their goals.

Every ``benchmarks/<topic>_bench.py`` defines ``figures(quick: bool = False) ->
list[dict]``; each dict is one figure: ``name``, ``value`` (a float), ``goal`` (a
comparison such as ``"<= 1.15"``), ``unit`` and ``note`` (how it was measured,
against which reference). A figure that could not be measured (an optional library
missing) has value NaN and a note starting with ``skipped:``. A module may also
accept ``only=`` to compute just the figures whose name contains that text.

This script imports each module, calls ``figures``, checks each row against its
goal and prints one table (rich). A module that fails to import or raises becomes
one error row; the other modules still run. Usage::

    python benchmarks/run.py                  # everything, full size
    python benchmarks/run.py --quick          # small sizes: does it all run?
    python benchmarks/run.py --only core      # modules or figures matching "core"
    python benchmarks/run.py --only compile_ms_10k_nodes   # just that figure
    python benchmarks/run.py --json out.json  # also write the rows (and the machine)
    python benchmarks/run.py --threads 1      # BLAS/OpenMP threads for every library

Exit status: 0 when every module ran (goals missed or not), 1 when a module errored.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import inspect
import json
import math
import operator
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REQUIRED_KEYS = ("name", "value", "goal", "unit", "note")
COMPARISONS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
               "==": operator.eq}


def discover(bench_dir: Path = BENCH_DIR) -> list[Path]:
    """The benchmark modules: every ``*_bench.py`` in `bench_dir`, sorted by name."""
    return sorted(bench_dir.glob("*_bench.py"))


def module_name(path: Path) -> str:
    """``core_bench.py`` -> ``core``: the name rows of an errored module carry."""
    return path.stem.removesuffix("_bench")


def load_module(path: Path) -> ModuleType:
    """Import a benchmark file by path (benchmarks/ is a folder of scripts, not a
    package) under the name ``benchmarks.<stem>``."""
    # Benchmark files may share helpers (executor_bench uses core_bench's timers):
    # their folder goes on sys.path, as when a script there is run directly.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"benchmarks.{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up here
    spec.loader.exec_module(module)
    return module


def parse_goal(goal: str) -> tuple[str, float]:
    """``"<= 1.15"`` -> (``"<="``, 1.15). Raises ValueError for anything else."""
    text = goal.strip()
    for symbol in sorted(COMPARISONS, key=len, reverse=True):  # "<=" before "<"
        if text.startswith(symbol):
            return symbol, float(text[len(symbol):])
    raise ValueError(f"goal {goal!r} is not '<op> <number>' with op one of "
                     f"{', '.join(COMPARISONS)}")


def verdict(row: dict) -> str:
    """``yes``/``no`` (the value meets its goal or not), ``skipped`` or ``error``."""
    if row.get("error"):
        return "error"
    value = row.get("value")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "skipped" if str(row.get("note", "")).startswith("skipped") else "error"
    symbol, target = parse_goal(row["goal"])
    return "yes" if COMPARISONS[symbol](float(value), target) else "no"


def check_row(row: Any, source: str) -> dict:
    """Validate one figure dict from `source` (module name); return it normalized
    (value as float). Raises ValueError naming the module and the problem."""
    if not isinstance(row, dict):
        raise ValueError(f"{source}: a figure must be a dict, got {type(row).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in row]
    if missing:
        raise ValueError(f"{source}: figure {row.get('name', '?')!r} lacks {missing}")
    parse_goal(row["goal"])
    value = row["value"]
    row = dict(row)
    row["value"] = float("nan") if value is None else float(value)
    return row


def error_row(name: str, err: BaseException) -> dict:
    """The row a failing module becomes: the exception and where it was raised."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return {"name": name, "value": float("nan"), "goal": "", "unit": "", "error": True,
            "note": f"error: {type(err).__name__}: {err}{where}"}


def run_module(path: Path, quick: bool, only: str | None) -> tuple[list[dict], float]:
    """Rows of one module (or its one error row) and the seconds it took.

    `only` selects: when it matches the module's name every figure is kept; else
    only figures whose name contains it (passed on as ``only=`` when the module's
    `figures` accepts it, so it can skip the work for the others). A module that
    raises is kept as its error row either way: the figure asked for may be in it."""
    name = module_name(path)
    start = time.perf_counter()
    try:
        module = load_module(path)
        kwargs: dict[str, Any] = {"quick": quick}
        whole_module = only is None or only in path.stem
        if not whole_module and "only" in inspect.signature(module.figures).parameters:
            kwargs["only"] = only
        rows = [check_row(r, name) for r in module.figures(**kwargs)]
        if not whole_module:
            rows = [r for r in rows if only in r["name"]]
    except Exception as err:  # one broken module must not hide the others' figures
        rows = [error_row(name, err)]
    for row in rows:
        row["module"] = name
        row["met"] = verdict(row)
    return rows, time.perf_counter() - start


def machine() -> dict:
    """What the figures were measured on (written into the JSON)."""
    info: dict[str, Any] = {"python": platform.python_version(),
                            "platform": platform.platform(), "cpus": os.cpu_count(),
                            "threads": os.environ.get("TINYFLOW_BENCH_THREADS")}
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    try:
        import numpy
        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    return info


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title, show_lines=False)
    for column, justify in [("name", "left"), ("value", "right"), ("goal", "left"),
                            ("met?", "center"), ("unit", "left"), ("note", "left")]:
        table.add_column(column, justify=justify, overflow="fold")
    style = {"yes": "green", "no": "bold red", "skipped": "yellow", "error": "bold red"}
    for row in rows:
        value = row["value"]
        shown = "-" if math.isnan(value) else f"{value:.3g}" if abs(value) < 1e4 \
            else f"{value:.0f}"
        table.add_row(row["name"], shown, row["goal"],
                      f"[{style[row['met']]}]{row['met']}[/]", row["unit"], row["note"])
    # Piped output (CI logs, `| tee`) gets room for the notes instead of 80 columns.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def json_safe(rows: list[dict]) -> list[dict]:
    """NaN is not JSON: write it as null."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v)
             for k, v in row.items()} for row in rows]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few runs")
    parser.add_argument("--only", metavar="NAME", nargs="+",
                        help="run modules, or keep figures, whose name contains NAME "
                             "(several names: the union)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object {figure: number} instead of the table")
    parser.add_argument("--json-file", metavar="OUT",
                        help="also write every row (goal, note, verdict) and the machine "
                             "as JSON to OUT")
    parser.add_argument("--threads", type=int,
                        help="BLAS/OpenMP threads for every library (default 1)")
    return parser.parse_args(argv)


def collect(args: argparse.Namespace) -> tuple[list[dict], dict[str, float]] | None:
    """Every figure the chosen modules give (one row per name) and each module's
    seconds; None when an --only NAME matches nothing."""
    all_paths = discover()
    rows: list[dict] = []
    seconds: dict[str, float] = {}
    for only in args.only or [None]:
        paths = all_paths
        if only and any(only in p.stem for p in paths):
            # NAME names modules: run just those, whole.
            paths = [p for p in paths if only in p.stem]
        found = []
        for path in paths:
            module_rows, took = run_module(path, args.quick, only)
            found += module_rows
            seconds[module_name(path)] = round(took, 2)
        if only and not found:
            print(f"no benchmark module or figure matches {only!r}", file=sys.stderr)
            return None
        known = {r["name"] for r in rows}
        rows += [r for r in found if r["name"] not in known]
    return rows, seconds


def checkout_position(pythonpath: str | None) -> int:
    """Where this checkout goes on sys.path: after the script's folder (entry 0) and
    the PYTHONPATH entries, before site-packages. So `python benchmarks/run.py` uses
    this checkout's tinyflow even when another is installed, while
    `PYTHONPATH=OTHER python benchmarks/run.py` runs OTHER's (a paired run of two
    versions of the code on the same benchmarks; at position 0 the checkout won,
    and such a run measured this code twice)."""
    return 1 + len([entry for entry in (pythonpath or "").split(os.pathsep) if entry])


def settle_malloc() -> str:
    """Fix glibc's malloc in the state a long-running process tends to, so that a
    figure does not depend on what ran before it in the process; returns what was
    done, for the JSON's "machine" entry.

    glibc serves a request above its mmap threshold (128 KiB at start) with fresh
    pages from mmap, which fault on first touch, and gives the top of the heap back
    to the system past a trim threshold; both thresholds then move with what the
    process frees. In a fresh `--only cnn_bench` run PyTorch's CNN step took 3,078
    page faults (12 MB of fresh pages) and 41.0 ms a step; once the process had
    made and freed a few large arrays (as the modules before it in a full run do),
    0 and 37.6 ms. TinyFlow's planned steps allocate nothing (0 faults either way),
    so cnn_step_vs_torch moved by 10% with what ran before it. Here the mmap
    threshold is 32 MiB (glibc's own cap for it) and the trim threshold 512 MiB:
    the libraries' arrays come from a heap that stays paged in, PyTorch's best case,
    the same in every run. (Elsewhere than glibc: left as it is.)"""
    try:
        mallopt = ctypes.CDLL(None).mallopt   # the process's C library
    except (OSError, AttributeError):
        return "malloc: the platform's"
    m_trim_threshold, m_mmap_threshold = -1, -3    # glibc's <malloc.h>
    if mallopt(m_mmap_threshold, 32 << 20) != 1 or mallopt(m_trim_threshold, 512 << 20) != 1:
        return "malloc: the platform's (mallopt refused)"
    return "malloc: mmap threshold 32 MiB, trim threshold 512 MiB (glibc mallopt)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        os.environ["TINYFLOW_BENCH_THREADS"] = str(args.threads)
    # The repository root on sys.path, so modules import `tinyflow` uninstalled too.
    sys.path.insert(checkout_position(os.environ.get("PYTHONPATH")), str(BENCH_DIR.parent))
    malloc = settle_malloc()
    collected = collect(args)
    if collected is None:
        return 1
    rows, seconds = collected
    if args.json:
        print(json.dumps({r["name"]: r["value"] for r in json_safe(rows)}))
    else:
        print_table(rows, "TinyFlow benchmarks" + (" (quick)" if args.quick else ""))
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(
            {"quick": args.quick, "machine": {**machine(), "malloc": malloc},
             "seconds": seconds,
             "figures": json_safe(rows)}, indent=1) + "\n")
    return 1 if any(r["met"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
