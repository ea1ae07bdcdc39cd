"""tutorials/train_parallel.py: every scheme, as a user runs it (--quick --check), on
threads; a few on real processes (`tinyflow launch`) and MPI."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinyflow import trace
from tinyflow.allreduce import find_mpiexec

SCRIPT = Path(__file__).resolve().parent.parent / "tutorials" / "train_parallel.py"
spec = importlib.util.spec_from_file_location("train_parallel", SCRIPT)
train_parallel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_parallel)

EXACT = ["dp", "zero1", "zero2", "zero3", "tp", "pp-gpipe", "pp-1f1b", "ps-sync"]


def value(name: str, out: str) -> float:
    match = re.search(rf"^{name}=(\S+)$", out, re.MULTILINE)
    assert match, f"{name} not printed:\n{out}"
    return float(match.group(1))


@pytest.mark.parametrize("scheme", ["tp", "zero3"])
def test_char_transformer_trains_like_one_rank(scheme, tmp_path, capsys):
    """--model charlm: tp splits attention by heads (and the MLP), zero3 shards it."""
    argv = ["--model", "charlm", "--scheme", scheme, "--quick", "--check", "--epochs", "1",
            "--checkpoint", str(tmp_path / "w.npz")]
    assert train_parallel.main(argv) == 0
    out = capsys.readouterr().out
    assert value("max_rel_diff_vs_one_rank", out) < 1e-9
    assert value("test_accuracy", out) > 0.08   # learned: chance is 1/vocabulary ~ 0.013


@pytest.mark.parametrize("scheme", EXACT)
def test_scheme_trains_like_one_rank(scheme, tmp_path, capsys):
    argv = ["--scheme", scheme, "--quick", "--check", "--epochs", "1",
            "--checkpoint", str(tmp_path / "w.npz")]
    assert train_parallel.main(argv) == 0
    out = capsys.readouterr().out
    assert value("max_rel_diff_vs_one_rank", out) < 1e-9
    assert value("test_accuracy", out) > 0.3          # it learned (chance is 0.1)
    assert (tmp_path / "w.npz").exists()


def test_async_ps_learns(tmp_path, capsys):
    assert train_parallel.main(["--scheme", "ps-async", "--quick", "--epochs", "3",
                                "--checkpoint", str(tmp_path / "w.npz")]) == 0
    assert value("test_accuracy", capsys.readouterr().out) > 0.3


def test_1f1b_trace_has_a_lane_per_rank(tmp_path, capsys):
    out = tmp_path / "pp.json"
    assert train_parallel.main(["--scheme", "pp-1f1b", "--quick", "--epochs", "1",
                                "--trace", str(out), "--checkpoint", ""]) == 0
    record = trace.load(out)
    names = {s["name"] for s in record["streams"]}
    assert {f"rank{r}/compute" for r in range(4)} <= names


def test_trace_shows_the_bytes_each_rank_holds(tmp_path, capsys):
    # dp keeps the whole model and its momentum on every rank; ZeRO-3 a quarter of
    # both; a pipeline's last stage only its own (smaller) layer.
    held = {}
    for scheme in ("dp", "zero3", "pp-1f1b"):
        out = tmp_path / f"{scheme}.json"
        assert train_parallel.main(["--scheme", scheme, "--quick", "--epochs", "1",
                                    "--trace", str(out), "--checkpoint", ""]) == 0
        record = trace.load(out)
        plan = record["memory_plan"]
        held[scheme] = [plan["strategies"][f"rank {r}"] for r in range(4)]
        assert sum(held[scheme]) == plan["arena_bytes"]
        # every rank's collectives and (but for the pipeline, whose F and B are its
        # compute lanes) its steps: ZeRO-3's timeline had no events at all, then
        # only comm lanes, so nothing showed where the collectives fell in a step
        lanes = {s["name"] for s in record["streams"]}
        work = "compute" if scheme.startswith("pp") else "run"
        assert {f"rank{r}/{work}" for r in range(4)} <= lanes, (scheme, lanes)
        if not scheme.startswith("pp"):
            assert {f"rank{r}/comm" for r in range(4)} <= lanes, (scheme, lanes)
    assert len(set(held["dp"])) == 1
    for rank_bytes in held["zero3"]:
        assert abs(rank_bytes - held["dp"][0] / 4) < 64, held   # (shards padded evenly)
    assert held["pp-1f1b"][3] < held["pp-1f1b"][0] < held["dp"][0], held


# One launch runs several schemes in the same ranks (importing scikit-learn for the
# digits costs seconds per process on a loaded machine; one import serves them all).
DRIVER = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("train_parallel", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
for scheme in sys.argv[2:]:
    print("scheme=" + scheme, flush=True)
    assert module.main(["--scheme", scheme, "--quick", "--epochs", "1", "--check",
                        "--checkpoint", "", "--timeout", "60"]) == 0
"""


def launch_schemes(tmp_path, use_mpi: bool, schemes: list[str]) -> str:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    done = subprocess.run([sys.executable, "-c",
                           "import sys; from tinyflow.allreduce import launch; "
                           f"sys.exit(launch(2, sys.argv[1], sys.argv[2:], use_mpi={use_mpi}))",
                           str(driver), str(SCRIPT), *schemes],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    diffs = re.findall(r"^max_rel_diff_vs_one_rank=(\S+)$", done.stdout, re.MULTILINE)
    assert len(diffs) == len(schemes), done.stdout
    assert all(float(d) < 1e-9 for d in diffs), done.stdout
    return done.stdout


def test_schemes_on_processes(tmp_path):
    launch_schemes(tmp_path, False, ["pp-1f1b", "ps-sync"])


needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or find_mpiexec() is None,
    reason="mpi4py or mpiexec not installed")


@needs_mpi
def test_schemes_on_mpi(tmp_path):
    launch_schemes(tmp_path, True, ["dp", "zero3", "tp", "pp-1f1b"])


@pytest.mark.parametrize("argv, numbers", [
    (["--scheme", "dp", "--threads", "5"], ["--batch-size 48", "5 ranks"]),
    (["--scheme", "zero3", "--threads", "5"], ["--batch-size 48", "5 ranks"]),
    (["--scheme", "ps-sync", "--threads", "6"], ["--batch-size 48", "5 workers"]),
    (["--scheme", "dp", "--threads", "4", "--batch-size", "50"], ["50", "4 ranks"]),
    (["--scheme", "pp-gpipe", "--threads", "5"], ["4 layers", "5 stages"]),
    (["--scheme", "pp-1f1b", "--threads", "2", "--microbatches", "5"],
     ["--batch-size 48", "--microbatches 5"])])
def test_sizes_that_do_not_fit_are_refused_up_front(argv, numbers, capsys):
    """Ranks that do not divide the batch silently dropped its last rows (--check:
    a relative difference of 2e2); 5 pipeline stages for 4 layers trained, then
    crashed with numpy's "need at least one array to concatenate"."""
    with pytest.raises(SystemExit) as info:
        train_parallel.main(argv + ["--quick", "--checkpoint", ""])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in numbers), err


def test_the_default_ranks_must_divide_the_batch_too(capsys):
    """Without --threads the ranks are known only after init_communicator (4 thread
    ranks here, the launcher's ranks under `tinyflow launch`)."""
    assert train_parallel.main(["--scheme", "dp", "--batch-size", "50", "--quick",
                                "--checkpoint", ""]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 50" in err and "4 ranks" in err, err
