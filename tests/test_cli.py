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
    record = _record_copy(tmp_path)   # (debug checks that it is a record: "{}" is not)
    assert cli.main(["debug", str(record)]) == 0
    assert cli.main(["export", str(record), "--dot", "g.dot", "--after", "cse"]) == 0
    assert cli.main(["export", str(record), "--perfetto", "t.json"]) == 0
    # The README's --all-nodes and --run N (the CLI refused them: "unrecognized
    # arguments", though python -m viz export takes them)
    assert cli.main(["export", str(record), "--dot", "g.svg", "--all-nodes"]) == 0
    assert cli.main(["export", str(record), "--perfetto", "t.json", "--run", "3"]) == 0
    assert viz_calls == [
        [sys.executable, "-m", "viz", str(record)],
        [sys.executable, "-m", "viz", "export", str(record), "--dot", "g.dot", "--after", "cse"],
        [sys.executable, "-m", "viz", "export", str(record), "--perfetto", "t.json"],
        [sys.executable, "-m", "viz", "export", str(record), "--dot", "g.svg", "--all-nodes"],
        [sys.executable, "-m", "viz", "export", str(record), "--perfetto", "t.json", "--run",
         "3"],
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
    # The fake debugger reads the record while it is open, as the real one does.
    monkeypatch.setattr(cli, "_viz", lambda arguments: opened.append(
        (arguments[0], trace.load(arguments[0]))) or 0)
    assert cli.main(["debug", "--run", str(script), "2.0"]) == 0
    ((path, record),) = opened
    assert record["timelines"], "the script's runs were not recorded"
    assert {n["op"] for n in record["graphs"][0]["nodes"]} >= {"matmul", "placeholder"}
    # Issue 14 item 29: the temporary folder goes when the debugger closes.
    assert not Path(path).parent.exists()


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


# -- debug --check and export --tensorboard (issue 22) -------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"


def test_debug_check_accepts_a_valid_record(capsys):
    assert cli.main(["debug", "--check", str(FIXTURES / "mlp.record.json")]) == 0
    assert "a valid DebugRecord" in capsys.readouterr().out


def test_debug_check_prints_every_problem_with_its_json_path(tmp_path, capsys):
    import json
    record = json.loads((FIXTURES / "mlp.record.json").read_text())
    record["graphs"][1]["nodes"][0]["bytes"] = "many"
    record["streams"][0]["id"] = -3
    del record["meta"]["title"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(record))
    assert cli.main(["debug", "--check", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f'{path}: graphs[1].nodes[0].bytes: "many" is not of type "integer"',
        f'{path}: meta: missing key "title"',
        f"{path}: streams[0].id: -3 is less than the minimum of 0"]
    path.write_text("[1, 2,, 3]")
    assert cli.main(["debug", "--check", str(path)]) == 1
    assert "invalid JSON" in capsys.readouterr().out


def test_export_tensorboard_writes_the_scalars_tensorboard_reads_back(tmp_path, capsys):
    import json
    pytest.importorskip("tensorboardX")
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    record = json.loads((FIXTURES / "mlp.record.json").read_text())
    record["scalars"]["accuracy"] = [[0, 0.5], [3, 0.75], [4, None]]
    path = tmp_path / "run.json"
    trace.save(record, path)
    logdir = tmp_path / "runs"
    assert cli.main(["export", str(path), "--tensorboard", str(logdir)]) == 0
    assert "tensorboard --logdir" in capsys.readouterr().err
    events = accumulator.EventAccumulator(str(logdir))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(record["scalars"])
    for tag, points in record["scalars"].items():
        read = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in read] == [s for s, _ in points]
        for (_, got), (_, want) in zip(read, points):
            if want is None:
                assert got != got  # NaN: the gap TensorBoard draws
            else:
                assert got == pytest.approx(want, rel=1e-6)


def test_export_tensorboard_errors(tmp_path, capsys):
    import json
    record = json.loads((FIXTURES / "mlp.record.json").read_text())
    record["scalars"] = {}
    empty = tmp_path / "empty.json"
    trace.save(record, empty)
    with pytest.raises(SystemExit) as stop:
        cli.main(["export", str(empty), "--tensorboard", str(tmp_path / "runs")])
    assert stop.value.code == 2
    assert "no scalar series" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(SystemExit):
        cli.main(["export", str(FIXTURES / "mlp.record.json"), "--tensorboard", str(a_file)])
    assert "is a file" in capsys.readouterr().err


# -- issue 14 item 29: bad arguments are one-line errors before any work --------------------

TUTORIALS = Path(__file__).parents[1] / "tutorials"


@pytest.mark.parametrize("arguments,message", [
    (["--epochs", "-1"], "argument --epochs: must be at least 1, got -1"),
    (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["--hidden", "0"], "argument --hidden: must be at least 1, got 0"),
    (["--epochs", "two"], "argument --epochs: expected a whole number, got 'two'"),
    (["--trace", "/missing/dir/x.json"], "argument --trace: no such folder: /missing/dir"),
])
def test_train_refuses_bad_arguments_before_training(arguments, message, capsys):
    assert cli.main(["train", "mlp", *arguments]) == 2  # the script's argparse exit
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_train_without_a_name_lists_the_scripts(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["train"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "train needs the NAME of a script" in err and "mlp" in err


def test_every_training_script_checks_its_sizes(capsys):
    for name in cli.training_scripts():
        assert cli.main(["train", name, "--batch-size", "0"]) == 2, name
        assert "must be at least 1" in capsys.readouterr().err, name


def test_charlm_quick_keeps_explicit_model_sizes():
    import runpy
    parse_args = runpy.run_path(str(TUTORIALS / "train_charlm.py"))["parse_args"]
    args = parse_args(["--quick", "--dim", "64", "--heads", "4", "--layers", "3"])
    assert (args.dim, args.heads, args.layers) == (64, 4, 3)
    quick = parse_args(["--quick"])
    assert (quick.dim, quick.heads, quick.layers) == (32, 2, 1)
    full = parse_args([])
    assert (full.dim, full.heads, full.layers) == (96, 4, 2)


# -- issue 14 item 19: TINYFLOW_TRACE in a missing folder -----------------------------------

def test_tinyflow_trace_in_a_missing_folder_is_refused_up_front(tmp_path):
    import os
    script = tmp_path / "script.py"
    script.write_text("import tinyflow as tf\nprint('ran', tf.Session().run(tf.constant(1.0)))\n")
    env = dict(os.environ, TINYFLOW_TRACE=str(tmp_path / "missing" / "x.json"),
               PYTHONPATH=str(Path(cli.__file__).parents[1]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    assert "ran" not in done.stdout  # refused before the work, not after it
    assert f"TINYFLOW_TRACE={tmp_path / 'missing' / 'x.json'}: no such folder" in done.stderr
    assert "Exception ignored" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["script.py"]  # no temp file


# -- probes of bad input: output paths checked up front, children die with tinyflow ------

@pytest.mark.parametrize("where,message", [
    ("afile/x.safetensors", "afile is a file, not a folder"),
    (".", "'.' is a folder, not a file name"),
])
def test_train_checkpoint_path_is_checked_before_training(tmp_path, monkeypatch, capsys,
                                                          where, message):
    # It trained the whole run, then failed to save with a traceback.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "mlp", "--quick", "--checkpoint", where])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert "tinyflow: error: --checkpoint: " in captured.err and message in captured.err
    assert "final_loss" not in captured.out  # refused before any training


def test_checkpoint_file_takes_missing_folders_and_no_checkpoint(tmp_path):
    assert cli.checkpoint_file("") == ""  # the scripts' "no checkpoint"
    deep = str(tmp_path / "new" / "deeper" / "m.safetensors")
    assert cli.checkpoint_file(deep) == deep  # Saver.save makes the folders
    cli._check_outputs(["--quick", f"--checkpoint={deep}"])  # the = form is checked
    (tmp_path / "afile").write_text("")
    with pytest.raises(cli.CommandError, match="afile is a file"):
        cli._check_outputs([f"--checkpoint={tmp_path / 'afile' / 'm.safetensors'}"])


def test_train_live_trace_under_a_file_is_a_clear_error(tmp_path, monkeypatch, capsys):
    # open(FILE.log) raised a bare NotADirectoryError.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "mlp", "--trace", "afile/x.json", "--live"])
    assert stop.value.code == 2
    assert "--trace: cannot write afile/x.json: " in capsys.readouterr().err


@pytest.mark.parametrize("option,where,message", [
    ("--onnx", "afile/x.onnx", "afile is a file, not a folder"),
    ("--onnx", ".", "'.' is a folder, not a file name"),
    ("--dot", "afile/x.dot", "afile is a file, not a folder"),
    ("--perfetto", "afile/x.json", "afile is a file, not a folder"),
    ("--tensorboard", "afile/sub", "afile is a file, not a folder"),
    ("--tensorboard", "afile", "afile is a file, not a folder"),
])
def test_export_output_paths_are_checked_up_front(tmp_path, monkeypatch, capsys, option,
                                                  where, message):
    # --onnx, --tensorboard: NotADirectoryError / IsADirectoryError tracebacks.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as stop:
        cli.main(["export", str(FIXTURES / "mlp.record.json"), option, where])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and message in err and "Traceback" not in err


def test_debug_check_checks_every_file_given(tmp_path, capsys):
    # A second FILE was silently ignored.
    bad = tmp_path / "bad.json"
    bad.write_text("x")
    good = str(FIXTURES / "mlp.record.json")
    assert cli.main(["debug", "--check", good, str(bad)]) == 1
    out = capsys.readouterr().out
    assert "a valid DebugRecord" in out and f"{bad}: not a DebugRecord" in out
    assert cli.main(["debug", "--check", good, good]) == 0
    assert capsys.readouterr().out.count("a valid DebugRecord") == 2


def test_input_that_is_not_a_regular_file_is_refused(tmp_path, capsys):
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv in (["debug", str(fifo)], ["diff", str(fifo), str(fifo)],
                 ["export", str(fifo), "--dot", str(tmp_path / "g.dot")]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert "is not a regular file" in capsys.readouterr().err


_FAKE_VIZ = """\
import os, sys, time
open(os.environ["PIDS"] + ".viz", "w").write(str(os.getpid()))
time.sleep(120)
"""

_FAKE_TRAINING = """\
import os, time
open(os.environ["PIDS"] + ".train", "w").write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie waiting for PID 1 to reap it does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_train_live_children_die_with_tinyflow(tmp_path, signal_name):
    """`train NAME --trace F --live`: the training script and the debugger were
    re-parented to PID 1 and ran on after tinyflow was terminated."""
    import os
    import signal
    import time
    # A stand-in debugger (`python -m viz`, found first from the working folder) and
    # training script, each writing its pid and sleeping.
    (tmp_path / "viz").mkdir()
    (tmp_path / "viz" / "__init__.py").write_text("")
    (tmp_path / "viz" / "__main__.py").write_text(_FAKE_VIZ)
    (tmp_path / "train_fake.py").write_text(_FAKE_TRAINING)
    pids = tmp_path / "pid"
    env = dict(os.environ, PIDS=str(pids),
               PYTHONPATH=f"{tmp_path}{os.pathsep}{Path(cli.__file__).parents[1]}")
    code = ("import sys; from pathlib import Path; from tinyflow import cli; "
            "sys.exit(cli._train_live(Path('train_fake.py'), "
            "['--trace', 'run.json', '--live']))")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (Path(f"{pids}.viz").exists() and Path(f"{pids}.train").exists()):
            assert time.monotonic() < deadline and parent.poll() is None, "did not start"
            time.sleep(0.05)
        time.sleep(0.1)  # the pid files are written: their content too
        children = [int(Path(f"{pids}.{kind}").read_text()) for kind in ("viz", "train")]
        parent.send_signal(getattr(signal, signal_name))
        parent.wait(30)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in children if _alive(pid)]
        for pid in left:  # clean up before failing
            os.kill(pid, signal.SIGKILL)
        assert not left, f"children outlived tinyflow ({signal_name}): {left}"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_an_output_path_through_a_symlink_and_dotdot_is_checked_where_it_goes(tmp_path):
    # Review: the up-front check removed '..' lexically (abspath) and looked for a
    # folder the OS would not write into: a valid path was refused.
    (tmp_path / "real" / "target").mkdir(parents=True)
    (tmp_path / "real" / "sub").mkdir()
    (tmp_path / "top").mkdir()
    (tmp_path / "top" / "a").symlink_to(tmp_path / "real" / "target")
    path = str(tmp_path / "top" / "a" / ".." / "sub" / "x.json")
    assert cli.writable_file(path) == path


# -- new-user probe: bad input is one `tinyflow: error:` line before any app starts ------

def _record_copy(tmp_path: Path) -> Path:
    """A valid record the test may pass around (the fixture, copied)."""
    path = tmp_path / "run.json"
    path.write_bytes((FIXTURES / "mlp.record.json").read_bytes())
    return path


@pytest.mark.parametrize("content,message", [
    ("hello\n", "not a DebugRecord: invalid JSON at line 1, column 1"),
    ('{"a": 1}\n', "not a TinyFlow debug record"),
    ('{"format": "tinyflow.debugrecord", "version": 1', "the file is truncated"),
])
def test_debug_of_a_file_that_is_not_a_record_is_one_line_before_the_screen(
        tmp_path, capsys, monkeypatch, content, message):
    # It opened the full-screen debugger, which said "Cannot open this record ...
    # Press q to quit", while a missing file was a one-line error. viz reads the
    # record before its app starts (once: the CLI does not read it first).
    import viz.app
    from viz import __main__ as viz_main
    monkeypatch.setenv("VIZ_PROG", "tinyflow")
    monkeypatch.setattr(viz.app, "DebuggerApp",
                        lambda *a, **k: pytest.fail("the debugger's screen opened"))
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    good = str(_record_copy(tmp_path))
    for argv in ([str(bad)], [good, str(bad)]):
        assert viz_main.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tinyflow: error: {bad}: ") and message in err, err
        assert err.count("\n") == 1


def test_debug_follow_still_waits_for_a_record_not_written_yet(viz_calls, tmp_path, capsys):
    missing = tmp_path / "later.json"
    partial = tmp_path / "partial.json"
    partial.write_text('{"format": "tinyflow.debugrecord", "version": 1, "meta": {')
    for path in (missing, partial):
        assert cli.main(["debug", "--follow", str(path)]) == 0
    assert viz_calls == [[sys.executable, "-m", "viz", str(path), "--follow"]
                         for path in (missing, partial)]
    # A folder can never become a record: that is refused at once.
    with pytest.raises(SystemExit) as stop:
        cli.main(["debug", "--follow", str(tmp_path)])
    assert stop.value.code == 2
    assert f"tinyflow: error: {tmp_path} is a folder, not a file" in capsys.readouterr().err


def test_debug_check_errors_have_the_cli_prefix_and_documented_statuses(tmp_path, capsys):
    # `--check FOLDER` said "FOLDER: is a directory, not a record", exit 1, while
    # `debug FOLDER` said "tinyflow: error: FOLDER is a folder, not a file", exit 2.
    with pytest.raises(SystemExit) as stop:
        cli.main(["debug", "--check", str(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"tinyflow: error: {tmp_path} is a folder, not a file\n"
    with pytest.raises(SystemExit) as stop:   # the first file is not checked alone
        cli.main(["debug", "--check", str(FIXTURES / "mlp.record.json"),
                  str(tmp_path / "none.json")])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"no such file: {tmp_path / 'none.json'}" in captured.err
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    assert cli.main(["debug", "--check", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{bad}: format: expected 'tinyflow.debugrecord'")
    assert captured.err == (f"tinyflow: error: {bad} is not a valid DebugRecord "
                            "(1 problem, listed above)\n")
    with pytest.raises(SystemExit):
        cli.main(["debug", "--help"])
    assert "exit status" in capsys.readouterr().out


def test_a_folder_given_as_a_script_is_named_a_folder(viz_calls, tmp_path, capsys):
    # `launch -n 2 /tmp` said "no such script: /tmp".
    for argv in (["launch", "-n", "2", str(tmp_path)], ["debug", "--run", str(tmp_path)]):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
        assert f"tinyflow: error: {tmp_path} is a folder, not a script" in \
            capsys.readouterr().err
    assert viz_calls == []


def test_every_training_script_refuses_a_negative_thread_count(capsys):
    # `train mlp --threads -3 --quick` trained, silently.
    for name in cli.training_scripts():
        assert cli.main(["train", name, "--threads", "-3", "--quick"]) == 2, name
        err = capsys.readouterr().err
        assert "argument --threads: must be at least 0, got -3" in err, name
    assert cli.nonnegative_int("0") == 0


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0", "REC"], "argument --batch: must be at least 1, got 0"),
    (["--batch", "2", "REC"], "--batch applies only to an ONNX model"),
    (["--save", "out.json", "REC"], "--save applies only to an ONNX model"),
    (["--check-numerics", "REC"], "--check-numerics applies only with --run SCRIPT"),
    (["--check", "--batch", "2", "REC"], "--batch applies only to an ONNX model"),
])
def test_debug_options_that_do_not_apply_are_refused(viz_calls, tmp_path, capsys, argv,
                                                     message):
    # `debug --batch 0 rec.json` opened the record, the --batch silently ignored.
    record = str(_record_copy(tmp_path))
    with pytest.raises(SystemExit) as stop:
        cli.main(["debug", *[record if a == "REC" else a for a in argv]])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert viz_calls == []


def test_export_run_counts_from_the_end_as_documented(viz_calls, tmp_path, capsys):
    # `--run -1` was accepted (the last run) and `--run 999` refused, neither documented.
    record = str(_record_copy(tmp_path))
    assert cli.main(["export", record, "--perfetto", str(tmp_path / "t.json"),
                     "--run", "-1"]) == 0
    assert viz_calls[-1][-2:] == ["--run", "-1"]
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "-1 the last" in help_text
    # The description line it lacked, and --dot's SVG (it said only "DOT").
    assert "Export the DebugRecord FILE" in help_text and "OUT.svg" in help_text
    for argv, message in (
            (["--dot", str(tmp_path / "g.dot"), "--run", "1"],
             "--run applies only with --perfetto"),
            (["--perfetto", str(tmp_path / "t.json"), "--after", "cse"],
             "--after applies only with --dot"),
            (["--dot", str(tmp_path / "g.png")],
             "argument --dot: expected a name ending in .svg (a picture), .dot or .gv")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["export", record, *argv])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err


def test_export_run_minus_one_is_the_last_run(tmp_path):
    """The documented meaning, through the real exporter: -1 is the last run."""
    pytest.importorskip("viz")
    import json
    record = str(FIXTURES / "mlp.record.json")
    runs = len(trace.load(record)["timelines"])
    written = {}
    for run in ("-1", str(runs - 1)):
        out = tmp_path / f"run{run}.json"
        done = subprocess.run([*_tinyflow_command(), "export", record, "--perfetto", str(out),
                               "--run", run], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        written[run] = json.loads(out.read_text())
    assert written["-1"] == written[str(runs - 1)]


def test_a_training_scripts_argument_error_names_the_command_typed(capsys):
    # Second new-user pass: it said "train_mlp.py: error:", a file the user never
    # typed (runpy sets argv[0] to the script's path).
    assert cli.main(["train", "mlp", "--threads", "-3"]) == 2
    err = capsys.readouterr().err
    assert "tinyflow train mlp: error: argument --threads: must be at least 0" in err
    assert "usage: tinyflow train mlp" in err and "train_mlp.py" not in err
