"""Shape ops: reshape, transpose, broadcast, concat, slicing and row gathers.

These ops move or select elements without arithmetic, so each gradient is the same
movement run backwards (a transpose by the inverse permutation, a slice by writing the
gradient into zeros of the input's shape, a gather by a scatter-add). They register into
the same `REGISTRY` as the arithmetic ops of `ops.py` (this module imports ops.py, never
the other way), and ``tf.reshape`` & co. are these functions.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyflow import backend
from tinyflow.graph import OPERATOR_BUILDERS, Node
from tinyflow.ops import (
    SHAPE_OP_BUILDERS,
    Axis,
    OpDef,
    Operand,
    Shape,
    _axis_attr,
    _shape_attr,
    argument_error,
    int_attr,
    int_like,
    ints_attr,
    Mismatch,
    result_dtype,
    check_dims,
    constant,
    make,
    normalize_axes,
    python_dtype,
    register,
    require_shape,
    sum_to_like,
    zeros_like,
)


def _resolve_zeros(src: tuple, target: tuple) -> list:
    """A 0 in a reshape target copies that dim from the input (ONNX/MXNet rule), so
    `reshape(x, (0, -1))` flattens whatever the batch size turns out to be."""
    return [src[i] if d == 0 and i < len(src) else d for i, d in enumerate(target)]


def _reshape_check(attrs, dtypes):
    shape = attrs["shape"]
    if any(d < -1 for d in shape):
        raise Mismatch(f"shape {tuple(shape)} has a negative size other than -1")
    if list(shape).count(-1) > 1:
        raise Mismatch(f"shape {tuple(shape)} has more than one -1")


def _reshape_infer(shapes, dtypes, attrs):
    src, shape = shapes[0], tuple(attrs["shape"])
    return _resolve_target(src, shape), dtypes[0]


def _resolve_target(src: tuple, shape: tuple) -> tuple:
    """The shape `reshape(x, shape)` gives an x of shape `src` (dims may be None).

    A -1 is what the dims of x that are not copied leave once the target's other
    dims are taken out: the copied dims (0s) appear on both sides and cancel. That
    is the only way to know it when a copied dim is unknown (flatten: (None, 3, 3, 3)
    to (0, -1) is (None, 27)) or 0 (flatten of an empty batch: (0, 3, 3, 3) to
    (0, -1) is (0, 27), though 0 elements alone cannot tell).
    """
    target = _resolve_zeros(src, shape)
    if -1 in target:
        copied = {i for i, d in enumerate(shape) if d == 0 and i < len(src)}
        rest = [d for i, d in enumerate(src) if i not in copied]
        known = math.prod(d for i, d in enumerate(target) if i not in copied and d != -1)
        size = None
        if None not in rest:
            if known == 0:  # 0 elements per 0: any size would do (numpy and TF refuse)
                raise Mismatch(f"cannot infer the -1 of {shape} for an empty tensor "
                               "whose other target dims are 0")
            size, left = divmod(math.prod(rest), known)
            if left:
                raise Mismatch(f"cannot reshape {math.prod(src) if None not in src else '?'}"
                               f" elements into {shape}")
        target[target.index(-1)] = size
    elif None not in src and math.prod(src) != math.prod(target):
        raise Mismatch(f"cannot reshape {math.prod(src)} elements into {tuple(target)}")
    return tuple(target)


def _reshape_compute(xp, x, out=None, shape=()):
    # numpy infers a -1 itself, but not for an empty x (0 elements fit any size):
    # there the target is resolved here, so that (0, -1) flattens an empty batch too.
    # (Only there: resolving costs a reshape step 1.4 us more per run.)
    if x.size == 0:
        return x.reshape(_resolve_target(x.shape, shape))
    return x.reshape(_resolve_zeros(x.shape, shape))


def _reshape_like_infer(shapes, dtypes, attrs):
    """Shape of input 1 (ref), dtype of input 0 (x): as many elements, where known."""
    x, ref = shapes
    if None not in x and None not in ref and math.prod(x) != math.prod(ref):
        raise Mismatch(f"cannot reshape {math.prod(x)} elements into {tuple(ref)}")
    return tuple(ref), dtypes[0]


def _reshape_like_compute(xp, x, ref, out=None):
    result = x.reshape(ref.shape)
    return result


register(OpDef("reshape", _reshape_compute, _reshape_infer,
               lambda n, g: [reshape_like(g, n.inputs[0])], doc="same data, new shape",
               check=_reshape_check, reshape=True))
register(OpDef("reshape_like", _reshape_like_compute, _reshape_like_infer,
               lambda n, g: [reshape_like(g, n.inputs[0]), None],
               doc="reshape input 0 to the shape of input 1", reshape=True,
               shape_inputs=(1,)))


def _transpose_infer(shapes, dtypes, attrs):
    shape, axes = shapes[0], attrs.get("axes")
    if axes is None:
        return tuple(reversed(shape)), dtypes[0]
    if len(axes) != len(shape) or any(not -len(shape) <= a < len(shape) for a in axes) \
            or sorted(a % len(shape) for a in axes) != list(range(len(shape))):
        raise Mismatch(f"axes {tuple(axes)} are not a permutation of rank {len(shape)}")
    return tuple(shape[a] for a in axes), dtypes[0]


def _transpose_compute(xp, x, out=None, axes=None):
    result = xp.transpose(x, axes)
    return result


def _transpose_grad(n, g):
    axes = n.attrs.get("axes")
    if axes is None:
        return [transpose(g)]
    inverse = tuple(int(i) for i in np.argsort([a % len(axes) for a in axes]))
    return [transpose(g, inverse)]


register(OpDef("transpose", _transpose_compute, _transpose_infer, _transpose_grad,
               doc="permute axes (reverse them by default)"))


def _broadcast_to_infer(shapes, dtypes, attrs):
    target = tuple(attrs["shape"])
    check_dims(target)
    src = shapes[0]
    # An unknown dim may turn out to be 1 or the target's size: checked when fed.
    if len(src) > len(target) or any(
            d is not None and d != 1 and d != t for d, t in zip(src[::-1], target[::-1])):
        raise Mismatch(f"cannot broadcast to {target}")
    return target, dtypes[0]


def _broadcast_to_compute(xp, x, out=None, shape=()):
    return xp.broadcast_to(x, shape)


register(OpDef("broadcast_to", _broadcast_to_compute, _broadcast_to_infer,
               lambda n, g: [sum_to_like(g, n.inputs[0])], doc="numpy broadcast_to"))


def _expand_dims_infer(shapes, dtypes, attrs):
    shape = list(shapes[0])
    axis = attrs["axis"]
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    ndim = len(shape) + len(axes)
    for a in axes:
        if not -ndim <= a < ndim:
            raise Mismatch(f"axis {a} is out of range for a result of rank {ndim}")
    for a in sorted(x % ndim for x in axes):
        shape.insert(a, 1)
    return tuple(shape), dtypes[0]


def _expand_dims_compute(xp, x, out=None, axis=0):
    result = xp.expand_dims(x, axis)
    return result


def _squeeze_infer(shapes, dtypes, attrs):
    shape = shapes[0]
    axis = attrs.get("axis")
    if axis is None:
        if None in shape:  # which dims are 1 is known once fed: rank unknown (TF1)
            return None, dtypes[0]
        return tuple(d for d in shape if d != 1), dtypes[0]
    axes = normalize_axes(axis, len(shape))
    for a in axes:
        if shape[a] not in (1, None):
            raise Mismatch(f"cannot squeeze axis {a} of size {shape[a]}")
    return tuple(d for i, d in enumerate(shape) if i not in axes), dtypes[0]


def _squeeze_compute(xp, x, out=None, axis=None):
    result = xp.squeeze(x, axis=axis)
    return result


register(OpDef("expand_dims", _expand_dims_compute, _expand_dims_infer,
               lambda n, g: [reshape_like(g, n.inputs[0])], doc="insert size-1 axes",
               reshape=True))
register(OpDef("squeeze", _squeeze_compute, _squeeze_infer,
               lambda n, g: [reshape_like(g, n.inputs[0])], doc="remove size-1 axes",
               reshape=True))


def _concat_infer(shapes, dtypes, attrs):
    ndim = len(shapes[0])
    (axis,) = normalize_axes(attrs["axis"], ndim)
    out = list(shapes[0])
    for s in shapes[1:]:
        if len(s) != ndim:
            raise Mismatch("concat needs inputs of one rank")
        for i, (d0, d) in enumerate(zip(out, s)):
            if i != axis and d0 is not None and d is not None and d0 != d:
                raise Mismatch(f"dimension {i} differs ({d0} vs {d})")
            if i != axis and d0 is None:
                out[i] = d
    sizes = [s[axis] for s in shapes]
    out[axis] = None if None in sizes else sum(sizes)
    return tuple(out), result_dtype(dtypes)


def _concat_compute(xp, *arrays, out=None, axis=0):
    return xp.concatenate(arrays, axis=axis, out=out)


def _concat_grad(n, g):
    return [make("concat_part", g, *n.inputs, axis=n.attrs["axis"], part=i)
            for i in range(len(n.inputs))]


def _concat_part_compute(xp, g, *inputs, out=None, axis=0, part=0):
    start = sum(x.shape[axis] for x in inputs[:part])
    index = [slice(None)] * g.ndim
    index[axis] = slice(start, start + inputs[part].shape[axis])
    result = g[tuple(index)]
    return result


register(OpDef("concat", _concat_compute, _concat_infer, _concat_grad,
               doc="join arrays along an axis"))


def _concat_part_grad(n, g):
    # The adjoint of taking a slice: g written into zeros at that slice, i.e. a concat
    # of g with zeros shaped like the other parts. The parts only give shapes.
    part, parts = n.attrs["part"], n.inputs[1:]
    pieces = [g if i == part else zeros_like(x) for i, x in enumerate(parts)]
    return [make("concat", *pieces, axis=n.attrs["axis"])] + [None] * len(parts)


def _concat_part_infer(shapes, dtypes, attrs):
    """Shape of the concat's input `part`, dtype of g, which must be the concat's."""
    expected, _ = _concat_infer(shapes[1:], dtypes[1:], attrs)
    require_shape(shapes[0], expected, "g", "the concat of the parts")
    return tuple(shapes[1 + attrs["part"]]), dtypes[0]


register(OpDef("concat_part", _concat_part_compute, _concat_part_infer, _concat_part_grad,
               doc="the slice of a concat's gradient that belongs to input `part`",
               shape_inputs=range(1, sys.maxsize)))   # the parts give offsets only


# Indexing by slices: the index is stored as a tuple of (start, stop, step) triples
# and plain ints, so it is hashable and readable in the debugger.
def _encode_index(index: Any) -> tuple:
    if not isinstance(index, tuple):
        index = (index,)
    encoded = []
    for item in index:
        if isinstance(item, slice):
            # Bounds are ints (or None): a float or a node reached numpy's probe in
            # the shape rule, whose TypeError named neither the op nor the line.
            if not all(b is None or int_like(b) for b in (item.start, item.stop, item.step)):
                raise argument_error("getitem", f"slice bounds must be ints or None, "
                                     f"not {item!r}")
            encoded.append(("slice", *(None if b is None else int(b)
                                       for b in (item.start, item.stop, item.step))))
        elif int_like(item):  # not x[True], which numpy reads as a mask, not as row 1
            encoded.append(("int", int(item)))
        elif item is None:
            encoded.append(("newaxis",))
        elif item is Ellipsis:
            encoded.append(("ellipsis",))
        else:
            raise argument_error("getitem", f"graph nodes can be indexed by ints and "
                                 f"slices, not {item!r}; use tf.gather for index arrays")
    return tuple(encoded)


def _decode_index(encoded: tuple) -> tuple:
    decoded = []
    for item in encoded:
        kind = item[0]
        decoded.append(slice(*item[1:]) if kind == "slice" else item[1] if kind == "int"
                       else None if kind == "newaxis" else Ellipsis)
    return tuple(decoded)


# Stands in for an unknown dim when the index is tried on a probe: large enough for
# any int or slice a program uses, so only a real mismatch raises.
_PROBE_SIZE = 1 << 20


def _source_axes(index: tuple, ndim: int) -> list[int | None]:
    """For each output axis of x[index], the axis of x it comes from (None: a new
    axis). Ints consume an axis, slices keep one, an ellipsis keeps the rest."""
    consumed = sum(1 for item in index if item[0] in ("int", "slice"))
    sources: list[int | None] = []
    axis = 0
    for item in index:
        kind = item[0]
        if kind == "ellipsis":
            sources.extend(range(axis, axis + ndim - consumed))
            axis += ndim - consumed
        elif kind == "newaxis":
            sources.append(None)
        else:
            if kind == "slice":
                sources.append(axis)
            axis += 1
    return sources + list(range(axis, ndim))


def _getitem_infer(shapes, dtypes, attrs):
    shape, index = shapes[0], attrs["index"]
    # Index a probe of the same shape (a zero-stride view: no memory, whatever the
    # size) and read the result's shape; numpy's own rules decide, errors included.
    probe = np.broadcast_to(np.False_, [_PROBE_SIZE if d is None else d for d in shape])
    try:
        result = probe[_decode_index(index)].shape
    except (IndexError, ValueError) as err:  # out of bounds; a slice step of 0
        raise Mismatch(str(err)) from None
    # An output axis sliced from an unknown dim stays unknown.
    return tuple(None if src is not None and shape[src] is None else d
                 for d, src in zip(result, _source_axes(index, len(shape)))), dtypes[0]


def _getitem_compute(xp, x, out=None, index=()):
    result = x[_decode_index(index)]
    return result


def _slice_grad_infer(shapes, dtypes, attrs):
    """Shape of input 1 (ref), dtype of input 0 (g), which must be ref[index]'s: numpy
    would broadcast a smaller g into the slice."""
    g, ref = shapes
    expected, _ = _getitem_infer([ref], dtypes[1:], attrs)
    require_shape(g, expected, "g", "ref[index]")
    return tuple(ref), dtypes[0]


def _slice_grad_compute(xp, g, ref, out=None, index=()):
    result = xp.zeros(ref.shape, dtype=g.dtype) if out is None else out
    if out is not None:
        out.fill(0)
    result[_decode_index(index)] = g
    return result


register(OpDef("getitem", _getitem_compute, _getitem_infer,
               lambda n, g: [make("slice_grad", g, n.inputs[0], index=n.attrs["index"])],
               doc="x[index] with ints and slices"))
register(OpDef("slice_grad", _slice_grad_compute, _slice_grad_infer,
               lambda n, g: [make("getitem", g, index=n.attrs["index"]), None],
               doc="zeros of input 1's shape with input 0 written at index",
               shape_inputs=(1,)))


def _gather_infer(shapes, dtypes, attrs):
    params, indices = shapes
    if len(params) < 1:
        raise Mismatch("gather needs params of rank >= 1")
    return tuple(indices) + tuple(params[1:]), dtypes[0]


def _gather_compute(xp, params, indices, out=None):
    # Checked here, so that an index past the end (any index, when params have no
    # rows) is named in the user's terms rather than numpy's ("cannot do a
    # non-empty take from an empty axes"). Negative indices count from the end.
    # (Before the cast to int64: a uint64 index beyond its range would wrap to a
    # negative one, and pick a row from the end.)
    n = len(params)
    if indices.size:
        low, high = int(indices.min()), int(indices.max())
        if not -n <= low <= high < n:
            bad = high if high >= n else low
            raise IndexError(f"index {bad} is out of range for params of {n} rows "
                             f"(indices must be in [-{n}, {n}))")
    rows = indices.astype(np.int64, copy=False)
    return xp.take(params, rows, axis=0, out=out)


def _scatter_rows_infer(shapes, dtypes, attrs):
    """Shape of input 2 (ref, the params), dtype of g, which must be gather's output
    shape: the kernel reshapes g, so a g of the same size would pass, scrambled."""
    g, indices, ref = shapes
    expected, _ = _gather_infer([ref, indices], [dtypes[2], dtypes[1]], attrs)
    require_shape(g, expected, "g", "gather(ref, indices)")
    return tuple(ref), dtypes[0]


def _scatter_rows_compute(xp, g, indices, ref, out=None):
    result = xp.zeros(ref.shape, dtype=g.dtype) if out is None else out
    if out is not None:
        out.fill(0)
    rows = indices.astype(np.int64, copy=False).reshape(-1)
    # add.at sums repeated indices (the same token twice in a batch).
    backend.scatter_add(xp, result, rows, g.reshape((rows.size,) + ref.shape[1:]))
    return result


def _gather_check(attrs, dtypes):
    if dtypes[1] is not None and dtypes[1].kind not in "iu":
        raise Mismatch(f"indices must be integers, got {dtypes[1]} (cast them first)")


register(OpDef("gather", _gather_compute, _gather_infer,
               lambda n, g: [make("scatter_rows", g, n.inputs[1], n.inputs[0]), None],
               doc="rows of params picked by integer indices (embeddings)",
               check=_gather_check))
register(OpDef("scatter_rows", _scatter_rows_compute, _scatter_rows_infer,
               lambda n, g: [gather(g, n.inputs[1]), None, None],
               doc="gradient of gather: rows of g summed into zeros of params' shape",
               shape_inputs=(2,)))


# pad (the original TinyFlow's, after Torch's nn.Padding): |pad| zeros along one
# dimension, after the data when pad > 0 and before it when pad < 0. Its gradient is
# the slice that drops them again.
def _pad_infer(shapes, dtypes, attrs):
    shape = list(shapes[0])
    (dim,) = normalize_axes(attrs["dim"], len(shape))
    if shape[dim] is not None:
        shape[dim] += abs(attrs["pad"])
    return tuple(shape), dtypes[0]


def _pad_compute(xp, x, out=None, dim=0, pad=0):
    widths = [(0, 0)] * x.ndim
    widths[dim] = (-pad, 0) if pad < 0 else (0, pad)
    result = xp.pad(x, widths)
    return result


def _pad_grad(n, g):
    dim, pad = n.attrs["dim"], n.attrs["pad"]
    kept = slice(-pad, None) if pad < 0 else slice(None, -pad if pad else None)
    # Index the padded axis by its position from the front or, if dim is negative,
    # from the back, so the rank need not be known.
    index = ((slice(None),) * dim + (kept,) if dim >= 0
             else (Ellipsis, kept) + (slice(None),) * (-dim - 1))
    return [getitem(g, index)]


register(OpDef("pad", _pad_compute, _pad_infer, _pad_grad,
               doc="|pad| zeros along dimension `dim`: after if pad > 0, before if < 0"))


# Builders

def pad(x: Operand, dim: int = 0, pad: int = 0) -> Node:  # noqa: A002 - the original's names
    """The original TinyFlow's tf.pad(x, dim=, pad=): add |pad| zeros along `dim`,
    after the data for pad > 0 and before it for pad < 0 (Torch's nn.Padding)."""
    return make("pad", x, dim=int_attr("pad", "dim", dim), pad=int_attr("pad", "pad", pad))


def getitem(x: Operand, index: Any) -> Node:
    return make("getitem", x, index=_encode_index(index))


def reshape(x: Operand, shape: Shape) -> Node:
    return make("reshape", x, shape=_shape_attr(shape, "reshape"))


def transpose(x: Operand, axes: Sequence[int] | None = None, perm: Sequence[int] | None = None,
              name: str | None = None) -> Node:
    """The axes of x reordered (reversed when none are given); `perm` is TF1's name."""
    axes = perm if axes is None else axes
    return make("transpose", x,
                axes=None if axes is None else ints_attr("transpose", "axes", axes), name=name)


def broadcast_to(x: Operand, shape: Shape) -> Node:
    return make("broadcast_to", x, shape=_shape_attr(shape, "broadcast_to"))


def expand_dims(x: Operand, axis: int) -> Node:
    return make("expand_dims", x, axis=_axis_attr(axis, "expand_dims"))


def squeeze(x: Operand, axis: Axis = None, name: str | None = None,
            squeeze_dims: Axis = None) -> Node:
    """x without its size-1 axes (those of `axis`; `squeeze_dims` is TF1's old name)."""
    axis = squeeze_dims if axis is None else axis
    return make("squeeze", x, axis=_axis_attr(axis, "squeeze"), name=name)


def concat(values: Sequence[Operand], axis: int) -> Node:
    # A single tensor (not a list of them) would be tested for truth by `not values`.
    if not isinstance(values, (list, tuple)):
        raise argument_error("concat", f"values must be a list of tensors, got {values!r}")
    if not values:
        raise argument_error("concat", "needs at least one value to join, got []")
    return make("concat", *values, axis=int_attr("concat", "axis", axis))


def index_operand(indices: Operand) -> Operand:
    """Indices as an op takes them: Python ints and lists (and numpy integer arrays)
    become a constant of their own integer dtype, as in TF1, not a literal typed
    beside the other inputs (beside float32 params, [2, 0] was float32)."""
    if isinstance(indices, (int, np.integer, list, tuple, np.ndarray)) \
            and not isinstance(indices, (bool, np.bool_)):
        array = np.asarray(indices)
        if array.size == 0 and array.dtype.kind == "f":   # [] is float64 to numpy
            array = array.astype(np.int32)
        if array.dtype.kind in "iu":
            dtype = array.dtype if isinstance(indices, np.ndarray) else python_dtype(array)
            return constant(array, dtype)
    return indices


def gather(params: Operand, indices: Operand) -> Node:
    """tf.gather: the rows of params that `indices` pick (see `index_operand`)."""
    return make("gather", params, index_operand(indices))


def reshape_like(x: Operand, ref: Operand) -> Node: return make("reshape_like", x, ref)


OPERATOR_BUILDERS["getitem"] = getitem  # `x[1:, ::2]` on a Node
SHAPE_OP_BUILDERS.update(  # ops.reshape & co. (ops.py does not import this module)
    broadcast_to=broadcast_to, concat=concat, expand_dims=expand_dims, gather=gather,
    getitem=getitem, pad=pad, reshape=reshape, reshape_like=reshape_like, squeeze=squeeze,
    transpose=transpose)
