"""Tracing: a Python function of eager Tensors recorded into a Graph, compiled with
the ordinary passes, planner and executor, and replayed (tf.function, torch.compile).

`function` runs the Python function once on *symbolic* Tensors (eager.py's Tensor
with a graph Node instead of an array), whose ops build Nodes instead of computing,
compiles the Graph, and replays it for later calls whose inputs have the same shapes
and dtypes (the guard). Parameters the function reads (Tensors from outside) become
inputs fed on every call; in-place updates (``assign_``, optimizers) and ``.grad``
writes become outputs written back after the run (functionalization, as
torch.compile does). Asking a symbolic Tensor for its value (``if loss > 0``,
``.item()``) is a *graph break*: an error naming the line. Where eager mode records
no history (values made under ``no_grad``, written in place, copied), the trace puts
a ``stop_gradient``, so a backward inside the function stops where eager's does.

What a trace freezes, as TF2's tf.function does (torch.compile guards some of it):
Python values the function reads (a global number, ``opt.lr``, a config dict) are
constants of the graph, and so is *which* Tensor a global name refers to (the Tensor
itself is read on every call, so in-place updates of it are seen; rebinding the name
to another Tensor is not). A Tensor from outside whose ``requires_grad`` changed
(a frozen parameter) is part of the guard: the function traces again.
Pass what changes between calls as an argument (a Python number in the arguments
is part of the guard: a new value traces again), or keep it in a Tensor. Random ops
draw different numbers traced and eager: each eager call builds its ops anew, each
with a stream of its own, while a traced op continues one stream from call to call.
A ``tf.function`` called inside another is traced into it.

`memory_comparison` runs one step both ways and puts the static plan beside the
caching allocator and plain malloc (lesson 9).
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyflow import api, nest, ops, shape_ops
from tinyflow.allocator import CachingAllocator
from tinyflow.eager import (SECOND_BACKWARD, EagerError, GraphBreak, Tensor, _thread, _wrap,
                            accumulates_in_place, check_implicit_seed, check_seed_shape,
                            set_allocator)
from tinyflow.graph import Node, topological_order, user_source_line
from tinyflow.ops import REGISTRY


# ----------------------------------------------------------------------------------
# Tracing: record a Python function of Tensors into a Graph, compile it, replay it
# ----------------------------------------------------------------------------------

@dataclass
class _Capture:
    """A value from outside the traced function, fed on every call."""

    placeholder: Node
    read: Callable[[tuple], np.ndarray]   # its value in a call with these arguments
    what: str


class _Trace:
    """What one trace collects while the function runs on symbolic Tensors."""

    def __init__(self) -> None:
        self.captures: dict[tuple, _Capture] = {}
        self.writes: dict[int, tuple[Tensor, Node]] = {}        # in-place writes
        self.grad_writes: dict[int, tuple[Tensor, Tensor | None]] = {}
        # Grad keys whose `.grad` is a new Tensor by the end of the call (set, or made
        # by a backward that found None), not the one the call started with: a
        # backward's sum goes into that one in place, as eager's does, otherwise.
        self.grad_replaced: set[int] = set()
        self.grad_guards: dict[int, tuple[Tensor, bool]] = {}   # (t, t.grad is None)
        self.leaves: dict[int, Tensor] = {}                     # requires_grad leaves seen
        self.breaks: list[str] = []
        # Aliases the trace must follow: a Tensor passed as an argument and also used
        # from outside is its argument's stand-in; a `.grad` read has one stand-in,
        # and a write into it goes into the Tensor that was that .grad when the call
        # started (see _write_target); a .grad reached under another name as well is
        # an error (_grad_alias_error).
        self.arguments: dict[int, Tensor] = {}      # id(argument) -> its stand-in
        self.outside: dict[int, Tensor] = {}        # Tensors used from outside
        self.outside_flags: dict[int, tuple[Tensor, bool]] = {}   # and their requires_grad
        self.unified: dict[int, Tensor] = {}        # arguments also used from outside
        self.grad_reads: dict[int, Tensor] = {}     # id(t) -> stand-in of t.grad
        self.grad_owner: dict[int, Tensor] = {}     # id(stand-in) -> t
        # An argument's stand-in keys its .grad; the .grad read, written and guarded
        # is args[index].grad at each call (the trace-time argument gives shapes).
        self.argument_index: dict[int, int] = {}    # id(argument stand-in) -> index
        self.args: tuple = ()                       # the call being traced (Function._trace)
        self.paths: list[str] = []                  # each argument's name in messages
        # Nodes with no history in eager terms (made under no_grad, or written in
        # place), and the stop_gradient put in front of each (see input_of).
        self.no_history: dict[int, Node] = {}
        self.stopped: dict[int, Node] = {}
        self.inner_leaves: dict[int, Tensor] = {}   # requires_grad_() inside the trace
        self.flags: dict[int, bool] = {}            # argument index -> requires_grad_(flag)
        self.unfollowable: dict[int, str] = {}      # id(node) -> why (see _unfollowable)
        # Eager's tape rules, kept on nodes: the computed values that require grad
        # (eager's tape), those a backward without retain_graph went through (eager
        # frees their saved values), and the values an in-place write replaced, with
        # the write's line (eager's version counter).
        self.grad_nodes: set[int] = set()
        self.freed: set[int] = set()
        self.overwritten: dict[int, str] = {}

    # -- values of the trace -----------------------------------------------------------
    def node_of(self, value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value                     # a literal: `make` types it as usual
        if id(value) in self.writes:         # read after an in-place write
            return self.writes[id(value)][1]
        if value.node is not None:
            return value.node
        if id(value) in self.arguments:      # an argument, used from outside too
            self.unified[id(value)] = value
            return self.node_of(self.arguments[id(value)])
        if any(self._trace_time(owner)._grad is value for owner in self.grad_owner.values()):
            raise _grad_alias_error(value)
        if value.requires_grad and value.is_leaf:
            self.leaves[id(value)] = value
        self.outside[id(value)] = value
        self.outside_flags.setdefault(id(value), (value, value.requires_grad))
        return self._capture(("tensor", id(value)), value.shape, value.dtype,
                             lambda args, t=value: t.data, "a Tensor from outside")

    def copy_of(self, value: Any, dtype: Any) -> Node:
        """The node of `Tensor(value, dtype=dtype)` made inside the trace, which has
        no history: a constant, or the Tensor's value as the trace sees it behind a
        stop_gradient (cast to `dtype` when given)."""
        if isinstance(value, Tensor):
            node = ops.stop_gradient(self.node_of(value))
        else:
            node = ops.constant(np.asarray(value, dtype=dtype))
        if dtype is not None and node.dtype != np.dtype(dtype):
            node = ops.cast(node, np.dtype(dtype))
        return node

    def input_of(self, value: Any) -> Any:
        """`value` as an input of an op recorded with grad enabled. A value made
        under no_grad, or written in place into a Tensor that is not a leaf needing
        grad, has no history in eager mode, so here it stands behind a stop_gradient:
        a backward in the trace does not reach through it, as eager backward does not.
        (A leaf that needs grad is a gradient target whatever was written into it.)"""
        node = self.node_of(value)
        if (not isinstance(value, Tensor) or id(node) not in self.no_history
                or (value.requires_grad and value.is_leaf) or id(node) in self.unfollowable):
            return node   # (an unfollowable node stays in reach: backward reports it)
        stopped = self.stopped.get(id(node))
        if stopped is None:
            stopped = self.stopped[id(node)] = ops.stop_gradient(node)
        return stopped

    def grads_read(self) -> list[Tensor | int]:
        """The Tensors (or argument indices) whose .grad the trace read."""
        return [self.resolve(t) for t in self.grad_owner.values()]

    def set_requires_grad(self, t: Tensor, flag: bool) -> None:
        """`t.requires_grad_(flag)` on a symbolic Tensor, changing its flag. True: an
        argument becomes a backward target (its .grad written back); a value made
        inside the trace becomes a leaf of its own, cut from its history. False: its
        value is cut from its history, and it is no backward target. An argument's
        new flag is set on the caller's Tensor after each run, as eager sets it."""
        if id(t) in self.argument_index:
            self.flags[self.argument_index[id(t)]] = flag
        if not flag:
            self.writes[id(t)] = (t, ops.stop_gradient(self.node_of(t)))
            self.leaves.pop(id(t), None)
            return
        if id(t) in self.argument_index:
            # Its uses so far did not require grad: reads from now on are a new node,
            # the backward target, which those earlier uses do not reach.
            node = self.node_of(t)
            self.writes[id(t)] = (t, ops.make("cast", node, dtype=node.dtype.name))
            self.leaves[id(t)] = t
            return
        self.writes[id(t)] = (t, ops.stop_gradient(self.node_of(t)))
        t._op = None
        self.leaves[id(t)] = t
        self.inner_leaves[id(t)] = t

    def _unfollowable(self) -> dict[int, str]:
        """Nodes a backward must not reach, by id, with why: the placeholders of
        Tensors with a history outside the function, and in-place writes into an
        op's result that requires grad."""
        found = dict(self.unfollowable)
        for key, capture in self.captures.items():
            t = self.outside.get(key[1]) if key[0] == "tensor" else None
            if t is not None and t.requires_grad and not t.is_leaf:
                found[id(capture.placeholder)] = f"a {t.shape} Tensor from outside with a history"
        for stand_in in self.arguments.values():
            index = self.argument_index[id(stand_in)]
            real = self.args[index]
            if isinstance(real, Tensor) and real.requires_grad and not real.is_leaf:
                found[id(stand_in.node)] = f"{self.paths[index]}, a Tensor with a history"
        return found

    def grad_key(self, t: Tensor) -> Tensor | None:
        """The Tensor that `t.grad` is keyed by in the trace: `t` (from outside), its
        argument's stand-in (an argument, also when reached from outside), or None
        for a value made inside the trace (its plain `_grad`)."""
        if t.node is None:
            if id(t) not in self.arguments:
                return t
            self.unified[id(t)] = t          # an argument, reached from outside
            t = self.arguments[id(t)]
        if id(t) in self.inner_leaves:
            return t
        index = self.argument_index.get(id(t))
        return t if index is not None and isinstance(self.args[index], Tensor) else None

    def _trace_time(self, key: Tensor) -> Tensor:
        """The eager Tensor behind a grad key, as it is at trace time."""
        index = self.argument_index.get(id(key))
        return key if index is None else self.args[index]

    def resolve(self, key: Tensor) -> Tensor | int:
        """A grad key as a run finds it: an argument's index, or the Tensor."""
        return self.argument_index.get(id(key), key)

    def grad_of(self, t: Tensor) -> Tensor | None:
        """`t.grad` as seen inside the trace (t is a grad key, see `grad_key`): the
        pending gradient, or the current `.grad` fed at each call (the guard
        remembers whether it was None)."""
        if id(t) in self.grad_writes:
            return self.grad_writes[id(t)][1]
        if id(t) in self.inner_leaves:     # made in this call: no .grad yet
            return None
        real, where = self._trace_time(t), self.resolve(t)
        if not isinstance(where, int):
            self.outside[id(t)] = t          # reached from outside through its .grad
        self.grad_guards.setdefault(id(t), (where, _grad_layout(real)))
        if real._grad is None:
            return None
        stand_in = self.grad_reads.get(id(t))
        if stand_in is None:
            if id(real._grad) in self.arguments or id(real._grad) in self.outside:
                raise _grad_alias_error(real._grad)
            read = ((lambda args, i=where: args[i]._grad.data) if isinstance(where, int)
                    else (lambda args, t=t: t._grad.data))
            node = self._capture(("grad", id(t)), real._grad.shape, real._grad.dtype, read,
                                 "the .grad of a Tensor")
            stand_in = self.grad_reads[id(t)] = _wrap(None, None, node=node)
            self.grad_owner[id(stand_in)] = t
        return stand_in

    def _capture(self, key: tuple, shape: tuple, dtype: Any, read: Callable,
                 what: str) -> Node:
        capture = self.captures.get(key)
        if capture is None:
            placeholder = api.placeholder(dtype, shape, name=f"captured_{len(self.captures)}")
            capture = self.captures[key] = _Capture(placeholder, read, what)
        return capture.placeholder

    # -- what Tensor methods do while tracing ------------------------------------------
    def apply(self, op: str, inputs: Sequence[Any], attrs: dict, name: str | None) -> Tensor:
        grad_enabled = _thread.state.grad_enabled
        if grad_enabled:
            nodes = [self.input_of(i) for i in inputs]
        else:
            nodes = [self.node_of(i) for i in inputs]
        node = ops.make(op, *nodes, name=name, **attrs)
        if not grad_enabled:
            self.no_history[id(node)] = node
        out = _wrap(None, None, node=node)
        out.requires_grad = (grad_enabled and REGISTRY[op].differentiable and any(
            isinstance(i, Tensor) and i.requires_grad for i in inputs))
        if out.requires_grad:
            out._op = op   # not a leaf: it has a history, as on eager's tape
            self.grad_nodes.add(id(node))
        return out

    def write(self, t: Tensor, value: Any) -> None:
        node = self.node_of(value) if isinstance(value, Tensor) else ops.constant(
            np.asarray(value, t.dtype))
        if node.dtype != t.dtype:
            node = ops.cast(node, t.dtype)
        if node.shape != t.shape:
            node = shape_ops.broadcast_to(node, t.shape)
        if t.node is None and id(t) in self.arguments:   # an argument: its stand-in
            self.unified[id(t)] = t
            t = self.arguments[id(t)]
        replaced = self._current_node(t)
        if replaced is not None:
            self.overwritten[id(replaced)] = user_source_line()
        if t.node is None:
            self.outside[id(t)] = t
        if t.requires_grad and not t.is_leaf:
            # Eager refuses a backward that reaches a computed Tensor written in place
            # (eager.Tensor.assign_), and so does the trace (see backward).
            # (A node of its own, so that other readers of the value are not flagged.)
            node = ops.make("cast", node, dtype=t.dtype.name)   # (not elided: a new node)
            self.writes[id(t)] = (t, node)
            self.unfollowable[id(node)] = ("an in-place write into an op's result that "
                                           "requires grad (eager keeps its old history)")
            return
        if t.requires_grad and t.is_leaf:
            # A leaf keeps being a leaf: the written value, cut from its history, is
            # what its forward reads and what its gradient is taken with respect to.
            node = ops.stop_gradient(node)
            self.leaves[id(t)] = t
        self.writes[id(t)] = (t, node)
        self.no_history[id(node)] = node

    def _current_node(self, t: Tensor) -> Node | None:
        """The node a read of `t` gives now, or None when the trace never read it."""
        if id(t) in self.writes:
            return self.writes[id(t)][1]
        if t.node is not None:
            return t.node
        capture = self.captures.get(("tensor", id(t)))
        return None if capture is None else capture.placeholder

    def set_grad(self, key: Tensor, value: Tensor | None) -> None:
        """`t.grad = value` inside the trace (key: `grad_key(t)`)."""
        self.grad_writes[id(key)] = (key, value)
        self.grad_replaced.add(id(key))

    def backward(self, root: Tensor, gradient: Any, retain_graph: bool = False,
                 create_graph: bool = False) -> None:
        if not root.requires_grad:
            raise EagerError("backward() on a Tensor that does not require grad (no input "
                             "of its ops had requires_grad=True, or it was made under "
                             "no_grad)")
        if create_graph:
            raise EagerError(f"backward(create_graph=True) at {user_source_line()} inside "
                             "a traced function: not supported; call it eagerly")
        if gradient is None:   # (eager mode's rule: tracing must not change the answer)
            check_implicit_seed(root.node.shape)
        else:
            check_seed_shape(gradient.shape if isinstance(gradient, Tensor)
                             else np.shape(gradient), root.shape)
        why = _first_unfollowable(root.node, self._unfollowable())
        if why is not None:
            raise EagerError(f"backward() at {user_source_line()} in a traced function "
                             f"reaches {why}: the trace cannot follow it; pass a leaf "
                             "(x.detach().requires_grad_()) or call the function eagerly")
        walked = self._tape_nodes(root.node)
        if walked & self.freed:
            raise EagerError(SECOND_BACKWARD)
        targets = list(self.leaves.values())
        seeds = None if gradient is None else [self.node_of(gradient)]
        from tinyflow.autodiff import gradients
        grads = gradients(root.node, [self.node_of(t) for t in targets], seeds)
        self._check_not_overwritten(grads)
        if not retain_graph:
            self.freed |= walked
        for t, g in zip(targets, grads):
            if g is None:
                continue
            # (a .grad has no history, as eager's without create_graph)
            new = _wrap(None, None, node=ops.stop_gradient(g))
            previous = self.grad_of(t)
            if previous is None or not accumulates_in_place(previous, g.dtype, False):
                self.grad_replaced.add(id(t))
            self.grad_writes[id(t)] = (t, new if previous is None else previous + new)


    def _tape_nodes(self, root: Node) -> set[int]:
        """The ids of the computed values requiring grad that a backward from `root`
        goes through: eager's walk of its tape (inputs that require grad only)."""
        walked, stack = set(), [root]
        while stack:
            node = stack.pop()
            if id(node) in walked or id(node) not in self.grad_nodes:
                continue
            walked.add(id(node))
            stack.extend(node.inputs)
        return walked

    def _check_not_overwritten(self, grads: list[Node | None]) -> None:
        """A gradient rule must read its op's values as the op saw them: eager's
        version counter refuses a backward that needs a value written in place
        after the op used it, and so does the trace (the gradient nodes would read
        the old value, an answer eager mode never gives)."""
        if not self.overwritten:
            return
        for node in topological_order([g for g in grads if g is not None]):
            if node.grad_of is None:      # a forward value, computed before any write
                continue
            read_for_shape = REGISTRY[node.op].shape_inputs
            for k, value in enumerate(node.inputs):
                if k not in read_for_shape and id(value) in self.overwritten:
                    raise EagerError(
                        f"backward() at {user_source_line()}: the gradient of "
                        f"{node.grad_of.op} needs a value as the op saw it, but it was "
                        f"written in place afterwards, at {self.overwritten[id(value)]} "
                        "(eager mode and PyTorch raise here too); write the new value to "
                        "a new Tensor")


@dataclass
class _Concrete:
    """One trace, compiled: the program and how to feed it and read it back."""

    program: Any
    arg_slots: list[tuple[int, Node]]          # (argument index, placeholder)
    captures: list[_Capture]
    outputs: Any                               # the result's structure, fetch indices
    grad_writes: list[tuple[Tensor | int, int | None, bool]]  # (Tensor or argument,
    #                                                     fetch, into the .grad in place?)
    writes: list[tuple[Any, int]]     # (Tensor, argument index or ("grad", owner); fetch)
    grad_guards: list[tuple[Tensor | int, Any]]   # (Tensor or argument, its .grad's layout)
    nodes: int
    identities: list[tuple[int, Tensor, bool]]  # (argument, Tensor from outside, same?)
    flags: dict[int, bool]                       # arguments given requires_grad_(flag)
    grads_read: list[Tensor | int]              # Tensors (arguments) whose .grad it read
    outside: list[Tensor]                       # Tensors it used from outside
    outside_flags: list[tuple[Tensor, bool]]    # their requires_grad when first read
    paths: list[str]                            # each argument's name in messages

    def guards_hold(self, args: tuple) -> str | None:
        """None when this trace fits the world as it is now, else why not."""
        for where, layout in self.grad_guards:
            t = args[where] if isinstance(where, int) else where
            if _grad_layout(t) != layout:
                return f"the .grad of a {t.shape} Tensor was " \
                       f"{'None' if layout is None else layout} when traced"
        for t, flag in self.outside_flags:   # (a frozen parameter gets no gradient)
            if t.requires_grad != flag:
                return f"a {t.shape} Tensor from outside has requires_grad={t.requires_grad} " \
                       f"now, {flag} when traced"
        for index, t, same in self.identities:
            if (args[index] is t) != same:
                return (f"{self.paths[index]} is {'no longer' if same else 'now'} a "
                        "Tensor the function also uses from outside")
        if self.grads_read:   # no .grad it reads may be reachable under another name
            grads = {id((args[t] if isinstance(t, int) else t)._grad) for t in self.grads_read}
            if any(id(x) in grads for x in [*args, *self.outside]):
                return "a .grad the function reads is now also an argument or a Tensor " \
                       "it uses from outside"
        return None


class Function:
    """A Python function of Tensors, traced into a compiled graph per input signature.

    Calling it with Tensors (or arrays) whose shapes and dtypes were seen before runs
    the compiled program; new ones trace again (counted in `traces`, with the reason).
    `explain()` says what was traced and why. Options go to `tinyflow.compile`.
    """

    def __init__(self, fn: Callable, **compile_options: Any) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.compile_options = compile_options
        self.cache: dict[tuple, list[_Concrete]] = {}
        self.traces: list[dict] = []
        self.breaks: list[str] = []
        self.owner: type | None = None   # the class, for a method (__set_name__)
        # Held while tracing: threads that first call it at once trace it once (the
        # others wait, then run the cached program), and `traces` counts each trace.
        self._tracing = threading.RLock()

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner = owner    # a method of `owner`: see __get__ and __call__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """A decorated method: `model.step` is a Function of its own for each instance,
        of the method bound to it (kept in the instance's __dict__, so it lives and
        dies with the instance), as tf.function binds methods; the Tensors the
        instance holds are read from outside, on every call. An instance without a
        __dict__ (__slots__), or a class (a classmethod), is passed as a Python value
        of each call instead."""
        if instance is None:
            return self
        state = getattr(instance, "__dict__", None)
        if not isinstance(state, dict):   # (a class's is a read-only mappingproxy)
            return types.MethodType(self, instance)
        slot = f"_tf_function_{id(self)}"   # (this Function's: an override has another)
        bound = state.get(slot)
        if bound is None:
            bound = state[slot] = Function(types.MethodType(self.fn, instance),
                                           **self.compile_options)
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _thread.state.tracer is not None:
            # Called from inside another traced function: its ops join that trace
            # (as tf.function's do), rather than compiling a program of their own.
            return self.fn(*args, **kwargs)
        owner = self.owner
        if owner is not None and args and isinstance(args[0], owner):
            # Model.step(model, x): the instance's own Function, as model.step(x) is
            # (keyed by the instance, the cache would keep every instance alive)
            bound = self.__get__(args[0])
            if bound is not self and not isinstance(bound, types.MethodType):
                return bound(*args[1:], **kwargs)
        if kwargs:
            args = self._positional(args, kwargs)
        flat, nesting, key = args, None, _call_signature(args)
        if key is None:   # a list, tuple or dict among the arguments: opened
            flat, nesting = _open_arguments(args)
            key = _call_signature(flat, nesting)
        concrete, reason = self._cached(key, flat)
        if concrete is not None:
            return self._run(concrete, flat)
        if key not in self.cache and self.cache:
            reason = _why_new(key, list(self.cache))
        if not kwargs:   # (a miss only: the call's arity, said plainly, before tracing)
            self._bind(args, {})
        return self._run(self._trace_once(flat, key, nesting, reason), flat)

    def _cached(self, key: tuple, flat: tuple) -> tuple[_Concrete | None, str | None]:
        """(the cached program whose guards hold for the call, None), or (None, why
        no program does: "first call", or the last failed guard)."""
        reason = "first call"
        for concrete in self.cache.get(key, []):
            reason = concrete.guards_hold(flat)
            if reason is None:
                return concrete, None
        return None, reason

    def _trace_once(self, flat: tuple, key: tuple, nesting: tuple | None,
                    reason: str) -> _Concrete:
        """The call's program, traced now (and counted in `traces`, for `reason`),
        unless another thread traced it while this one waited for the lock."""
        with self._tracing:
            concrete, _ = self._cached(key, flat)
            if concrete is not None:
                return concrete
            concrete = self._trace(flat, key, nesting)
            self.traces.append({"signature": key, "reason": reason, "nodes": concrete.nodes})
            self.cache.setdefault(key, []).append(concrete)
            return concrete

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        """The function's signature, asked once (a step called with keywords asks
        on every call)."""
        return inspect.signature(self.fn)

    def _bind(self, args: tuple, kwargs: dict) -> inspect.BoundArguments:
        """The call's arguments bound to the function's parameters; a call that does
        not fit them is an ArgumentError naming the function and the caller's line
        (Python's own TypeError came from inside inspect, or the trace)."""
        try:
            return self._signature.bind(*args, **kwargs)
        except TypeError as err:
            raise ops.argument_error(self.__name__, f"{err} (the function's parameters "
                                     f"are {self._signature})") from None

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """`f(x, lr=0.1)` as `f(x, 0.1)` (defaults filled in), so keywords are guarded
        like any argument; keyword-only parameters cannot be passed by position."""
        bound = self._bind(args, kwargs)
        if bound.kwargs:   # passed to keyword-only parameters (or **kwargs)
            raise EagerError(f"{self.__name__}: keyword-only arguments "
                             f"{sorted(bound.kwargs)} are not supported by tf.function; "
                             "make them ordinary parameters")
        bound.apply_defaults()    # (keyword-only defaults stay the function's own)
        return bound.args

    def _trace(self, args: tuple, key: tuple, nesting: tuple | None) -> _Concrete:
        from tinyflow.executor import compile as compile_graph
        trace = _Trace()
        trace.args = args
        trace.paths = _leaf_paths(nesting, len(args))
        symbolic, arg_slots = [], []
        for index, arg in enumerate(args):
            if id(arg) in trace.arguments:     # the same Tensor again: one stand-in
                symbolic.append(trace.arguments[id(arg)])
            elif isinstance(arg, (Tensor, np.ndarray)):
                placeholder = api.placeholder(arg.dtype, arg.shape, name=f"arg{index}")
                value = _wrap(None, None, node=placeholder)
                value.requires_grad = bool(getattr(arg, "requires_grad", False))
                arg_slots.append((index, placeholder))
                symbolic.append(value)
                trace.arguments[id(arg)] = value
                trace.argument_index[id(value)] = index
                if isinstance(arg, Tensor) and arg.requires_grad and arg.is_leaf:
                    trace.leaves[id(value)] = value   # backward in the trace reaches it
            else:
                symbolic.append(arg)
        call_args = symbolic
        if nesting is not None:
            values = iter(symbolic)
            call_args = [nest.unflatten(n, values) for n in nesting]
        state = _thread.state   # (tracing is per thread, as grad mode: see eager._State)
        before, state.tracer = state.tracer, trace
        try:
            result = self.fn(*call_args)
        except GraphBreak as err:
            self.breaks.append(str(err))
            raise
        finally:
            state.tracer = before
        fetches: list[Node] = []
        outputs = _collect(result, fetches, trace.node_of)
        grad_writes = []
        for t, g in trace.grad_writes.values():
            if id(t) in trace.inner_leaves:    # made in the call: nothing to write back
                continue
            grad_writes.append((trace.resolve(t), None if g is None else len(fetches),
                                id(t) not in trace.grad_replaced))
            if g is not None:
                fetches.append(trace.node_of(g))
        writes = []
        for t, node in trace.writes.values():
            target = _write_target(t, args, trace)
            if target is not None:
                writes.append((target, len(fetches)))
                fetches.append(node)
        feeds = {p: (p.shape, p.dtype) for _, p in arg_slots}
        feeds.update({c.placeholder: (c.placeholder.shape, c.placeholder.dtype)
                      for c in trace.captures.values()})
        program = compile_graph(fetches, feeds, **self.compile_options) if fetches else None
        nodes = 0 if program is None else len(program.graph.nodes)
        return _Concrete(program, arg_slots, list(trace.captures.values()), outputs,
                         grad_writes, writes, list(trace.grad_guards.values()), nodes,
                         _identities(args, trace), trace.flags, trace.grads_read(),
                         list(trace.outside.values()), list(trace.outside_flags.values()),
                         trace.paths)

    def _run(self, concrete: _Concrete, args: tuple) -> Any:
        values: list = []
        if concrete.program is not None:
            feeds = {p: _as_array(args[i]) for i, p in concrete.arg_slots}
            feeds.update({c.placeholder: c.read(args) for c in concrete.captures})
            values = concrete.program.run(feeds, {})

        def tensor(where: Tensor | int) -> Tensor:   # an argument's index, or a Tensor
            return args[where] if isinstance(where, int) else where

        # In-place writes first: one into a .grad goes into the Tensor that was the
        # .grad when the call started, before the function's new .grads replace it.
        for target, slot in concrete.writes:
            t = tensor(target[1])._grad if isinstance(target, tuple) else tensor(target)
            t.data[...] = values[slot]
        for where, slot, in_place in concrete.grad_writes:
            t = tensor(where)
            if slot is None:
                t._grad = None
            elif in_place:   # the sum into the .grad the call started with, as eager adds
                t._grad.data[...] = values[slot]
                t._grad._version += 1
            else:
                t._grad = Tensor(values[slot])
        for index, flag in concrete.flags.items():
            args[index].requires_grad = flag
        return _rebuild(concrete.outputs, values, self.__name__)

    def explain(self) -> str:
        """What was traced, how often and why; graph breaks with their lines."""
        lines = [f"{self.__name__}: {len(self.traces)} trace(s)"]
        for i, entry in enumerate(self.traces):
            shapes = _signature_text(entry["signature"])
            lines.append(f"  trace {i}: {entry['reason']}; inputs ({shapes}); "
                         f"{entry['nodes']} nodes after the passes")
        for message in self.breaks:
            lines.append(f"  {message}")
        return "\n".join(lines)


def function(fn: Callable | None = None, **compile_options: Any) -> Any:
    """Decorator: trace `fn` into a graph and run it compiled (tf.function)."""
    if fn is None:
        return lambda f: Function(f, **compile_options)
    return Function(fn, **compile_options)


def _first_unfollowable(root: Node, unfollowable: dict[int, str]) -> str | None:
    """Why a backward from `root` cannot be traced, or None: the first unfollowable
    node (by id) that a walk up the inputs from `root` reaches, not counting what
    lies behind an op whose gradient rule gives its inputs none (stop_gradient,
    zeros_like: no gradient goes there)."""
    if not unfollowable:
        return None
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in unfollowable:
            return unfollowable[id(node)]
        if REGISTRY[node.op].gradient is not ops.zero_gradient:
            stack.extend(node.inputs)
    return None


def _grad_layout(t: Tensor) -> tuple | None:
    """What the guard remembers of t.grad: None, or its shape and dtype."""
    return None if t._grad is None else (t._grad.shape, t._grad.dtype)


def _grad_alias_error(t: Tensor) -> EagerError:
    return EagerError(
        f"at {user_source_line()} a traced function reaches the .grad of a Tensor both "
        "as `.grad` and under another name (an argument, or a Tensor from outside): "
        "the trace cannot follow in-place writes through both; read it one way, or "
        "call the function eagerly")


def _open_arguments(args: tuple) -> tuple[tuple, tuple]:
    """The call's leaves (nest.flatten: each Tensor in a list, tuple or dict is an
    input of its own, as in JAX's pytrees and TF2's nests, not a Python value keyed
    by its identity) and how they nest."""
    leaves: list = []
    nesting = tuple(nest.flatten(arg, leaves) for arg in args)
    return tuple(leaves), nesting


def _leaf_paths(nesting: tuple | None, count: int) -> list[str]:
    """Each leaf's name in messages: "argument 1", or "argument 1[0]" in a tuple."""
    if nesting is None:
        return [f"argument {i}" for i in range(count)]
    return [path for i, n in enumerate(nesting) for path in nest.paths(n, f"argument {i}")]


def _call_signature(args: tuple, nesting: tuple | None = None) -> tuple | None:
    """The cache key of a call: each leaf's signature, or, for a Tensor passed
    again, ("alias", the leaf it is the same as) (writes through one name must show
    through the other, so such a call is traced on its own); then the nesting, if
    any. None when an argument is a container to open (`_open_arguments`)."""
    first: dict[int, int] = {}
    key = []
    for index, arg in enumerate(args):
        if isinstance(arg, (Tensor, np.ndarray)):
            seen = first.setdefault(id(arg), index)
            if seen != index:
                key.append(("alias", seen))
                continue
        elif nest.opens(arg):
            return None
        key.append(_signature(arg))
    if nesting is not None:
        key.append(("nesting", nesting))
    return tuple(key)


def _split_key(key: tuple) -> tuple[tuple, tuple | None]:
    """A cache key as (the leaves' signatures, the nesting or None)."""
    if key and key[-1][0] == "nesting":
        return key[:-1], key[-1][1]
    return key, None


def _entry_text(entry: tuple, paths: list[str]) -> str:
    if entry[0] == "alias":
        return f"the same as {paths[entry[1]]}"
    return str(entry[1:])


def _signature_text(key: tuple) -> str:
    """A cache key as `explain` prints it."""
    leaves, nesting = _split_key(key)
    paths = _leaf_paths(nesting, len(leaves))
    text = ", ".join(_entry_text(entry, paths) if entry[0] == "alias" else str(entry)
                     for entry in leaves)   # (an argument's entry whole: its kind too)
    if nesting is not None:
        text += ", arguments nested as " + ", ".join(map(nest.describe, nesting))
    return text


def _identities(args: tuple, trace: _Trace) -> list[tuple[int, Tensor, bool]]:
    """For each Tensor argument and each Tensor the function used from outside
    (read, written, or an argument it also reached from outside): whether they were
    the same Tensor when traced. The guard checks it again on every call."""
    used = list(trace.outside.values()) + list(trace.unified.values())
    return [(index, t, arg is t) for index, arg in enumerate(args)
            if isinstance(arg, Tensor) for t in used]


def _signature(arg: Any) -> tuple:
    if isinstance(arg, Tensor):
        return ("tensor", arg.shape, arg.dtype.str, arg.requires_grad, arg.is_leaf)
    if isinstance(arg, np.ndarray):
        return ("array", arg.shape, arg.dtype.str, False)
    try:
        hash(arg)
    except TypeError:
        raise EagerError(f"a traced function takes Tensors, arrays and hashable Python "
                         f"values; got {type(arg).__name__}") from None
    return ("python", type(arg).__name__, _exact(arg))


def _exact(value: Any) -> Any:
    """A Python value as the guard compares it: a float by its repr, which tells
    -0.0 from 0.0 (equal under ==, yet `x * -0.0` differs) and matches NaN to NaN
    of the same sign (NaN is unequal to itself, which would retrace on every call);
    tuples element-wise."""
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if value != value:   # NaN: its sign too (repr says "nan" for both)
            return "-nan" if math.copysign(1.0, value) < 0 else "nan"
        return repr(value)
    if isinstance(value, tuple):
        return tuple(_exact(v) for v in value)
    return value


def _arguments_text(leaves: tuple, nesting: tuple | None) -> str:
    """How a call's arguments nest, x for each leaf: "x, tuple(x, x)"."""
    if nesting is None:
        return ", ".join(["x"] * len(leaves))
    return ", ".join(map(nest.describe, nesting))


def _why_new(key: tuple, seen: list[tuple]) -> str:
    """Name the first argument that differs from the closest signature seen."""
    (now_leaves, now_nesting), (then_leaves, then_nesting) = _split_key(key), \
        _split_key(seen[-1])
    if now_nesting != then_nesting:
        return (f"the arguments are ({_arguments_text(now_leaves, now_nesting)}); traced "
                f"for ({_arguments_text(then_leaves, then_nesting)})")
    if len(now_leaves) != len(then_leaves):
        return f"called with {len(now_leaves)} arguments, traced with {len(then_leaves)}"
    paths = _leaf_paths(now_nesting, len(now_leaves))
    for index, (now, then) in enumerate(zip(now_leaves, then_leaves)):
        if now != then:
            return (f"{paths[index]} is {_entry_text(now, paths)}; traced for "
                    f"{_entry_text(then, paths)}")
    return "new signature"


def _as_array(value: Any) -> np.ndarray:
    return value.data if isinstance(value, Tensor) else np.asarray(value)


def _write_target(t: Tensor, args: tuple, trace: _Trace) -> Any:
    """Where a traced in-place write to `t` goes after each run: into `t` itself (a
    Tensor from outside), into the argument it stands for (its index: the caller's
    Tensor, as torch.compile writes back into mutated inputs), into the `.grad`
    that `t` was read as (("grad", owner): the Tensor that is owner.grad when the
    call starts, even if the function then replaced owner.grad), or nowhere (a
    value made inside the function: later reads in the trace already see it)."""
    if t.node is None:
        return t
    if id(t) in trace.grad_owner:
        return ("grad", trace.resolve(trace.grad_owner[id(t)]))
    index = trace.argument_index.get(id(t))
    if index is None:
        return None
    if not isinstance(args[index], Tensor):
        raise EagerError(f"the traced function writes in place into {trace.paths[index]}, "
                         "a numpy array; pass an eager Tensor (eager.tensor) to have "
                         "it updated")
    return index


def _collect(result: Any, fetches: list[Node], node_of: Callable[[Tensor], Node]) -> Any:
    """The result as (its nesting, each leaf's part): a symbolic Tensor is
    ("fetch", index) of the node `node_of` gives (the latest in-place write, if any),
    or ("fetch with history", index) when it required grad; anything else is
    ("value", the leaf), kept as it is. An object holding a traced Tensor is an
    error: it would keep the trace's stand-in, the same on every call."""
    leaves: list = []
    nesting = nest.flatten(result, leaves)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.node is not None:
            fetches.append(node_of(leaf))
            kind = "fetch with history" if leaf.requires_grad else "fetch"
            parts.append((kind, len(fetches) - 1))
            continue
        held = vars(leaf).values() if hasattr(leaf, "__dict__") else ()
        if any(isinstance(v, Tensor) and v.node is not None for v in held):
            raise EagerError(f"a traced function returned a {type(leaf).__name__} holding "
                             "a traced Tensor; return Tensors in a tuple, list, namedtuple "
                             "or dict (their values come back on every call)")
        parts.append(("value", leaf))
    return nesting, parts


def _rebuild(outputs: Any, values: list, name: str) -> Any:
    """The result as the function returned it, each fetch a new Tensor of its value.

    A result that required grad in the trace requires grad here too, as eager's
    would, but the compiled program keeps no tape for eager backward: it is marked
    opaque, so a backward that reaches it is an error, not a gradient that silently
    misses every path through the function (torch.compile differentiates through
    its graphs; tf.function's results are used with a GradientTape around the call)."""
    nesting, parts = outputs
    if nesting is None:   # one result, the common case (a comprehension costs a call)
        kind, inner = parts[0]
        return inner if kind == "value" else _result_tensor(values[inner], kind, name)
    leaves = [inner if kind == "value" else _result_tensor(values[inner], kind, name)
              for kind, inner in parts]
    return nest.unflatten(nesting, iter(leaves))


def _result_tensor(value: np.ndarray, kind: str, name: str) -> Tensor:
    result = Tensor(value)
    if kind == "fetch with history" and _thread.state.grad_enabled:
        result.requires_grad, result._op = True, "tf.function"   # (not a leaf)
        result._opaque = (
            f"the result of a call of tf.function {name}: the compiled program keeps no "
            "tape for eager backward; call backward inside the function (it writes the "
            ".grad of what it reads), or call the function eagerly")
    return result


# ----------------------------------------------------------------------------------
# Three ways to give the same ops memory, side by side
# ----------------------------------------------------------------------------------

def memory_comparison(step: Callable[..., Any], *args: Any) -> dict:
    """Run `step(*args)` once eagerly through a fresh caching allocator and once
    traced, and compare the memory each way needs for the same op sequence:

    static   the traced program's arena (memory.py's plan) and its lower bound
    caching  the allocator's peak reserved (segments) and peak allocated (blocks)
    malloc   plain malloc/free of exactly what each Tensor asks: its peak is the
             most bytes alive at once during the eager run

    `events` is the allocator's log, with `allocated` and `reserved` after every
    event, for a plot; `fragmentation` is 1 - allocated/reserved when the most
    bytes were allocated.
    Parameters and inputs made before the call are not counted by any of the three.
    """
    fresh = CachingAllocator(record=True)
    old = set_allocator(fresh)
    try:
        step(*args)
        live_requested, peak_requested = 0, 0
        requested = {}
        for event in fresh.events:
            if event["event"] == "alloc":
                requested[event["block"]] = event["requested"]
                live_requested += event["requested"]
                peak_requested = max(peak_requested, live_requested)
            elif event["event"] == "free" and event["block"] in requested:
                live_requested -= requested.pop(event["block"])
    finally:
        set_allocator(old)
    traced = Function(step)
    traced(*args)
    plan = traced.cache[next(iter(traced.cache))][0].program.memory_plan
    at_peak = max(fresh.events, key=lambda e: e["allocated"], default=None)
    return {"static_arena": plan.arena_bytes if plan else 0,
            "static_lower_bound": plan.lower_bound_bytes if plan else 0,
            "caching_reserved": fresh.peak_reserved,
            "caching_allocated": fresh.peak_allocated,
            "malloc_peak": peak_requested,
            "fragmentation": 0.0 if at_peak is None or not at_peak["reserved"]
            else 1.0 - at_peak["allocated"] / at_peak["reserved"],
            "events": fresh.events}
