"""The op registry's data: `OpDef`, the table of them, and the questions layers ask it.

NNVM's lesson: an op is a name plus attributes in one table (`FInferShape`,
`FGradient`, `FMutateInputs`, ...), and every layer asks the table rather than
testing op names. This module is that table and nothing else, so it sits at the
bottom of the import order: graph.py asks it which ops write a variable (its order
rule), and ops.py, shape_ops.py, nn_ops.py, image_ops.py, fusion.py and sublinear.py fill it with
their `register` calls. Adding an op is one `register` call: no set of op names
elsewhere can drift out of sync with it.

What each field means, and who reads it, is written beside the field below.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (types only: graph.py imports this module)
    from tinyflow.graph import Node

# The kinds of `OpDef.source`: where a source op's value comes from.
SOURCE_KINDS = ("feed", "variable", "constant")


@dataclass(frozen=True)
class OpDef:
    """One registry entry. Flags are read by passes; functions by the layers above."""

    name: str
    compute: Callable[..., Any]
    infer: Callable[[list, list, dict], tuple]
    gradient: Callable[[Node, Node], list] | None = None
    elementwise: bool = False   # output[i] depends only on inputs[i] (after broadcast)
    inplace: int | None = None  # index of an input the output may overwrite
    pure: bool = True           # deterministic and side-effect free
    commutative: bool = False   # f(a, b) == f(b, a)
    differentiable: bool = True  # False: has no gradient (comparisons, argmax, ...)
    # A boolean of how its inputs compare (less, equal, ...): inputs that are equal
    # as numbers (+0 and -0), or both NaN, give equal results.
    comparison: bool = False
    random: bool = False        # draws random numbers: compute takes `generators`
    doc: str = ""
    # Optional: bind(xp, shapes, dtypes, attrs, workspace, scratch) -> a compute
    # specialized to these static input shapes (or None). The executor calls it once
    # per step when it compiles, so per-run work (finding a plan) disappears;
    # `workspace` is a dict of plans and buffers shared by the steps of one stream,
    # which never run at once; `scratch` is the step's own scratch memory (below).
    bind: Callable[..., Any] | None = None
    # Optional: scratch(xp, shapes, dtypes, attrs) -> the bytes of scratch memory the
    # kernel needs while it runs (an im2col matrix, a padded copy), for these static
    # shapes. The memory planner places them in the arena, alive during that step
    # only (the workspace that cuDNN and TVM kernels declare), so they show in the
    # plan and its validator checks them; `bind` receives them as a uint8 array.
    scratch: Callable[..., int] | None = None
    # Optional: check(attrs, dtypes) raises Mismatch for attributes or input dtypes no
    # shape could make valid (a stride of 0, an unknown padding, float indices). Run
    # at build time even when the input shapes are not known yet, so the error names
    # the user's line.
    check: Callable[[dict, list], None] | None = None
    # Where a source's value comes from (one of SOURCE_KINDS), None for computed ops:
    # the executor binds feeds, variables and constants instead of running a kernel,
    # and the memory planner keeps them out of the arena.
    source: str | None = None
    # The index of an input this op writes in place (NNVM's FMutateInputs), always a
    # variable: its value *is* that variable's buffer (not in the arena), every other
    # reader of the variable runs first (graph.ordering_dependencies), and the
    # executor binds the kernel to the Session's variable store.
    mutates: int | None = None
    # Optional: cost(node) -> the flops of this node when they are not ~ its output
    # size (matmul, convolution), or None when its input shapes are not known; the
    # stream assigner balances streams with it (streams.estimate_cost).
    cost: Callable[[Node], float | None] | None = None
    # fuse_dense may absorb this op as the activation of a dense layer: a unary
    # elementwise op whose compute can run in place on the layer's output.
    dense_activation: bool = False
    # The array library's ufunc (numpy/CuPy name) that compute calls and nothing else,
    # `ufunc(*inputs, out=out)`: the fused-kernel generator calls it directly.
    ufunc: str | None = None
    # Only reshapes its input (the data is unchanged, in the same order): a reshape
    # of a reshape is one reshape (rules.py).
    reshape: bool = False
    # Runs only for its effect (tf.group): fetching it gives None, as in TF1.
    effect_only: bool = False
    # Inputs of which only the shape (and dtype) is read, never the values (the
    # `ref` of broadcast_like, sum_to_like, reshape_like): eager backward's version
    # check does not ask whether they were written in place after use. A tuple of
    # indices, or a range for "every input from i on".
    shape_inputs: Container[int] = ()
    # A marker the user places (tf.checkpoint): the gradient-checkpointing pass keeps
    # the values of these nodes, and recomputes the rest (sublinear.py).
    checkpoint_marker: bool = False

    def __post_init__(self) -> None:
        if self.source is not None and self.source not in SOURCE_KINDS:
            raise ValueError(f"op {self.name!r}: source={self.source!r} is not one of "
                             f"{SOURCE_KINDS}")


REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add `opdef` to the registry (a name may be registered once)."""
    if opdef.name in REGISTRY:
        raise ValueError(f"op {opdef.name!r} is registered twice")
    REGISTRY[opdef.name] = opdef
    return opdef


_NO_FACTS = OpDef("", compute=lambda *a, **k: None, infer=lambda s, d, a: (None, None))


def opdef_of(node: Node) -> OpDef:
    """`node`'s registry entry (an entry with every flag off for an op name no one
    registered, as tests build bare Nodes of made-up ops)."""
    return REGISTRY.get(node.op, _NO_FACTS)


def source_kind(node: Node) -> str | None:
    """"feed", "variable" or "constant" for a source node, None for a computed one."""
    return opdef_of(node).source


def mutated_input(node: Node) -> int | None:
    """The index of the input `node` writes in place (a variable), or None."""
    return opdef_of(node).mutates


def written_variable(node: Node) -> Node | None:
    """The variable `node` writes in place (an assign's target), or None."""
    k = opdef_of(node).mutates
    return node.inputs[k] if k is not None and len(node.inputs) > k else None
