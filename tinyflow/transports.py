"""Transports: how one rank's bytes reach another, for the collectives in allreduce.py.

A collective algorithm (ring allreduce, broadcast) is written once against a tiny
interface, the one MPI's point-to-point layer offers:

    comm.rank, comm.size        who am I, how many of us
    comm.sendrecv(array, dst, out, src, tag)
                                send `array` to rank `dst` while receiving rank
                                `src`'s message into `out` (either half may be None)
    comm.exchange(sends, recvs, tag)
                                the general form: several (dst, array) sends and
                                (src, out) receives at once (a tree node's children)
    comm.send(dst, array, tag), comm.recv(src, out, tag)
    comm.bytes_sent             payload bytes this rank has sent so far
    comm.xp                     the array module the transport moves (numpy, cupy)

`sendrecv` is the primitive, not `send` then `recv`: in a ring every rank sends to
its right neighbour while its left neighbour sends to it. If every rank first sent a
large message and only then received, a transport that cannot buffer the whole
message (a socket, MPI's rendezvous protocol) would deadlock, each rank waiting for a
receiver that is itself still sending.

Every message carries a `tag` naming the collective and its array ("allreduce of 10
float32"). Transports that frame messages compare tag, dtype and byte count with what
the receiver expects, so ranks that disagree (one reduces 10 elements, another 12)
get a `CollectiveError` that says so, rather than garbage or a hang. A tag travels
as a fixed-size digest of the whole tag (what is compared, however long the tag)
and a readable prefix (what error messages show). Every wait has a
deadline (`timeout` seconds): a peer that died or stopped answering is named in the
error instead of hanging the job. The rank named is the one that is actually late:
while a rank waits it posts "rank r waits for rank s" on a shared `WaitBoard` (a
dict for threads, small files in the socket folder for processes and in a folder
`tinyflow launch` gives MPI ranks), and a rank that
gives up follows that wait-for chain (rank 0 waits for 2, which waits for 1, which
waits for nobody: rank 1 is late), as deadlock detectors walk a wait-for graph.

Four transports, from the lesson to the real engines:

* `ThreadTransport`: N ranks as threads of one process, a queue per pair of ranks
  (the lesson and test transport); `run_threads(n, fn)` runs fn(comm) on N threads.
* `ProcessTransport`: ranks as processes on one machine, a full mesh of Unix-domain
  stream sockets (the kernel copies at memory speed; a dead peer shows up at once as
  a closed connection). `tinyflow launch` starts the processes.
* `MPITransport`: mpi4py's nonblocking Isend/Irecv of numpy buffers, the engine for
  many machines (Horovod's first transport was MPI too).
* `NCCLTransport`: NVIDIA's NCCL point-to-point send/recv of CuPy arrays (GPUDirect
  between GPUs), grouped so both halves of a ring step run at once.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import os
import queue
import select
import signal
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tinyflow.errors import ArgumentError, TinyFlowError

DEFAULT_TIMEOUT = 60.0
# Ranks are processes started one after another, each importing numpy and tinyflow
# first (a second or more on a busy machine), so connecting waits at least this long
# even when collectives time out sooner: a short `timeout` is for late peers, not for
# slow starts.
CONNECT_TIMEOUT = 30.0
ENV_RANK, ENV_SIZE, ENV_ADDR, ENV_TIMEOUT = (
    "TINYFLOW_RANK", "TINYFLOW_SIZE", "TINYFLOW_ADDR", "TINYFLOW_TIMEOUT")
# The folder MPI ranks share as their wait board (`tinyflow launch` makes one).
ENV_BOARD = "TINYFLOW_WAIT_BOARD"


class CollectiveError(TinyFlowError, RuntimeError):
    """A collective failed: a peer died, stopped answering within the timeout, or the
    ranks disagree on the operation, the array size or the dtype.

    `peer` is the rank this rank was talking to, `operation` the collective (the
    first word of the message tag, e.g. "allreduce").
    """

    def __init__(self, message: str, peer: int | None = None,
                 operation: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.operation = operation


def check_timeout(timeout: Any, where: str, name: str = "timeout") -> float:
    """`timeout` as float seconds, or an ArgumentError naming `name` and the value.
    A deadline must be positive and finite: 0 or less fails a healthy wait at once
    (blaming a peer that is not late), inf or nan would never end a dead one."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer,
                                                             np.floating)):
        raise ArgumentError(f"{where}: {name} must be a number of seconds, got {timeout!r}")
    if not 0 < float(timeout) < math.inf:
        raise ArgumentError(f"{where}: {name} must be a positive, finite number of "
                            f"seconds, got {timeout!r}")
    return float(timeout)


def timeout_from_env(where: str, environ: Any = os.environ) -> float | None:
    """$TINYFLOW_TIMEOUT as seconds (None when unset), or an ArgumentError naming the
    variable and its text (a raw ValueError in every rank named nothing)."""
    text = environ.get(ENV_TIMEOUT)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # refused just below, with the text as it was written
    if not 0 < value < math.inf:
        raise ArgumentError(f"{where}: {ENV_TIMEOUT}={text!r} is not a positive, finite "
                            "number of seconds")
    return value


def _operation(tag: str) -> str:
    return tag.split(" ", 1)[0] if tag else "message"


# A tag travels as a readable prefix (for messages) and a digest of the whole tag
# (for the check): both of fixed size, so a socket header holds any tag, and two
# tags that differ only past the prefix still differ.
TAG_PREFIX_BYTES = 64
TAG_DIGEST_BYTES = 16


@functools.lru_cache(maxsize=256)
def wire_tag(tag: str) -> tuple[str, bytes]:
    """(readable prefix, digest) of `tag`: the prefix is the tag itself when it fits
    in TAG_PREFIX_BYTES, else its start and "...". (Remembered: a ring sends the same
    tag 2(N-1) times per call.)"""
    raw = tag.encode()
    digest = hashlib.blake2b(raw, digest_size=TAG_DIGEST_BYTES).digest()
    if len(raw) > TAG_PREFIX_BYTES:  # (a character cut in two is dropped: "ignore")
        return raw[:TAG_PREFIX_BYTES - 3].decode(errors="ignore") + "...", digest
    return tag, digest


def _dtype_text(dtype: Any) -> str:
    """The dtype's name, with its byte order when not native: float32 and '>f4' have
    the same name, and "float32 ... expected float32" hid the difference."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.isnative else f"{dtype.name} ({dtype.str})"


def _describe(tag: str, dtype: str, nbytes: int) -> str:
    return f"'{wire_tag(tag)[0]}' ({nbytes} bytes of {_dtype_text(dtype)})"


class WaitBoard:
    """Who waits for whom: rank -> (peer, tag, state), state "waiting" while the
    wait lasts and "gave up" after it timed out (kept, so that ranks still waiting
    on a rank that gave up can follow the chain past it). This base keeps the
    entries in a dict shared by the thread ranks of one process."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[int, str, str]] = {}

    def post(self, rank: int, peer: int, tag: str, state: str = "waiting") -> None:
        self.entries[rank] = (peer, tag, state)

    def clear(self, rank: int) -> None:
        self.entries.pop(rank, None)

    def read(self, rank: int) -> tuple[int, str, str] | None:
        return self.entries.get(rank)


class FileWaitBoard(WaitBoard):
    """The same board for processes: one small file per waiting rank in a folder
    the ranks share (the launcher's socket folder). Posts are rare (only waits that
    last longer than `ProcessTransport.POST_AFTER`), so files cost nothing per step."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def _file(self, rank: int) -> str:
        return os.path.join(self.folder, f"wait{rank}")

    def post(self, rank, peer, tag, state="waiting"):
        temporary = self._file(rank) + ".new"
        try:
            with open(temporary, "w") as f:
                f.write(f"{peer}\n{state}\n{tag}")
            os.replace(temporary, self._file(rank))  # readers never see half a file
        except OSError:
            pass  # the folder is gone (the launcher is cleaning up): nothing to tell

    def clear(self, rank):
        try:
            os.unlink(self._file(rank))
        except OSError:
            pass

    def read(self, rank):
        try:
            with open(self._file(rank)) as f:
                peer, state, tag = f.read().split("\n", 2)
            return int(peer), tag, state
        except (OSError, ValueError):
            return None


def wait_chain(board: WaitBoard | None, me: int, peer: int) -> list[int]:
    """[peer, the rank peer waits for, the rank that one waits for, ...], stopping at
    a rank that waits for nobody (the late one) or at a cycle (ranks waiting for each
    other, or for `me`: then `peer` itself is the one to name)."""
    chain = [peer]
    while board is not None:
        entry = board.read(chain[-1])
        if entry is None:
            break
        if entry[0] == me or entry[0] in chain:
            return [peer]
        chain.append(entry[0])
    return chain


def _through(chain: list[int]) -> str:
    """", which waits for rank 1" for a chain [2, 1] (empty for a chain of one)."""
    return "".join(f", which waits for rank {r}" for r in chain[1:])


class Transport:
    """The interface every transport implements (see the module docstring).

    Subclasses implement `sendrecv`; `send` and `recv` are its halves. After any
    error the transport is broken (a message may be half sent) and refuses further
    use, naming the first failure.
    """

    xp: Any = np

    def __init__(self, rank: int, size: int, timeout: float | None = DEFAULT_TIMEOUT
                 ) -> None:
        if size < 1:
            raise ValueError(f"{type(self).__name__}: a group needs at least one rank, "
                             f"got size {size}")
        if not 0 <= rank < size:
            raise ValueError(f"{type(self).__name__}: rank {rank} is not in 0..{size - 1}")
        self.rank = rank
        self.size = size
        self.timeout = (DEFAULT_TIMEOUT if timeout is None
                        else check_timeout(timeout, type(self).__name__))
        self.bytes_sent = 0
        # When a list, ring_allreduce appends one record per ring step to it (the
        # data-parallel allreduce op passes it on, so a training step can show the
        # ring turning). None: record nothing.
        self.trace: list[dict] | None = None
        self._broken: str | None = None
        # Where this rank posts whom it waits for (None: the transport has no shared
        # place, e.g. MPI; a timeout then names the direct peer).
        self.board: WaitBoard | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"

    def sendrecv(self, array: Any | None, dst: int | None, out: Any | None,
                 src: int | None, tag: str = "") -> None:
        """Send `array` to `dst` and receive into `out` from `src`, concurrently.

        Either half may be None. `out` must be contiguous with the dtype and size of
        the message expected; `tag` names the collective, for checks and errors.
        Raises CollectiveError on a timeout, a dead peer or a mismatch.
        """
        self.exchange([] if array is None else [(dst, array)],
                      [] if out is None else [(src, out)], tag)

    def exchange(self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]],
                 tag: str = "") -> None:
        """Send each (dst, array) and receive each (src, out), all concurrently; return
        when all are done. The general form of `sendrecv`, for collectives whose rank
        talks to several peers at once (a tree node receives from both children).
        Two messages between the same pair of ranks in one call travel in list order
        on both sides (as MPI's non-overtaking rule guarantees).
        """
        raise NotImplementedError

    def send(self, dst: int, array: Any, tag: str = "") -> None:
        self.sendrecv(array, dst, None, None, tag)

    def recv(self, src: int, out: Any, tag: str = "") -> None:
        self.sendrecv(None, None, out, src, tag)

    def close(self) -> None:
        """Release connections (a no-op for transports that hold none)."""

    # -- helpers shared by the transports --------------------------------------------
    def _check_usable(self, tag: str) -> None:
        if self._broken is not None:
            raise CollectiveError(f"{_operation(tag)} on rank {self.rank}: this transport "
                                  f"failed earlier and cannot be used again ({self._broken})",
                                  operation=_operation(tag))

    def _fail(self, message: str, peer: int | None, tag: str) -> CollectiveError:
        """Mark the transport broken; return the error for the caller to raise."""
        self._broken = message
        return CollectiveError(message, peer=peer, operation=_operation(tag))

    def _check_header(self, src: int, got: tuple[str, bytes, str, int], out: Any,
                      tag: str) -> None:
        """Compare an incoming message's (tag prefix, tag digest, dtype, nbytes), as
        `wire_tag` and the sender made them, with what `out` and `tag` expect."""
        their_prefix, their_digest, their_dtype, their_nbytes = got
        if (their_digest != wire_tag(tag)[1] or their_dtype != out.dtype.str
                or their_nbytes != out.nbytes):
            mine = _describe(tag, out.dtype.str, out.nbytes)
            theirs = _describe(their_prefix, their_dtype, their_nbytes)
            raise self._fail(
                f"{_operation(tag)}: rank {src} sent {theirs} but rank {self.rank} expected "
                f"{mine}: the ranks disagree on the operation, the array size or the dtype",
                src, tag)

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _timed_out(self, peer: int, tag: str, how: str = "") -> CollectiveError:
        """The error for a wait on `peer` that reached the deadline. It names the
        rank at the end of the wait-for chain (the one actually late) and posts that
        this rank gave up, so ranks waiting on it can follow the chain too."""
        chain = wait_chain(self.board, self.rank, peer)
        if self.board is not None:
            self.board.post(self.rank, peer, tag, "gave up")
        late = chain[-1]
        return self._fail(
            f"{_operation(tag)}: rank {self.rank} waited {self.timeout:g} s for rank "
            f"{peer}{how}{_through(chain)}: rank {late} is late (it stopped answering or "
            f"never joined '{tag}')", late, tag)

    def _late_behind(self, peer: int) -> list[int]:
        """The wait-for chain past `peer` when peer failed because it gave up waiting
        (then the rank it waited for is the cause), else just [peer]."""
        entry = self.board.read(peer) if self.board is not None else None
        if entry is None or entry[2] != "gave up":
            return [peer]
        return [peer] + wait_chain(self.board, self.rank, entry[0])


def _contiguous(array: Any) -> Any:
    if not array.flags.c_contiguous:
        raise ValueError("transports move C-contiguous arrays only "
                         f"(got strides {array.strides})")
    return array


# ----------------------------------------------------------------------------------
# Threads: N ranks in one process
# ----------------------------------------------------------------------------------

class ThreadGroup:
    """What the ranks of one thread group share: a mailbox (queue) per ordered pair of
    ranks, and who has failed (so a peer's death is reported at once, not at the
    timeout)."""

    def __init__(self, size: int, timeout: float | None) -> None:
        self.size = size
        self.mailboxes = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.failed: dict[int, str] = {}
        self.board = WaitBoard()
        self.comms = [ThreadTransport(self, rank, timeout) for rank in range(size)]

    def fail(self, rank: int, why: str) -> None:
        self.failed.setdefault(rank, why)


class ThreadTransport(Transport):
    """One rank of a group of threads. Make a group with `ThreadTransport.group(n)`.

    A send copies the array into the receiver's mailbox (so the sender may reuse its
    buffer at once, as with a real network); a receive takes the next message from
    the sender's mailbox, waiting at most `timeout` seconds.
    """

    POLL = 0.02  # seconds between checks of the group's failures while waiting

    def __init__(self, group: ThreadGroup, rank: int, timeout: float | None) -> None:
        super().__init__(rank, group.size, timeout)
        self.group = group
        self.board = group.board

    def _fail(self, message: str, peer: int | None, tag: str) -> CollectiveError:
        # A broken rank is a failed rank for its peers: their waits on it end now.
        self.group.fail(self.rank, message)
        return super()._fail(message, peer, tag)

    @staticmethod
    def group_of(size: int, timeout: float | None = DEFAULT_TIMEOUT
                 ) -> list[ThreadTransport]:
        """`size` connected ranks, one transport per rank (give each to one thread)."""
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ArgumentError(f"ThreadTransport.group_of: size must be a whole number "
                                f"of ranks >= 1, got {size!r}")
        if timeout is not None:  # (None: the default, as for every transport)
            timeout = check_timeout(timeout, "ThreadTransport.group_of")
        return ThreadGroup(size, timeout).comms

    def exchange(self, sends, recvs, tag=""):
        self._check_usable(tag)
        for dst, array in sends:  # a send never blocks: the mailbox holds a copy
            array = _contiguous(array)
            # The header the socket transport sends, so both check alike.
            message = (*wire_tag(tag), array.dtype.str, array.nbytes, array.copy())
            self.group.mailboxes[(self.rank, dst)].put(message)
            self.bytes_sent += array.nbytes
        for src, out in recvs:
            *header, payload = self._take(src, tag)
            self._check_header(src, tuple(header), out, tag)
            out.reshape(-1)[...] = payload.reshape(-1)

    def _take(self, src: int, tag: str) -> tuple:
        mailbox = self.group.mailboxes[(src, self.rank)]
        try:
            return mailbox.get_nowait()
        except queue.Empty:
            pass
        deadline = self._deadline()
        self.board.post(self.rank, src, tag)
        while True:
            try:
                message = mailbox.get(timeout=self.POLL)
                self.board.clear(self.rank)
                return message
            except queue.Empty:
                pass
            if src in self.group.failed:
                chain = self._late_behind(src)
                raise self._fail(f"{_operation(tag)}: rank {src} failed while rank "
                                 f"{self.rank} waited for its message "
                                 f"({self.group.failed[src]})"
                                 + (f"; rank {chain[-1]} is late" if len(chain) > 1 else ""),
                                 chain[-1], tag)
            if time.monotonic() > deadline:
                raise self._timed_out(src, tag)


def run_threads(ranks: int | Sequence[ThreadTransport], fn: Callable[[ThreadTransport], Any],
                timeout: float | None = DEFAULT_TIMEOUT) -> list[Any]:
    """Run fn(comm) on one thread per rank; return the results in rank order.

    `ranks` is a number of ranks or a group made by `ThreadTransport.group_of` (to
    build per-rank graphs before the threads start). If any rank raises, the others
    are told (their waits on it end at once) and the first error raised, in time, is
    re-raised here with a note naming its rank: it is the cause, the others followed.
    """
    if timeout is not None:
        timeout = check_timeout(timeout, "run_threads")
    comms = ThreadTransport.group_of(ranks, timeout) if isinstance(ranks, int) else list(ranks)
    results: list[Any] = [None] * len(comms)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(comm: ThreadTransport) -> None:
        try:
            results[comm.rank] = fn(comm)
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            with lock:
                errors.append((comm.rank, err))
            comm.group.fail(comm.rank, f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=body, args=(c,), name=f"tinyflow-rank{c.rank}",
                                daemon=True) for c in comms]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        rank, err = errors[0]
        err.add_note(f"(raised on rank {rank} of {len(comms)} threads)")
        raise err
    return results


# ----------------------------------------------------------------------------------
# Processes on one machine: Unix-domain sockets
# ----------------------------------------------------------------------------------

# Each message: a fixed header (the tag's readable prefix and digest, dtype, payload
# bytes), then the payload.
HEADER = struct.Struct(f"!{TAG_PREFIX_BYTES}s{TAG_DIGEST_BYTES}s8sQ")
HELLO = struct.Struct("!I")  # the first bytes on a new connection: the caller's rank
SOCKET_BUFFER = 4 << 20      # bigger kernel buffers: fewer wake-ups per megabyte
# A Unix socket's address holds 108 bytes on Linux and 104 on macOS (sun_path), so a
# long TMPDIR makes `addr/rank<r>.sock` too long to bind. On Linux the folder can be
# named through a descriptor (/proc/self/fd/N/rank<r>.sock), short whatever its path.
SUN_PATH_MAX = 104


def _pack_header(tag: str, array: Any) -> bytes:
    prefix, digest = wire_tag(tag)
    return HEADER.pack(prefix.encode(), digest, array.dtype.str.encode(), array.nbytes)


def _unpack_header(raw: bytes) -> tuple[str, bytes, str, int]:
    prefix, digest, dtype, nbytes = HEADER.unpack(raw)
    return (prefix.rstrip(b"\0").decode(errors="replace"), digest,
            dtype.rstrip(b"\0").decode(), nbytes)


def _byte_view(array: np.ndarray) -> memoryview:
    """The array's memory as a flat memoryview of bytes (what sockets read and write)."""
    return memoryview(array.reshape(-1).view(np.uint8))


class _Outgoing:
    """A message being written to a socket: header, then payload, as memoryviews."""

    def __init__(self, header: bytes, array: Any) -> None:
        self.parts = [p for p in (memoryview(header), _byte_view(array)) if len(p)]

    def progress(self, sock: socket.socket) -> None:
        """Write as much as the socket takes now (raises BlockingIOError when full)."""
        while self.parts:
            sent = sock.send(self.parts[0])
            self.parts[0] = self.parts[0][sent:]
            if not len(self.parts[0]):
                self.parts.pop(0)

    @property
    def done(self) -> bool:
        return not self.parts


class _Incoming:
    """A message being read from a socket: the header first, checked, then the
    payload straight into the caller's `out` (no intermediate copy)."""

    def __init__(self, out: Any, check: Callable[[tuple], None]) -> None:
        self.header = bytearray(HEADER.size)
        self.view = memoryview(self.header)
        self.out = out
        self.check = check
        self.in_header = True

    def progress(self, sock: socket.socket) -> None:
        """Read what has arrived (raises BlockingIOError when nothing more has, and
        ConnectionResetError when the peer closed the connection)."""
        while not self.done:
            got = sock.recv_into(self.view)
            if got == 0:
                raise ConnectionResetError("the connection was closed by the peer")
            self.view = self.view[got:]
            if self.in_header and not len(self.view):
                self.in_header = False
                self.check(_unpack_header(bytes(self.header)))
                self.view = _byte_view(self.out)

    @property
    def done(self) -> bool:
        return not self.in_header and not len(self.view)


class ProcessTransport(Transport):
    """Ranks as processes on one machine, over a full mesh of Unix-domain sockets.

    `addr` is a directory shared by the ranks (`tinyflow launch` makes a fresh one).
    Each rank listens on ``addr/rank<r>.sock``, connects to every lower rank and
    accepts every higher one. Sockets are nonblocking; `sendrecv` moves both
    messages as far as the sockets allow, then waits in `select` until one can move
    again, until both are done or the deadline passes.
    A peer that dies closes its sockets, so the others fail at once, naming it.
    """

    POST_AFTER = 0.05  # seconds a wait lasts before it is posted on the wait board

    def __init__(self, rank: int, size: int, addr: str,
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
        super().__init__(rank, size, timeout)
        self.addr = addr
        self.peers: dict[int, socket.socket] = {}
        self._folder_fd: int | None = None  # open only while connecting (long paths)
        self.board = FileWaitBoard(addr)
        _clean_up_on_sigterm(self)
        self._connect()

    @classmethod
    def from_env(cls, timeout: float | None = None) -> ProcessTransport:
        """The transport of a process started by `launch` (TINYFLOW_RANK, _SIZE, _ADDR
        and, optionally, _TIMEOUT in the environment)."""
        missing = [v for v in (ENV_RANK, ENV_SIZE, ENV_ADDR) if v not in os.environ]
        if missing:
            raise TinyFlowError(f"ProcessTransport.from_env: {', '.join(missing)} not set; "
                                "start the script with `tinyflow launch -n N script.py`")
        if timeout is None:
            timeout = timeout_from_env("ProcessTransport.from_env")
        size = _env_int(ENV_SIZE, 1)
        return cls(_env_int(ENV_RANK, 0, size - 1), size, os.environ[ENV_ADDR], timeout)

    def _path(self, rank: int) -> str:
        return os.path.join(self.addr, f"rank{rank}.sock")

    @property
    def connect_timeout(self) -> float:
        """Seconds the ranks have to find each other (see CONNECT_TIMEOUT)."""
        return max(self.timeout, CONNECT_TIMEOUT)

    def _address(self, rank: int) -> str:
        """The address to bind or connect for `rank`'s socket: its path, or the same
        file named through a descriptor of the folder when the path is too long."""
        path = self._path(rank)
        if len(os.fsencode(path)) < SUN_PATH_MAX:
            return path
        if self._folder_fd is None:
            if not os.path.isdir("/proc/self/fd"):
                raise TinyFlowError(
                    f"ProcessTransport: the socket path {path} is longer than the "
                    f"{SUN_PATH_MAX} bytes a Unix socket address holds; set TMPDIR "
                    "to a shorter folder")
            self._folder_fd = os.open(self.addr, os.O_RDONLY)
        return f"/proc/self/fd/{self._folder_fd}/rank{rank}.sock"

    def _connect(self) -> None:
        try:
            self._connect_all()
        finally:
            if self._folder_fd is not None:
                os.close(self._folder_fd)
                self._folder_fd = None

    def _connect_all(self) -> None:
        deadline = time.monotonic() + self.connect_timeout
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self._address(self.rank))
        listener.listen(self.size)
        try:
            # Connecting needs no accept on the other side (the listen backlog holds
            # the connection), so "connect down, then accept up" cannot deadlock.
            for peer in range(self.rank):
                sock = self._dial(peer, deadline)
                sock.sendall(HELLO.pack(self.rank))
                self.peers[peer] = sock
            while len(self.peers) < self.size - 1:
                listener.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    missing = sorted(set(range(self.size)) - set(self.peers) - {self.rank})
                    raise self._fail(f"connect: ranks {missing} did not connect to rank "
                                     f"{self.rank} within {self.connect_timeout:g} s",
                                     missing[0], "connect") from None
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                (peer,) = HELLO.unpack(_recv_exactly(sock, HELLO.size))
                self.peers[peer] = sock
        finally:
            listener.close()
            os.unlink(self._path(self.rank))
        for sock in self.peers.values():
            sock.setblocking(False)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)

    def _dial(self, peer: int, deadline: float) -> socket.socket:
        """Connect to `peer`'s socket, retrying until it exists (it may start later)."""
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self._address(peer))
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise self._fail(f"connect: rank {peer} did not listen at "
                                     f"{self._path(peer)} within {self.connect_timeout:g} s",
                                     peer, "connect") from None
                time.sleep(0.01)

    def exchange(self, sends, recvs, tag=""):
        self._check_usable(tag)
        jobs = self._jobs(sends, recvs, tag)
        deadline, posted = self._deadline(), False
        while True:
            jobs = self._progress(jobs, tag)
            if not jobs:
                break
            posted = self._wait(_first_per_stream(jobs), deadline, posted, tag)
        if posted:
            self.board.clear(self.rank)
        self.bytes_sent += sum(array.nbytes for _, array in sends)

    def _jobs(self, sends, recvs, tag: str) -> list[tuple]:
        """(socket, message, peer) per message; with two ranks a sendrecv's two halves
        share one socket (one direction each)."""
        jobs = [(self.peers[dst], _Outgoing(_pack_header(tag, _contiguous(array)), array),
                 dst) for dst, array in sends]
        for src, out in recvs:
            check = functools.partial(self._check_header, src, out=out, tag=tag)
            jobs.append((self.peers[src], _Incoming(_contiguous(out), check), src))
        return jobs

    def _progress(self, jobs: list[tuple], tag: str) -> list[tuple]:
        """Move what can move without waiting (small messages finish right here);
        returns the jobs not done yet."""
        for sock, message, peer in _first_per_stream(jobs):
            try:
                message.progress(sock)
            except BlockingIOError:
                pass  # the socket is full (sending) or empty (receiving) for now
            except OSError as err:
                raise self._lost(peer, tag, err) from None
        return [job for job in jobs if not job[1].done]

    def _wait(self, active: list[tuple], deadline: float, posted: bool, tag: str) -> bool:
        """Wait until a socket of `active` can move; returns whether this rank's wait
        is posted on the board. Raises CollectiveError at the deadline."""
        readers = [sock for sock, message, _ in active if isinstance(message, _Incoming)]
        writers = [sock for sock, message, _ in active if isinstance(message, _Outgoing)]
        left = max(deadline - time.monotonic(), 0)
        # Most waits are short; only one that outlasts POST_AFTER is posted on
        # the board (a file write), so that a late rank can be traced through it.
        ready = select.select(readers, writers, [], left if posted else
                              min(left, self.POST_AFTER))
        if any(ready):
            return posted
        if not posted and left > self.POST_AFTER:
            self.board.post(self.rank, _awaited(active), tag)
            return True
        raise self._timed_out(_awaited(active), tag)

    def _lost(self, peer: int, tag: str, err: OSError) -> CollectiveError:
        chain = self._late_behind(peer)
        if len(chain) > 1:  # it gave up waiting on someone: name that rank
            why = (f"rank {peer} gave up waiting{_through(chain)}: rank {chain[-1]} "
                   "is late")
        else:
            why = f"rank {peer} has probably died"
        return self._fail(f"{_operation(tag)}: lost the connection to rank {peer} during "
                          f"'{tag}' ({err}); {why}", chain[-1], tag)

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.peers.clear()


def _first_per_stream(jobs: list[tuple]) -> list[tuple]:
    """The first unfinished message per (socket, direction): messages that share a
    socket and direction must go one after another, or their bytes would interleave."""
    seen, first = set(), []
    for job in jobs:
        key = (job[0].fileno(), isinstance(job[1], _Incoming))
        if key not in seen:
            seen.add(key)
            first.append(job)
    return first


def _awaited(jobs: list[tuple]) -> int:
    """The peer to name when waiting on `jobs`: a sender we wait to hear from first
    (we cannot know whether a slow receiver is late or just busy)."""
    incoming = [peer for _, message, peer in jobs if isinstance(message, _Incoming)]
    return (incoming or [jobs[0][2]])[0]


def _clean_up_on_sigterm(comm: ProcessTransport) -> None:
    """When SIGTERM ends this rank (the launcher stops its ranks, or died and the
    kernel sent PR_SET_PDEATHSIG), first remove this rank's files from the shared
    socket folder, and the folder once empty, then die of SIGTERM as before. Only
    when SIGTERM still has its default action and we run on the main thread: a
    handler the user installed is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        return

    def handler(signum: int, frame: Any) -> None:
        for name in (f"rank{comm.rank}.sock", f"wait{comm.rank}", f"wait{comm.rank}.new"):
            try:
                os.unlink(os.path.join(comm.addr, name))
            except OSError:
                pass
        try:
            os.rmdir(comm.addr)  # the last rank to go removes the folder
        except OSError:
            pass
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


def _env_int(name: str, low: int, high: int | None = None) -> int:
    """The whole number in variable `name`, in low..high, or a TinyFlowError naming
    the variable (TINYFLOW_SIZE=0 read "rank 0 is not in 0..-1")."""
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise TinyFlowError(f"ProcessTransport.from_env: {name}={text!r} is not a whole "
                            f"number {span}; start the script with `tinyflow launch -n N "
                            "script.py`")
    return value


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionResetError("peer closed the connection during the handshake")
        data += chunk
    return data


# ----------------------------------------------------------------------------------
# MPI (mpi4py)
# ----------------------------------------------------------------------------------

def _tag_number(tag: str) -> int:
    """MPI tags are small ints: a hash of the tag string (MPI guarantees < 32768)."""
    return zlib.crc32(tag.encode()) % 32768


def _as_bytes(array: Any) -> Any:
    return _contiguous(array).reshape(-1).view(np.uint8)


def _ranks_on_this_machine(size: int) -> int:
    """Ranks sharing this machine, as the launcher says (MPICH's Hydra sets
    MPI_LOCALNRANKS, Open MPI OMPI_COMM_WORLD_LOCAL_SIZE); else all `size`."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return size


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class MPITransport(Transport):
    """Point-to-point over MPI: Isend/Irecv of the arrays' bytes, then a polling wait
    with a deadline (a blocking MPI wait could hang forever on a silent peer).

    MPI messages carry no dtype, so a mismatch shows as a different tag (the tag's
    hash travels as the MPI tag) or a different byte count. Start ranks with
    ``mpiexec -n N python script.py`` (or `tinyflow launch`, which uses mpiexec when
    mpi4py is installed).
    """

    # Seconds of busy polling before napping between polls. MPI moves a large
    # message over shared memory only while both sides poll, so a rank with a core
    # of its own spins long (napping cost ~10% of the bandwidth at 16 MiB); ranks
    # that outnumber the cores spin briefly, or the rank holding the core starves
    # the one it waits for (spinning long made 4 ranks on 2 cores 5x slower).
    SPIN_OWN_CORE = 2e-2
    SPIN_SHARED_CORE = 1e-4
    NAP = 5e-5    # seconds per nap
    POST_AFTER = ProcessTransport.POST_AFTER  # a wait this long goes on the wait board

    def __init__(self, comm: Any = None, timeout: float | None = None) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        if timeout is None:
            timeout = timeout_from_env("MPITransport")
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), timeout)
        own_core = _ranks_on_this_machine(self.size) <= _usable_cores()
        self.spin = self.SPIN_OWN_CORE if own_core else self.SPIN_SHARED_CORE
        # `tinyflow launch` names a folder the ranks share, so a timeout can name the
        # rank that is actually late. Started by mpiexec alone there is none (agreeing
        # on one would take a collective without a deadline): a timeout names the
        # direct peer.
        if ENV_BOARD in os.environ:
            self.board = FileWaitBoard(os.environ[ENV_BOARD])

    def exchange(self, sends, recvs, tag=""):
        self._check_usable(tag)
        MPI = self.MPI
        code = _tag_number(tag)
        requests = [self.comm.Irecv([_as_bytes(out), MPI.BYTE], src, MPI.ANY_TAG)
                    for src, out in recvs]
        requests += [self.comm.Isend([_as_bytes(array), MPI.BYTE], dst, code)
                     for dst, array in sends]
        statuses = [MPI.Status() for _ in requests]
        deadline = self._deadline()
        peers = [src for src, _ in recvs] + [dst for dst, _ in sends]  # one per request
        peer = peers[0] if peers else self.rank
        try:
            started, posted = time.monotonic(), False
            while not MPI.Request.Testall(requests, statuses):
                # MPI moves data only while some call polls it, so poll hard at
                # first; after `spin` seconds the peer is probably busy elsewhere
                # (computing, or waiting for a core when ranks outnumber cores):
                # sleep between polls and leave it the core.
                now = time.monotonic()
                if now - started > self.spin:
                    time.sleep(self.NAP)
                if not posted and self.board is not None and now - started > self.POST_AFTER:
                    self.board.post(self.rank, _first_pending(requests, peers), tag)
                    posted = True
                if now > deadline:
                    raise self._timed_out(_first_pending(requests, peers), tag)
            if posted:
                self.board.clear(self.rank)
        except MPI.Exception as err:  # e.g. MPI_ERR_TRUNCATE: the message was larger
            raise self._fail(f"{_operation(tag)}: MPI failed receiving '{tag}' from rank "
                             f"{peer} ({err.Get_error_string()}); the ranks probably "
                             "disagree on the array size", peer, tag) from None
        for (src, out), status in zip(recvs, statuses):
            got = status.Get_count(MPI.BYTE)
            if status.Get_tag() != code or got != out.nbytes:
                raise self._fail(
                    f"{_operation(tag)}: rank {src} sent {got} bytes with tag "
                    f"#{status.Get_tag()}, rank {self.rank} expected "
                    f"{_describe(tag, out.dtype.str, out.nbytes)} (tag #{code}): the ranks "
                    "disagree on the operation, the array size or the dtype", src, tag)
        self.bytes_sent += sum(array.nbytes for _, array in sends)

    def native_allreduce(self, array: np.ndarray) -> np.ndarray:
        """MPI's own Allreduce (sum, in place): the reference our ring is measured by."""
        self.comm.Allreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM)
        return array


def _first_pending(requests: list, peers: list[int]) -> int:
    """The peer of the first MPI request not yet complete (the one being waited for).

    It asks with Get_status (MPI_Request_get_status), which leaves the request as it
    is. Test would free a completed request and drop its status: the Testall that
    follows then reports an empty status (tag MPI_ANY_TAG, 0 bytes) for that receive,
    and a message that arrived intact failed the tag check as "rank 0 sent 0 bytes
    with tag #-1" (a receive done while the send of the same exchange was not, at
    the moment a wait went on the wait board)."""
    return next((peer for request, peer in zip(requests, peers)
                 if not request.Get_status()), peers[0])


# ----------------------------------------------------------------------------------
# NCCL (CuPy): GPUs
# ----------------------------------------------------------------------------------

def _cupy_nccl() -> tuple[Any, Any]:
    """CuPy and its NCCL binding, or a CollectiveError saying which is missing.
    (CuPy's ``cupy.cuda.nccl`` imports without libnccl; its ``available`` says
    whether the library loaded, and without it every NCCL call is missing.)"""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as err:
        raise CollectiveError(f"NCCLTransport needs CuPy ({err}): pip install "
                             "'tinyflow[gpu]' on a machine with NVIDIA GPUs") from None
    if not getattr(nccl, "available", False):
        raise CollectiveError("NCCLTransport: CuPy cannot load the NCCL library "
                             "(libnccl.so.2); pip install 'nvidia-nccl-cu12>=2.16.5,<3'")
    return cupy, nccl


def nccl_id_bytes(unique_id: Any) -> np.ndarray:
    """NCCL's unique id as 128 bytes to send to the other ranks. CuPy (13 and
    earlier) returns ``nccl.get_unique_id()`` as a tuple of 128 ints, the C
    ``char`` values (signed: -128..127); bytes are taken too."""
    if isinstance(unique_id, (bytes, bytearray)):
        return np.frombuffer(bytes(unique_id), np.uint8).copy()
    return np.array(unique_id, dtype=np.int64).astype(np.int8).view(np.uint8)


def nccl_id_tuple(uid: np.ndarray) -> tuple[int, ...]:
    """The id received as bytes, in the form ``NcclCommunicator(ndev, commId,
    rank)`` takes: the tuple `get_unique_id` returned."""
    return tuple(np.asarray(uid, np.uint8).view(np.int8).tolist())


# numpy dtypes NCCL reduces (ncclDataType_t; bfloat16 has no numpy dtype). NCCL has
# no bool, int16 or uint16 type.
NCCL_DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64",
               "float16", "float32", "float64")


def nccl_dtype(nccl: Any, dtype: Any) -> int:
    """NCCL's code for numpy `dtype` (``nccl.NCCL_FLOAT32``...), or a CollectiveError."""
    name = np.dtype(dtype).name
    if name not in NCCL_DTYPES:
        raise CollectiveError(f"NCCL cannot reduce {name} arrays; it reduces "
                             f"{', '.join(NCCL_DTYPES)} (cast first)")
    return getattr(nccl, f"NCCL_{name.upper()}")


class NCCLTransport(Transport):
    """GPU ranks over NCCL's send/recv (NCCL >= 2.7), one GPU per rank.

    NCCL needs a shared unique id to set up its own connections; rank 0 makes it and
    sends it over `bootstrap` (any transport: processes, MPI). A ring step's send and
    receive are issued inside one NCCL group so they progress together (a lone
    blocking send would deadlock the ring). NCCL work is asynchronous on the current
    CUDA stream; each step records an event and polls it until done or the deadline,
    aborting the NCCL communicator on a timeout.
    """

    UID_BYTES = 128

    def __init__(self, bootstrap: Transport, device: int | None = None,
                 timeout: float | None = None) -> None:
        cupy, nccl = _cupy_nccl()
        self.xp = cupy
        self.nccl = nccl
        super().__init__(bootstrap.rank, bootstrap.size,
                         bootstrap.timeout if timeout is None else timeout)
        cupy.cuda.Device(bootstrap.rank % cupy.cuda.runtime.getDeviceCount()
                         if device is None else device).use()
        uid = np.zeros(self.UID_BYTES, dtype=np.uint8)
        if self.rank == 0:
            uid[:] = nccl_id_bytes(nccl.get_unique_id())
            for peer in range(1, self.size):
                bootstrap.send(peer, uid, "nccl-id")
        else:
            bootstrap.recv(0, uid, "nccl-id")
        self.comm = nccl.NcclCommunicator(self.size, nccl_id_tuple(uid), self.rank)

    def exchange(self, sends, recvs, tag=""):
        self._check_usable(tag)
        nccl = self.nccl
        stream = self.xp.cuda.get_current_stream()
        nccl.groupStart()
        try:  # (empty chunks send nothing: both sides agree on the sizes)
            for dst, array in sends:
                if array.nbytes:
                    self.comm.send(_contiguous(array).data.ptr, array.nbytes,
                                   nccl.NCCL_UINT8, dst, stream.ptr)
            for src, out in recvs:
                if out.nbytes:
                    self.comm.recv(_contiguous(out).data.ptr, out.nbytes, nccl.NCCL_UINT8,
                                   src, stream.ptr)
        finally:
            nccl.groupEnd()
        peers = [src for src, _ in recvs] + [dst for dst, _ in sends]
        self._wait(stream, peers[0] if peers else self.rank, tag)
        self.bytes_sent += sum(array.nbytes for _, array in sends)

    def _wait(self, stream: Any, peer: int, tag: str) -> None:
        done = self.xp.cuda.Event(disable_timing=True)
        done.record(stream)
        deadline = self._deadline()
        while not done.done:
            if time.monotonic() > deadline:
                self.comm.abort()  # unblocks the GPU; the communicator is gone
                raise self._timed_out(peer, tag, " over NCCL")
            time.sleep(0)

    def native_allreduce(self, array: Any) -> Any:
        """NCCL's own allReduce (sum, in place), for comparison with the ring."""
        nccl = self.nccl
        code = nccl_dtype(nccl, array.dtype)
        stream = self.xp.cuda.get_current_stream()
        self.comm.allReduce(array.data.ptr, array.data.ptr, array.size, code,
                            nccl.NCCL_SUM, stream.ptr)
        self._wait(stream, (self.rank + 1) % self.size, "allreduce (nccl)")
        return array

    def close(self) -> None:
        self.comm.destroy()


# ----------------------------------------------------------------------------------
# Communicators for graph ops: an allreduce node's attrs hold an int key (attrs must
# be plain data), and its kernel finds the transport under that key, in this process.
# ----------------------------------------------------------------------------------

COMMUNICATORS: dict[int, Transport] = {}
_keys = itertools.count(1)


def register_communicator(comm: Transport) -> int:
    """The int key under which allreduce nodes find `comm` (registered once)."""
    for key, known in COMMUNICATORS.items():
        if known is comm:
            return key
    key = next(_keys)
    COMMUNICATORS[key] = comm
    return key


def communicator(key: int) -> Transport:
    try:
        return COMMUNICATORS[key]
    except KeyError:
        raise KeyError(f"no communicator registered under key {key}: allreduce nodes "
                       "only run in the process that built them") from None
