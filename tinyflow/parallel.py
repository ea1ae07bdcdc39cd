"""Data-parallel training: every rank runs the same program on its shard of the batch,
and gradients are averaged across ranks, in the graph, before the update.

Horovod's design (Sergeev & Del Balso 2018), with PyTorch DDP's buckets (Li et al.
2020):

* `DistributedOptimizer(optimizer, comm)` wraps any tf.train optimizer. Between
  computing the gradients and applying them it inserts **allreduce nodes** into the
  graph: one per *bucket* of gradients, whose output is the bucket's gradients
  flattened, concatenated and averaged over the ranks (ring_allreduce, op "mean").
  Slices of it, reshaped, feed the wrapped optimizer's updates, so every rank applies
  the same averaged gradient and the replicas stay identical.
* Buckets are filled in the reverse order of the forward pass: the last layer's
  gradients are computed first in backward, so its bucket is ready (and sent) while
  the earlier layers' gradients are still being computed. Allreduce nodes carry
  attrs["stream"] = "comm": the executor runs them on a separate comm stream, so
  communication overlaps the rest of backward. Fewer, larger buckets cost less
  per-message latency; smaller ones start communicating sooner (`bucket_bytes`).
* `broadcast_variables(session, comm)` copies rank 0's initial parameters to every
  rank, so all replicas start equal.

Node attrs must be plain hashable values, so an allreduce node names its transport
by an int key into `COMMUNICATORS` (`register_communicator`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyflow import api, ops, shape_ops
from tinyflow.allreduce import broadcast, ring_allreduce, ring_timeline_events
from tinyflow.graph import Node, ShapeError, tensor_nbytes, topological_order
from tinyflow.ops import OpDef, make, register
from tinyflow.transports import (  # noqa: F401  (COMMUNICATORS: public here too)
    COMMUNICATORS,
    Transport,
    communicator,
    register_communicator,
)

__all__ = ["DistributedOptimizer", "broadcast_variables", "register_communicator",
           "communicator", "plan_buckets", "timeline_with_ring_steps", "COMMUNICATORS",
           "DEFAULT_BUCKET_BYTES"]

# PyTorch DDP's default bucket cap is 25 MiB; our CPU models are small, so buckets of
# 1 MiB let even a small MLP overlap its last layer's allreduce with backward.
DEFAULT_BUCKET_BYTES = 1 << 20

# ----------------------------------------------------------------------------------
# The allreduce op
# ----------------------------------------------------------------------------------

def _allreduce_infer(shapes, dtypes, attrs):
    if any(d is None for s in shapes for d in s):
        total = None
    else:
        total = sum(math.prod(s) for s in shapes)
    kinds = {np.dtype(d).str for d in dtypes if d is not None}
    if len(kinds) > 1:
        raise ops.Mismatch("the gradients of one allreduce bucket must share a dtype")
    return (total,), next((d for d in dtypes if d is not None), None)


def _allreduce_compute(xp, *grads, out=None, comm=0, reduce="mean", stream="comm",
                       bucket=0):
    """Flatten and concatenate the bucket's gradients into `out`, then allreduce it
    in place across the ranks of communicator `comm`."""
    called = time.perf_counter()  # lines ring steps up with the timeline's event
    transport = communicator(comm)
    total = sum(g.size for g in grads)
    flat = out if out is not None else xp.empty(total, dtype=grads[0].dtype)
    offset = 0
    for g in grads:
        flat[offset:offset + g.size] = g.reshape(-1)
        offset += g.size
    if transport.trace is None:
        return ring_allreduce(flat, transport, reduce)
    steps: list[dict] = []
    result = ring_allreduce(flat, transport, reduce, record=steps)
    transport.trace.extend({**step, "bucket": bucket, "called": called} for step in steps)
    return result


register(OpDef("allreduce", _allreduce_compute, _allreduce_infer, None, pure=False,
               differentiable=False,
               doc="concatenate the inputs (one gradient bucket) flat and reduce them "
                   "across ranks (attrs: comm key, reduce, stream='comm', bucket index)"))


def timeline_with_ring_steps(timeline: list[dict], records: Sequence[dict]) -> list[dict]:
    """The executor's timeline of one run plus one event per ring step, so a viewer
    shows the ring turning inside each allreduce node, on the comm stream.

    `records` is a transport's `trace` list, filled by the allreduce ops while the
    run was traced (set ``comm.trace = []`` before it). Calls run one after another
    on the comm stream, so the k-th allreduce event of the timeline is the k-th call
    among the last ones recorded; its "called" time (perf_counter) lines the steps
    up with the event's start (seconds from the run's start).
    """
    calls: list[list[dict]] = []
    for record in records:
        if "called" not in record:
            continue  # a direct ring_allreduce call, not an allreduce node
        if not calls or record["called"] != calls[-1][0]["called"]:
            calls.append([])
        calls[-1].append(record)
    events = [e for e in timeline if e["op"] == "allreduce"]
    merged = list(timeline)
    for event, call in zip(events, calls[-len(events):] if events else []):
        t0 = call[0]["called"] - event["start"]
        merged += ring_timeline_events(call, t0, event["stream"], node=event["node"])
    return sorted(merged, key=lambda e: e["start"])


# ----------------------------------------------------------------------------------
# Buckets and the optimizer wrapper
# ----------------------------------------------------------------------------------

def _nbytes(var: Node) -> int:
    nbytes = tensor_nbytes(var.shape, var.dtype or np.float32)
    if nbytes is None:
        raise ShapeError(f"DistributedOptimizer needs the shape of {var.name} (created at "
                         f"{var.where}) to bucket its gradient; call "
                         "tf.infer_variable_shapes before minimize")
    return nbytes


def plan_buckets(grads_and_vars: Sequence[tuple[Node, Node]], loss: Node,
                 bucket_bytes: int) -> list[list[tuple[Node, Node]]]:
    """Group (gradient, variable) pairs into buckets, last-used variable first.

    Variables are ordered by where the forward pass first reads them; walking that
    order backwards follows the order backward produces their gradients. A bucket is
    closed once it holds at least `bucket_bytes` (PyTorch DDP's rule) or when the
    next gradient has another dtype (a bucket is one flat array).
    """
    first_use: dict[int, int] = {}
    for position, node in enumerate(topological_order([loss])):
        for inp in node.inputs:
            first_use.setdefault(id(inp), position)
    ordered = sorted(grads_and_vars, key=lambda gv: first_use.get(id(gv[1]), -1),
                     reverse=True)
    buckets: list[list[tuple[Node, Node]]] = []
    current: list[tuple[Node, Node]] = []
    filled = 0
    dtype_of = lambda gv: np.dtype(gv[0].dtype or gv[1].dtype or np.float32)  # noqa: E731
    for grad, var in ordered:
        if current and dtype_of((grad, var)) != dtype_of(current[0]):
            buckets.append(current)
            current, filled = [], 0
        current.append((grad, var))
        filled += _nbytes(var)
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class DistributedOptimizer:
    """Wrap `optimizer` so its gradients are averaged across the ranks of `comm`.

    compute_gradients(loss) returns [(averaged gradient, variable)], each averaged
    gradient a slice of its bucket's allreduce node; apply_gradients and minimize
    build the same training op as the wrapped optimizer, plus the allreduce nodes.
    With one rank the allreduces are no-ops and training matches the plain optimizer.

    bucket_bytes  close a bucket once it holds this many bytes of gradients
    op            "mean" (Horovod's default: the step of the global batch when each
                  rank's loss is a mean over its shard) or "sum"
    zero          0: plain data parallelism; 1, 2, 3: ZeRO stages (zero.py): shard the
                  optimizer state, also the gradients, also the parameters. Then
                  `minimize` builds the ZeRO step (op "mean", one flat bucket) and
                  `shard`, `remap`, `gather_variables` and `zero_stage` are there too.
    """

    def __init__(self, optimizer: Any, comm: Transport,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, op: str = "mean",
                 zero: int = 0) -> None:
        if op not in ("mean", "sum"):
            raise ValueError(f"DistributedOptimizer op must be 'mean' or 'sum', got {op!r}")
        self.optimizer = optimizer
        self.comm = comm
        self.comm_key = register_communicator(comm)
        self.zero_stage = zero
        self.zero = None
        if zero:
            from tinyflow.zero import ZeroOptimizer  # zero.py builds on this module
            if op != "mean":
                raise ValueError("ZeRO averages gradients (op='mean')")
            self.zero = ZeroOptimizer(optimizer, comm, self.comm_key, zero)
        # (0: a bucket per gradient; "big" or -5 once passed int() or went unchecked)
        self.bucket_bytes = ops.int_attr("DistributedOptimizer", "bucket_bytes", bucket_bytes)
        if self.bucket_bytes < 0:
            raise ops.argument_error("DistributedOptimizer", "bucket_bytes must be >= 0 "
                                     f"(0: a bucket per gradient), got {bucket_bytes!r}")
        self.op = op
        self.allreduce_nodes: list[Node] = []   # in bucket order (last layer first)
        self._bucket_of: dict[int, Node] = {}   # id(averaged grad) -> its allreduce

    def compute_gradients(self, loss: Node, var_list: Sequence[Node] | None = None
                          ) -> list[tuple[Node, Node]]:
        local = self.optimizer.compute_gradients(loss, var_list)
        averaged: list[tuple[Node, Node]] = []
        for bucket in plan_buckets(local, loss, self.bucket_bytes):
            reduced = make("allreduce", *[g for g, _ in bucket], comm=self.comm_key,
                           reduce=self.op, stream="comm", bucket=len(self.allreduce_nodes),
                           name=f"allreduce_bucket{len(self.allreduce_nodes)}")
            reduced.phase = "backward"
            self.allreduce_nodes.append(reduced)
            offset = 0
            for _, var in bucket:
                count = math.prod(var.shape)
                piece = shape_ops.getitem(reduced, slice(offset, offset + count))
                piece.phase = "backward"
                if len(var.shape) != 1:  # a slice is already the shape of a vector
                    # var.shape reads literally: piece is (count,), so only a leading
                    # 0 is a copy, and then count, the dim it copies, is 0 too.
                    piece = shape_ops.reshape(piece, var.shape)
                    piece.phase = "backward"
                self._bucket_of[id(piece)] = reduced
                averaged.append((piece, var))
                offset += count
        return averaged

    def apply_gradients(self, grads_and_vars: Sequence[tuple[Node, Node]]) -> Node:
        """The wrapped optimizer's update, grouped *after* the allreduce nodes.

        The executor runs nodes in the order a depth-first walk from the outputs
        meets them. Listing the allreduces first makes that order "backward for
        bucket 0, allreduce 0, backward for bucket 1, allreduce 1, ..., updates", so
        each bucket is sent as soon as it is ready and no update (which waits for
        its allreduce) blocks the compute stream before backward is done.
        """
        reduces: list[Node] = []
        for grad, _ in grads_and_vars:
            node = self._bucket_of.get(id(grad))
            if node is not None and all(node is not r for r in reduces):
                reduces.append(node)
        return api.group(*reduces, self.optimizer.apply_gradients(grads_and_vars))

    def minimize(self, loss: Node, var_list: Sequence[Node] | None = None) -> Node:
        if self.zero is not None:
            return self.zero.minimize(loss, var_list)
        return self.apply_gradients(self.compute_gradients(loss, var_list))

    # -- ZeRO (zero != 0): see zero.py ------------------------------------------------
    def shard(self, session: Any) -> None:
        """ZeRO: after init and broadcast_variables, keep this rank's shard."""
        self._zero().shard(session)

    def remap(self, node: Node) -> Node:
        """ZeRO stage 3: `node` over the gathered parameters (other stages: `node`)."""
        return self._zero().remap(node)

    def gather_variables(self, session: Any) -> list[np.ndarray]:
        """ZeRO: the full trained parameters, in variable order (all ranks call it)."""
        return self._zero().gather_variables(session)

    def _zero(self) -> Any:
        if self.zero is None:
            raise ValueError("this DistributedOptimizer was built without zero=1|2|3")
        return self.zero


def broadcast_variables(session: Any, comm: Transport, root: int = 0,
                        variables: Sequence[Node] | None = None) -> None:
    """Overwrite every rank's variable values with rank `root`'s (after initializing).

    `variables` defaults to every global variable the session holds, in creation
    order, which is the same on every rank that built the same program. Values are
    written in place, so compiled programs keep their buffers.
    """
    if variables is None:
        variables = [v for v in api.global_variables() if v in session.variables]
    for var in variables:
        value = session.variables[var]
        result = broadcast(value, comm, root)
        if result is not value:
            session.variables[var] = result
