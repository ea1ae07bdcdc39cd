"""The `tinyflow` command (tinyflow/cli.py): argument handling and what each command runs.

The viz subprocess and the allreduce launcher are replaced by recorders here, so these
tests check the command lines the CLI builds; the real debugger and launcher have
their own tests. One test runs a real script under `debug --run` to check that
TINYFLOW_TRACE makes it write a DebugRecord.
"""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tinyflow import cli, trace


def _tinyflow_command() -> list[str]:
    # The installed console script when it is on PATH (it is in the dev venv), else
    # the same entry point through the interpreter.
    exe = shutil.which("tinyflow") or str(Path(sys.executable).parent / "tinyflow")
    if Path(exe).exists():
        return [exe]
    return [sys.executable, "-c", "import sys; from tinyflow.cli import main; sys.exit(main())"]


def test_console_script_help_lists_the_commands():
    result = subprocess.run([*_tinyflow_command(), "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    for command in ("train", "debug", "export", "launch"):
        assert command in result.stdout


def test_train_unknown_name_is_a_clear_error():
    result = subprocess.run([*_tinyflow_command(), "train", "nosuch"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "no training script named 'nosuch'" in result.stderr
    assert "mlp" in result.stderr and "Traceback" not in result.stderr


def test_training_scripts_are_found_in_the_checkout():
    scripts = cli.training_scripts()
    assert {"mlp", "cnn", "charlm"} <= set(scripts)
    assert scripts["mlp"] == cli.tutorials_dir() / "train_mlp.py"


def test_train_passes_arguments_through(capsys):
    # --help makes the script print its own options and exit 0 before any training.
    assert cli.main(["train", "mlp", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--epochs", "--batch-size", "--lr", "--quick", "--trace", "--checkpoint",
                   "--seed"):
        assert option in out


def test_train_without_a_tutorials_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "tutorials_dir", lambda: tmp_path / "tutorials")
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "mlp"])
    assert stop.value.code == 2
    assert "is missing" in capsys.readouterr().err


@pytest.fixture
def viz_calls(monkeypatch):
    """Record the `python -m viz` command lines instead of running them."""
    calls = []

    def fake_call(command, **kwargs):
        calls.append(command)
        return 0
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "viz" else None)
    monkeypatch.setattr(cli.subprocess, "call", fake_call)
    return calls


def test_debug_and_export_run_python_m_viz(viz_calls, tmp_path):
    record = tmp_path / "run.json"
    record.write_text("{}")
    assert cli.main(["debug", str(record)]) == 0
    assert cli.main(["export", str(record), "--dot", "g.dot", "--after", "cse"]) == 0
    assert cli.main(["export", str(record), "--perfetto", "t.json"]) == 0
    assert viz_calls == [
        [sys.executable, "-m", "viz", str(record)],
        [sys.executable, "-m", "viz", "export", str(record), "--dot", "g.dot", "--after", "cse"],
        [sys.executable, "-m", "viz", "export", str(record), "--perfetto", "t.json"],
    ]


def test_export_needs_exactly_one_target(tmp_path, capsys):
    for argv in (["export", "f.json"], ["export", "f.json", "--dot", "a", "--perfetto", "b"]):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
    assert "--dot" in capsys.readouterr().err


def test_missing_viz_extra_is_explained(monkeypatch, tmp_path, capsys):
    record = tmp_path / "run.json"
    record.write_text("{}")
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(SystemExit) as stop:
        cli.main(["debug", str(record)])
    assert stop.value.code == 2
    assert "pip install 'tinyflow[viz]'" in capsys.readouterr().err


def test_debug_errors(viz_calls, tmp_path, capsys):
    for argv, message in ((["debug"], "needs a DebugRecord FILE"),
                          (["debug", str(tmp_path / "none.json")], "no such file"),
                          (["debug", "--run", str(tmp_path / "none.py")], "no such script")):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
        assert message in capsys.readouterr().err
    assert viz_calls == []


def test_debug_run_records_a_trace_and_opens_it(monkeypatch, tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import tinyflow as tf
        x = tf.placeholder(tf.float32, (None, 3))
        w = tf.Variable(np.ones((3, 2), np.float32))
        loss = tf.reduce_sum(tf.matmul(x, w))
        sess = tf.Session()
        sess.run(tf.global_variables_initializer())
        scale = float(sys.argv[1])
        for step in range(3):
            sess.run(loss, {x: scale * np.ones((4, 3), np.float32)})
    """))
    opened = []
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(cli, "_viz", lambda arguments: opened.append(arguments) or 0)
    assert cli.main(["debug", "--run", str(script), "2.0"]) == 0
    (path,) = opened[0]
    record = trace.load(path)
    assert record["timelines"], "the script's runs were not recorded"
    assert {n["op"] for n in record["graphs"][0]["nodes"]} >= {"matmul", "placeholder"}


def test_launch_calls_allreduce_launch(monkeypatch, tmp_path):
    import tinyflow.allreduce as allreduce
    script = tmp_path / "rank.py"
    script.write_text("print('hello')\n")
    calls = []
    monkeypatch.setattr(allreduce, "launch",
                        lambda n, path, args: calls.append((n, path, args)) or 3)
    assert cli.main(["launch", "-n", "4", str(script), "--epochs", "2"]) == 3
    assert calls == [(4, str(script), ["--epochs", "2"])]
    with pytest.raises(SystemExit):
        cli.main(["launch", "-n", "0", str(script)])
