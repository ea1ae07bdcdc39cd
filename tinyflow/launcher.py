"""Starting N ranks of one script: `launch`, and `init_communicator` inside each rank.

Data-parallel training runs one copy of the training script per rank. `launch` starts
them (mpiexec when MPI is installed, local processes otherwise; ``tinyflow launch -n N
script.py`` calls it), gives each rank's BLAS its share of the cores, and stops every
rank at the first failure, returning that rank's exit code. Inside each copy,
`init_communicator()` finds from the environment which transport (transports.py)
connects it to the others. A launcher that dies takes its ranks along
(PR_SET_PDEATHSIG), as torchrun's workers do.

allreduce.py re-exports `launch`, `init_communicator`, `find_mpiexec` and
`spawn_local`, where they first lived.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import numbers
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tinyflow.errors import ArgumentError, TinyFlowError
from tinyflow.transports import (
    ENV_ADDR,
    ENV_BOARD,
    ENV_RANK,
    ENV_SIZE,
    ENV_TIMEOUT,
    MPITransport,
    ProcessTransport,
    ThreadTransport,
    Transport,
    check_timeout,
    timeout_from_env,
)

BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def init_communicator(timeout: float | None = None) -> Transport:
    """The transport of this process, found from its environment:

    * started by `launch` without MPI (TINYFLOW_RANK is set): `ProcessTransport`;
    * started by mpiexec (PMI_RANK / OMPI_COMM_WORLD_RANK is set): `MPITransport`;
    * otherwise a world of one rank (the script runs alone; collectives are no-ops).

    `timeout` (default: $TINYFLOW_TIMEOUT, else 60 s) bounds every wait on a peer.
    """
    if timeout is None:
        timeout = timeout_from_env("init_communicator")
    else:
        timeout = check_timeout(timeout, "init_communicator")
    if ENV_RANK in os.environ:
        return ProcessTransport.from_env(timeout)
    if any(v in os.environ for v in MPI_RANK_VARIABLES):
        return MPITransport(timeout=timeout)
    return ThreadTransport.group_of(1, 60.0 if timeout is None else timeout)[0]


def find_mpiexec() -> str | None:
    """mpiexec next to this Python (the `mpich` wheel puts it in the venv's bin), else
    the first on PATH; None when there is none."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")


def _mpi_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None and find_mpiexec() is not None


def _mpiexec_command(mpiexec: str, n: int) -> list[str]:
    command = [mpiexec]
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        # Open MPI refuses root unless told, and refuses more ranks than cores.
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")
        command.append("--oversubscribe")
    return command + ["-n", str(n)]


def launch(n: int, script: str, args: Sequence[str] = (), use_mpi: bool | str = "auto",
           timeout: float | None = None, env: dict[str, str] | None = None,
           trace: str | None = None) -> int:
    """Run `python script args...` as `n` ranks; return 0 when all succeed.

    use_mpi  "auto": mpiexec when mpi4py and an mpiexec are installed, else local
             processes; True / False force one or the other.
    timeout  seconds each rank waits on a peer (sets TINYFLOW_TIMEOUT for the ranks)
    env      extra environment variables for the ranks
    trace    a DebugRecord path: each rank records itself (TINYFLOW_TRACE=
             trace.rank<r>.json), then the records are merged into one with a lane
             per rank and stream (rank_trace.merge_files). Local processes only.

    With local processes, each rank gets TINYFLOW_RANK / _SIZE / _ADDR (a fresh socket
    directory) and builds its transport with `init_communicator()`. Each rank's BLAS
    gets cores/n threads unless OMP_NUM_THREADS & co. are already set. If a rank exits
    with an error, the others are terminated and its exit code is returned (a rank
    killed by a signal gives 128 + signal). mpiexec does the same for MPI jobs.
    This is what ``tinyflow launch -n N script.py`` calls.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ArgumentError(f"launch: n must be a whole number of ranks >= 1, got {n!r}")
    if not (isinstance(use_mpi, bool) or use_mpi == "auto"):
        raise ArgumentError(f"launch: use_mpi must be True, False or 'auto', got {use_mpi!r}")
    if timeout is not None:
        timeout = check_timeout(timeout, "launch")
    if not Path(script).exists():
        raise FileNotFoundError(f"launch: no script {script!r}")
    child_env = _rank_environment(n, env, timeout)
    if timeout is None:  # a bad inherited $TINYFLOW_TIMEOUT: one error here, not one per rank
        timeout_from_env("launch", child_env)
    if use_mpi == "auto":
        use_mpi = _mpi_available() and trace is None
    if use_mpi and trace is not None:
        raise TinyFlowError("launch(trace=...) records local processes; with MPI, "
                            "record each rank yourself (tf.debug.record)")
    if use_mpi:
        return _launch_mpi(n, script, args, child_env)
    argv = [sys.executable, script, *map(str, args)]
    if trace is None:
        return _launch_local(n, argv, child_env)
    return _launch_traced(n, argv, child_env, trace, Path(script).name)


def _rank_environment(n: int, env: dict[str, str] | None, timeout: float | None
                      ) -> dict[str, str]:
    """The ranks' environment: ours, `env`, a BLAS share of the cores, the timeout."""
    child_env = {**os.environ, **(env or {})}
    # N ranks share the machine's cores: give each rank's BLAS its share, unless the
    # user chose (torchrun does the same). Oversubscribed BLAS threads spin and wait
    # on each other, which made a small model's step 15x slower on a loaded 2 cores.
    for variable in BLAS_THREAD_VARIABLES:
        child_env.setdefault(variable, str(max(1, (os.cpu_count() or 1) // n)))
    if timeout is not None:
        child_env[ENV_TIMEOUT] = str(timeout)
    return child_env


def _launch_mpi(n: int, script: str, args: Sequence[str], child_env: dict[str, str]) -> int:
    """`n` ranks under mpiexec; returns mpiexec's exit status."""
    mpiexec = find_mpiexec()
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        raise TinyFlowError("launch(use_mpi=True) needs mpi4py and an mpiexec: "
                            "pip install 'tinyflow[dist]'")
    for variable in (ENV_RANK, ENV_SIZE, ENV_ADDR):
        child_env.pop(variable, None)  # the ranks must pick MPI, not sockets
    # `python -m mpi4py script` turns an uncaught exception or a non-zero exit
    # into MPI_Abort, so mpiexec stops every rank at once (a plain exit would
    # finalize MPI cleanly and leave the others waiting for their timeout).
    argv = [sys.executable, "-m", "mpi4py", script, *map(str, args)]
    # The ranks' wait board (who waits for whom), so a timeout names the late rank.
    board = tempfile.mkdtemp(prefix="tinyflow-board-")
    try:
        with _signals_noted() as signals:
            process = subprocess.Popen(_mpiexec_command(mpiexec, n) + argv,
                                       env={**child_env, ENV_BOARD: board},
                                       preexec_fn=_die_with_parent())
            try:
                while (code := process.poll()) is None:
                    if signals:
                        return 128 + signals[0]
                    time.sleep(POLL_SECONDS)
                return code
            finally:
                _stop([process])  # a SIGTERM to us: mpiexec stops its ranks on SIGTERM
    finally:
        shutil.rmtree(board, ignore_errors=True)


def _launch_traced(n: int, argv: Sequence[str], child_env: dict[str, str], trace: str,
                   script_name: str) -> int:
    """Local ranks that each record a DebugRecord, merged into `trace` at the end."""
    parts = [f"{trace}.rank{r}.json" for r in range(n)]
    status = _launch_local(n, argv, child_env,
                           [{"TINYFLOW_TRACE": part} for part in parts])
    written = [p for p in parts if Path(p).exists()]
    if len(written) == n:
        from tinyflow.rank_trace import merge_files  # (it needs trace.py; launch not)
        merge_files(written, trace, title=f"{script_name} on {n} ranks")
        for part in written:
            os.unlink(part)
    return status


# A launcher that dies must take its ranks along. SIGTERM (and Ctrl-C) to the launcher
# end in its `finally`, which stops the ranks and removes the socket folder; SIGKILL
# cannot be caught, so each child asks the kernel for a signal when its parent dies
# (Linux's PR_SET_PDEATHSIG, as torchrun's workers and Kubernetes' tini do). The
# child gets SIGTERM, so that a rank removes its own socket-folder files on the way
# out and mpiexec stops its proxies and ranks.
PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int = signal.SIGTERM) -> Any:
    """A `preexec_fn` for Popen: the child gets `sig` when this process dies (Linux;
    None elsewhere, where only the SIGTERM path below applies)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # looked up before fork, not in the child
    parent = os.getpid()

    def in_child() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before prctl: go at once
            os._exit(128 + int(sig))
    return in_child


# How often the launcher looks at its ranks (and at signals noted meanwhile).
POLL_SECONDS = 0.02


@contextlib.contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """Within the block, SIGTERM and Ctrl-C (SIGINT) are noted in the list it yields
    instead of ending the process; the wait loops look at it and stop the ranks,
    returning 128 + the signal. (Main thread only: Python runs handlers there.)

    The handler only notes: it used to raise, and an exception that arrives inside
    Popen.poll between its lock's acquire and its `try` leaves that lock held, so
    the next wait() on the rank blocked forever: the launcher hung, its ranks dead
    but never reaped."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return

    def note(signum: int, frame: Any) -> None:
        noted.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def spawn_local(n: int, argv: Sequence[str], env: dict[str, str] | None = None,
                addr: str | None = None, rank_env: Sequence[dict[str, str]] | None = None
                ) -> tuple[list[subprocess.Popen], str]:
    """Start `argv` as n local ranks wired for `ProcessTransport` (returns the processes
    and the socket directory, which the caller removes). `launch` is built on it.
    `rank_env[r]`, if given, is added to rank r's environment."""
    addr = addr or tempfile.mkdtemp(prefix="tinyflow-ranks-")
    base = {**os.environ, **(env or {})}
    procs = [subprocess.Popen(list(argv), env={**base, **(rank_env[rank] if rank_env else {}),
                                               ENV_RANK: str(rank), ENV_SIZE: str(n),
                                               ENV_ADDR: addr},
                              preexec_fn=_die_with_parent())
             for rank in range(n)]
    return procs, addr


def _launch_local(n: int, argv: Sequence[str], env: dict[str, str],
                  rank_env: Sequence[dict[str, str]] | None = None) -> int:
    with _signals_noted() as signals:
        procs, addr = spawn_local(n, argv, env, rank_env=rank_env)
        return _watch(procs, addr, signals)


def _watch(procs: Sequence[subprocess.Popen], addr: str, signals: list[int]) -> int:
    """Wait for the ranks; stop them all at the first failure (or when a signal was
    noted: Ctrl-C, SIGTERM) and remove the socket folder."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if all(c == 0 for c in codes):
                return 0
            if signals:
                return 128 + signals[0]
            time.sleep(POLL_SECONDS)
    finally:
        _stop(procs)
        shutil.rmtree(addr, ignore_errors=True)


def _stop(procs: Sequence[subprocess.Popen], grace: float = 3.0) -> None:
    """Terminate the ranks still running (SIGTERM, then SIGKILL after `grace` s)."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
