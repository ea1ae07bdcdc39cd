"""The `tinyflow` command: train the small models, open the debugger, export, launch.

    tinyflow train NAME [args...]         run tutorials/train_NAME.py (mlp, cnn, charlm, ...)
    tinyflow train NAME --trace FILE --live   train with the debugger following the run
    tinyflow debug FILE [--view V]        open a DebugRecord in the terminal debugger
    tinyflow debug A B                    compare two records (curves overlaid, view 5)
    tinyflow debug --follow FILE          follow a live record while a run writes it
    tinyflow debug --run [--check-numerics] SCRIPT [args]
                                          run SCRIPT recording a trace, then open it
    tinyflow diff A B                     what changed between two records, as text
    tinyflow export FILE --dot OUT        the graph: OUT.svg drawn, OUT.dot as Graphviz DOT
                                          (--after PASS)
    tinyflow export FILE --perfetto OUT   the timelines as Perfetto / chrome://tracing JSON
                                          (--run N: one run; -1 the last)
    tinyflow export FILE --onnx OUT.onnx  the recorded forward graph as ONNX (no weights)
    tinyflow export FILE --tensorboard DIR  the scalar series as TensorBoard event files
    tinyflow debug --check FILE [FILE_B]  list every problem of a DebugRecord, by JSON path
    tinyflow debug MODEL.onnx [--batch N] import an ONNX model, run it recorded, open it
    tinyflow launch -n N [--trace FILE] SCRIPT [args]
                                          N ranks running SCRIPT (one merged record)

The debugger and the exporters live in the separate `viz` package (the `viz` extra),
which reads the DebugRecord files TinyFlow writes; tinyflow never imports it. The
commands here run `python -m viz ...` in a child process, so the core library needs
no terminal-UI packages.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any
from pathlib import Path

import tinyflow

__all__ = ["main", "tutorials_dir", "training_scripts", "positive_int", "nonnegative_int",
           "positive_float", "writable_file", "checkpoint_file", "writable_folder",
           "script_prog"]

_VIZ_MISSING = ("the debugger and exporters are in the viz extra, which is not installed: "
                "pip install 'tinyflow[viz]'")


def tutorials_dir() -> Path:
    """The tutorials folder of the checkout this tinyflow was imported from."""
    return Path(tinyflow.__file__).resolve().parents[1] / "tutorials"


def training_scripts() -> dict[str, Path]:
    """{name: path} for every tutorials/train_NAME.py."""
    folder = tutorials_dir()
    if not folder.is_dir():
        return {}
    return {p.stem[len("train_"):]: p for p in sorted(folder.glob("train_*.py"))}


class CommandError(Exception):
    """A user mistake on the command line: printed as `tinyflow: error: ...`, exit 2."""


# ----------------------------------------------------------------------------------
# Argument types (also used by tutorials/train_*.py): a bad value is argparse's
# one-line usage error before any work starts, never a traceback an hour in.
# ----------------------------------------------------------------------------------

def _whole_number(text: str, least: int) -> int:
    """`text` as an integer >= `least`, or argparse's one-line error saying why."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (epochs, batch size, layer widths, ...)."""
    return _whole_number(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0, for counts where 0 means "the default" (--threads:
    0 is one BLAS thread per core, or no thread ranks)."""
    return _whole_number(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a learning rate, a timeout, epochs)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def writable_file(text: str) -> str:
    """argparse type: a file we can create or overwrite; its folder must exist now.

    Checked up front so a run's result cannot be lost at the end to a typo in the
    folder name. (The path is resolved as the OS will open it: `link/../x` is beside
    the link's target, not beside the link.)
    """
    path = Path(os.path.realpath(text)) if text else Path()
    if not text or _is_dir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file name")
    if not _is_dir(path.parent):
        _refuse_a_file_on_the_way(text, path.parent)
        _need_write_access(text, path, _nearest_existing(path.parent))  # not a typo?
        raise argparse.ArgumentTypeError(f"no such folder: {path.parent}")
    _need_write_access(text, path, path.parent)
    return text


# What `viz export --dot` can write, by the name's ending: it checks only after
# reading the whole record, so the CLI checks first.
_DOT_SUFFIXES = (".svg", ".dot", ".gv")


def dot_file(text: str) -> str:
    """argparse type: `export --dot OUT`, a writable file named .svg, .dot or .gv."""
    if not text.lower().endswith(_DOT_SUFFIXES):
        raise argparse.ArgumentTypeError(f"expected a name ending in .svg (a picture), .dot "
                                         f"or .gv (Graphviz DOT text), got {text!r}")
    return writable_file(text)


def checkpoint_file(text: str) -> str:
    """argparse type: where a checkpoint will be saved at the end of a run ("" for
    none). Saver.save creates missing folders, so they may be missing now; but a
    folder at the path itself, or a file where a folder must go, would fail only
    after the whole run: refused up front, saying which."""
    if not text:
        return text
    path = Path(os.path.realpath(text))
    if _is_dir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file name (give "
                                         "one such as model.safetensors)")
    _refuse_a_file_on_the_way(text, path.parent)
    _need_write_access(text, path, _nearest_existing(path.parent))
    return text


def writable_folder(text: str) -> str:
    """argparse type: a folder to write files into, made if missing (TensorBoard's
    logdir); refused when it, or a folder on the way to it, is a file."""
    path = Path(os.path.realpath(text)) if text else Path()
    if not text:
        raise argparse.ArgumentTypeError("expected a folder name, got ''")
    _refuse_a_file_on_the_way(text, path)
    _need_write_access(text, path, _nearest_existing(path))
    return text


def _is_dir(path: Path) -> bool:
    """Path.is_dir, False where we may not look (a folder of mode 000 on the way)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (the root, at worst)."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor)


def _refuse_a_file_on_the_way(text: str, folder: Path) -> None:
    """Refuse `text` when `folder`, which must be (or become) a folder, or the
    nearest of its ancestors that exists, is a file: nothing can be written there."""
    existing = _nearest_existing(folder)
    if not _is_dir(existing):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {existing} is a file, not "
                                         "a folder")


def _need_write_access(text: str, path: Path, folder: Path) -> None:
    """Refuse `text` when we may not create files in `folder` or replace `path`."""
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.lexists(path)
                                                    and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")


# ----------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------

def _train(args: argparse.Namespace) -> int:
    scripts = training_scripts()
    if args.name is None:
        raise CommandError("train needs the NAME of a script: tinyflow train NAME [args]; "
                           f"available: {', '.join(scripts) or 'none found'}")
    if args.name not in scripts:
        if not scripts:
            raise CommandError(f"no training scripts: {tutorials_dir()} is missing (the "
                               "scripts ship with a checkout of the TinyFlow repository, "
                               "not with the wheel)")
        raise CommandError(f"no training script named {args.name!r}; available: "
                           f"{', '.join(scripts)}")
    _check_outputs(args.script_args)
    if "--live" in args.script_args:
        return _train_live(scripts[args.name], list(args.script_args))
    return _run_script(scripts[args.name], args.script_args, f"tinyflow train {args.name}")


# The training scripts' options that name a file written after the run, and the
# check each needs: a bad --checkpoint would fail only once the whole run is done.
# (The scripts check --trace themselves; `_train_live` checks it before opening
# FILE.log.)
_OUTPUT_OPTIONS = {"--checkpoint": checkpoint_file}


def _check_outputs(script_args: Sequence[str]) -> None:
    """Refuse a training script's output path that cannot be written (CommandError)."""
    for k, arg in enumerate(script_args):
        option, equals, value = arg.partition("=")   # --checkpoint=F or --checkpoint F
        if option not in _OUTPUT_OPTIONS:
            continue
        if not equals:
            if k + 1 == len(script_args):
                continue  # the script's own argparse says the value is missing
            value = script_args[k + 1]
        _check_path(option, value, _OUTPUT_OPTIONS[option])


def _check_path(option: str, value: str, kind: Any) -> None:
    """`kind(value)` (an argparse type above), its refusal as a CommandError."""
    try:
        kind(value)
    except argparse.ArgumentTypeError as err:
        raise CommandError(f"{option}: {err}") from None


def _train_live(path: Path, script_args: list[str]) -> int:
    """`train NAME --trace FILE --live`: the script trains in a child process that
    appends to FILE.live.jsonl (TINYFLOW_LIVE=1), its output going to FILE.log, while
    the debugger follows FILE here; quitting the debugger lets training finish."""
    script_args = [a for a in script_args if a != "--live"]
    trace_file = next((script_args[k + 1] for k, a in enumerate(script_args[:-1])
                       if a == "--trace"), None)
    if trace_file is None:
        raise CommandError("--live needs --trace FILE (the record the debugger follows)")
    _check_path("--trace", trace_file, writable_file)
    _need_viz()
    log_path = trace_file + ".log"
    env = dict(os.environ, TINYFLOW_LIVE="1")
    with open(log_path, "w") as log:
        child = subprocess.Popen([sys.executable, str(path), *script_args], env=env,
                                 stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=_die_with_parent())
        try:
            print(f"tinyflow: training in process {child.pid} (output: {log_path})",
                  file=sys.stderr)
            status = _viz([trace_file, "--follow"])
            if child.poll() is None:
                print("tinyflow: the debugger closed; waiting for training to finish "
                      "(Ctrl-C stops it)", file=sys.stderr)
            code = child.wait()
        finally:  # Ctrl-C, or an error here: training must not go on without us
            _stop_child(child)
    return code or status


def _die_with_parent() -> Any:
    """A Popen `preexec_fn` that makes the child get SIGTERM when this process dies.

    A child started with a plain Popen outlives a `tinyflow` that is killed (SIGTERM
    from a supervisor, SIGKILL), re-parented to PID 1: a training run, or a debugger
    that no one sees, going on alone. `launch` asks the kernel for the same signal
    for its ranks (Linux's PR_SET_PDEATHSIG); this is its helper. SIGTERM, not
    SIGKILL, so that the debugger can restore the terminal on its way out.
    """
    from tinyflow.launcher import _die_with_parent as die_with_parent
    return die_with_parent()


def _stop_child(child: subprocess.Popen) -> None:
    """Terminate `child` if it still runs (SIGTERM, then SIGKILL after a grace)."""
    from tinyflow.launcher import _stop
    _stop([child])


def _need_file(path: str) -> None:
    """Refuse (CommandError) an input `path` that is not a regular file we can read:
    missing, a folder, or a FIFO or device (which would block or never end)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CommandError(f"no such file: {path}") from None
    except OSError as err:  # a folder on the way we may not enter, a loop of links
        raise CommandError(f"cannot read {path}: {err.strerror}") from None
    if stat.S_ISDIR(mode):
        raise CommandError(f"{path} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise CommandError(f"{path} is not a regular file (a FIFO, device or socket)")


def _need_followable(path: str) -> None:
    """`debug --follow FILE`: FILE may not exist yet (the run has not started) or be
    half written, and the debugger waits for it; only what can never become a record
    (a folder, a FIFO or device) is refused now."""
    if os.path.exists(path):
        _need_file(path)


def _need_script(path: str) -> None:
    """Refuse (CommandError) a SCRIPT to run that is missing or not a file."""
    if _is_dir(Path(path)):
        raise CommandError(f"{path} is a folder, not a script (give the .py file to run)")
    if not Path(path).is_file():
        raise CommandError(f"no such script: {path}")


def _refuse_unused(args: argparse.Namespace, options: dict[str, str]) -> None:
    """Refuse every option of `options` ({"--name": "when it applies"}) that was given:
    one silently ignored makes the user believe it did something."""
    for option, applies in options.items():
        if getattr(args, option[2:].replace("-", "_")) not in (None, False):
            raise CommandError(f"{option} applies only {applies}")


# The command a training script runs under (`tinyflow train mlp`), while `train`
# runs it: runpy sets argv[0] to the file's path, which argparse would name instead.
_running_as: list[str] = []


def script_prog(file: str) -> str:
    """A training script's argparse `prog`: the command the user typed, `tinyflow
    train NAME` under `tinyflow train`, else the file's name (`python FILE`)."""
    return _running_as[-1] if _running_as else os.path.basename(file)


def _run_script(path: Path, script_args: Sequence[str], prog: str) -> int:
    """Run a Python file as __main__ in this process, as `python FILE args` would;
    its errors name `prog` (see script_prog)."""
    saved_argv = sys.argv
    sys.argv = [str(path), *script_args]
    _running_as.append(prog)
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:  # the script's own exit (argparse's --help, errors)
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved_argv
        _running_as.pop()
    return 0


def _need_viz() -> None:
    """Refuse (CommandError) a command that needs the viz extra when it is missing."""
    if importlib.util.find_spec("viz") is None:
        raise CommandError(_VIZ_MISSING)


def _viz(arguments: Sequence[str]) -> int:
    """Run `python -m viz ARGUMENTS` and return its exit status."""
    _need_viz()
    env = dict(os.environ, VIZ_PROG="tinyflow")   # messages say `tinyflow export: ...`
    # subprocess.call kills the child if waiting is interrupted (Ctrl-C, an error).
    return subprocess.call([sys.executable, "-m", "viz", *arguments], env=env,
                           preexec_fn=_die_with_parent())


def _view_options(args: argparse.Namespace) -> list[str]:
    """The debugger's own options, passed through (`--view`, `--theme`)."""
    out = []
    if args.view:
        out += ["--view", args.view]
    if args.theme:
        out += ["--theme", args.theme]
    return out


def _check(path: str) -> int:
    """`debug --check FILE`: every problem of the record, each with its JSON path, on
    stdout (the report), then one `tinyflow: error:` line on stderr; 1 if any."""
    from tinyflow import trace
    found = trace.check_file(path)
    for problem in found:
        print(problem if problem.startswith(path) else f"{path}: {problem}")
    if not found:
        print(f"{path}: a valid DebugRecord (schema {trace.SCHEMA_PATH})")
        return 0
    sys.stdout.flush()   # the report before the verdict, in a terminal
    count = f"{len(found)} problem{'s' if len(found) > 1 else ''}"
    print(f"tinyflow: error: {path} is not a valid DebugRecord ({count}, listed above)",
          file=sys.stderr)
    return 1


# The debugger's options that apply only to some FILEs or modes: refused elsewhere.
_ONNX_ONLY = {"--batch": "to an ONNX model (debug MODEL.onnx --batch N)",
              "--save": "to an ONNX model (debug MODEL.onnx --save RECORD)"}


def _debug(args: argparse.Namespace) -> int:
    if args.file is None or not args.file.endswith(".onnx") or args.check:
        _refuse_unused(args, _ONNX_ONLY)
    if args.run is None:
        _refuse_unused(args, {"--check-numerics": "with --run SCRIPT"})
    if args.check:
        return _debug_check(args)
    if args.run is None:
        return _debug_files(args)
    return _debug_run(args)


def _debug_check(args: argparse.Namespace) -> int:
    """`debug --check FILE [FILE_B]`: 0 when every file is a valid record, 1 if not."""
    if args.file is None or args.run is not None:
        raise CommandError("debug --check needs a record FILE (or two)")
    files = [path for path in (args.file, args.other) if path is not None]
    for path in files:   # a file that cannot be read is a mistake, not a finding
        _need_file(path)
    # Each file given is checked: a second one was once silently ignored.
    return max(_check(path) for path in files)


def _debug_files(args: argparse.Namespace) -> int:
    """`debug FILE [OTHER]`: open a record (or two, compared), follow a live one, or
    import and record an ONNX model."""
    if args.file is None:
        raise CommandError("debug needs a DebugRecord FILE, or --run SCRIPT [args]")
    if args.follow:
        if args.other is not None:
            raise CommandError("--follow takes one record")
        _need_followable(args.file)
        return _viz([args.file, "--follow", *_view_options(args)])
    if args.file.endswith(".onnx"):
        _need_file(args.file)
        return _debug_onnx(args)
    for path in (args.file, args.other):
        if path is not None:
            _need_file(path)
    # (a file that is not a record: viz says so in one line before its screen opens)
    return _viz([args.file, *([args.other] if args.other else []), *_view_options(args)])


def _debug_run(args: argparse.Namespace) -> int:
    """`debug --run SCRIPT [ARGS]`: the script runs in a child process with
    TINYFLOW_TRACE set, which makes tinyflow.debug record every Session.run into a
    temporary file the debugger then opens."""
    if args.file is not None:
        raise CommandError("debug takes a FILE or --run SCRIPT, not both")
    if args.run and args.run[0] == "--check-numerics":   # `--run --check-numerics SCRIPT`
        args.run, args.check_numerics = args.run[1:], True
    if not args.run:
        raise CommandError("debug --run needs a SCRIPT")
    _need_viz()
    _need_script(args.run[0])
    script, script_args = Path(args.run[0]), args.run[1:]
    # The record lives in a temporary folder for as long as the debugger has it open.
    folder = Path(tempfile.mkdtemp(prefix="tinyflow-debug-"))
    try:
        trace = folder / f"{script.stem}.trace.json"
        env = dict(os.environ, TINYFLOW_TRACE=str(trace))
        if args.check_numerics:   # trace values and stop at the first NaN/Inf
            env["TINYFLOW_CHECK_NUMERICS"] = "1"
        status = subprocess.call([sys.executable, str(script), *script_args], env=env,
                                 preexec_fn=_die_with_parent())
        if not trace.is_file():
            raise CommandError(f"{script} wrote no trace to {trace} (exit status {status}); "
                               "did it run a tf.Session?")
        print(f"tinyflow: trace of {script} in {trace} (removed when the debugger closes; "
              "to keep one, set TINYFLOW_TRACE=FILE and run the script)", file=sys.stderr)
        return _viz([str(trace), *_view_options(args)])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _diff(args: argparse.Namespace) -> int:
    for path in (args.a, args.b):
        _need_file(path)
    return _viz(["diff", args.a, args.b])


def _onnx_io() -> Any:
    try:
        from tinyflow import onnx_io
        onnx_io._onnx()
    except Exception as err:  # OnnxError: the onnx extra is missing
        raise CommandError(str(err)) from None
    return onnx_io


def _debug_onnx(args: argparse.Namespace) -> int:
    """Import MODEL.onnx, compile and run it for example inputs while recording, then
    open the record (or only write it, with --save)."""
    onnx_io = _onnx_io()
    out = args.save or str(Path(tempfile.mkdtemp(prefix="tinyflow-onnx-"))
                           / (Path(args.file).stem + ".tfdbg.json"))
    try:   # (--batch is checked by its argparse type; None: not given, so 1)
        onnx_io.record_model(args.file, out, batch=args.batch or 1)
    except tinyflow.TinyFlowError as err:
        raise CommandError(str(err)) from None
    print(f"tinyflow: record of {args.file} written to {out}", file=sys.stderr)
    return 0 if args.save else _viz([out])


# export's options that shape one kind of output: refused with another.
_EXPORT_ONLY = {"--after": "with --dot", "--all-nodes": "with --dot",
                "--run": "with --perfetto", "--opset": "with --onnx"}
_EXPORT_TARGETS = ("dot", "perfetto", "onnx", "tensorboard")


def _export(args: argparse.Namespace) -> int:
    _need_file(args.file)
    target = next(f"with --{name}" for name in _EXPORT_TARGETS
                  if getattr(args, name) is not None)
    _refuse_unused(args, {option: applies for option, applies in _EXPORT_ONLY.items()
                          if applies != target})
    if args.tensorboard is not None:
        return _export_tensorboard(args.file, args.tensorboard)
    if args.onnx is not None:
        return _export_onnx(args.file, args.onnx, args.opset)
    return _export_viz(args)


def _export_viz(args: argparse.Namespace) -> int:
    """--dot and --perfetto: `python -m viz export` draws and writes them."""
    command = ["export", args.file]
    if args.dot is not None:
        command += ["--dot", args.dot]
    else:
        command += ["--perfetto", args.perfetto]
    if args.after is not None:
        command += ["--after", args.after]
    if args.all_nodes:
        command.append("--all-nodes")
    if args.run is not None:
        command += ["--run", str(args.run)]
    return _viz(command)


def _export_onnx(path: str, out: str, opset: int | None) -> int:
    onnx_io = _onnx_io()
    opset = onnx_io.DEFAULT_OPSET if opset is None else opset
    try:
        onnx_io.check_opset(opset)
    except tinyflow.TinyFlowError as err:
        raise CommandError(f"--opset: {err}") from None
    try:
        onnx_io.export_record(path, out, opset=opset)
    except tinyflow.TinyFlowError as err:
        raise CommandError(str(err)) from None
    print(f"tinyflow: {out} written (the forward graph; a DebugRecord keeps no weights, so "
          "Variables are graph inputs)", file=sys.stderr)
    return 0


def _export_tensorboard(path: str, logdir: str) -> int:
    from tinyflow import tensorboard_export, trace
    try:
        written = tensorboard_export.write_scalars(trace.load(path), logdir)
    except trace.RecordError as err:
        raise CommandError(str(err)) from None
    series = ", ".join(f"{tag} ({n} points)" for tag, n in written.items())
    print(f"tinyflow: wrote {series} to {logdir} (view: tensorboard --logdir {logdir})",
          file=sys.stderr)
    return 0


def _launch(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise CommandError(f"launch -n must be >= 1, got {args.n}")
    _need_script(args.script)
    try:
        from tinyflow.allreduce import launch
    except ImportError as err:
        raise CommandError(f"launch needs tinyflow.allreduce, which failed to import: {err}"
                           ) from None
    if args.trace is not None:
        _check_path("--trace", args.trace, writable_file)
    extra = {} if args.trace is None else {"trace": args.trace}
    status = launch(args.n, args.script, list(args.script_args), **extra)
    return status if isinstance(status, int) else 0


# ----------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    # (imported here, not at the top: the training scripts import this module for its
    # argparse types and need no ONNX code)
    from tinyflow.onnx_io import DEFAULT_OPSET
    parser = argparse.ArgumentParser(
        prog="tinyflow", description="TinyFlow: train the small models, debug, export, "
        "launch data-parallel runs.")
    parser.add_argument("--version", action="version",
                        version=f"tinyflow {tinyflow.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    names = ", ".join(training_scripts()) or "none found"
    train = commands.add_parser(
        "train", help="run a training script from tutorials/",
        description=f"Run tutorials/train_NAME.py; the remaining arguments go to the "
        f"script (`tinyflow train mlp --help` shows them). Available: {names}.")
    train.add_argument("name", metavar="NAME", nargs="?")
    train.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    train.set_defaults(handler=_train)

    debug = commands.add_parser(
        "debug", help="open a DebugRecord in the terminal debugger",
        description="Open FILE (a DebugRecord) in the terminal debugger, or with --run "
        "run SCRIPT with tracing on and then open what it recorded. A FILE that is not a "
        "readable record is refused before the debugger starts.",
        epilog="exit status: 0 on success; 1 when --check found problems (listed on "
        "stdout) or the debugger could not open a record; 2 for a mistake on the command "
        "line or a FILE that cannot be opened (missing, a folder, not a record).")
    debug.add_argument("file", nargs="?", metavar="FILE")
    debug.add_argument("other", nargs="?", metavar="FILE_B",
                       help="a second record: compare FILE with it")
    debug.add_argument("--follow", action="store_true", help="follow a live record "
                       "(tinyflow train NAME --trace FILE --live writes one)")
    debug.add_argument("--view", choices=("graph", "timeline", "memory", "curves",
                                          "compare"), help="the view to open on")
    debug.add_argument("--theme", choices=("dark", "light"))
    debug.add_argument("--check-numerics", action="store_true",
                       help="with --run: trace values and stop at the first NaN/Inf")
    debug.add_argument("--run", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]",
                       help="run SCRIPT (with ARGS) recording a trace, then open it")
    debug.add_argument("--batch", type=positive_int, metavar="N", help="FILE.onnx only: "
                       "the size of the model's unknown (batch) dims (default 1)")
    debug.add_argument("--save", metavar="RECORD",
                       help="FILE.onnx only: write the record here instead of opening it")
    debug.add_argument("--check", action="store_true", help="check FILE against the "
                       "DebugRecord schema and print every problem (exit status 1 if any)")
    debug.set_defaults(handler=_debug)

    diff = commands.add_parser(
        "diff", help="what changed between two DebugRecords, as text",
        description="Compare record A with record B: graphs after each pass (nodes "
        "matched by op and source line, with the rewrites that explain each difference), "
        "memory plans, timelines per node, scalars.")
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")
    diff.set_defaults(handler=_diff)

    export = commands.add_parser(
        "export", help="export a DebugRecord as Graphviz DOT, Perfetto JSON, ONNX or TensorBoard",
        description="Export the DebugRecord FILE (exactly one target): its graph as a "
        "picture or Graphviz DOT (--dot), its timelines for Perfetto (--perfetto), its "
        "forward graph as ONNX (--onnx), its scalar series for TensorBoard "
        "(--tensorboard).")
    export.add_argument("file", metavar="FILE")
    target = export.add_mutually_exclusive_group(required=True)
    # Output paths are checked before anything is read or computed (writable_file).
    target.add_argument("--dot", metavar="OUT", type=dot_file,
                        help="write the graph: OUT.svg as an SVG picture (laid out by "
                        "Graphviz's dot, or graphviz-pure), OUT.dot or OUT.gv as DOT text")
    target.add_argument("--perfetto", metavar="OUT", type=writable_file,
                        help="write the timelines as Perfetto (chrome://tracing) JSON")
    target.add_argument("--onnx", metavar="OUT", type=writable_file, help="write the "
                        "forward graph as ONNX (Variables as inputs: a record keeps no "
                        "weights)")
    target.add_argument("--tensorboard", metavar="DIR", type=writable_folder,
                        help="write the scalar series (loss, ...) as TensorBoard event "
                        "files in DIR")
    export.add_argument("--opset", type=int, help="with --onnx: the ONNX opset (default "
                        f"{DEFAULT_OPSET})")
    export.add_argument("--after", metavar="PASS", help="with --dot: the graph after this "
                        "pass (default: the last)")
    export.add_argument("--all-nodes", action="store_true", help="with --dot: draw every "
                        "node (a graph of more than 400 is drawn as its folded overview)")
    export.add_argument("--run", type=int, metavar="N", help="with --perfetto: only the "
                        "recorded run N, counted as Python counts: 0 the first, -1 the "
                        "last, -2 the one before (default: every recorded run)")
    export.set_defaults(handler=_export)

    launch = commands.add_parser(
        "launch", help="run SCRIPT on N data-parallel ranks",
        description="Run SCRIPT on N ranks that average gradients with a ring allreduce.")
    launch.add_argument("-n", type=int, required=True, metavar="N", help="number of ranks")
    launch.add_argument("--trace", metavar="FILE", help="record every rank (local "
                        "processes) and merge them into one DebugRecord, a timeline lane "
                        "per rank and stream")
    launch.add_argument("script", metavar="SCRIPT")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    launch.set_defaults(handler=_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tinyflow` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except CommandError as err:
        parser.exit(2, f"tinyflow: error: {err}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
