"""Tensor parallelism: Megatron's column-then-row split of an MLP, as a graph rewrite.

An MLP block y = act(x W1 + b1) W2 is split over N ranks without changing its math
(Shoeybi et al. 2019, "Megatron-LM"):

* **column split** of W1 (in x h): rank r keeps the columns h*r/N .. h*(r+1)/N (and
  those entries of b1). Its x W1_r + b1_r is rank r's slice of the hidden layer; an
  elementwise activation needs no communication.
* **row split** of W2 (h x out): rank r keeps the matching rows. act(.)_r W2_r is a
  partial sum of x W2; an **allreduce** (sum) adds the partials: every rank has y.

Attention splits the same way, by heads: Q, K and V projections column-split (rank r
keeps heads H*r/N .. H*(r+1)/N, which are contiguous columns), each head's attention is
local, and the output projection is row-split. Between the two, a split tensor may go
through ops that keep the heads apart: elementwise ops, the reshape into (B, T, H, D/H)
and back, transposes, batched matmuls of two tensors split on the same batch axis, and
softmax over another axis. `SPLIT_RULES` says, per op, where the rank's slice goes.

Megatron's two conjugate operators make autodiff produce the backward collectives by
itself: `tp_copy` (called f in the paper) is the identity forward and an allreduce of
the gradient backward (each rank's x feeds only its columns); `tp_allreduce` (g) is
the allreduce forward and the identity backward. Per block and step a rank therefore
sends one ring allreduce of the (batch x out) activations forward and one of the
(batch x in) gradients backward: `tp_bytes_vs_theory` checks exactly that.

`TensorParallel(comm)` is the pass: mark weights with `split_column(W, bias=b)` and
`split_row(W)`, then `apply(loss)` rewrites the forward graph for this rank (before
`minimize`, so autodiff sees the collectives), making shard Variables W_r, and appends
one RewriteRecord per rewrite with its reason, so `tf.explain(tp)` prints them.
After initializing, `tp.shard(session)` fills the shards from the full weights (and
drops those); `tp.gather_variables(session)` reassembles them.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from tinyflow import api
from tinyflow.allreduce import chunk_bounds, ring_allreduce
from tinyflow.graph import Graph, Node, TinyFlowError, topological_order
from tinyflow.ops import REGISTRY, OpDef, make, register
from tinyflow.passes import PassContext
from tinyflow.transports import Transport, communicator, register_communicator

__all__ = ["TensorParallel", "tp_bytes_theory"]


# ----------------------------------------------------------------------------------
# Megatron's f and g as ops
# ----------------------------------------------------------------------------------

def _same_infer(shapes, dtypes, attrs):
    return shapes[0], dtypes[0]


def _tp_copy_compute(xp, x, out=None, comm=0):
    if out is None:
        return x.copy()
    out[...] = x
    return out


def _tp_allreduce_compute(xp, x, out=None, comm=0):
    result = out if out is not None else xp.empty_like(x)
    result[...] = x
    return ring_allreduce(result, communicator(comm), "sum", label="tp")


def _tp_copy_grad(node: Node, grad: Node) -> list:
    return [make("tp_allreduce", grad, comm=node.attrs["comm"])]


def _tp_allreduce_grad(node: Node, grad: Node) -> list:
    return [make("tp_copy", grad, comm=node.attrs["comm"])]


register(OpDef("tp_copy", _tp_copy_compute, _same_infer, _tp_copy_grad, pure=False,
               doc="tensor parallel f: identity forward, allreduce of the gradient "
                   "backward (the input of a column-split matmul)"))
register(OpDef("tp_allreduce", _tp_allreduce_compute, _same_infer, _tp_allreduce_grad,
               pure=False,
               doc="tensor parallel g: allreduce (sum) of the partial products of a "
                   "row-split matmul forward, identity backward"))


def tp_bytes_theory(batch: int, blocks: list[tuple[int, int]], size: int,
                    itemsize: int, first_input_needs_grad: bool = False) -> float:
    """Bytes a rank sends per training step for column-then-row blocks (in, out):
    a ring allreduce (2(N-1)/N of the array) of batch x out forward, and one of
    batch x in backward, except for a first block fed by data (no gradient needed)."""
    elements = sum(batch * out for _, out in blocks)
    elements += sum(batch * inp for k, (inp, _) in enumerate(blocks)
                    if k or first_input_needs_grad)
    return 2.0 * (size - 1) / size * elements * itemsize


# ----------------------------------------------------------------------------------
# The rewrite
# ----------------------------------------------------------------------------------

class TensorParallel:
    """The tensor-parallel rewrite for rank `comm.rank` of `comm.size` (see module)."""

    def __init__(self, comm: Transport) -> None:
        self.comm = comm
        self.key = register_communicator(comm)
        self.columns: dict[int, Node | None] = {}   # id(W) -> its bias (or None)
        self.rows: set[int] = set()
        self.shards: dict[int, tuple[Node, Node, tuple]] = {}  # id(full) -> (full, shard, index)
        self.ctx = PassContext(current_pass="tensor_parallel")

    def split_column(self, weight: Node, bias: Node | None = None) -> None:
        """Split `weight` (in x out) and `bias` (out) by output columns (W's rows when
        its matmul reads it transposed, transpose_b: W is then out x in)."""
        self.columns[id(weight)] = bias

    def split_row(self, weight: Node) -> None:
        """Split `weight` (in x out) by input rows (W's columns under transpose_b); its
        matmul's result is allreduced."""
        self.rows.add(id(weight))

    def _shard(self, full: Node, axis: int, reader: Node) -> Node:
        """This rank's Variable for its slice of `full` along `axis` (made once)."""
        if id(full) in self.shards:
            self._check_same_cut(full, axis, reader)
        else:
            n = full.shape[axis]
            if n % self.comm.size:
                raise TinyFlowError(f"tensor parallel: {full.name} has {n} "
                                    f"{'columns' if axis else 'rows'}, not divisible by "
                                    f"{self.comm.size} ranks")
            lo, hi = chunk_bounds(n, self.comm.size)[self.comm.rank]
            index = tuple(slice(lo, hi) if a == axis else slice(None)
                          for a in range(len(full.shape)))
            shape = tuple(hi - lo if a == axis else d for a, d in enumerate(full.shape))
            shard = api.Variable(np.zeros(shape, full.dtype), dtype=full.dtype,
                                 name=f"{full.name}/tp{self.comm.rank}")
            self.shards[id(full)] = (full, shard, index)
        return self.shards[id(full)][1]

    def _check_same_cut(self, full: Node, axis: int, reader: Node) -> None:
        """One Variable holds one slice, so every reader must cut `full` the same way:
        a weight used both as W and as W^T (tied) would need both of its axes cut."""
        index = self.shards[id(full)][2]
        if index[axis] == slice(None):
            held = next(a for a, s in enumerate(index) if s != slice(None))
            raise TinyFlowError(
                f"tensor parallel: {reader.name} ({reader.op}, at {reader.where}) splits "
                f"{full.name} along axis {axis}, but another matmul already split it along "
                f"axis {held}; a weight can be split only one way (a transposed use cuts "
                "the other axis)")

    def apply(self, output: Node) -> Node:
        """`output`'s graph rewritten for this rank: marked matmuls split, collectives
        inserted. Raises TinyFlowError when a split tensor reaches an op that is not
        elementwise (its math would change) before a row-split matmul joins it, or when
        anything but its marked matmul reads a split weight (no rank holds it whole)."""
        self.mapped: dict[int, Node] = {}
        # id(new node) -> the axis along which it holds only this rank's slice
        self.split: dict[int, int] = {}
        self.copies: dict[int, Node] = {}  # id(input) -> its tp_copy (one f per input)
        began = time.perf_counter()
        for node in topological_order([output]):
            self.mapped[id(node)] = self._rewrite(node)
            self._check_reads(node, self.mapped[id(node)])
        result = self.mapped[id(output)]
        # Snapshots before and after, as the compile pipeline keeps them, so the
        # debugger and tf.explain step through this rewrite like any pass.
        self.ctx.snapshots += [("input", Graph([output]), 0.0),
                               ("tensor_parallel", Graph([result]),
                                time.perf_counter() - began)]
        return result

    def _rewrite(self, node: Node) -> Node:
        inputs = [self.mapped[id(i)] for i in node.inputs]
        if node.op == "matmul" and id(node.inputs[1]) in self.columns:
            return self._column(node, inputs)
        if node.op == "matmul" and id(node.inputs[1]) in self.rows:
            return self._row(node, inputs)
        if not any(id(i) in self.split for i in inputs):
            if all(a is b for a, b in zip(inputs, node.inputs)):
                return node
            return make(node.op, *inputs, name=None, **node.attrs)
        if REGISTRY[node.op].elementwise:
            new, axis = self._elementwise(node, inputs)
        elif node.op in SPLIT_RULES:
            new, axis = SPLIT_RULES[node.op](self, node, inputs)
        else:
            raise self._refuse(node, "is not elementwise and does not keep the ranks' "
                                     "slices apart; split the next matmul's weight by rows "
                                     "first")
        self.split[id(new)] = axis
        return new

    def _check_reads(self, node: Node, new: Node) -> None:
        """Only the marked matmul (and the add of a marked bias) read a split Variable:
        there the rewrite swaps in the shard. Any other reader, an L2 term say, would
        still read the full Variable, which `shard()` drops on every rank: training
        would silently lose that term's gradient, so it is refused here."""
        for i in new.inputs:
            if id(i) in self.columns or id(i) in self.rows or self._is_bias(i):
                raise TinyFlowError(
                    f"tensor parallel: {node.name} ({node.op}, at {node.where}) reads "
                    f"{i.name} {_shape(i)} whole, but {i.name} is split over the ranks: "
                    "each rank holds only its shard (only its marked matmul, or its "
                    "bias add, reads it). Compute such a term on the shard and "
                    "all-reduce it, or don't split that weight")

    def _refuse(self, node: Node, why: str) -> TinyFlowError:
        return TinyFlowError(f"tensor parallel: {node.name} ({node.op}, at {node.where}) "
                             f"reads a column-split tensor but {why}")

    def _elementwise(self, node: Node, inputs: list[Node]) -> tuple[Node, int]:
        """An elementwise op on split inputs: every split input holds its slice on the
        same output axis; an unsplit input must be a marked bias (it is sharded) or
        have size 1 there (it broadcasts over the slice unchanged)."""
        ndim = len(node.shape)
        axes = {self.split[id(i)] + ndim - len(i.shape) for i in inputs if id(i) in self.split}
        if len(axes) != 1:
            raise self._refuse(node, f"its inputs are split along different axes {axes}")
        (axis,) = axes
        sharded = []
        for i in inputs:
            own = axis - (ndim - len(i.shape))  # the same axis, counted in i's dims
            if id(i) in self.split or own < 0 or i.shape[own] == 1:
                sharded.append(i)
            elif self._is_bias(i):
                sharded.append(self._shard(i, 0, node))
            else:
                raise self._refuse(node, f"also reads {i.name} {_shape(i)} whole along "
                                         f"the split axis {axis}")
        return make(node.op, *sharded, **node.attrs), axis

    def _is_bias(self, node: Node) -> bool:
        return any(bias is node for bias in self.columns.values())

    def _column(self, node: Node, inputs: list[Node]) -> Node:
        weight, transposed = node.inputs[1], node.attrs.get("transpose_b", False)
        # One f per input: Q, K and V read the same x, so their gradients meet in one
        # tp_copy and backward allreduces their sum once (as Megatron's f does).
        if id(inputs[0]) not in self.copies:
            self.copies[id(inputs[0])] = make("tp_copy", inputs[0], comm=self.key)
        x = self.copies[id(inputs[0])]
        # x W^T (transpose_b) stores W as (out x in): its output columns are W's rows.
        shard = self._shard(weight, 0 if transposed else 1, node)
        new = make("matmul", x, shard, **node.attrs)  # keeps transpose_a/_b
        self.split[id(new)] = len(new.shape) - 1
        self.ctx.record([node], [x, new],
                        f"column-split {weight.name} {_shape(weight)} -> {_shape(shard)}"
                        f"{' (used transposed: its rows)' if transposed else ''} on rank "
                        f"{self.comm.rank} of {self.comm.size}; tp_copy (f) before it: its "
                        "gradient is allreduced in backward")
        return new

    def _row(self, node: Node, inputs: list[Node]) -> Node:
        weight, x = node.inputs[1], inputs[0]
        transposed = node.attrs.get("transpose_b", False)
        # The matmul sums over x's last axis (its second last with transpose_a): that
        # axis must hold this rank's slice, to meet the rows of W it keeps.
        inner = len(x.shape) - (2 if node.attrs.get("transpose_a") else 1)
        if self.split.get(id(x)) != inner:
            raise TinyFlowError(f"tensor parallel: {weight.name} is split by rows, so its "
                                f"input must be column-split (mark the previous layer with "
                                f"split_column); {node.name} at {node.where}")
        # x W^T (transpose_b) stores W as (out x in): the rows it sums over are W's columns.
        shard = self._shard(weight, 1 if transposed else 0, node)
        partial = make("matmul", x, shard, **node.attrs)  # keeps transpose_a/_b
        total = make("tp_allreduce", partial, comm=self.key)
        self.ctx.record([node], [partial, total],
                        f"row-split {weight.name} {_shape(weight)} -> {_shape(shard)}"
                        f"{' (used transposed: its columns)' if transposed else ''}; "
                        "tp_allreduce (g) sums the ranks' partial products")
        return total

    # -- around training --------------------------------------------------------------
    def shard(self, session: Any) -> None:
        """Fill this rank's shards from the initialized full weights; drop the full."""
        for full, shard, index in self.shards.values():
            session.variables[shard] = np.ascontiguousarray(session.variables[full][index])
            session.variables.pop(full, None)

    def gather_variables(self, session: Any, variables: list[Node]) -> list[np.ndarray]:
        """The full values of `variables` (the original, unsplit ones): split ones are
        all-gathered along their split axis (every rank must call it)."""
        from tinyflow.collectives import all_gather
        result = []
        for var in variables:
            if id(var) not in self.shards:
                result.append(np.array(session.variables[var]))
                continue
            _, shard, index = self.shards[id(var)]
            axis = next(a for a, s in enumerate(index) if s != slice(None))
            local = np.moveaxis(np.asarray(session.variables[shard]), axis, 0)
            whole = all_gather(np.ascontiguousarray(local), self.comm,
                               total=math.prod(var.shape))
            moved = (var.shape[axis], *[d for a, d in enumerate(var.shape) if a != axis])
            result.append(np.moveaxis(whole.reshape(moved), 0, axis))
        return result


def _shape(node: Node) -> str:
    return "x".join(map(str, node.shape))


# ----------------------------------------------------------------------------------
# Where a rank's slice goes through ops that are not elementwise
# ----------------------------------------------------------------------------------
# Each rule gets the pass, the original node and its rewritten inputs, and returns the
# new node and the output axis that holds the slice (or raises, naming the node).

def _split_reshape(tp: TensorParallel, node: Node, inputs: list[Node]) -> tuple[Node, int]:
    """A slice along axis a of x is, for each index of the axes before a, one
    contiguous run of x[a:] (size prod(x.shape[a:]) / N). After the reshape the same
    run is a slice along the output axis j whose trailing size prod(out[j:]) equals
    prod(x.shape[a:]), if out[j] divides by N: (B*T, D) -> (B, T, H, D/H) puts the
    slice of D on H; (B, T, H, D/H) -> (B*T, D) puts the slice of H on D."""
    (x,) = inputs
    axis = tp.split[id(x)]
    full_in, out = node.inputs[0].shape, node.shape
    trailing = math.prod(full_in[axis:])
    for j in range(len(out)):
        if out[j] is not None and all(d is not None for d in out[j:]) \
                and math.prod(out[j:]) == trailing and out[j] % tp.comm.size == 0:
            shape = list(node.attrs["shape"])
            shape[j] = out[j] // tp.comm.size
            return make("reshape", x, shape=tuple(shape)), j
    raise tp._refuse(node, f"its reshape {_shape(node.inputs[0])} -> {_shape(node)} mixes "
                           f"the split axis {axis} with others")


def _split_transpose(tp: TensorParallel, node: Node, inputs: list[Node]) -> tuple[Node, int]:
    """The slice moves with its axis. No axes reverse them (numpy's default); a
    negative axis counts from the end."""
    (x,) = inputs
    ndim, axes = len(x.shape), node.attrs.get("axes")
    order = list(reversed(range(ndim))) if axes is None else [a % ndim for a in axes]
    return make("transpose", x, **node.attrs), order.index(tp.split[id(x)])


def _split_batched_matmul(tp: TensorParallel, node: Node, inputs: list[Node]
                          ) -> tuple[Node, int]:
    """A batched matmul of two tensors split on the same batch axis (each head's
    Q K^T, or weights x V): every batch entry is computed from its own slices."""
    axes = {tp.split.get(id(i)) for i in inputs}
    batch_axes = len(node.shape) - 2
    if len(axes) != 1 or None in axes or axes.pop() >= batch_axes \
            or any(len(i.shape) != len(node.shape) for i in inputs):
        raise tp._refuse(node, "its operands are not both split on the same batch axis")
    axis = tp.split[id(inputs[0])]
    return make("matmul", *inputs, **node.attrs), axis


def _split_last_axis_reduction(tp: TensorParallel, node: Node, inputs: list[Node]
                               ) -> tuple[Node, int]:
    """softmax normalizes over the last axis: a slice along any other axis is whole."""
    (x,) = inputs
    axis = tp.split[id(x)]
    if axis == len(x.shape) - 1:
        raise tp._refuse(node, "normalizes over the split axis")
    return make(node.op, x, **node.attrs), axis


SPLIT_RULES = {
    "reshape": _split_reshape,
    "transpose": _split_transpose,
    "matmul": _split_batched_matmul,   # the marked 2-D ones were handled before
    "softmax": _split_last_axis_reduction,
    "log_softmax": _split_last_axis_reduction,
}
