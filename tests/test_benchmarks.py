"""Smoke test of the benchmarks: every benchmarks/*_bench.py runs with quick=True and
returns well-formed, finite figures; benchmarks/run.py judges goals and survives a
broken module. No timing is asserted (the machine's speed is not a test result)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def _load_runner():
    spec = importlib.util.spec_from_file_location("benchmarks_run", BENCH_DIR / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


run = _load_runner()
BENCH_FILES = run.discover(BENCH_DIR)


def test_benchmark_modules_exist():
    assert any(p.name == "core_bench.py" for p in BENCH_FILES)


@pytest.mark.parametrize("path", BENCH_FILES, ids=lambda p: p.stem)
def test_quick_figures_are_well_formed(path, monkeypatch):
    monkeypatch.setenv("TINYFLOW_BENCH_THREADS", "1")  # leave the other core to pytest -n
    module = run.load_module(path)
    rows = module.figures(quick=True)
    assert isinstance(rows, list) and rows, f"{path.name}: figures() returned no figures"
    names = [row["name"] for row in rows]
    assert len(set(names)) == len(names), f"{path.name}: duplicate figure names {names}"
    for row in rows:
        for key in run.REQUIRED_KEYS:
            assert key in row, f"{path.name}: figure {row.get('name')!r} lacks {key!r}"
        assert isinstance(row["name"], str) and row["name"]
        assert isinstance(row["unit"], str) and isinstance(row["note"], str)
        run.parse_goal(row["goal"])  # raises unless "<op> <number>"
        value = float(row["value"])
        if math.isnan(value):  # allowed only for an explicitly skipped figure
            assert row["note"].startswith("skipped"), f"{row['name']}: NaN, not skipped"
        else:
            assert math.isfinite(value), f"{row['name']}: value {value}"
        assert run.verdict(run.check_row(row, path.stem)) in {"yes", "no", "skipped"}


@pytest.mark.parametrize("goal, value, expected", [
    ("<= 1.15", 1.15, "yes"), ("<= 1.15", 1.16, "no"), (">= 2", 3.0, "yes"),
    ("< 10", 10.0, "no"), ("> 0.5", 0.4, "no"), ("== 1", 1.0, "yes")])
def test_verdict_compares_value_with_goal(goal, value, expected):
    row = {"name": "f", "value": value, "goal": goal, "unit": "x", "note": ""}
    assert run.verdict(row) == expected


def test_verdict_skipped_and_bad_goal():
    skipped = {"name": "f", "value": float("nan"), "goal": "<= 1", "unit": "x",
               "note": "skipped: torch not installed"}
    assert run.verdict(skipped) == "skipped"
    assert run.verdict({**skipped, "note": "measured"}) == "error"
    with pytest.raises(ValueError, match="goal"):
        run.parse_goal("about 1")


def test_broken_module_is_an_error_row_and_others_still_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "good_bench.py").write_text(
        "def figures(quick=False):\n"
        "    return [{'name': 'answer', 'value': 42.0, 'goal': '>= 40', 'unit': 'x',\n"
        "             'note': 'quick' if quick else 'full'},\n"
        "            {'name': 'other', 'value': 1, 'goal': '< 1', 'unit': 'x', 'note': ''}]\n")
    (tmp_path / "broken_bench.py").write_text(
        "def figures(quick=False):\n    raise RuntimeError('kernel exploded')\n")
    (tmp_path / "helper.py").write_text("raise SystemExit('not a benchmark')\n")
    monkeypatch.setattr(run, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(run, "discover", lambda bench_dir=tmp_path: sorted(
        tmp_path.glob("*_bench.py")))
    out = tmp_path / "out.json"
    status = run.main(["--quick", "--json-file", str(out)])
    assert status == 1  # a module errored
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["figures"]}
    assert rows["broken"]["met"] == "error"
    assert "RuntimeError: kernel exploded" in rows["broken"]["note"]
    assert rows["broken"]["value"] is None  # NaN written as JSON null
    assert rows["answer"]["met"] == "yes" and rows["answer"]["note"] == "quick"
    assert rows["other"]["met"] == "no"
    assert "answer" in capsys.readouterr().out

    # --only naming a module runs just that module; naming a figure runs every module
    # and keeps that figure (and the error rows, which might have held it).
    assert run.main(["--only", "good", "--json-file", str(out)]) == 0
    assert [r["name"] for r in json.loads(out.read_text())["figures"]] == ["answer", "other"]
    assert run.main(["--only", "answ", "--json-file", str(out)]) == 1
    assert [r["name"] for r in json.loads(out.read_text())["figures"]] == ["broken", "answer"]
    # Several names: the union. --json prints one object {figure: number}, no table.
    capsys.readouterr()
    assert run.main(["--only", "answer", "other", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"broken": None, "answer": 42.0,
                                                    "other": 1}


def test_torch_figure_is_skipped_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    monkeypatch.setenv("TINYFLOW_BENCH_THREADS", "1")
    core = run.load_module(BENCH_DIR / "core_bench.py")
    rows = {r["name"]: r for r in core.figures(quick=True, only="mlp_step")}
    assert set(rows) == {"mlp_step_vs_numpy", "mlp_step_vs_torch"}
    assert rows["mlp_step_vs_torch"]["note"] == "skipped: torch not installed"
    assert run.verdict(rows["mlp_step_vs_torch"]) == "skipped"
    assert math.isfinite(rows["mlp_step_vs_numpy"]["value"])


@pytest.mark.parametrize("figure", ["mlp_nodes_after", "compile_ms_10k_nodes"])
def test_only_with_a_full_figure_name_runs_that_figure(figure, capsys, monkeypatch):
    # A module runs groups of figures; asking for one full figure name must still
    # run its group (passes_bench once asked whether the NAME was in the group's
    # prefix, so `--only compile_ms_10k_nodes` found nothing).
    monkeypatch.setenv("TINYFLOW_BENCH_THREADS", "1")
    assert run.main(["--quick", "--only", figure, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert list(rows) == [figure]



@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc")
def test_compile_subprocess_reports_its_own_peak_memory_not_its_parents():
    # Linux carries a parent's peak RSS across fork and exec into ru_maxrss, so a
    # 100-node compile reported the runner's size (412 MiB under a 400 MiB parent).
    compile_bench = run.load_module(BENCH_DIR / "compile_bench.py")
    ballast = bytearray(300 << 20)
    ballast[::4096] = b"\1" * len(ballast[::4096])          # touch every page
    row = compile_bench.measure("chain", 100, "default")
    assert row["rss_mb"] < 200, row
    del ballast


def test_pythonpath_code_comes_before_the_checkout(tmp_path):
    # Regression: run.py put its checkout first on sys.path, so
    # `PYTHONPATH=other_checkout python benchmarks/run.py` ran this checkout's
    # tinyflow, and a paired run of two versions measured one version twice.
    fake = tmp_path / "code" / "tinyflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('the PYTHONPATH copy')\n")
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "code")}
    subprocess.run([sys.executable, str(BENCH_DIR / "run.py"), "--quick", "--only",
                    "core_bench", "--json-file", str(out)], env=env, cwd=tmp_path,
                   capture_output=True, text=True, timeout=120)
    notes = [row["note"] for row in json.loads(out.read_text())["figures"]]
    assert any("the PYTHONPATH copy" in note for note in notes), notes
    assert run.checkout_position(None) == 1
    assert run.checkout_position(os.pathsep.join(["a", "", "b"])) == 3
