"""ZeRO: data parallelism that shards the optimizer's memory over the ranks.

Plain data parallelism keeps a full copy of everything on every rank: parameters
(Psi elements), averaged gradients (Psi) and optimizer state (K Psi: Adam's m and v,
K = 2; momentum's velocity, K = 1). ZeRO (Rajbhandari et al. 2020; llm.c does stages 1
and 2) notices that the update is elementwise, so rank r only needs to *update* its
own 1/N of the parameters, and shards in three stages:

    stage 1  optimizer state sharded      allreduce the gradients, update my shard,
                                          all-gather the updated parameters
    stage 2  + gradients sharded          reduce-scatter the gradients (each rank gets
                                          the average of only its shard), update,
                                          all-gather the parameters
    stage 3  + parameters sharded         each rank stores only its shard of the
                                          parameters; all-gather them before the
                                          forward pass, reduce-scatter the gradients,
                                          update the shard in place

Per rank, in elements (the `zero_bytes_vs_formula` figure checks these on real runs):

    stage   parameters   gradients   optimizer state
      1       Psi          Psi        (K + 1) Psi / N
      2       Psi          Psi / N    (K + 1) Psi / N
      3       Psi / N      Psi / N     K Psi / N

In stages 1 and 2 the optimizer state includes the rank's *master shard* of the
parameters, the Variable the wrapped optimizer updates (ZeRO's accounting does the
same: with mixed precision its K = 12 counts the fp32 master weights). In stage 3 that
shard is the parameters' only storage.

All of it is graph nodes, built by `DistributedOptimizer(opt, comm, zero=k)`: a
`zero_reduce` node (allreduce or reduce-scatter of the flat gradients, on the comm
stream), the wrapped optimizer's own update applied to the shard (its slots are then
shard-sized: the saving), and a `zero_gather` node (all-gather). Parameters are one
flat vector in variable order, cut with `chunk_bounds` (rank r owns chunk r).

Use: build, `sess.run(init)`, `broadcast_variables(sess, comm)`, then
`opt.shard(sess)` (copies this rank's shard into the master Variable; in stage 3 drops
the full parameters from the Session). Stage 3's forward reads gathered parameters, so
fetch `opt.remap(loss)` (the same loss over the gathered parameters), and read the
trained weights with `opt.gather_variables(sess)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyflow import api, ops, shape_ops
from tinyflow.allreduce import chunk_bounds, ring_allreduce
from tinyflow.autodiff import gradients
from tinyflow.collectives import all_gather, reduce_scatter
from tinyflow.graph import Node, TinyFlowError, reachable, topological_order
from tinyflow.ops import OpDef, make, register
from tinyflow.transports import communicator

__all__ = ["ZeroOptimizer", "zero_bytes_formula", "STAGES"]

STAGES = (1, 2, 3)


# ----------------------------------------------------------------------------------
# The two ops: reduce the flat gradients, gather the flat parameters
# ----------------------------------------------------------------------------------

def _zero_reduce_infer(shapes, dtypes, attrs):
    size = attrs["total"] if attrs["stage"] == 1 else attrs["hi"] - attrs["lo"]
    return (size,), next((d for d in dtypes if d is not None), None)


def _zero_reduce_compute(xp, *grads, out=None, comm=0, stage=1, total=0, lo=0, hi=0,
                         stream="comm"):
    """Concatenate the gradients flat and average them over the ranks: all of them
    (stage 1, an allreduce) or only this rank's shard [lo, hi) (a reduce-scatter)."""
    transport = communicator(comm)
    flat = xp.empty(total, dtype=grads[0].dtype)
    offset = 0
    for g in grads:
        flat[offset:offset + g.size] = g.reshape(-1)
        offset += g.size
    label = f"zero{stage}"
    if stage == 1:
        result = ring_allreduce(flat, transport, "mean", label=label)
    else:
        result = reduce_scatter(flat, transport, "mean", label=label)
    return result


def _zero_gather_infer(shapes, dtypes, attrs):
    return (attrs["total"],), dtypes[0]


def _zero_gather_compute(xp, shard, out=None, comm=0, stage=1, total=0, stream="comm"):
    """Every rank's parameter shard, concatenated: the full flat parameters."""
    result = all_gather(shard, communicator(comm), total=total, label=f"zero{stage}")
    return result


register(OpDef("zero_reduce", _zero_reduce_compute, _zero_reduce_infer, None, pure=False,
               differentiable=False,
               doc="ZeRO: average the flat gradients over the ranks; stage 1 keeps all "
                   "(allreduce), stages 2-3 only this rank's shard (reduce-scatter)"))
register(OpDef("zero_gather", _zero_gather_compute, _zero_gather_infer, None, pure=False,
               differentiable=False,
               doc="ZeRO: all-gather the parameter shards into the full flat parameters"))


def zero_bytes_formula(stage: int, params: int, size: int, slots: int, itemsize: int
                       ) -> dict[str, float]:
    """Bytes per rank the ZeRO paper's accounting predicts (see the module table)."""
    shard = params / size
    return {"parameters": itemsize * (params if stage < 3 else shard),
            "gradients": itemsize * (params if stage == 1 else shard),
            "optimizer state": itemsize * (slots + (1 if stage < 3 else 0)) * shard}


# ----------------------------------------------------------------------------------
# The optimizer wrapper
# ----------------------------------------------------------------------------------

def _flat(nodes: Sequence[Node]) -> Node:
    """The nodes flattened and joined, in order: one (total,) vector."""
    # (-1,), not (prod(shape),): a 0 there would copy dim 0 of an empty (3, 0).
    pieces = [shape_ops.reshape(n, (-1,)) for n in nodes]
    return pieces[0] if len(pieces) == 1 else shape_ops.concat(pieces, 0)


class ZeroOptimizer:
    """`optimizer` with its state (and, by stage, gradients and parameters) sharded
    over the ranks of `comm`. Built by `DistributedOptimizer(..., zero=stage)`; see
    the module docstring for the stages and the calls around training.
    """

    def __init__(self, optimizer: Any, comm: Any, comm_key: int, stage: int) -> None:
        if stage not in STAGES:
            raise ValueError(f"zero must be one of {STAGES} (or 0 for plain data "
                             f"parallelism), got {stage!r}")
        self.optimizer, self.comm, self.comm_key, self.stage = optimizer, comm, comm_key, stage
        self.variables: list[Node] = []
        self.views: dict[int, Node] = {}     # stage 3: id(variable) -> gathered view
        self.reduce_node: Node | None = None
        self.gather_node: Node | None = None
        self.master: Node | None = None
        self._remapped: dict[int, Node] = {}

    # -- layout --------------------------------------------------------------------
    def _layout(self, variables: Sequence[Node]) -> None:
        dtypes = {np.dtype(v.dtype) for v in variables}
        if len(dtypes) != 1 or any(v.shape is None or None in v.shape for v in variables):
            raise TinyFlowError("ZeRO needs trainable variables of one dtype and known "
                                "shapes (call tf.infer_variable_shapes before minimize)")
        self.variables = list(variables)
        self.dtype = dtypes.pop()
        self.total = sum(math.prod(v.shape) for v in variables)
        self.lo, self.hi = chunk_bounds(self.total, self.comm.size)[self.comm.rank]
        self.master = api.Variable(ops.zeros((self.hi - self.lo,), self.dtype),
                                   name=f"zero{self.stage}_shard_rank{self.comm.rank}",
                                   trainable=False)
        self.load_shard = api.assign(self.master,
                                     shape_ops.getitem(_flat(self.variables),
                                                 slice(self.lo, self.hi)))

    def _pieces(self, flat: Node) -> list[Node]:
        """flat (total,) cut back into one node per variable, shaped like it."""
        pieces, offset = [], 0
        for var in self.variables:
            count = math.prod(var.shape)
            piece = shape_ops.getitem(flat, slice(offset, offset + count))
            # var.shape reads literally: piece is (count,), so only a leading 0 is a
            # copy, and then count, the dim it copies, is 0 too.
            piece = shape_ops.reshape(piece, var.shape)
            pieces.append(piece)
            offset += count
        return pieces

    # -- building the training step --------------------------------------------------
    def minimize(self, loss: Node, var_list: Sequence[Node] | None = None) -> Node:
        if var_list is None:
            under = {id(n) for n in reachable([loss])}
            var_list = [v for v in api.trainable_variables() if id(v) in under]
        self._layout(var_list)
        if self.stage == 3:
            self.gather_node = make("zero_gather", self.master, comm=self.comm_key,
                                    stage=3, total=self.total, stream="comm",
                                    name="zero3_gather_params")
            for var, view in zip(self.variables, self._pieces(self.gather_node)):
                self.views[id(var)] = view
            loss = self.remap(loss)
            xs = [self.views[id(v)] for v in self.variables]
        else:
            xs = self.variables
        grads = gradients(loss, xs)
        missing = [v.name for v, g in zip(self.variables, grads) if g is None]
        if missing:
            raise TinyFlowError(f"ZeRO: the loss does not depend on {missing}")
        self.reduce_node = make("zero_reduce", *grads, comm=self.comm_key, stage=self.stage,
                                total=self.total, lo=self.lo, hi=self.hi, stream="comm",
                                name=f"zero{self.stage}_reduce_grads")
        self.reduce_node.phase = "backward"
        shard_grad = self.reduce_node if self.stage > 1 else shape_ops.getitem(
            self.reduce_node, slice(self.lo, self.hi))
        update = self.optimizer.apply_gradients([(shard_grad, self.master)])
        if self.stage == 3:
            return api.group(self.reduce_node, update)
        # Stages 1-2: everyone's updated shard, gathered back into the full parameters.
        self.gather_node = make("zero_gather", update_value(update, self.master),
                                comm=self.comm_key, stage=self.stage, total=self.total,
                                stream="comm", name=f"zero{self.stage}_gather_params")
        writes = [api.assign(var, piece)
                  for var, piece in zip(self.variables, self._pieces(self.gather_node))]
        return api.group(self.reduce_node, *writes)

    def remap(self, node: Node) -> Node:
        """`node` as the stage-3 graph computes it: every read of a sharded parameter
        becomes a read of its slice of the gathered parameters (other stages: `node`)."""
        if self.stage != 3:
            return node
        mapped = self._remapped
        for old in topological_order([node]):
            if id(old) in mapped:
                continue
            if id(old) in self.views:
                mapped[id(old)] = self.views[id(old)]
                continue
            inputs = [mapped.get(id(i), i) for i in old.inputs]
            if all(a is b for a, b in zip(inputs, old.inputs)):
                mapped[id(old)] = old
                continue
            mapped[id(old)] = Node(old.op, inputs, old.attrs, shape=old.shape,
                                   dtype=old.dtype, where=old.where,
                                   provenance=old.provenance, phase=old.phase,
                                   grad_of=old.grad_of)
        return mapped[id(node)]

    # -- around training ------------------------------------------------------------
    def shard(self, session: Any) -> None:
        """Copy this rank's shard of the (initialized, broadcast) parameters into its
        master Variable; in stage 3 then drop the full parameters from the Session."""
        session.run(self.load_shard)
        if self.stage == 3:
            for var in self.variables:
                session.variables.pop(var, None)

    def gather_variables(self, session: Any) -> list[np.ndarray]:
        """The full parameters, in variable order (stage 3 all-gathers the shards:
        every rank must call it)."""
        if self.stage < 3:
            return [np.array(session.variables[v]) for v in self.variables]
        flat = all_gather(np.asarray(session.variables[self.master]), self.comm,
                          total=self.total, label="zero3")
        pieces, offset = [], 0
        for var in self.variables:
            count = math.prod(var.shape)
            pieces.append(flat[offset:offset + count].reshape(var.shape))
            offset += count
        return pieces

    def held_bytes(self, session: Any, reduced: np.ndarray) -> dict[str, int]:
        """Bytes this rank holds after a step: parameters (the full Variables, or the
        stage-3 shard), reduced gradients (`reduced`, the zero_reduce node's value
        fetched from a run), optimizer state (slots shaped like the shard, plus the
        master shard in stages 1-2)."""
        # The wrapped optimizer's slots of this shard (by name they were also
        # another model's: a benchmark counted earlier models' slots of the same name)
        slots = [self.optimizer.get_slot(self.master, name)
                 for name in self.optimizer.get_slot_names()]
        slots = [v for v in slots if v is not None and v in session.variables]
        params = (sum(session.variables[v].nbytes for v in self.variables)
                  if self.stage < 3 else session.variables[self.master].nbytes)
        state = sum(session.variables[v].nbytes for v in slots)
        if self.stage < 3:
            state += session.variables[self.master].nbytes
        return {"parameters": int(params), "gradients": int(reduced.nbytes),
                "optimizer state": int(state)}


def update_value(update: Node, master: Node) -> Node:
    """The node whose value is `master`'s new value inside the optimizer's update
    group (the assign to it), so the gather reads the updated shard."""
    for node in update.inputs:  # the optimizer's group of its per-variable assigns
        if node.inputs and node.inputs[0] is master:
            return node
    raise TinyFlowError("ZeRO: the wrapped optimizer did not assign the parameters")
