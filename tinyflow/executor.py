"""Compile a graph into a Program once; run the Program many times.

`compile(fetches, feeds, variables)` specializes the graph to the fed shapes, runs the
pass pipeline, fixes a schedule (topological order) and binds each node to its
kernel: a Program is then a flat list of steps ``(compute, input slots, output slot,
attrs)``. Running it is one loop over that list, so the per-node overhead is a
Python call (the lesson of CSE 599W's executor and of TF1's Session: build once,
run many times). `Session.run` compiles per set of fetches and fed shapes and
caches the Program, so a `None` batch dimension specializes at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyflow import passes as passes_mod
from tinyflow.graph import FeedError, Graph, Node, TinyFlowError
from tinyflow.ops import REGISTRY


class ExecutionError(TinyFlowError, RuntimeError):
    """A kernel failed; the message names the node and the user's source line."""


def check_feed(node: Node, value: Any) -> np.ndarray:
    """Return `value` as an array fit for placeholder `node`, or raise FeedError.

    Values are converted when numpy calls the conversion "same_kind" (float64 data
    into a float32 placeholder, ints into a float placeholder), as the original
    TinyFlow's programs rely on; anything else (floats into an int placeholder,
    strings, objects) is refused. Known dims of the placeholder must match.
    """
    try:
        array = np.asarray(value)
    except Exception as err:  # ragged lists and the like
        raise FeedError(f"feed for {node.name!r} is not an array: {err}") from None
    want = node.dtype
    if want is not None and array.dtype != want:
        if array.dtype.kind in "OUSV" or not np.can_cast(array.dtype, want, "same_kind"):
            raise FeedError(f"feed for placeholder {node.name!r} (created at {node.where}) "
                            f"has dtype {array.dtype}, expected {want}")
        array = array.astype(want)
    if node.shape is not None:
        ok = len(node.shape) == array.ndim and all(
            d is None or d == s for d, s in zip(node.shape, array.shape))
        if not ok:
            declared = tuple("None" if d is None else d for d in node.shape)
            raise FeedError(f"feed for placeholder {node.name!r} (created at {node.where}) "
                            f"has shape {array.shape}, expected {declared}")
    return array


@dataclass
class Step:
    """One step of a Program: run `node`'s kernel on the values in `inputs` slots."""

    node: Node
    compute: Any
    inputs: tuple[int, ...]
    output: int
    attrs: dict
    free_after: tuple[int, ...] = ()   # slots whose last reader is this step


@dataclass
class Program:
    """A compiled graph: its steps, the slots of feeds/variables/fetches.

    `graph` is the specialized, optimized graph; `user_nodes` maps its sources back
    to the user's placeholders and variables; `ctx` holds the pass records.
    """

    graph: Graph
    steps: list[Step]
    feed_slots: list[tuple[Node, int]]        # (user node, slot)
    variable_slots: list[tuple[Node, int, bool]]  # (user variable, slot, only written)
    assign_targets: dict[int, Node]           # step index -> user variable it writes
    fetch_slots: list[int]
    ctx: passes_mod.PassContext
    device: str = "cpu"
    xp: Any = np
    stats: dict = field(default_factory=dict)
    # The Session's variable store, shared with the assign kernels (set by `run`).
    store_ref: list = field(default_factory=lambda: [None])

    def run(self, feeds: dict[Node, np.ndarray], store: dict[Node, np.ndarray]) -> list:
        """Execute once. `feeds` maps the user's fed nodes to checked arrays; `store`
        is the Session's variables (updated in place by assigns). Returns the fetched
        arrays (copies: later runs never change what a caller holds)."""
        self.store_ref[0] = store
        values: list[Any] = [None] * self.stats["slots"]
        for node, slot in self.feed_slots:
            values[slot] = feeds[node]
        for var, slot, write_only in self.variable_slots:
            if var not in store:
                if write_only:  # a first tf.assign gives it a value
                    continue
                raise ExecutionError(f"variable {var.name!r} (created at {var.where}) is "
                                     "used before it has a value; run "
                                     "tf.global_variables_initializer() first")
            values[slot] = store[var]
        xp = self.xp
        step = self.steps[0] if self.steps else None
        try:
            for step in self.steps:
                values[step.output] = step.compute(xp, *[values[i] for i in step.inputs],
                                                   **step.attrs)
                for slot in step.free_after:
                    values[slot] = None
        except TinyFlowError:
            raise
        except Exception as err:
            node = step.node
            shapes = ", ".join(str(i.shape) for i in node.inputs)
            raise ExecutionError(f"{node.op} {node.name} (created at {node.where}) failed "
                                 f"on inputs of shapes {shapes}: {type(err).__name__}: {err}"
                                 ) from err
        return [None if v is None else np.array(v, copy=True) for v in
                (values[s] for s in self.fetch_slots)]


def _make_assign(store_ref: list, var: Node):
    """An assign kernel bound to user variable `var`: writes into the Session's store.

    A variable keeps its buffer across runs (the planner relies on it), so an assign
    of the same shape writes in place; a first assign, or one that changes the shape
    (tf.infer_variable_shapes programs), rebinds the buffer.
    """
    def assign(xp, current, value, out=None):
        store = store_ref[0]
        held = store.get(var)
        if held is not None and held.shape == value.shape and held.dtype == value.dtype:
            held[...] = value
            return held
        store[var] = xp.array(value, dtype=var.dtype or value.dtype, copy=True)
        return store[var]
    return assign


def compile(fetches: Sequence[Node], feeds: dict[Node, tuple[tuple, Any]] | None = None,
            variables: dict[Node, tuple[tuple, Any]] | None = None, *,
            passes: list[str] | None = None, disable: Sequence[str] = (),
            device: str = "cpu") -> Program:
    """Compile `fetches` for the given shapes.

    feeds      {fed node: (shape, dtype)} for this program
    variables  {variable: (shape, dtype)}: the variables' current shapes
    passes     pass names to run (None: the default pipeline; [] none)
    disable    pass names to skip
    device     "cpu" (numpy); "cuda" (cupy) where the GPU backend is installed
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    xp = np
    if device == "cuda":
        from tinyflow.backend import cuda_array_module
        xp = cuda_array_module()
    fetches = list(fetches)
    sources = {**(variables or {}), **(feeds or {})}
    sources = {n: (tuple(s), np.dtype(d)) for n, (s, d) in sources.items()}
    graph, clones = passes_mod.specialize(fetches, sources)
    ctx = passes_mod.PassContext(device=device)
    graph = passes_mod.run_pipeline(graph, ctx, passes=passes, disable=tuple(disable))

    order = graph.nodes
    slot_of = {id(n): i for i, n in enumerate(order)}
    last_use: dict[int, int] = {}
    for step_index, node in enumerate(order):
        for inp in node.inputs:
            last_use[slot_of[id(inp)]] = step_index
    keep = {slot_of[id(f)] for f in graph.outputs}

    user_of = {id(clone): user for user, clone in clones.items()}
    users = graph.consumers()
    store_ref: list = [None]
    steps: list[Step] = []
    feed_slots, variable_slots = [], []
    assign_targets: dict[int, Node] = {}
    for node in order:
        slot = slot_of[id(node)]
        if node.op == "placeholder":
            feed_slots.append((user_of[id(node)], slot))
            continue
        if node.op == "variable":
            write_only = all(u.op == "assign" and u.inputs[0] is node and u.inputs[1] is not node
                             for u in users[node])
            variable_slots.append((user_of[id(node)], slot, write_only))
            continue
        compute = REGISTRY[node.op].compute
        if node.op == "assign":
            target = node.inputs[0]
            if target.op != "variable":
                raise TinyFlowError(f"tf.assign at {node.where}: the target must be a "
                                    f"Variable, got {target.op}")
            compute = _make_assign(store_ref, user_of[id(target)])
            assign_targets[len(steps)] = user_of[id(target)]
        steps.append(Step(node, compute, tuple(slot_of[id(i)] for i in node.inputs), slot,
                          dict(node.attrs)))
    # Drop each intermediate value after its last reader, so a program holds only
    # what is still needed (the memory planner replaces this with an arena).
    frees: dict[int, list[int]] = {}
    for slot, step_index in last_use.items():
        if slot not in keep:
            frees.setdefault(step_index, []).append(slot)
    computed = {id(s.node): k for k, s in enumerate(steps)}
    for node_index, node in enumerate(order):
        if id(node) in computed and node_index in frees:
            steps[computed[id(node)]].free_after = tuple(frees[node_index])

    return Program(graph, steps, feed_slots, variable_slots, assign_targets,
                   [slot_of[id(f)] for f in graph.outputs], ctx, device, xp,
                   {"slots": len(order), "nodes": len(order)}, store_ref)


class Session:
    """TF1's Session: holds variable values; `run` compiles, caches and executes.

    Options (`passes`, `disable`, `device`) are passed to `compile`. ``device='gpu'``
    is the original TinyFlow's spelling: it selects CUDA when a GPU is available and
    falls back to the CPU with a warning otherwise, so those programs run anywhere.
    """

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
        self.device = device
        self.options = options
        self.variables: dict[Node, np.ndarray] = {}
        self._cache: dict[tuple, Program] = {}
        self.last_program: Program | None = None

    # -- the TF1 API ---------------------------------------------------------------
    def run(self, fetches: Any, feed_dict: dict | None = None) -> Any:
        """Evaluate `fetches` (a node, or a list/tuple/dict of them) given feeds."""
        flat: list[Node] = []
        structure = _flatten(fetches, flat)
        feeds = {}
        for node, value in (feed_dict or {}).items():
            if not isinstance(node, Node):
                raise FeedError(f"feed_dict keys must be graph nodes, got {node!r}")
            feeds[node] = check_feed(node, value)
        program = self.program_for(flat, feeds)
        results = program.run(feeds, self.variables)
        # Running an op for its effect (tf.group) gives None, as in TF1.
        results = [None if n.op == "group" else r for n, r in zip(flat, results)]
        return _unflatten(structure, iter(results))

    def program_for(self, fetches: list[Node], feeds: dict[Node, np.ndarray]) -> Program:
        """The compiled Program for these fetches and fed shapes (cached)."""
        var_specs = self._variable_specs(fetches, feeds)
        key = (tuple(id(f) for f in fetches),
               tuple((id(n), a.shape, a.dtype.str) for n, a in feeds.items()),
               tuple((id(v), s, np.dtype(d).str) for v, (s, d) in var_specs.items()))
        program = self._cache.get(key)
        if program is None:
            program = compile(fetches, {n: (a.shape, a.dtype) for n, a in feeds.items()},
                              var_specs, device=self.device, **self.options)
            self._cache[key] = program
        self.last_program = program
        return program

    def _variable_specs(self, fetches, feeds) -> dict[Node, tuple]:
        from tinyflow.graph import reachable
        specs = {}
        for node in reachable(fetches, frozenset(id(n) for n in feeds)):
            if node.op != "variable" or node in feeds:
                continue
            value = self.variables.get(node)
            if value is not None:
                specs[node] = (value.shape, value.dtype)
            elif node.shape is not None and None not in node.shape:
                specs[node] = (node.shape, node.dtype)
        return specs

    def close(self) -> None:
        self._cache.clear()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _flatten(fetches: Any, out: list[Node]) -> Any:
    """Record the nesting of `fetches` and collect its nodes into `out`."""
    if isinstance(fetches, Node):
        out.append(fetches)
        return None
    if isinstance(fetches, dict):
        return ("dict", {k: _flatten(v, out) for k, v in fetches.items()})
    if isinstance(fetches, (list, tuple)):
        return (type(fetches).__name__, [_flatten(v, out) for v in fetches])
    raise TypeError(f"cannot fetch {fetches!r}: fetch graph nodes, or lists/dicts of them")


def _unflatten(structure: Any, results) -> Any:
    if structure is None:
        return next(results)
    kind, inner = structure
    if kind == "dict":
        return {k: _unflatten(v, results) for k, v in inner.items()}
    items = [_unflatten(v, results) for v in inner]
    return tuple(items) if kind == "tuple" else items
