"""The fusion passes: several nodes of the graph become one kernel.

Three rewrites, each a sweep of `rewrite.sweep` like every pass of passes.py:

* `fuse_dense`: matmul + bias (+ activation) -> one `fused_dense` node;
* `fuse_elementwise`: a tree of elementwise ops, each read only by the next ->
  one `fused_elementwise` node holding a small register program (fusion.py runs it);
* `fuse_assign`: an optimizer's elementwise update -> one `fused_assign` node that
  writes the variable in place.

Fusion removes the temporaries between ops and the per-op dispatch, as XLA's and
TVM's operator fusion do; the program format and its interpreter are in fusion.py.
`describe(node)` prints a fused node for `passes.explain`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from tinyflow import fusion, nn_ops
from tinyflow.graph import Graph, Node
from tinyflow.ops import REGISTRY
from tinyflow.registry import mutated_input
from tinyflow.rewrite import AfterAssign, PassContext, finish, new_node, sweep
from tinyflow.rules import same_type


# ----------------------------------------------------------------------------------
# fuse_dense: matmul + bias + activation as one node
# ----------------------------------------------------------------------------------

def _only_consumer(node: Node, users: dict[Node, list[Node]], outputs: set[int]
                   ) -> Node | None:
    """The one node that reads `node` (possibly twice), or None (several, or fetched)."""
    if id(node) in outputs:
        return None
    readers = users.get(node, [])
    if not readers or any(r is not readers[0] for r in readers):
        return None
    return readers[0]


def fuse_dense(graph: Graph, ctx: PassContext) -> Graph:
    """matmul(a, w) + bias, then an optional activation -> one `fused_dense` node.

    Needs: shapes. Provides: fused_dense nodes (fusion.py).
    The bias is an `add` (either operand) that does not broadcast the product, or a
    `bias_add` along the product's last axis (its columns); the matmul must have no
    other reader. The activation (relu, tanh, sigmoid, gelu) joins when it is the sum's only reader.
    In a training graph gelu's gradient reads the sum too, so there gelu stays
    outside; relu, tanh and sigmoid gradients read the activation's output, so
    they join.
    """
    first = len(ctx.records)
    users = graph.consumers()
    outputs = {id(o) for o in graph.outputs}
    after_assign = AfterAssign()
    plans: dict[int, tuple[int, int, bool]] = {}  # root id -> (matmul pos, bias pos, act)
    for node in graph.nodes:
        if node.op != "matmul":
            continue
        adder = _only_consumer(node, users, outputs)
        if adder is None or adder.op not in ("add", "bias_add") or adder.inputs.count(node) != 1:
            continue
        pos = adder.inputs.index(node)
        if adder.op == "bias_add" and (pos != 0 or not nn_ops.bias_along_last_axis(adder)):
            continue   # (fused_dense adds a (C,) bias along the product's last axis)
        if not same_type(adder, node):
            continue
        root, act = adder, False
        reader = _only_consumer(adder, users, outputs)
        if (reader is not None and REGISTRY[reader.op].dense_activation
                and same_type(reader, adder)):
            root, act = reader, True
        if not after_assign.fresh_read_is_safe([*node.inputs, *adder.inputs], [root], root):
            continue
        plans[id(root)] = (pos, 1 - pos, act)

    def fuse(old: Node, node: Node) -> Node:
        plan = plans.get(id(old))
        if plan is None:
            return node
        pos, bias_pos, act = plan
        adder = node.inputs[0] if act else node
        matmul = adder.inputs[pos]
        attrs = {"transpose_a": bool(matmul.attrs.get("transpose_a", False)),
                 "transpose_b": bool(matmul.attrs.get("transpose_b", False)),
                 "activation": node.op if act else None}
        members = [matmul, adder] + ([node] if act else [])
        fused = new_node("fused_dense", [*matmul.inputs, adder.inputs[bias_pos]], attrs,
                          node, tuple(members[:-1]), name=ctx.unique_name(f"fused_{node.name}"),
                          same_value=True)
        ctx.record(members, [fused], " + ".join(m.op for m in members) + " -> fused_dense")
        return fused
    result = sweep(graph, fuse)
    return finish(graph, result, ctx, first)


# ----------------------------------------------------------------------------------
# fuse_elementwise: trees of elementwise ops -> one node with a small program
# ----------------------------------------------------------------------------------

def _fusable(node: Node) -> bool:
    opdef = REGISTRY[node.op]
    return opdef.elementwise and opdef.pure and node.op != "fused_elementwise"


def fuse_elementwise(graph: Graph, ctx: PassContext) -> Graph:
    """A tree of elementwise ops, each with one consumer inside it -> one node.

    Needs: shapes. Provides: fused_elementwise nodes holding their program.
    Walking from the outputs back, an elementwise node joins the group of its only
    consumer when that consumer is elementwise too; a node read by several nodes (or
    fetched) starts a group of its own, since its value must exist anyway. As every
    member but the root has its one reader inside the group, fusing cannot create a
    cycle; the one exception, a member that reads a variable while the group waits
    on an assign, is refused (see `AfterAssign`). Groups of one stay as they are.
    """
    first = len(ctx.records)
    users = graph.consumers()
    outputs = {id(o) for o in graph.outputs}
    after_assign = AfterAssign()
    root_of: dict[int, Node] = {}          # member id -> its group's root (old nodes)
    members: dict[int, list[Node]] = {}    # root id -> members, root first
    for node in reversed(graph.nodes):
        if not _fusable(node):
            continue
        root = node
        reader = _only_consumer(node, users, outputs)
        if reader is not None and id(reader) in root_of:
            candidate = root_of[id(reader)]
            if after_assign.fresh_read_is_safe(node.inputs, [], candidate):
                root = candidate
        root_of[id(node)] = root
        members.setdefault(id(root), []).append(node)

    current_of: dict[int, Node] = {}      # member id -> its rebuilt copy in this sweep

    def fuse(old: Node, node: Node) -> Node:
        group = members.get(id(root_of.get(id(old), old)))
        if group is None or len(group) < 2:
            return node
        current_of[id(old)] = node
        if group[0] is not old:
            return node  # a member: its value lives on inside the root's program
        ordered = list(reversed(group))  # topological order, root last
        register_of = {id(current_of[id(m)]): f"t{k}" for k, m in enumerate(ordered)}
        inputs: list[Node] = []
        input_index: dict[int, int] = {}  # id -> position in inputs (a list scan
        program = []                      # per operand was quadratic in wide groups)
        for m in ordered:
            operands = []
            for i in current_of[id(m)].inputs:
                name = register_of.get(id(i))
                if name is None:
                    name = f"x{input_index.setdefault(id(i), len(inputs))}"
                    if len(input_index) > len(inputs):
                        inputs.append(i)
                operands.append(name)
            program.append((m.op, tuple(operands), tuple(sorted(m.attrs.items()))))
        fused = new_node("fused_elementwise", inputs, {"program": tuple(program)}, node,
                          tuple(ordered[:-1]), name=ctx.unique_name(f"fused_{node.name}"),
                          same_value=True)
        ctx.sources[fused.name] = tuple((m.name, m.where) for m in ordered)
        ops = ", ".join(m.op for m in ordered)
        ctx.record(ordered, [fused], f"fused {len(ordered)} elementwise ops ({ops}), each "
                                     "read only by the next, into one kernel")
        return fused
    result = sweep(graph, fuse)
    return finish(graph, result, ctx, first)


# ----------------------------------------------------------------------------------
# fuse_assign: an optimizer's update computed straight into its variable
# ----------------------------------------------------------------------------------

def _update_program(value: Node) -> tuple[fusion.Program, list[Node]] | None:
    """(program, inputs) computing `value`: a fused node's own, or one instruction
    for a single elementwise op; None for anything else."""
    if value.op == "fused_elementwise":
        return value.attrs["program"], list(value.inputs)
    if not _fusable(value):
        return None
    inputs: list[Node] = []
    for i in value.inputs:
        if i not in inputs:
            inputs.append(i)
    operands = tuple(f"x{inputs.index(i)}" for i in value.inputs)
    return ((value.op, operands, tuple(sorted(value.attrs.items()))),), inputs


def _last_op_may_overwrite(program: fusion.Program, register: str) -> bool:
    """Can the program's last instruction write the buffer that holds `register`?
    Yes when it does not read it, or when its op may overwrite exactly that operand
    (OpDef.inplace: each element is read before it is written)."""
    op, operands, _ = program[-1]
    if register not in operands:
        return True
    inplace = REGISTRY[op].inplace
    return (inplace is not None and inplace < len(operands)
            and operands[inplace] == register and operands.count(register) == 1)


def fuse_assign(graph: Graph, ctx: PassContext) -> Graph:
    """assign(v, elementwise update) -> one `fused_assign` node that writes v in place.

    Needs: shapes; fused_elementwise nodes. Provides: fused_assign nodes (fusion.py).
    An optimizer's update (``v - lr * g``, Adam's moments) is an elementwise program
    whose value exists only to be copied into the variable: computed straight into
    the variable's buffer, it needs neither a temporary nor the copy. Fused when
    * the value is a fused_elementwise (or one elementwise op) that nothing else
      reads or fetches, with the variable's shape and dtype;
    * the program reads no variable but v, and this assign is v's only writer: the
      fused node is a writer (OpDef.mutates) and runs where the assign ran,
      after every other reader of v, so it still reads v's value from before the
      run; a read of another variable, or a second writer of v, would lose its order;
    * the last instruction may overwrite v where it reads it (`_last_op_may_overwrite`);
      earlier instructions read v freely, since only the last one writes it.
    """
    first = len(ctx.records)
    users = graph.consumers()
    outputs = {id(o) for o in graph.outputs}
    writers = Counter(id(n.inputs[0]) for n in graph.nodes
                      if mutated_input(n) is not None and n.inputs)
    updates: set[int] = set()  # ids of the assigns to fuse
    for node in graph.nodes:
        if node.op != "assign" or len(node.inputs) != 2:
            continue
        var, value = node.inputs
        if (var.op != "variable" or writers[id(var)] != 1 or not same_type(value, var)
                or _only_consumer(value, users, outputs) is not node):
            continue
        found = _update_program(value)
        if found is None:
            continue
        program, inputs = found
        if any(i.op == "variable" and i is not var for i in inputs):
            continue
        if var in inputs and not _last_op_may_overwrite(program, f"x{inputs.index(var)}"):
            continue
        updates.add(id(node))

    def fuse(old: Node, node: Node) -> Node:
        if id(old) not in updates:
            return node
        var, value = node.inputs
        program, inputs = _update_program(value)  # the value's inputs as rewritten
        fused = new_node("fused_assign", [var, *inputs], {"program": program}, node,
                         (value,), name=ctx.unique_name(f"fused_{node.name}"),
                         same_value=True)
        ctx.sources[fused.name] = ctx.sources.get(value.name, ((value.name, value.where),))
        ctx.record([value, node], [fused],
                   f"{value.op} read only by assign({var.name}, ...) -> fused_assign: "
                   f"the update is computed straight into {var.name}'s buffer (no "
                   "temporary, no copy)")
        return fused
    result = sweep(graph, fuse)
    return finish(graph, result, ctx, first)




# ----------------------------------------------------------------------------------
# describe: a fused node as one line of text (for passes.explain)
# ----------------------------------------------------------------------------------

def _describe_elementwise(node: Node) -> tuple[str, tuple[Node, ...]]:
    return fusion.format_program(node.attrs["program"]), node.inputs


def _describe_assign(node: Node) -> tuple[str, tuple[Node, ...]]:
    program = node.attrs["program"]  # input 0 is the variable written
    body = (f"{node.inputs[0].name} <- t{len(program) - 1}, where "
            + fusion.format_program(program))
    return body, node.inputs[1:]


def _describe_dense(node: Node) -> tuple[str, tuple[Node, ...]]:
    act = node.attrs.get("activation")
    return "matmul + bias" + (f" + {act}" if act else ""), node.inputs


# fused op -> (body text, the inputs its program names x0, x1, ...)
DESCRIBE: dict[str, Callable[[Node], tuple[str, tuple[Node, ...]]]] = {
    "fused_elementwise": _describe_elementwise,
    "fused_assign": _describe_assign,
    "fused_dense": _describe_dense,
}


def describe(node: Node) -> list[str]:
    """Two lines for a fused node: its program, then its inputs and what it stands for."""
    body, program_inputs = DESCRIBE[node.op](node)
    inputs = ", ".join(f"x{k}={i.name}" for k, i in enumerate(program_inputs))
    return [f"  {node.name} ({node.op}): {body}",
            f"      inputs {inputs}; stands for {', '.join(node.provenance)}"]
