"""TF1's Session: variable values that live across runs, and a cache of Programs.

`Session.run(fetches, feed_dict)` checks the feeds, finds (or compiles, through
executor.compile) the Program for these fetches and fed shapes, and runs it against
the Session's variables. Caching per fed shape is what lets a `None` batch dimension
specialize at run time, as in tqchen/tinyflow's Session; the cache is an LRU so a
batch of every size does not keep a Program each. `run` may be called from several
threads at once: the lock guards the caches, not the runs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from tinyflow import nest
from tinyflow.errors import ArgumentError
from tinyflow.executor import DEBUG_HOOKS, Program, check_feed, compile, validate_options
from tinyflow.graph import OPERATOR_BUILDERS, FeedError, Node, TinyFlowError
from tinyflow.ops import REGISTRY
from tinyflow.registry import source_kind


class SessionClosedError(TinyFlowError, RuntimeError):
    """Session.run after Session.close() (TF1: "Attempted to use a closed Session")."""


def _close_programs(cache: OrderedDict) -> None:
    """End the stream threads of every cached Program (Session.close, or the
    Session garbage collected)."""
    programs = list(cache.values())
    cache.clear()
    for program in programs:
        program.close()


class Session:
    """TF1's Session: holds variable values; `run` compiles, caches and executes.

    Options (`passes`, `streams`, `memory`, ...: see `compile`) are passed to
    `compile` for every program the Session builds. ``device='gpu'``
    is the original TinyFlow's spelling: it selects CUDA when a GPU is available and
    falls back to the CPU with a warning otherwise, so those programs run anywhere.

    Programs are cached per fetches and fed shapes, at most `MAX_CACHED_PROGRAMS`
    (least recently used dropped first: a `None` batch dim fed 400 sizes must not
    keep 400 programs). `close()` (or leaving a ``with`` block, or the Session
    being garbage collected) ends the programs' stream threads; a closed Session
    refuses to run. `run` may be called from several threads at once.
    """

    MAX_CACHED_PROGRAMS = 32

    def __init__(self, device: str = "cpu", config: Any = None, **options: Any) -> None:
        if config == "gpu" or device == "gpu":
            from tinyflow.backend import gpu_available
            if gpu_available():
                device = "cuda"
            else:
                import warnings
                warnings.warn("tf.Session(device='gpu'): no GPU found, running on the CPU",
                              stacklevel=2)
                device = "cpu"
        validate_options(options, "Session()")
        self.device = device
        self.options = options
        self.variables: dict[Node, np.ndarray] = {}
        self._cache: OrderedDict[tuple, Program] = OrderedDict()
        self._variables_read: dict[tuple, list[Node]] = {}
        self.generators: dict = {}  # this Session's random streams, by op seed
        self.last_program: Program | None = None
        self.closed = False
        self._lock = threading.Lock()  # guards the caches, not the runs
        self._finalizer = weakref.finalize(self, _close_programs, self._cache)
        self._finalizer.atexit = False  # at exit the (daemon) threads just stop

    # -- the TF1 API ---------------------------------------------------------------
    def run(self, fetches: Any, feed_dict: dict | None = None) -> Any:
        """Evaluate `fetches` (a node, or a list/tuple/dict of them) given feeds."""
        flat: list[Node] = []
        structure = nest.flatten(fetches, flat)
        for fetch in flat:
            if not isinstance(fetch, Node):
                # ArgumentError is a TypeError too: code that caught the TypeError
                # this once was still catches it.
                raise ArgumentError(f"Session.run: cannot fetch {_describe(fetch)}: fetch "
                                    "graph nodes, or lists/tuples/dicts of them")
        if feed_dict is not None and not isinstance(feed_dict, dict):
            raise FeedError(f"feed_dict must be a dict {{placeholder: value}}, got a "
                            f"{type(feed_dict).__name__}")
        feeds = {}
        for node, value in (feed_dict or {}).items():
            if not isinstance(node, Node):
                raise FeedError(f"feed_dict keys must be graph nodes, got {node!r}")
            feeds[node] = check_feed(node, value)
        recorder = DEBUG_HOOKS.current()
        extra = {}
        if recorder is not None:
            # The recorder's options are defaults: what the user set on this Session
            # (check_numerics=True, trace_values) wins; tracing is what recording is.
            extra = {k: v for k, v in recorder.compile_options.items()
                     if k == "trace" or k not in self.options}
        program = self.program_for(flat, feeds, extra)
        try:
            results = program.run(feeds, self.variables)
        finally:
            if recorder is not None:
                recorder.add_run(program)
        # Running an op for its effect (tf.group) gives None, as in TF1.
        results = [None if REGISTRY[n.op].effect_only else r for n, r in zip(flat, results)]
        return nest.unflatten(structure, iter(results))

    def program_for(self, fetches: list[Node], feeds: dict[Node, np.ndarray],
                    extra_options: dict | None = None) -> Program:
        """The compiled Program for these fetches and fed shapes (cached)."""
        if self.closed:
            raise SessionClosedError("Attempted to use a closed Session: it was closed "
                                     "(Session.close() or the end of its with block)")
        var_specs = self._variable_specs(fetches, feeds)
        extra_options = extra_options or {}
        # Keyed by Node.id, never reused (id() of a freed node can come back).
        key = (tuple(sorted(extra_options.items())), tuple(f.id for f in fetches),
               tuple((n.id, a.shape, a.dtype.str) for n, a in feeds.items()),
               tuple((v.id, s, np.dtype(d).str) for v, (s, d) in var_specs.items()))
        with self._lock:
            program = self._cache.get(key)
            if program is not None:
                self._cache.move_to_end(key)
        if program is None:
            program = compile(fetches, {n: (a.shape, a.dtype) for n, a in feeds.items()},
                              var_specs, device=self.device, generators=self.generators,
                              **{**self.options, **extra_options})
            with self._lock:
                program = self._cache.setdefault(key, program)  # another thread's twin
                self._cache.move_to_end(key)
                evicted = []
                while len(self._cache) > self.MAX_CACHED_PROGRAMS:
                    evicted.append(self._cache.popitem(last=False)[1])
            for old in evicted:  # (its threads end; a caller still holding it may
                old.close()      # run it again, which starts them anew)
        self.last_program = program
        return program

    def _variable_specs(self, fetches, feeds) -> dict[Node, tuple]:
        """The current (shape, dtype) of every variable the fetches read. Which
        variables those are is found once per fetches/feeds (a graph walk), not per run."""
        key = (tuple(f.id for f in fetches), frozenset(n.id for n in feeds))
        variables = self._variables_read.get(key)
        if variables is None:
            from tinyflow.graph import reachable
            variables = [n for n in reachable(fetches, frozenset(id(n) for n in feeds))
                         if source_kind(n) == "variable" and n not in feeds]
            self._variables_read[key] = variables
        specs = {}
        for node in variables:
            value = self.variables.get(node)
            if value is not None:
                specs[node] = (value.shape, value.dtype)
            elif node.shape is not None and None not in node.shape:
                specs[node] = (node.shape, node.dtype)
        return specs

    def variables_in_use(self) -> dict[Node, Any]:
        """{variable: value} of the variables the programs compiled so far read (an
        initializer only writes): what this session keeps between runs. A parallel
        scheme's rank holds its shard or stage here, not the whole model."""
        with self._lock:
            read = {node for program in self._cache.values()
                    for node, _, only_written in program.variable_slots if not only_written}
        return {node: value for node, value in self.variables.items() if node in read}

    def close(self) -> None:
        """Free the programs and end their stream threads; later runs raise
        SessionClosedError (as TF1's do)."""
        self.closed = True
        with self._lock:
            _close_programs(self._cache)
            self._variables_read.clear()

    def __enter__(self) -> Session:
        _defaults().append(self)   # TF1: `with tf.Session() as sess:` makes it the default
        return self

    def __exit__(self, *exc: Any) -> None:
        _leave_default(self)
        self.close()

    @contextlib.contextmanager
    def as_default(self) -> Iterator[Session]:
        """TF1's sess.as_default(): inside the block, x.eval() and op.run() use this
        Session (which stays open afterwards)."""
        _defaults().append(self)
        try:
            yield self
        finally:
            _leave_default(self)


class InteractiveSession(Session):
    """TF1's InteractiveSession: a Session that makes itself the default when made
    (for a notebook or a shell: x.eval() without a with block), until close()."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        _defaults().append(self)

    def close(self) -> None:
        _leave_default(self)
        super().close()


# The default Sessions of this thread, innermost last (TF1 keeps one stack per thread).
_default_sessions = threading.local()


def _defaults() -> list[Session]:
    if not hasattr(_default_sessions, "stack"):
        _default_sessions.stack = []
    return _default_sessions.stack


def _leave_default(session: Session) -> None:
    stack = _defaults()
    if session in stack:
        del stack[len(stack) - 1 - stack[::-1].index(session)]   # its innermost entry


def get_default_session() -> Session | None:
    """TF1's tf.get_default_session(): the innermost default Session of this thread."""
    stack = _defaults()
    return stack[-1] if stack else None


def _eval(node: Node, feed_dict: dict | None = None, session: Session | None = None) -> Any:
    """x.eval(): run `node` in `session` or the default Session."""
    session = session or get_default_session()
    if session is None:
        raise TinyFlowError(f"{node.name}.eval(): no default Session; evaluate inside "
                            "`with tf.Session() as sess:` (or sess.as_default()), or pass "
                            "session=sess")
    return session.run(node, feed_dict)


OPERATOR_BUILDERS["eval"] = _eval     # graph.Node.eval


def _describe(value: Any) -> str:
    """A short description of a fetch that is not a node, for an error message: an
    array by its shape (its repr could be megabytes), anything else by its repr."""
    if isinstance(value, np.ndarray):
        return f"a numpy array of shape {value.shape}"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    if isinstance(value, (set, frozenset)):
        return f"{text} (a set has no order: use a list)"
    return text


