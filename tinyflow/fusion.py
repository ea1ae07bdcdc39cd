"""Fused ops: several small kernels run as one graph node.

The fusion passes (passes.py: `fuse_elementwise`, `fuse_dense`) replace groups of
nodes by one of the three ops registered here:

``fused_elementwise``
    A chain or tree of elementwise ops, each used only by the next, held as a small
    *program* (attribute ``program``): a tuple of instructions
    ``(op, (operand, ...), ((attr, value), ...))``. Operands name registers: ``x0,
    x1, ...`` are the node's inputs, ``t0, t1, ...`` the results of instructions 0,
    1, ... The last instruction's result is the node's value. For example
    ``relu(a * b + c)`` is::

        (("mul", ("x0", "x1"), ()), ("add", ("t0", "x2"), ()), ("relu", ("t1",), ()))

    The program is plain data (hashable, JSON-friendly), so CSE can compare fused
    nodes and the debugger can print them (`format_program`). On the CPU each
    instruction is still one numpy call; what fusion saves is the executor's
    per-node work and the intermediate arrays: the temporaries are allocated once
    per input shape, reused from one instruction to the next (an instruction may
    overwrite a dying input, where its op's `inplace` flag allows), and kept for the
    next run; the last instruction writes straight into the planned `out`. Over
    large arrays the program runs a block of rows at a time, so its temporaries
    stay in the cache (`BLOCK_BYTES`). This is the CPU stand-in for what XLA and
    TVM do on a GPU: one generated kernel for the whole tree (gpu.py does that).

``fused_dense``
    ``activation(matmul(a, w) + bias)``: the product is written into `out`, then
    the bias is added and the activation applied in place, so the layer makes one
    array where it made three. Attributes: ``transpose_a``, ``transpose_b`` (as
    matmul's) and ``activation`` (None or the name of a unary elementwise op).

``fused_assign``
    ``assign(v, program(...))``, the update of an optimizer: the program's last
    instruction writes the variable's own buffer, so an update needs neither a
    temporary for the new value nor the copy into the variable (MXNet's
    ``kWriteInplace`` for optimizer updates; TF's ApplyAdam kernels do the same).
    Input 0 is the variable; the executor binds it to the Session's store.

Fused nodes are made by passes, which run at compile time after `gradients` has
built the backward graph, so they need no gradient (``differentiable=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyflow import backend
from tinyflow.ops import (
    REGISTRY,
    OpDef,
    _matmul_compute,
    _matmul_infer,
    Mismatch,
    broadcast_shapes,
    matmul_cost,
    register,
)

Instruction = tuple[str, tuple[str, ...], tuple[tuple[str, Any], ...]]
Program = tuple[Instruction, ...]

# ----------------------------------------------------------------------------------
# Programs: building, reading, printing
# ----------------------------------------------------------------------------------

def _register_index(name: str, num_inputs: int) -> int:
    """``x3`` -> 3, ``t2`` -> num_inputs + 2: one flat numbering of registers."""
    kind, index = name[0], int(name[1:])
    return index if kind == "x" else num_inputs + index


def format_program(program: Program) -> str:
    """The program as one line a person reads: ``t0 = mul(x0, x1); t1 = relu(t0)``."""
    parts = []
    for k, (op, operands, attrs) in enumerate(program):
        args = list(operands) + [f"{key}={value}" for key, value in attrs]
        parts.append(f"t{k} = {op}({', '.join(args)})")
    return "; ".join(parts)


def program_ops(program: Program) -> list[str]:
    """The op of each instruction, in order."""
    return [op for op, _, _ in program]


_registers: dict[tuple, tuple[list[tuple], list[Any]]] = {}  # see _infer_registers
MAX_REMEMBERED = 4096


def _infer_registers(program: Program, shapes: Sequence[tuple], dtypes: Sequence[Any]
                     ) -> tuple[list[tuple], list[Any]]:
    """Shape and dtype of every register (inputs first), by each op's own rule.

    Remembered by (program, shapes, dtypes): each fused node is inferred by the
    infer_shapes pass and again when it is bound, and a graph of repeated layers
    fuses into many programs alike (or one long one)."""
    try:
        key = (program, tuple(tuple(s) for s in shapes), tuple(dtypes))
        found = _registers.get(key)
    except TypeError:         # an attribute value that does not hash
        key = found = None
    if found is None:
        found = _infer_each_register(program, shapes, dtypes)
        if key is not None:
            if len(_registers) >= MAX_REMEMBERED:
                _registers.clear()
            _registers[key] = found
    return list(found[0]), list(found[1])


def _infer_each_register(program: Program, shapes: Sequence[tuple], dtypes: Sequence[Any]
                         ) -> tuple[list[tuple], list[Any]]:
    """`_infer_registers`, computed: each instruction's rule, in order."""
    shapes, dtypes = [tuple(s) for s in shapes], list(dtypes)
    num_inputs = len(shapes)
    for op, operands, attrs in program:
        regs = [_register_index(r, num_inputs) for r in operands]
        if any(r >= len(shapes) for r in regs):
            raise Mismatch(f"program reads a register before it is written ({operands})")
        shape, dtype = REGISTRY[op].infer([shapes[r] for r in regs],
                                          [dtypes[r] for r in regs], dict(attrs))
        shapes.append(tuple(shape))
        dtypes.append(None if dtype is None else np.dtype(dtype))
    return shapes, dtypes


def _fused_infer(shapes, dtypes, attrs):
    all_shapes, all_dtypes = _infer_registers(attrs["program"], shapes, dtypes)
    return all_shapes[-1], all_dtypes[-1]


# ----------------------------------------------------------------------------------
# Running a program: a plan (register allocation + generated code) per node and shapes
# ----------------------------------------------------------------------------------

OUT = 0  # buffer 0 is the node's output: the planned `out`, or a fresh array


@dataclass
class _Plan:
    """How to run one program on inputs of given shapes and dtypes.

    steps    (compute, input registers, attrs, buffer) per instruction
    buffers  (shape, dtype) of each buffer: buffers[OUT] is the output, the rest
             are temporaries
    source   the plan as straight-line Python (see `_generate`); `kernel` is it,
             compiled: ``kernel(xp, x0, x1, ..., b0, b1, ...)`` with b0 the output
    """

    program: Program
    steps: list[tuple[Any, tuple[int, ...], dict, int]]
    buffers: list[tuple[tuple, Any]]
    source: str = ""
    kernel: Any = None


def _generate(plan: _Plan, num_inputs: int, xp: Any) -> None:
    """Write the plan as a Python function and compile it (once per plan).

    Interpreting the program costs a loop, a list and a lookup per instruction;
    the generated function is one call per instruction and nothing else, so a
    fused node costs less than the separate nodes it replaces. This is the CPU
    stand-in for the kernel a GPU compiler would generate from the same program::

        def kernel(xp, x0, x1, x2, b0):
            f0(x0, x1, out=b0)              # t0 = mul(x0, x1): numpy.multiply
            r = c1(xp, b0, out=b0)          # t1 = sigmoid(t0): the registry compute
            if r is not b0: b0[...] = r
            ...
            return b0
    """
    names = [f"x{i}" for i in range(num_inputs)]
    args = names + [f"b{b}" for b in range(len(plan.buffers))]
    lines = [f"def kernel(xp, {', '.join(args)}):"]
    instruction_of_line: list[int | None] = [None]  # source line - 1 -> instruction
    namespace: dict[str, Any] = {"__instruction_of_line__": instruction_of_line}
    for k, ((compute, regs, attrs, buffer), (op, operands, _)) in enumerate(
            zip(plan.steps, plan.program)):
        operands_now = ", ".join(names[r] for r in regs)
        comment = f"  # t{k} = {op}({', '.join(operands)})"
        ufunc = REGISTRY[op].ufunc   # compute is exactly this ufunc (a call less)
        if ufunc is not None and not attrs:  # lowered: the array library's ufunc itself
            namespace[f"f{k}"] = getattr(xp, ufunc)
            lines.append(f"    f{k}({operands_now}, out=b{buffer}){comment}")
        else:
            namespace[f"c{k}"] = compute
            extra = ""
            if attrs:
                namespace[f"a{k}"] = attrs
                extra = f", **a{k}"
            lines.append(f"    r = c{k}(xp, {operands_now}, out=b{buffer}{extra}){comment}")
            lines.append(f"    if r is not b{buffer}: b{buffer}[...] = r")
        instruction_of_line.extend([k] * (len(lines) - len(instruction_of_line)))
        names.append(f"b{buffer}")  # register num_inputs + k now lives in that buffer
    lines.append(f"    return b{OUT}")
    plan.source = "\n".join(lines)
    # Compiling the source is the expensive part (~1 ms); a graph of repeated
    # layers fuses into many groups of the same text, so the code object is cached
    # by its text and only the (cheap) def runs per plan, with this plan's names.
    code = _compiled.get(plan.source)
    if code is None:
        if len(_compiled) >= MAX_COMPILED:
            _compiled.clear()
        code = _compiled[plan.source] = compile(plan.source, "<fused_elementwise>", "exec")
    exec(code, namespace)  # noqa: S102
    plan.kernel = namespace["kernel"]


def failed_instruction(err: BaseException) -> int | None:
    """The index of the program instruction whose kernel raised `err`, read from the
    traceback's frame in a generated kernel (its lines map to instructions); None
    when the error did not come from one. Costs nothing until something fails."""
    found, tb = None, err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename == "<fused_elementwise>":
            lines = frame.f_globals.get("__instruction_of_line__", [])
            if 0 < tb.tb_lineno <= len(lines):
                found = lines[tb.tb_lineno - 1]
        tb = tb.tb_next
    return found


_compiled: dict[str, Any] = {}   # kernel source -> its code object
MAX_COMPILED = 4096


def _make_plan(program: Program, shapes: Sequence[tuple], dtypes: Sequence[Any],
               xp: Any = np, out_is_input: bool = False) -> _Plan:
    """Register allocation for the temporaries, as a compiler does for a basic block.

    Each instruction's result gets a buffer; a buffer returns to the free pool after
    the instruction that reads it last, and a later result of the same shape and
    dtype reuses it. An instruction writes over one of its own inputs where its
    op's `inplace` flag names that input (the ufunc reads each element before
    writing it), so a chain of n ops needs one buffer, not n. The output buffer
    serves as a temporary too (a value still warm in the cache when the last
    instruction overwrites it), as long as whatever it holds is dead, or is the
    operand the last instruction may overwrite, by the time the last one runs.

    `out_is_input`: the output buffer is one of the inputs (a ``fused_assign``
    writes a variable's update into the variable, which the program also reads).
    Then it is never a temporary: only the last instruction writes it, each
    element after reading it (the pass checks that the last op may overwrite it).
    """
    num_inputs = len(shapes)
    reg_shapes, reg_dtypes = _infer_registers(program, shapes, dtypes)
    lives = _Lifetimes(program, num_inputs)
    pool = _BufferPool([(reg_shapes[-1], reg_dtypes[-1])])
    steps = []
    for k, (op, operands, attrs) in enumerate(program):
        opdef = REGISTRY[op]
        regs = tuple(_register_index(r, num_inputs) for r in operands)
        me = num_inputs + k
        key = (reg_shapes[me], reg_dtypes[me])
        # temporaries whose last reader is this instruction: free once it has run
        dying = [r for r in dict.fromkeys(regs) if r in pool.buffer_of and lives.last_read[r] == k]
        buffer = _choose_buffer(k, opdef.inplace, regs, me, key, dying, pool, lives,
                                out_is_input)
        pool.give(buffer, me, dying)
        steps.append((opdef.compute, regs, dict(attrs), buffer))
    plan = _Plan(program, steps, pool.buffers)
    _generate(plan, num_inputs, xp)
    return plan


class _Lifetimes:
    """When each register is read last, and what the last instruction may overwrite."""

    def __init__(self, program: Program, num_inputs: int) -> None:
        self.last = len(program) - 1
        self.last_read: dict[int, int] = {}
        for k, (_, operands, _) in enumerate(program):
            for r in operands:
                self.last_read[_register_index(r, num_inputs)] = k
        self.final_regs = [_register_index(r, num_inputs) for r in program[self.last][1]]
        self.final_inplace = REGISTRY[program[self.last][0]].inplace

    def may_hold_output(self, reg: int) -> bool:
        """Can register `reg` live in the output buffer without the last
        instruction clobbering an operand it still has to read?"""
        if self.last_read[reg] < self.last:
            return True
        inplace, regs = self.final_inplace, self.final_regs
        return (inplace is not None and inplace < len(regs)
                and regs[inplace] == reg and regs.count(reg) == 1)


class _BufferPool:
    """The plan's buffers (shape, dtype), the output buffer `OUT` first, and which
    register each holds now (None: free for a later result of its shape and dtype)."""

    def __init__(self, buffers: list[tuple[tuple, Any]]) -> None:
        self.buffers = buffers
        self.holder: dict[int, int | None] = {OUT: None}  # buffer -> register it holds
        self.buffer_of: dict[int, int] = {}                # temporary register -> buffer

    def free_temporary(self, key: tuple) -> int | None:
        """A free buffer (not the output) of this (shape, dtype), if any."""
        return next((b for b, r in self.holder.items()
                     if r is None and b != OUT and self.buffers[b] == key), None)

    def new(self, key: tuple) -> int:
        self.buffers.append(key)
        return len(self.buffers) - 1

    def give(self, buffer: int, reg: int, dying: list[int]) -> None:
        """`reg` now lives in `buffer`; the buffers of `dying` registers are free."""
        for r in dying:
            self.holder[self.buffer_of[r]] = None
        self.holder[buffer] = reg
        self.buffer_of[reg] = buffer


def _choose_buffer(k: int, inplace: int | None, regs: tuple, me: int, key: tuple,
                   dying: list[int], pool: _BufferPool, lives: _Lifetimes,
                   out_is_input: bool) -> int:
    """The buffer instruction k writes register `me` into, in order of preference:
    the output (the last instruction always), over its own dying operand (the op's
    `inplace` input, used once, of the same shape and dtype), the free output
    buffer (unless it is an input), a free temporary, else a new one."""
    if k == lives.last:
        return OUT
    if inplace is not None and inplace < len(regs):
        target = regs[inplace]
        if (target in dying and regs.count(target) == 1
                and pool.buffers[pool.buffer_of[target]] == key
                and (pool.buffer_of[target] != OUT or lives.may_hold_output(me))):
            return pool.buffer_of[target]
    if not out_is_input and pool.holder[OUT] is None and pool.buffers[OUT] == key \
            and lives.may_hold_output(me):
        return OUT
    found = pool.free_temporary(key)
    return pool.new(key) if found is None else found


def _fused_elementwise_compute(xp, *arrays, out=None, program=()):
    if xp is not np:  # on a GPU the program becomes one generated CUDA kernel (gpu.py)
        from tinyflow import gpu
        return gpu.fused_compute(xp, *arrays, out=out, program=program)
    # The generic path (constant folding, tests, a run without `bind`): plan, then
    # run with fresh temporaries. The executor binds fused nodes instead
    # (`_fused_elementwise_bind`): one plan per node, temporaries shared per stream.
    plan = _make_plan(program, [a.shape for a in arrays], [a.dtype for a in arrays], xp)
    temporaries = [xp.empty(shape, dtype=dtype) for shape, dtype in plan.buffers[OUT + 1:]]
    if out is None:
        shape, dtype = plan.buffers[OUT]
        out = xp.empty(shape, dtype=dtype)
    return plan.kernel(xp, *arrays, out, *temporaries)


def generated_source(program: Program, shapes: Sequence[tuple], dtypes: Sequence[Any]) -> str:
    """The Python function `program` runs as for inputs of these shapes and dtypes."""
    return _make_plan(program, shapes, dtypes).source


def _stream_plan(workspace: dict, program: Program, shapes: Sequence[tuple],
                 dtypes: Sequence[Any], out_is_input: bool = False) -> _Plan:
    """`_make_plan` on the CPU, made once per stream for each program, shapes and
    dtypes, and kept in the stream's `workspace`: a graph of repeated layers binds
    many fused nodes alike, and they can share one plan (its kernel reads and
    writes only its arguments; its temporaries come from the workspace anyway)."""
    key = ("fused plan", program, tuple(tuple(s) for s in shapes), tuple(dtypes),
           out_is_input)
    try:
        plan = workspace.get(key)
    except TypeError:      # an attribute value that does not hash: a plan of its own
        return _make_plan(program, shapes, dtypes, np, out_is_input=out_is_input)
    if plan is None:
        plan = workspace[key] = _make_plan(program, shapes, dtypes, np,
                                           out_is_input=out_is_input)
    return plan


def _workspace_buffers(plan: _Plan, workspace: dict) -> list[Any]:
    """The plan's temporaries, from a stream's workspace: the i-th temporary of a
    (shape, dtype) is the same array for every node bound on that stream."""
    temporaries, used = [], {}
    for shape, dtype in plan.buffers[OUT + 1:]:
        key = (tuple(shape), np.dtype(dtype))
        index = used[key] = used.get(key, -1) + 1
        shared = workspace.setdefault(key, [])
        if len(shared) <= index:
            shared.append(np.empty(shape, dtype=dtype))
        temporaries.append(shared[index])
    return temporaries


# ----------------------------------------------------------------------------------
# Cache blocking: a program over large arrays runs a block of rows at a time
# ----------------------------------------------------------------------------------

# A program of k instructions over arrays larger than the cache makes k round trips
# to memory: every temporary is written out and read back. Run over blocks of rows
# (axis 0), about BLOCK_BYTES of output each, the temporaries are block-sized and
# stay in the core's L2 cache, and only the inputs and the output travel: numexpr's
# idea (Halide and TVM call it tiling). It is exact: every op in a program is
# elementwise, so each element goes through the same operations in the same order.
# Measured (float32, cold cache, one thread): tanh's gradient g * (1 - y*y) on
# (100, 20, 28, 28) 1.88 -> 1.41 ms; an SGD update of a (2450, 500) weight 1.45 ->
# 1.04 ms; blocks of 32K-64K elements did best. In the training steps of
# benchmarks/cnn_bench.py (rounds in rotating order): CNN 46.6 -> 45.7 ms, LeNet
# 73.9 -> 69.9 ms.
BLOCK_BYTES = 256 << 10


def row_blocks(shape: Sequence[int], itemsize: int) -> list[tuple[int, int]] | None:
    """(start, stop) ranges of rows (axis 0) of about BLOCK_BYTES each, covering an
    array of `shape`; None when it is small enough for one pass (at most two blocks'
    worth: cutting it would cost calls and save nothing) or has no axis to cut."""
    if len(shape) == 0 or shape[0] < 2:
        return None
    row_bytes = itemsize * int(np.prod(shape[1:], dtype=np.int64))
    if row_bytes * shape[0] <= 2 * BLOCK_BYTES:
        return None
    per_block = max(1, BLOCK_BYTES // max(row_bytes, 1))
    return [(start, min(start + per_block, shape[0]))
            for start in range(0, shape[0], per_block)]


def _block_runs(workspace: dict, program: Program, shapes: Sequence[tuple],
                dtypes: Sequence[Any], out_is_input: bool = False) -> tuple | None:
    """How to run `program` block by block on the CPU: (cut, runs), where cut[i]
    says whether input i is cut into blocks (it has the output's rows; the others
    broadcast along axis 0 and go whole to every block) and runs holds (start, stop,
    kernel, temporaries) per block. A plan per block height (the full blocks' and
    the last one's), its temporaries block-sized. None: one pass over the whole."""
    reg_shapes, reg_dtypes = _infer_registers(program, shapes, dtypes)
    out_shape = reg_shapes[-1]
    itemsize = max(np.dtype(d).itemsize for d in reg_dtypes if d is not None)
    ranges = row_blocks(out_shape, itemsize)
    if ranges is None:
        return None
    cut = [len(s) == len(out_shape) and s[0] == out_shape[0] for s in shapes]
    runs, plan_of_height = [], {}
    for start, stop in ranges:
        height = stop - start
        if height not in plan_of_height:
            block_shapes = [(height, *s[1:]) if c else tuple(s) for s, c in zip(shapes, cut)]
            plan = _stream_plan(workspace, program, block_shapes, dtypes, out_is_input)
            plan_of_height[height] = (plan.kernel, _workspace_buffers(plan, workspace))
        runs.append((start, stop, *plan_of_height[height]))
    return cut, runs


def _run_blocks(cut: list[bool], runs: list[tuple], arrays: Sequence[Any], out: Any) -> Any:
    """Each block's kernel on its rows of the cut inputs (and the others whole),
    writing its rows of `out`."""
    for start, stop, kernel, temporaries in runs:
        inputs = [a[start:stop] if c else a for a, c in zip(arrays, cut)]
        kernel(np, *inputs, out[start:stop], *temporaries)
    return out


# inplace is None: the output buffer serves as a temporary before the inputs are all
# read, so it must not share memory with an input.
def _fused_elementwise_bind(xp: Any, shapes: Sequence[tuple], dtypes: Sequence[Any],
                            attrs: dict, workspace: dict, scratch: Any = None) -> Any:
    """The fused node specialized to its static shapes (OpDef.bind): its plan made
    once, its temporaries taken once from the stream's `workspace`. Fused nodes of one
    stream run one at a time, so they share those buffers (the i-th temporary of a
    (shape, dtype) is the same array in every node), and a run then allocates and looks
    up nothing. On a GPU the generic compute (a generated kernel) is kept."""
    if xp is not np:
        return None
    blocks = _block_runs(workspace, attrs["program"], shapes, dtypes)
    if blocks is not None:
        return _bind_blocks(blocks, *_fused_infer(shapes, dtypes, attrs))
    plan = _stream_plan(workspace, attrs["program"], shapes, dtypes)
    temporaries = _workspace_buffers(plan, workspace)
    out_shape, out_dtype = plan.buffers[OUT]
    kernel = plan.kernel

    def bound_compute(xp, *arrays, out=None, **attrs):
        if out is None:
            out = np.empty(out_shape, dtype=out_dtype)
        return kernel(xp, *arrays, out, *temporaries)
    return bound_compute


def _bind_blocks(blocks: tuple, out_shape: tuple, out_dtype: Any) -> Any:
    """A fused node's compute that runs its program block by block (see BLOCK_BYTES)."""
    cut, runs = blocks

    def bound_blocks(xp, *arrays, out=None, **attrs):
        if out is None:
            out = np.empty(out_shape, dtype=out_dtype)
        return _run_blocks(cut, runs, arrays, out)
    return bound_blocks


register(OpDef("fused_elementwise", _fused_elementwise_compute, _fused_infer, None,
               elementwise=True, differentiable=False, bind=_fused_elementwise_bind,
               doc="several elementwise ops run as one node (attribute: program)"))


# ----------------------------------------------------------------------------------
# fused_assign: a variable's update computed straight into the variable
# ----------------------------------------------------------------------------------

def _fused_assign_infer(shapes, dtypes, attrs):
    value_shape, value_dtype = _fused_infer(shapes[1:], dtypes[1:], attrs)
    if tuple(shapes[0]) != tuple(value_shape) or np.dtype(dtypes[0]) != value_dtype:
        raise Mismatch(f"the update {tuple(value_shape)} {value_dtype} is not the "
                        f"variable's {tuple(shapes[0])} {np.dtype(dtypes[0])}")
    return tuple(shapes[0]), np.dtype(dtypes[0])


def _fused_assign_compute(xp, var, *arrays, out=None, program=()):
    """The reference: compute the program's value, then write it into `var`."""
    var[...] = _fused_elementwise_compute(xp, *arrays, program=program)
    return var


def _fused_assign_bind(xp: Any, shapes: Sequence[tuple], dtypes: Sequence[Any],
                       attrs: dict, workspace: dict, scratch: Any = None) -> Any:
    """The update kernel specialized to its shapes: the program's plan made with the
    output being an input (`out_is_input`), so the last instruction writes each
    element of the variable after reading it, and nothing else writes it. On a GPU
    the generated kernel reads and writes each element in one thread, so the
    variable is passed as its `out` as it is."""
    if xp is not np:
        from tinyflow import gpu

        def gpu_update(xp, var, *arrays, out=None, program=()):
            return gpu.fused_compute(xp, *arrays, out=var, program=program)
        return gpu_update
    if not _may_update_in_place(attrs["program"], shapes[1:], dtypes[1:]):
        return _bind_value_first(xp, shapes[1:], dtypes[1:], attrs, workspace)
    blocks = _block_runs(workspace, attrs["program"], shapes[1:], dtypes[1:],
                         out_is_input=True)
    if blocks is not None:
        return _bind_block_update(blocks, _bind_value_first(xp, shapes[1:], dtypes[1:],
                                                            attrs, workspace))
    plan = _stream_plan(workspace, attrs["program"], shapes[1:], dtypes[1:],
                        out_is_input=True)
    temporaries = _workspace_buffers(plan, workspace)
    kernel = plan.kernel

    def bound_update(xp, var, *arrays, out=None, **attrs):
        # (`var` has the compiled shape and dtype: the executor sees to it)
        return kernel(xp, *arrays, var, *temporaries)
    return bound_update


def _bind_block_update(blocks: tuple, value_first: Any) -> Any:
    """A fused_assign's update run block by block into the variable. A block reads
    its rows of every input before it writes its rows of the variable, so an input
    may be the variable itself; no input is another view of the variable's memory
    (a transpose, whose rows a later block would read written), as the executor
    copies a variable's view that a step returns (executor.Step.copy_views).

    An error raised in a later block would leave the rows of the blocks before it
    updated, and a failed step must leave its variables as they were (as the
    unfused program does: its assign never runs). So when numpy may raise on a
    floating-point error now, the update runs `value_first` instead."""
    cut, runs = blocks

    def bound_block_update(xp, var, *arrays, out=None, **attrs):
        if backend.errors_may_raise():
            return value_first(xp, var, *arrays)
        return _run_blocks(cut, runs, arrays, var)
    return bound_block_update


def _bind_value_first(xp: Any, shapes: Sequence[tuple], dtypes: Sequence[Any],
                      attrs: dict, workspace: dict) -> Any:
    """A variable's update computed whole into an array of its own by the bound
    fused_elementwise kernel (`shapes`, `dtypes`: the program's inputs), then
    copied into the variable, in the unfused program's order: for an update that
    may raise halfway (see _may_update_in_place)."""
    value_of = _fused_elementwise_bind(xp, shapes, dtypes, attrs, workspace)

    def bound_value_first(xp, var, *arrays, out=None, **attrs):
        var[...] = value_of(xp, *arrays)
        return var
    return bound_value_first


def _may_update_in_place(program: Program, shapes: Sequence[tuple],
                         dtypes: Sequence[Any]) -> bool:
    """Whether a variable's update may be written into the variable as it is
    computed: not when it computes on integers, where an op can raise whatever
    numpy's error settings say, halfway through its output (numpy refuses an
    integer to a negative integer power after writing the elements before it).
    A failed step must leave the variable as it was."""
    _, reg_dtypes = _infer_registers(program, shapes, dtypes)
    return all(d is None or np.dtype(d).kind not in "iu" for d in reg_dtypes)


# The executor binds a fused_assign to the Session's variable store, as it does an
# assign (both mutate input 0, the variable; the rest are the program's inputs).
register(OpDef("fused_assign", _fused_assign_compute, _fused_assign_infer, None,
               pure=False, differentiable=False, bind=_fused_assign_bind, mutates=0,
               doc="write the value of a fused elementwise program straight into "
                   "variable input 0 (attribute: program; inputs 1.. are its x0, x1..)"))


# ----------------------------------------------------------------------------------
# fused_dense: activation(matmul(a, w) + bias)
# ----------------------------------------------------------------------------------

def _dense_infer(shapes, dtypes, attrs):
    a, w, bias = shapes
    product, dtype = _matmul_infer([a, w], dtypes[:2], attrs)
    if broadcast_shapes(product, bias) != product:
        raise Mismatch(f"bias {tuple(bias)} would broadcast the product {product}")
    dtype = np.result_type(dtype, dtypes[2])
    activation = attrs.get("activation")
    if activation is not None:
        product, dtype = REGISTRY[activation].infer([product], [dtype], {})
    return tuple(product), np.dtype(dtype)


def _dense_compute(xp, a, w, bias, out=None, transpose_a=False, transpose_b=False,
                   activation=None):
    y = _matmul_compute(xp, a, w, out=out, transpose_a=transpose_a, transpose_b=transpose_b)
    xp.add(y, bias, out=y)
    if activation is not None:
        result = REGISTRY[activation].compute(xp, y, out=y)
        if result is not y:
            y[...] = result
    return y


register(OpDef("fused_dense", _dense_compute, _dense_infer, None, differentiable=False,
               cost=matmul_cost,
               doc="activation(matmul(a, w) + bias) as one node"))
