"""Image ops: 2-D convolution and pooling, with the kernels that make them fast.

They register into the same registry as ops.py (one dict for all ops); they live in
their own file only so that each file reads in one sitting.

Layout is NCHW (batch, channels, height, width) and filters are OIHW, as in the
original TinyFlow and PyTorch. Convolution is im2col + one matrix multiply (the
CS231n / Caffe way): every window of the input becomes a column of a matrix, so the
heavy work is BLAS, on chunks of the batch sized to stay in the CPU's cache (see
CHUNK_BYTES). The forward multiplies the filters by each sample's windows in one
batched GEMM that writes the output in place (see _windows_by_sample); the filter
gradient puts the batch within each matrix row (a "CNHW" layout, see _im2col), so
it is one large GEMM per chunk; the stride-1 input gradient needs no im2col at all
(see _conv_grad_input_by_rows). The matrices and the other buffers of a conv kernel
are its scratch memory (OpDef.scratch), which the memory planner places in the
arena (see Scratch). Pooling loops over the taps of the window (see "Taps"), or,
when the windows tile the image, over their rows and then their columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyflow import backend
from tinyflow.graph import Node, ShapeError
from tinyflow.ops import (
    OpDef,
    Mismatch,
    Operand,
    argument_error,
    int_like,
    ints_attr,
    result_dtype,
    make,
    register,
    require_shape,
)

# ----------------------------------------------------------------------------------
# Windows (im2col)
# ----------------------------------------------------------------------------------


def _pads(size: int, kernel: int, stride: int, padding) -> tuple[int, int]:
    """(before, after) padding of one spatial dim for padding = int, "VALID" or "SAME"."""
    if padding == "VALID":
        return 0, 0
    if padding == "SAME":
        # TF's rule: output = ceil(size / stride); the odd pixel goes after.
        out = -(-size // stride)
        total = max((out - 1) * stride + kernel - size, 0)
        return total // 2, total - total // 2
    return int(padding), int(padding)


def _window_check(attrs: dict, dtypes: list) -> None:
    """Strides and window sizes are positive; padding is "SAME", "VALID" or an int >= 0."""
    for key in ("ksize", "stride"):  # (ksize first: a pool's stride defaults to it)
        if key in attrs and any(int(v) < 1 for v in attrs[key]):
            raise Mismatch(f"{key} {tuple(attrs[key])} must be >= 1")
    padding = attrs.get("padding", 0)
    if isinstance(padding, str) and padding not in ("SAME", "VALID") or \
            not isinstance(padding, str) and int(padding) < 0:
        raise Mismatch(f"padding {padding!r} must be 'SAME', 'VALID' or an int >= 0")


def _float_window_check(attrs: dict, dtypes: list) -> None:
    """A window check, and a float input 0: a mean of ints is a fraction (TF1's
    avg_pool refuses ints too)."""
    _window_check(attrs, dtypes)
    if dtypes[0] is not None and dtypes[0].kind != "f":
        raise Mismatch(f"needs a float input, got {dtypes[0]} (cast it first)")


def _out_size(size, kernel, stride, padding):
    if size is None:
        return None
    before, after = _pads(size, kernel, stride, padding)
    out = (size + before + after - kernel) // stride + 1
    if out <= 0:
        raise Mismatch(f"window {kernel} with stride {stride} does not fit size {size}")
    return out


def _windows(xp, x, kh, kw, sh, sw, padding, fill=0.0):
    """View of x (N,C,H,W) as windows (N, C, OH, OW, kh, kw). Pads with `fill`."""
    n, c, h, w = x.shape
    (pt, pb), (pl, pr) = _pads(h, kh, sh, padding), _pads(w, kw, sw, padding)
    if pt or pb or pl or pr:
        x = xp.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill)
    x = xp.ascontiguousarray(x)
    n, c, hp, wp = x.shape
    oh, ow = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    s0, s1, s2, s3 = x.strides
    return backend.as_strided(xp, x, (n, c, oh, ow, kh, kw), (s0, s1, s2 * sh, s3 * sw, s2, s3))


def _scatter_windows(xp, cols, x_shape, kh, kw, sh, sw, padding):
    """Adjoint of `_windows`: sum window values (N,C,OH,OW,kh,kw) back into (N,C,H,W)."""
    n, c, h, w = x_shape
    (pt, pb), (pl, pr) = _pads(h, kh, sh, padding), _pads(w, kw, sw, padding)
    padded = xp.zeros((n, c, h + pt + pb, w + pl + pr), dtype=cols.dtype)
    oh, ow = cols.shape[2], cols.shape[3]
    # One strided add per kernel offset: kh*kw numpy calls, each over the whole batch.
    for i in range(kh):
        for j in range(kw):
            padded[:, :, i:i + sh * oh:sh, j:j + sw * ow:sw] += cols[:, :, :, :, i, j]
    return padded[:, :, pt:pt + h, pl:pl + w]


# ----------------------------------------------------------------------------------
# Taps: the loop behind the conv2d and max_pool2d kernels
#
# A kh x kw window has kh*kw taps; tap (i, j) of every window at once is one strided
# view of the (padded) input, shaped like the output (N, C, OH, OW). The kernels
# loop over the taps (9 or 25 iterations), each a single numpy call over the whole
# batch, so Python's cost is per tap, not per window, and no (N,C,OH,OW,kh,kw) view
# is ever reduced over its tiny trailing axes (which numpy does slowly).
# ----------------------------------------------------------------------------------


def _padded(xp, x, ksize, stride, padding, fill=0.0):
    """x padded for windows of `ksize` (a copy only when there is padding), and the
    output size (oh, ow) and the (top, left) padding."""
    (kh, kw), (sh, sw) = ksize, stride
    h, w = x.shape[2:]
    (pt, pb), (pl, pr) = _pads(h, kh, sh, padding), _pads(w, kw, sw, padding)
    if pt or pb or pl or pr:
        x = xp.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill)
    oh, ow = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
    return x, oh, ow, (pt, pl)


def _tap(x, i, j, oh, ow, stride):
    """Element (i, j) of every window: a strided view (N, C, oh, ow) of x."""
    sh, sw = stride
    return x[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]


def _conv_layout(x_shape, kh, kw, stride, padding):
    """(pt, pb, pl, pr, oh, ow): the padding and the output size."""
    (sh, sw), (h, w) = stride, x_shape[2:]
    (pt, pb), (pl, pr) = _pads(h, kh, sh, padding), _pads(w, kw, sw, padding)
    oh, ow = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
    return pt, pb, pl, pr, oh, ow


# Every conv kernel below works through the batch in chunks whose matrix (the
# im2col windows, or the gradient's columns) is about CHUNK_BYTES: the copies into
# it and the GEMM reading it back then meet in the core's L2 cache (1-2 MiB on
# current x86 cores) instead of making a round trip to memory for the whole batch.
# Measured on the benchmark CNNs with a cold cache: forward -25% (CIFAR conv2,
# 64x32x16x16, 3x3) and -30% (LeNet conv2, 100x20x14x14, 5x5) against one GEMM
# over the whole batch; the GEMMs stay large (thousands of columns) for BLAS.
# 1.25 MiB leaves room in a 2 MiB L2 for what a chunk touches besides its matrix
# (the input it is copied from, the output the GEMM writes): the training steps of
# benchmarks/cnn_bench.py, the sizes in rotating order, 24 rounds: CNN 40.4 ms at
# 2 MiB, 37.2 at 1.5, 35.7 at 1.25, 36.6 at 1; LeNet 59.1, 55.0, 54.6, 55.6.
CHUNK_BYTES = 1280 << 10


def _batch_chunks(xp, n, bytes_per_sample):
    """(start, stop) ranges that cover a batch of n samples in chunks of about
    CHUNK_BYTES (at least one sample each, but for the one empty chunk of an empty
    batch), their sizes differing by one at most
    (so a kernel's scratch comes in two shapes at most). On a GPU, one chunk:
    there the whole batch in one GEMM is what keeps the device busy."""
    per_chunk = n if xp is not np else CHUNK_BYTES // max(bytes_per_sample, 1)
    # ceil(n / samples per chunk); an empty batch is one empty chunk (its filter
    # gradient is then the GEMM's zeros, not an unwritten buffer)
    count = max(1, -(-n // max(per_chunk, 1)))
    base, extra = divmod(n, count)
    ranges, start = [], 0
    for k in range(count):
        stop = start + base + (k < extra)
        ranges.append((start, stop))
        start = stop
    return ranges


def _im2col(xp, x, kh, kw, stride, padding, dtype, workspace=None):
    """The windows of x as a (C*kh*kw, N*OH*OW) matrix in `dtype`.

    Row c*kh*kw + i*kw + j holds tap (i, j) of channel c for every output pixel of
    every sample, so the rows match OIHW filters reshaped to (O, C*kh*kw). The batch
    (a chunk of it, see _batch_chunks) lies *inside* each row (channels outermost: a
    "CNHW" layout), which makes the forward and both gradients ONE GEMM per chunk,
    the samples in a long dimension: BLAS runs one large product faster than many
    small ones, and the filter gradient sums over the chunk inside the GEMM.
    The price is a transposing copy of x in (done with the padding copy anyway)
    and of the result out (a copy out of the GEMM's buffer anyway).

    The copies are _fill_windows's.

    `workspace` (the kernel's Scratch, see _bind_scratch) supplies the buffers;
    without it they are allocated here."""
    oh, ow = _conv_layout(x.shape, kh, kw, stride, padding)[4:6]
    n, c = x.shape[:2]
    cols = _scratch(xp, workspace, "im2col", (c, kh, kw, n, oh * ow), dtype)
    _fill_im2col(xp, x, cols, stride, padding, workspace)
    return cols.reshape(c * kh * kw, n * oh * ow)


def _fill_im2col(xp, x, cols, stride, padding, workspace):
    """The copies of _im2col into cols (C, kh, kw, N, OH*OW)."""
    c, kh, kw, n = cols.shape[:4]
    oh, ow = _conv_layout(x.shape, kh, kw, stride, padding)[4:6]
    # x as (C, N, H, W), a view: its padded copy is the transposing copy
    _fill_windows(xp, x.transpose(1, 0, 2, 3), cols.reshape(c, kh, kw, n, oh, ow), 1,
                  stride, padding, workspace)


def _windows_by_sample(xp, x, kh, kw, stride, padding, dtype, workspace=None):
    """The windows of x as (N, C*kh*kw, OH*OW) in `dtype`: sample by sample, the
    matrix of _im2col for that sample alone ("NCHW im2col"). The forward multiplies
    each by the filters in one batched GEMM, whose result (N, O, OH*OW) is already
    the output's layout: measured against _im2col's one GEMM and its transposing
    copy out, 7-45% faster on the shapes tried (3 to 64 channels, 3x3 to 7x7), but
    for LeNet's second layer (20 channels, 5x5: even), and no "gemm" buffer. The
    gradients keep _im2col (there its layout wins)."""
    n, c = x.shape[:2]
    oh, ow = _conv_layout(x.shape, kh, kw, stride, padding)[4:6]
    cols = _scratch(xp, workspace, "im2col", (n, c, kh, kw, oh, ow), dtype)
    _fill_windows(xp, x, cols, 2, stride, padding, workspace)
    return cols.reshape(n, c * kh * kw, oh * ow)


def _fill_windows(xp, x, cols, tap_axis, stride, padding, workspace):
    """Copy tap (i, j) of every window of x (A, B, H, W) into the windows' buffer
    `cols`: its axes are A, B, OH, OW in that order, with kh and kw inserted at
    `tap_axis` (cols[:, :, i, j] for tap_axis 2, cols[:, i, j] for 1).

    Each tap is one strided view of the padded input, copied whole: kh*kw numpy
    copies, each over the whole chunk. For the common stride-1 convolution that
    keeps the width ("SAME"), tap (i, j) of every window of an image is instead
    ONE contiguous run of the image flattened with its vertical padding (see
    _flat_image): numpy copies runs of OH*W values instead of rows of OW, which
    takes 14-43% less time on the benchmark CNNs' layers (the most for many
    channels: CIFAR's 32-channel second layer). A run that starts left of the
    image, or ends right of it, wraps into the neighbouring row, where the window
    should see padding: those columns are zeroed after (per filter column j, for
    every i at once)."""
    kh, kw = cols.shape[tap_axis:tap_axis + 2]
    a, b, h, w = x.shape
    before = (slice(None),) * tap_axis
    pt, pb, pl, pr, oh, ow = _conv_layout(x.shape, kh, kw, stride, padding)
    if tuple(stride) != (1, 1) or ow != w:
        padded = _pad_copy(xp, x, kh, kw, stride, padding, cols.dtype, workspace)
        for i in range(kh):
            for j in range(kw):
                cols[before + (i, j)] = _tap(padded, i, j, oh, ow, stride)
        return
    flat = _flat_image(xp, x, (pt, pb, pl, pr), cols.dtype, workspace)
    for i in range(kh):
        for j in range(kw):   # the run from i*W + j (flat starts pl before the image)
            run = flat[:, :, i * w + j:i * w + j + oh * w]
            cols[before + (i, j)] = run.reshape(a, b, oh, w)
    for j in range(kw):
        column = cols[before + (slice(None), j)]        # every i: (..., OH, OW)
        if j < pl:        # the window's left edge hangs over the image by pl - j
            column[..., :pl - j] = 0
        elif j > pl:      # its right edge, by j - pl
            column[..., max(0, w - (j - pl)):] = 0


def _flat_image(xp, x, pads, dtype, workspace):
    """x (A, B, H, W) as (A, B, pl + (pt + H + pb) * W + pr): each image's rows one
    after the other, pt rows of zeros above and pb below, and pl zeros before and pr
    after it all, in the scratch buffer "pad" (x itself, reshaped, without padding).
    Tap (i, j) of every window of a width-keeping convolution is then the run of
    OH*W values starting at i*W + j."""
    pt, pb, pl, pr = pads
    a, b, h, w = x.shape
    if not (pt or pb or pl or pr):
        return x.reshape(a, b, h * w)
    flat = _scratch(xp, workspace, "pad", (a, b, _flat_length(h, w, pads)), dtype)
    top = pl + pt * w
    flat[:, :, :top] = 0
    flat[:, :, top:top + h * w] = x.reshape(a, b, h * w)
    flat[:, :, top + h * w:] = 0
    return flat


def _flat_length(h, w, pads):
    pt, pb, pl, pr = pads
    return pl + (pt + h + pb) * w + pr


def _pad_copy(xp, x, kh, kw, stride, padding, dtype, workspace):
    """x (_, _, H, W) with the padding of a (kh, kw) window around it, in the
    scratch buffer "pad"; x itself when there is no padding."""
    pt, pb, pl, pr = _conv_layout(x.shape, kh, kw, stride, padding)[:4]
    if not (pt or pb or pl or pr):
        return x
    # x inside, zeros in the border (zeroed here, on every call: between runs the
    # scratch holds other tensors).
    h, w = x.shape[2:]
    padded = _scratch(xp, workspace, "pad", x.shape[:2] + (h + pt + pb, w + pl + pr),
                      dtype)
    _zero_border(padded, pt, pb, pl, pr)
    padded[:, :, pt:pt + h, pl:pl + w] = x
    return padded


def _scratch(xp, workspace, name, shape, dtype):
    """Scratch buffer `name` as an uninitialized array of `shape`: cut from the
    kernel's planned scratch bytes when it is bound (`workspace` is a Scratch), else
    new. Planned scratch is shared with other tensors between runs, so a kernel
    assumes nothing about what it holds: borders that must be zero are zeroed on
    every call (_zero_border)."""
    if workspace is None:
        return xp.empty(shape, dtype=dtype)
    return workspace.get(name, shape, dtype)


class Scratch:
    """A conv kernel's scratch memory: `region`, a uint8 array (the step's place in
    the memory plan's arena, `OpDef.scratch` bytes), cut into one buffer per name at
    the offsets that `sizes` ({name: most bytes the kernel asks for it}) give, each
    aligned to 64 bytes (a cache line)."""

    ALIGN = 64

    def __init__(self, region: np.ndarray, sizes: dict[str, int]) -> None:
        self.region = region
        self.places: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, nbytes in sizes.items():
            self.places[name] = (offset, nbytes)
            offset += _aligned(nbytes, self.ALIGN)
        if offset > region.nbytes:
            raise ShapeError(f"{offset} bytes of scratch are needed, {region.nbytes} given")

    def get(self, name: str, shape: tuple, dtype: Any) -> np.ndarray:
        """Buffer `name` as an array of `shape` and `dtype` (at most its bytes)."""
        offset, room = self.places[name]
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if nbytes > room:   # the kernel asked for more than its size function said
            raise ShapeError(f"scratch buffer {name!r}: {nbytes} bytes asked, {room} planned")
        return self.region[offset:offset + nbytes].view(dtype).reshape(shape)


def _aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def scratch_bytes(sizes: dict[str, int]) -> int:
    """The bytes a Scratch with these buffer sizes needs."""
    return sum(_aligned(n, Scratch.ALIGN) for n in sizes.values())


def _zero_border(image, top, bottom, left, right):
    """Zero the outer rows and columns of image (..., H, W): its padding."""
    height, width = image.shape[-2:]
    image[..., :top, :] = 0
    image[..., height - bottom:, :] = 0
    image[..., :left] = 0
    image[..., width - right:] = 0


def _rows(xp, g, dtype, workspace=None):
    """g (N, O, OH, OW) in the GEMM layout (O, N*OH*OW), batch inside the rows as
    in _im2col."""
    n, o, oh, ow = g.shape
    rows = _scratch(xp, workspace, "rows", (o, n, oh, ow), dtype)
    rows[...] = g.transpose(1, 0, 2, 3)
    return rows.reshape(o, n * oh * ow)


def _to_nchw(xp, y, out):
    """y (C, N, H, W), a view of a GEMM result in the CNHW layout, as an NCHW
    array: copied into `out` (the planned memory) when there is one."""
    if out is None:
        return xp.ascontiguousarray(y.transpose(1, 0, 2, 3))
    out[...] = y.transpose(1, 0, 2, 3)
    return out


def _zeroed_padded(xp, shape, dtype, ksize, stride, padding, out):
    """A zeroed buffer to scatter windows into: `out` itself when there is no
    padding and it is contiguous (the planned memory, already paged in), else a new
    padded array. Returns it and the (top, left, h, w) crop that is x's part."""
    n, c, h, w = shape
    (pt, pb), (pl, pr) = _pads(h, ksize[0], stride[0], padding), \
        _pads(w, ksize[1], stride[1], padding)
    if out is not None and not (pt or pb or pl or pr) and out.flags.c_contiguous:
        out[...] = 0
        return out, None
    return xp.zeros((n, c, h + pt + pb, w + pl + pr), dtype=dtype), (pt, pl, h, w)


def _uncrop(xp, buffer, crop, out):
    if crop is None:        # the buffer is `out`
        return buffer
    pt, pl, h, w = crop
    return buffer[:, :, pt:pt + h, pl:pl + w]


def _col2im(xp, dcols, x_shape, stride, padding, out):
    """Adjoint of _im2col: add each tap's values (C, kh, kw, N, OH*OW) back into an
    image of x_shape; kh*kw adds, each over the whole batch into a strided view of
    a CNHW image, which is transposed to NCHW at the end (into `out`)."""
    c, kh, kw, n = dcols.shape[:4]
    pt, pb, pl, pr, oh, ow = _conv_layout(x_shape, kh, kw, stride, padding)
    h, w = x_shape[2:]
    image = xp.zeros((c, n, h + pt + pb, w + pl + pr), dtype=dcols.dtype)
    for i in range(kh):
        for j in range(kw):
            view = _tap(image, i, j, oh, ow, stride)
            view += dcols[:, i, j].reshape(c, n, oh, ow)
    return _to_nchw(xp, image[:, :, pt:pt + h, pl:pl + w], out)


# ----------------------------------------------------------------------------------
# conv2d
# ----------------------------------------------------------------------------------

def _conv_infer(shapes, dtypes, attrs):
    x, w = shapes
    if len(x) != 4 or len(w) != 4:
        raise Mismatch("conv2d needs x as (N, C, H, W) and filters as (O, C, kh, kw)")
    if x[1] is not None and w[1] is not None and x[1] != w[1]:
        raise Mismatch(f"input has {x[1]} channels but the filters expect {w[1]}")
    if 0 in (w[2], w[3]):  # (the output would be wider than the input)
        raise Mismatch(f"filters of size {w[2]}x{w[3]} are empty: a window needs a tap")
    sh, sw = attrs.get("stride", (1, 1))
    padding = attrs.get("padding", 0)
    if w[2] is None or w[3] is None:
        return (x[0], w[0], None, None), result_dtype(dtypes)
    return (x[0], w[0], _out_size(x[2], w[2], sh, padding),
            _out_size(x[3], w[3], sw, padding)), result_dtype(dtypes)


def _conv_compute(xp, x, w, out=None, stride=(1, 1), padding=0, workspace=None):
    # Per chunk of the batch, one batched GEMM: the filters (O, C*kh*kw) times each
    # sample's windows (C*kh*kw, OH*OW), written straight into that sample's rows
    # of the output (see _windows_by_sample).
    o, c, kh, kw = w.shape
    n, dtype = x.shape[0], xp.result_type(x, w)
    oh, ow = _conv_layout(x.shape, kh, kw, stride, padding)[4:6]
    direct = out is not None and out.dtype == dtype and out.flags.c_contiguous
    result = out if direct else xp.empty((n, o, oh, ow), dtype=dtype)
    wmat = w.reshape(o, c * kh * kw).astype(dtype, copy=False)
    for start, stop in _batch_chunks(xp, n, c * kh * kw * oh * ow * dtype.itemsize):
        cols = _windows_by_sample(xp, x[start:stop], kh, kw, stride, padding, dtype,
                                  workspace)
        xp.matmul(wmat, cols, out=result[start:stop].reshape(stop - start, o, oh * ow))
    if out is not None and not direct:
        out[...] = result
        return out
    return result


def _conv_grad_input_compute(xp, g, w, x, out=None, stride=(1, 1), padding=0,
                             workspace=None):
    # The adjoint of the forward: every output pixel's g, times the filters, lands
    # on the kh*kw input pixels of its window. Stride 1 (almost every conv) has a
    # fast path; the general one makes a GEMM row per tap and adds them tap by tap.
    # The arithmetic is in g's and w's common type (as the scratch sizes say); dx
    # is stored in `out`'s, g's (the planned memory), or in that type without one.
    dtype = xp.result_type(g, w)
    if out is None:
        out = xp.empty(x.shape, dtype=dtype)
    if tuple(stride) == (1, 1):
        if bool(xp.isfinite(w).all()):
            return _conv_grad_input_by_rows(xp, g, w, x, out, padding, dtype, workspace)
        workspace = None  # (the scratch is the fast path's; this rare case allocates)
    return _conv_grad_input_by_taps(xp, g, w, x, out, stride, padding, dtype, workspace)


def _conv_grad_input_by_taps(xp, g, w, x, out, stride, padding, dtype, workspace):
    """Per chunk of the batch, W^T @ g (one GEMM) gives every window's share of dx,
    a row per tap (the layout of _col2im), and _col2im adds the kh*kw taps back
    into the chunk's rows of dx."""
    o, c, kh, kw = w.shape
    n = x.shape[0]
    oh, ow = g.shape[2:]
    wmat_t = w.reshape(o, c * kh * kw).T.astype(dtype, copy=False)
    for start, stop in _batch_chunks(xp, n, c * kh * kw * oh * ow * dtype.itemsize):
        g_rows = _rows(xp, g[start:stop], dtype, workspace)
        dcols = xp.matmul(wmat_t, g_rows, out=_scratch(
            xp, workspace, "dcols", (c * kh * kw, g_rows.shape[1]), dtype))
        _col2im(xp, dcols.reshape(c, kh, kw, stop - start, oh * ow),
                (stop - start,) + tuple(x.shape[1:]), stride, padding, out[start:stop])
    return out


def _conv_grad_input_by_rows(xp, g, w, x, out, padding, dtype, workspace):
    """dx of a stride-1 convolution with kh adds, not kh*kw (finite filters only).

    Give g's rows and the image's rows the same length (`row` columns, see
    _input_gradient_rows) and flatten both. Then g's value at flat position p,
    times W[o, c, i, j], lands on the image at p + i*row + shift(j), where shift(j)
    = j - base, `base` being the filter column that lands in g's own column. The
    taps of one filter row i differ only by shift(j), so kw shifted copies of g,
    stacked, let ONE GEMM sum over the filter columns j (and the output channels):

        E[(c, i), p] = sum over (o, j) of W[o, c, i, j] * g[o, p - shift(j)]

    and the filter rows are kh adds of E's rows into the image, each a contiguous
    slice starting i*row further. Measured against one GEMM row per tap and kh*kw
    adds: LeNet's second layer (5x5) 19.1 -> 13.3 ms, CIFAR's (3x3) 9.4 -> 8.3 ms;
    on x's own rows rather than widened ones, the GEMM is smaller still (by
    OW / row: 22% for LeNet's, 11% for CIFAR's).

    A shifted copy reads past the end of a row into the next one: there the window
    hangs over x's edge, so those columns must hold zeros. In widened rows they do
    (the extra columns are zero); in x's own rows they are zeroed after the copy.
    Zeros meet W there and in the shifts' ends: W * 0 = 0 is exact only while W is
    finite (inf * 0 is NaN), which the caller checks."""
    o, c, kh, kw = w.shape
    n = x.shape[0]
    pt, pb, pl, pr, oh, ow = _conv_layout(x.shape, kh, kw, (1, 1), padding)
    h, width = x.shape[2:]
    row, left = _input_gradient_rows(width, ow, pl, pr)
    span = oh * row                       # one sample's g, in rows of `row`
    base = pl - left                      # the filter column whose shift is 0
    lhs = w.transpose(1, 2, 0, 3).reshape(c * kh, o * kw).astype(dtype, copy=False)
    for start, stop in _batch_chunks(xp, n, _by_rows_bytes_per_sample(w.shape, span,
                                                                      dtype.itemsize)):
        m = stop - start
        shifted = _scratch(xp, workspace, "shifted", (o, kw, m, span), dtype)
        rows = shifted[:, base].reshape(o, m, oh, row)      # g itself, in rows of `row`
        rows[..., :ow] = g[start:stop].transpose(1, 0, 2, 3)
        rows[..., ow:] = 0
        for j in range(kw):
            _shift_rows(shifted[:, j], shifted[:, base], j - base, row, left == 0)
        e = xp.matmul(lhs, shifted.reshape(o * kw, m * span), out=_scratch(
            xp, workspace, "e", (c * kh, m * span), dtype)).reshape(c, kh, m, span)
        # filter row i lands i rows further down; the first one sets the image
        image = _scratch(xp, workspace, "col2im", (c, m, (oh + kh - 1) * row), dtype)
        image[:, :, :span] = e[:, 0]
        image[:, :, span:] = 0
        for i in range(1, kh):
            image[:, :, i * row:i * row + span] += e[:, i]
        image = image.reshape(c, m, oh + kh - 1, row)
        _to_nchw(xp, image[:, :, pt:pt + h, left:left + width], out[start:stop])
    return out


def _input_gradient_rows(width, ow, pl, pr):
    """(row, left) of _conv_grad_input_by_rows: the columns of its rows, and the one
    where x's column 0 sits. A convolution that keeps the width (OW == W, as SAME
    does) works on x's own rows: (W, 0). Any other on rows of the padded width, g's
    rows widened with zeros: (W + pl + pr, pl)."""
    return (width, 0) if ow == width else (width + pl + pr, pl)


def _shift_rows(dst, src, shift, row, zero_wrapped):
    """dst (O, m, span) = src moved `shift` places along each sample's span, zeros
    where nothing moves in; with `zero_wrapped`, also zero the columns whose values
    came from the neighbouring row (the first `shift` of every row, or the last)."""
    span = src.shape[-1]
    if shift == 0:
        return            # dst is src
    if abs(shift) >= span:   # a filter wider than the whole image moves everything out
        dst[...] = 0
        return
    if shift > 0:
        dst[..., :shift] = 0
        dst[..., shift:] = src[..., :span - shift]
    else:
        dst[..., span + shift:] = 0
        dst[..., :span + shift] = src[..., -shift:]
    if zero_wrapped:
        columns = dst.reshape(dst.shape[:-1] + (span // row, row))
        if shift > 0:
            columns[..., :shift] = 0
        else:
            columns[..., max(0, row + shift):] = 0


def _by_rows_bytes_per_sample(w_shape, span, itemsize):
    """One sample's share of _conv_grad_input_by_rows's chunk: its shifted g and its
    E (the GEMM's right matrix and result)."""
    o, c, kh, kw = w_shape
    return (o * kw + c * kh) * span * itemsize


def _conv_grad_filter_compute(xp, g, x, w, out=None, stride=(1, 1), padding=0,
                              workspace=None):
    # dW = sum over the chunks of g (O, n*OH*OW) @ cols^T (n*OH*OW, C*kh*kw): one
    # GEMM per chunk on its im2col matrix, whose inner dimension runs over every
    # pixel of every sample in the chunk, so the sum over them happens inside BLAS.
    # It is computed transposed, cols @ g^T (C*kh*kw, O): the same products, which
    # OpenBLAS runs 10-20% faster in that orientation for these shapes (long inner
    # dimension, small result); the small result is transposed once at the end.
    o, c, kh, kw = w.shape
    n, dtype = x.shape[0], xp.result_type(x, g)
    oh, ow = g.shape[2:]
    if _filter_gradient_by_sample(c, kh, kw, dtype):
        return _conv_grad_filter_by_sample(xp, g, x, w, out, stride, padding, workspace)
    dw_t = _scratch(xp, workspace, "dw", (c * kh * kw, o), dtype)
    for k, (start, stop) in enumerate(_batch_chunks(xp, n, c * kh * kw * oh * ow *
                                                    dtype.itemsize)):
        cols = _im2col(xp, x[start:stop], kh, kw, stride, padding, dtype, workspace)
        g_rows = _rows(xp, g[start:stop], dtype, workspace)
        if k == 0:
            xp.matmul(cols, g_rows.T, out=dw_t)
        else:
            dw_t += xp.matmul(cols, g_rows.T, out=_scratch(xp, workspace, "dw part",
                                                           dw_t.shape, dtype))
    if out is None:
        out = xp.empty(w.shape, dtype=dtype)
    out[...] = dw_t.T.reshape(o, c, kh, kw)
    return out


# A first layer's filters see few input rows (3 channels x 3x3 = 27, 1 x 5x5 = 25):
# there the GEMM above is short and wide, and the transposing copies of x and g
# around it cost more than it does. Sample by sample (g's own layout, the forward's
# windows) needs no copy of g: measured, 40% faster for 25 and 27 rows, about even
# at 72, slower from 100 up (4 channels x 5x5: +12%; 16 x 3x3: +20%).
FEW_WINDOW_ROWS = 32


def _filter_gradient_by_sample(c: int, kh: int, kw: int, dtype: Any) -> bool:
    """Whether the filter gradient goes sample by sample: few window rows, and 32 bits
    or more. (In float16 each sample's product would be rounded, and could overflow,
    before the sum over the samples: 300 * 256 is inf, and inf - inf NaN, where one
    GEMM over the chunk sums inside and gave the exact 4.)"""
    return c * kh * kw <= FEW_WINDOW_ROWS and np.dtype(dtype).itemsize >= 4


def _conv_grad_filter_by_sample(xp, g, x, w, out, stride, padding, workspace):
    """dW = sum over the samples s of g[s] (O, OH*OW) @ windows[s]^T (OH*OW, C*kh*kw):
    one batched GEMM per chunk of the batch, then the sum over its samples."""
    o, c, kh, kw = w.shape
    n, dtype = x.shape[0], xp.result_type(x, g)
    pixels = g.shape[2] * g.shape[3]
    dw = _scratch(xp, workspace, "dw", (o, c * kh * kw), dtype)
    for k, (start, stop) in enumerate(_batch_chunks(xp, n, c * kh * kw * pixels *
                                                    dtype.itemsize)):
        cols = _windows_by_sample(xp, x[start:stop], kh, kw, stride, padding, dtype,
                                  workspace)
        samples = stop - start
        g_rows = g[start:stop].reshape(samples, o, pixels).astype(dtype, copy=False)
        parts = _scratch(xp, workspace, "dw parts", (samples, o, c * kh * kw), dtype)
        xp.matmul(g_rows, cols.transpose(0, 2, 1), out=parts)
        if k == 0:
            xp.sum(parts, axis=0, out=dw)
        else:
            dw += xp.sum(parts, axis=0, out=_scratch(xp, workspace, "dw part", dw.shape,
                                                     dtype))
    if out is None:
        out = xp.empty(w.shape, dtype=dtype)
    out[...] = dw.reshape(o, c, kh, kw)
    return out


def _conv_grad(n, g):
    x, w = n.inputs
    attrs = dict(n.attrs)
    return [make("conv2d_grad_input", g, w, x, **attrs),
            make("conv2d_grad_filter", g, x, w, **attrs)]


# The two gradient kernels are linear in each of their first two inputs, so their
# own gradients (needed for second derivatives) are convolutions again. With
# conv2d(x, w) = A_w x = B_x w, the kernels are A_w^T g and B_x^T g, and
#   <gg, A_w^T g> = <conv2d(gg, w), g>,   <gg, B_x^T g> = <conv2d(x, gg), g>.
# The last input of each only gives a shape: no gradient flows into it.
def _conv_grad_input_grad(n, gg):
    g, w, x = n.inputs
    return [make("conv2d", gg, w, **n.attrs), make("conv2d_grad_filter", g, gg, w, **n.attrs),
            None]


def _conv_grad_filter_grad(n, gg):
    g, x, w = n.inputs
    return [make("conv2d", x, gg, **n.attrs), make("conv2d_grad_input", g, gg, x, **n.attrs),
            None]


# What each conv kernel cuts from its scratch (see Scratch): {buffer: most bytes},
# for the largest chunk of the batch. The executor asks for the total up front
# (OpDef.scratch), so the memory planner can place it; Scratch.get refuses a
# request beyond these sizes, so a kernel and its sizes cannot drift apart quietly.

def _largest_chunk(n, bytes_per_sample):
    return max(stop - start for start, stop in _batch_chunks(np, n, bytes_per_sample))


def _window_sizes(x_shape, kh, kw, attrs, item):
    """The forward's and the filter gradient's windows: the im2col matrix of one
    chunk and, with padding, its padded copy; and the chunk's size."""
    n, c, h, w = x_shape
    stride = tuple(attrs.get("stride", (1, 1)))
    pt, pb, pl, pr, oh, ow = _conv_layout(x_shape, kh, kw, stride, attrs.get("padding", 0))
    chunk = _largest_chunk(n, c * kh * kw * oh * ow * item)
    sizes = {"im2col": c * kh * kw * chunk * oh * ow * item}
    if pt or pb or pl or pr:    # the padded copy of _fill_windows: flat, or 2-D
        flat = stride == (1, 1) and ow == w
        padded = _flat_length(h, w, (pt, pb, pl, pr)) if flat else (h + pt + pb) * (w + pl + pr)
        sizes["pad"] = c * chunk * padded * item
    return sizes, chunk, oh * ow


def _conv_sizes(shapes, dtypes, attrs):
    x, w = shapes
    item = np.result_type(*dtypes).itemsize
    return _window_sizes(x, w[2], w[3], attrs, item)[0]   # (no buffer for the GEMM)


def _conv_grad_input_sizes(shapes, dtypes, attrs):
    g, w, x = shapes
    (o, c, kh, kw), item = w, np.result_type(dtypes[0], dtypes[1]).itemsize
    stride = attrs.get("stride", (1, 1))
    _, _, pl, pr, oh, ow = _conv_layout(x, kh, kw, stride, attrs.get("padding", 0))
    if tuple(stride) == (1, 1):   # _conv_grad_input_by_rows
        row = _input_gradient_rows(x[3], ow, pl, pr)[0]
        chunk = _largest_chunk(g[0], _by_rows_bytes_per_sample(w, oh * row, item))
        return {"shifted": o * kw * chunk * oh * row * item,
                "e": c * kh * chunk * oh * row * item,
                "col2im": c * chunk * (oh + kh - 1) * row * item}
    chunk = _largest_chunk(g[0], c * kh * kw * oh * ow * item)
    return {"rows": o * chunk * oh * ow * item,
            "dcols": c * kh * kw * chunk * oh * ow * item}


def _conv_grad_filter_sizes(shapes, dtypes, attrs):
    g, x, w = shapes
    (o, c, kh, kw), item = w, np.result_type(dtypes[0], dtypes[1]).itemsize
    sizes, chunk, pixels = _window_sizes(x, kh, kw, attrs, item)
    sizes["dw"] = c * kh * kw * o * item
    if _filter_gradient_by_sample(c, kh, kw, np.result_type(dtypes[0], dtypes[1])):
        sizes["dw parts"] = chunk * o * c * kh * kw * item
    else:
        sizes["rows"] = o * chunk * pixels * item
    if chunk < x[0]:   # more than one chunk: the later ones' products are added
        sizes["dw part"] = c * kh * kw * o * item
    return sizes


def _scratch_of(sizes):
    """OpDef.scratch for a kernel whose buffers are `sizes`: their bytes (on the CPU;
    the GPU kernels allocate their own, in one chunk)."""
    def scratch(xp, shapes, dtypes, attrs):
        return scratch_bytes(sizes(shapes, dtypes, attrs)) if xp is np else 0
    return scratch


def _bind_scratch(compute, infer, sizes):
    """OpDef.bind for the conv kernels: their buffers are cut from `scratch`, the
    step's bytes in the memory plan's arena (or, without one, the executor's or a
    region made here), so no run allocates or pages in memory."""
    def bind(xp, shapes, dtypes, attrs, workspace, scratch=None):
        if xp is not np:
            return None                 # the GPU keeps the generic compute
        shape, dtype = infer(shapes, dtypes, attrs)
        buffer_sizes = sizes(shapes, dtypes, attrs)
        if scratch is None:
            scratch = np.empty(scratch_bytes(buffer_sizes), np.uint8)
        buffers = Scratch(scratch, buffer_sizes)

        def bound_compute(xp, *arrays, out=None, **attrs):
            if out is None:
                out = np.empty(shape, dtype=dtype)
            result = compute(xp, *arrays, out=out, workspace=buffers, **attrs)
            if result is not out:  # (another dtype)
                out[...] = result
            return out
        return bound_compute
    return bind


def _require_conv_output(g, x, w, attrs) -> None:
    """Raise Mismatch unless g has the shape conv2d(x, w) has (with these attrs)."""
    expected, _ = _conv_infer([x, w], [None, None], attrs)
    require_shape(g, expected, "g", "conv2d(x, filters)")


def _conv_grad_input_infer(shapes, dtypes, attrs):
    """(g, w, x): x's shape, g's dtype; g must be conv2d(x, w)'s shape."""
    g, w, x = shapes
    _require_conv_output(g, x, w, attrs)
    return tuple(x), dtypes[0]


def _conv_grad_filter_infer(shapes, dtypes, attrs):
    """(g, x, w): w's shape, g's dtype; g must be conv2d(x, w)'s shape."""
    g, x, w = shapes
    _require_conv_output(g, x, w, attrs)
    return tuple(w), dtypes[0]


def conv_cost(node: Node) -> float | None:
    """Flops of a convolution (or one of its gradients): 2 * output size * the
    size of one filter (input 1's dims after the first)."""
    if len(node.inputs) < 2 or not node.inputs[1].shape:
        return None
    size = 1
    for d in node.shape or ():
        size *= d or 1
    kernel = 1
    for d in node.inputs[1].shape[1:]:
        kernel *= d or 1
    return 2.0 * size * kernel


def _register_conv(name, compute, infer, gradient, sizes, doc, shape_inputs=()):
    """A conv op: its kernel bound to the scratch that `sizes` declares (OpDef.bind
    and OpDef.scratch read the same sizes), its flops for the stream assigner."""
    register(OpDef(name, compute, infer, gradient, bind=_bind_scratch(compute, infer, sizes),
                   scratch=_scratch_of(sizes), cost=conv_cost, doc=doc,
                   check=_window_check, shape_inputs=shape_inputs))


_register_conv("conv2d", _conv_compute, _conv_infer, _conv_grad, _conv_sizes,
               "2-D convolution, NCHW input, OIHW filters (im2col + a GEMM per batch chunk)")
_register_conv("conv2d_grad_input", _conv_grad_input_compute, _conv_grad_input_infer,
               _conv_grad_input_grad, _conv_grad_input_sizes,
               "gradient of conv2d with respect to its input", shape_inputs=(2,))
_register_conv("conv2d_grad_filter", _conv_grad_filter_compute, _conv_grad_filter_infer,
               _conv_grad_filter_grad, _conv_grad_filter_sizes,
               "gradient of conv2d with respect to its filters", shape_inputs=(2,))


def pair_attr(op: str, arg: str, value: Any) -> tuple[int, int]:
    """A window size or stride: an int, or (h, w). A float is refused, not truncated
    (a stride of 1.5 became 1), as is a sequence of another length, which `int()`
    and unpacking turned into errors from inside tinyflow."""
    if int_like(value):
        return (int(value), int(value))
    if not isinstance(value, (Sequence, np.ndarray)) or isinstance(value, str) \
            or len(value) != 2:
        raise argument_error(op, f"{arg} must be an int or (h, w), got {value!r}")
    return ints_attr(op, arg, value)


def padding_attr(op: str, padding: Any) -> str | int:
    """"SAME" or "VALID" (any case), or an int: not a float (1.5 was 1), True, None."""
    if isinstance(padding, str):
        return padding.upper()  # (an unknown name is the check's, with the attributes)
    if not int_like(padding):
        raise argument_error(op, f"padding must be 'SAME', 'VALID' or an int, got "
                                 f"{padding!r}")
    return int(padding)


def conv2d(x: Operand, w: Operand, stride: int | Sequence[int] = (1, 1),
           padding: int | str | Sequence[int] = 0) -> Node:
    """Convolve x (N,C,H,W) with filters w (O,C,kh,kw); padding int, "SAME" or "VALID"."""
    return make("conv2d", x, w, stride=pair_attr("conv2d", "stride", stride),
                padding=padding_attr("conv2d", padding))


# ----------------------------------------------------------------------------------
# Pooling
# ----------------------------------------------------------------------------------

def _pool_infer(shapes, dtypes, attrs):
    x = shapes[0]
    if len(x) != 4:
        raise Mismatch("pooling needs x as (N, C, H, W)")
    kh, kw = attrs["ksize"]
    sh, sw = attrs["stride"]
    padding = attrs.get("padding", 0)
    return (x[0], x[1], _out_size(x[2], kh, sh, padding),
            _out_size(x[3], kw, sw, padding)), dtypes[0]


def _pool_infer_second(shapes, dtypes, attrs):
    """Pooled shape of input 1 (x), dtype of input 0 (g), which must be x's shape."""
    require_shape(shapes[0], shapes[1], "g", "x")
    shape, _ = _pool_infer(shapes[1:], dtypes[1:], attrs)
    return shape, dtypes[0]


def _pool_grad_infer(shapes, dtypes, attrs):
    """(g, x[, y]): x's shape, g's dtype; g (and y, the forward's output, when
    given) must have the pooled shape of x."""
    pooled, _ = _pool_infer(shapes[1:2], dtypes[1:2], attrs)
    for what, shape in zip(("g", "y"), [shapes[0], *shapes[2:]]):
        require_shape(shape, pooled, what, "the pooling of x")
    return tuple(shapes[1]), dtypes[0]


def _lowest(dtype: np.dtype) -> float | int | bool:
    """The value no element of `dtype` is below: max pooling pads windows with it.
    -inf only for floats: cast to ints it fails ('cannot convert float infinity'),
    and to booleans it is True, which made padded windows of all-False x True."""
    if dtype.kind == "f":
        return -np.inf
    if dtype.kind in "iu":
        return np.iinfo(dtype).min
    return False


def _max_pool_compute(xp, x, out=None, ksize=(2, 2), stride=(2, 2), padding=0,
                      workspace=None):
    # A running maximum over the kh*kw taps: kh*kw - 1 ufunc calls, each over the
    # whole (N, C, OH, OW) output, on strided views (the reshape
    # (N,C,OH,2,OW,2).max(axis=(3,5)) reads the same memory but numpy reduces its
    # two tiny axes ~40x slower). Windows that tile the image (the common 2x2
    # stride-2 pool) take the faster _max_pool_tiled.
    if _tiles(x.shape, ksize, stride, padding):
        if out is None:
            out = xp.empty(x.shape[:2] + (x.shape[2] // ksize[0], x.shape[3] // ksize[1]),
                           x.dtype)
        return _max_pool_tiled(xp, x, out, ksize, workspace)
    padded, oh, ow, _ = _padded(xp, x, ksize, stride, padding, fill=_lowest(x.dtype))
    shape = x.shape[:2] + (oh, ow)
    result = out if out is not None else xp.empty(shape, x.dtype)
    result[...] = _tap(padded, 0, 0, oh, ow, stride)
    for i in range(ksize[0]):
        for j in range(ksize[1]):
            if i or j:
                xp.maximum(result, _tap(padded, i, j, oh, ow, stride), out=result)
    return result


def _tiles(x_shape, ksize, stride, padding) -> bool:
    """Do the windows tile the image exactly: side by side (stride = window), no
    gaps, no padding?"""
    (kh, kw), (sh, sw), (h, w) = ksize, stride, x_shape[2:]
    unpadded = _pads(h, kh, sh, padding) == (0, 0) == _pads(w, kw, sw, padding)
    return (sh, sw) == (kh, kw) and h % kh == 0 and w % kw == 0 and unpadded


def _max_pool_tiled(xp, x, out, ksize, workspace):
    """max_pool2d of windows that tile the image, a chunk of samples at a time: the
    maximum over each window's rows first, kh - 1 maxima of whole image rows (long
    contiguous runs, which numpy vectorizes), into the scratch buffer "rows"; then
    over its columns, kw - 1 maxima of strided columns of that kh times smaller
    array. Against the running maximum over the taps, all strided: 1.72 -> 0.95 ms
    for CIFAR's first layer (64x32x32x32), 1.24 -> 0.75 ms for LeNet's. (The one
    value the order can change: a window whose maximum is 0 held as both +0 and -0
    gives whichever zero numpy's maximum, which keeps the second of equals, ends on:
    here [[-1, +0], [-0, -1]] gives +0, as PyTorch does, where the taps' order gave
    -0. Every run of a program uses this kernel, so options still agree bit for bit.)"""
    (kh, kw), (n, c, h, w) = ksize, x.shape
    oh, ow = h // kh, w // kw
    for start, stop in _batch_chunks(xp, n, c * oh * w * x.dtype.itemsize):
        window_rows = x[start:stop].reshape(stop - start, c, oh, kh, w)
        rows = _scratch(xp, workspace, "rows", (stop - start, c, oh, w), x.dtype)
        rows[...] = window_rows[:, :, :, 0]
        for i in range(1, kh):
            xp.maximum(rows, window_rows[:, :, :, i], out=rows)
        columns = rows.reshape(stop - start, c, oh, ow, kw)
        peak = out[start:stop]
        peak[...] = columns[..., 0]
        for j in range(1, kw):
            xp.maximum(peak, columns[..., j], out=peak)
    return out


def _max_pool_sizes(shapes, dtypes, attrs):
    """The tiled max pool's scratch: the row maxima of its largest chunk."""
    (n, c, h, w), item = shapes[0], np.dtype(dtypes[0]).itemsize
    if not _tiles(shapes[0], attrs["ksize"], attrs["stride"], attrs.get("padding", 0)):
        return {}
    per_sample = c * (h // attrs["ksize"][0]) * w * item
    return {"rows": _largest_chunk(n, per_sample) * per_sample}


def _first_max_masks(xp, x, ksize, stride, padding, peak=None):
    """Yield (i, j, hit) per tap: hit (N,C,OH,OW) is True where tap (i, j) is the
    first maximum of its window (row-major order, as cuDNN and PyTorch pick).

    `peak` is max_pool2d(x), the forward's output: the gradient op takes it as an
    input (it is usually alive anyway, as the next layer's input), so the argmax
    costs one compare per tap. An op has one output in the IR, so the forward
    cannot hand over an argmax array; without `peak` (the 2-input form) the max is
    recomputed, kh*kw - 1 ufunc calls.

    `free` marks the windows whose max no earlier tap holds. The first tap needs no
    `free` yet, and the last needs no compare: every window's max is one of its
    taps, so where no earlier tap had it, the last one does (a NaN max equals
    nothing: then the last tap is compared too). 2x2 pooling: 8 mask passes, not 13.
    """
    padded, oh, ow, _ = _padded(xp, x, ksize, stride, padding, fill=_lowest(x.dtype))
    if peak is None:
        peak = _max_pool_compute(xp, x, None, ksize, stride, padding)
    hit = xp.empty(peak.shape, dtype=bool)
    # A window holding NaN has max NaN, which equals nothing: its first NaN is the
    # "max" then (as argmax picks it). Checked once, so clean inputs pay one isnan.
    has_nan = bool(xp.isnan(peak).any())
    taps = [(i, j) for i in range(ksize[0]) for j in range(ksize[1])]
    free = None
    for i, j in taps:
        if free is not None and (i, j) == taps[-1] and not has_nan:
            yield i, j, free          # the max no earlier tap held is here
            return
        tap = _tap(padded, i, j, oh, ow, stride)
        xp.equal(tap, peak, out=hit)
        if has_nan:
            hit |= xp.isnan(tap)
        if free is None:              # the first tap: every other window is free
            free = ~hit
        else:
            hit &= free               # an earlier tap already holds this max
            free ^= hit
        yield i, j, hit


def _max_pool_grad_compute(xp, g, x, y=None, out=None, ksize=(2, 2), stride=(2, 2),
                           padding=0):
    # The gradient goes to the first max of each window (as cuDNN and PyTorch do).
    # Per tap, g lands where that tap is the max, in a strided view of dx. When the
    # windows do not overlap (stride >= ksize, the common 2x2 stride-2 pool) each
    # element of dx is in one window at most, so g where hit (else 0) can be
    # *written* (4x faster than a masked add); windows that overlap add into the
    # same elements, so there the adds accumulate.
    if _tiles(x.shape, ksize, stride, padding):
        return _max_pool_grad_tiled(xp, g, x, y, out, ksize)
    oh, ow = g.shape[2:]
    disjoint = windows_disjoint(ksize, stride)
    dx, crop = _zeroed_padded(xp, x.shape, g.dtype, ksize, stride, padding, out)
    for i, j, hit in _first_max_masks(xp, x, ksize, stride, padding, y):
        view = _tap(dx, i, j, oh, ow, stride)
        if disjoint:
            _where_hit(xp, g, hit, view)
        else:
            xp.add(view, g, out=view, where=hit)
    return _uncrop(xp, dx, crop, out)


def windows_disjoint(ksize: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether no two pooling windows of `ksize` at `stride` share an element."""
    (kh, kw), (sh, sw) = ksize, stride
    return sh >= kh and sw >= kw


def _max_pool_grad_tiled(xp, g, x, y, out, ksize):
    """max_pool2d_grad of windows that tile x: every element of dx is in exactly one
    window, so each tap's g-where-hit is written, and dx needs no zeroing first. A
    chunk of samples at a time, so that its x, dx, g and masks stay in the L2 cache
    over the kh*kw passes: CIFAR's first layer (64x32x32x32) 3.57 -> 2.77 ms,
    LeNet's (100x20x28x28) 2.71 -> 2.17 ms (alternated with the whole batch)."""
    n, oh, ow = x.shape[0], g.shape[2], g.shape[3]
    contiguous_out = out is not None and out.flags.c_contiguous
    dx = out if contiguous_out else xp.empty(x.shape, dtype=g.dtype)
    # a chunk reads x and writes dx (g, y and the masks are kh*kw times smaller)
    for start, stop in _batch_chunks(xp, n, 2 * x[:1].nbytes):
        peak = None if y is None else y[start:stop]
        chunk = dx[start:stop]
        for i, j, hit in _first_max_masks(xp, x[start:stop], ksize, ksize, 0, peak):
            _where_hit(xp, g[start:stop], hit, _tap(chunk, i, j, oh, ow, ksize))
    return dx


def _where_hit(xp, g, hit, out):
    """out = g where hit, else 0, bit for bit for every g: the multiply of g's bit
    patterns (read as unsigned ints of its width) by hit's 0 or 1. A float
    g * hit would leave NaN, not 0, beside the max wherever g is inf or NaN
    (inf * 0); np.copyto(where=hit) is exact too but 7x slower into a strided view."""
    if g.dtype.itemsize not in (1, 2, 4, 8) or g.dtype != out.dtype:
        out[...] = 0
        xp.copyto(out, g, where=hit)
        return
    bits = np.dtype(f"u{g.dtype.itemsize}")
    xp.multiply(g.view(bits), hit, out=out.view(bits))


def _max_pool_pick_compute(xp, g, x, out=None, ksize=(2, 2), stride=(2, 2), padding=0):
    # The adjoint of max_pool2d_grad: read g (shaped like x) where each window of x
    # has its first max. Exactly one tap per window hits, so copies do not collide.
    padded_g, oh, ow, _ = _padded(xp, g, ksize, stride, padding)
    result = out if out is not None else xp.empty(g.shape[:2] + (oh, ow), g.dtype)
    result[...] = 0
    for i, j, hit in _first_max_masks(xp, x, ksize, stride, padding):
        xp.copyto(result, _tap(padded_g, i, j, oh, ow, stride), where=hit)
    return result


def _avg_pool_compute(xp, x, out=None, ksize=(2, 2), stride=(2, 2), padding=0):
    win = _windows(xp, x, *ksize, *stride, padding)
    return win.mean(axis=(4, 5))


def _avg_pool_grad_compute(xp, g, x, out=None, ksize=(2, 2), stride=(2, 2), padding=0):
    kh, kw = ksize
    cols = xp.broadcast_to((g / (kh * kw))[..., None, None], g.shape + (kh, kw))
    return _scatter_windows(xp, cols, x.shape, kh, kw, *stride, padding)


# Which element of a window is its max does not move when x moves a little, so the
# pooling gradients are linear in g with no gradient into x; their own gradients
# (for second derivatives) are the adjoint linear maps: pick <-> scatter to the max,
# avg_pool2d <-> avg_pool2d_grad.
# The backward gets the forward's output too (g, x, y): see _first_max_masks.
register(OpDef("max_pool2d", _max_pool_compute, _pool_infer,
               lambda n, g: [make("max_pool2d_grad", g, n.inputs[0], n, **n.attrs)],
               bind=_bind_scratch(_max_pool_compute, _pool_infer, _max_pool_sizes),
               scratch=_scratch_of(_max_pool_sizes), doc="max over each window",
               check=_window_check))
register(OpDef("max_pool2d_grad", _max_pool_grad_compute, _pool_grad_infer,
               lambda n, gg: [make("max_pool2d_pick", gg, n.inputs[1], **n.attrs)]
               + [None] * (len(n.inputs) - 1),
               doc="gradient of max_pool2d (g, x[, y = max_pool2d(x)]): g to the first "
                   "max of each window of x (y must be that max: the forward's output, "
                   "as the gradient rule passes it)",
               check=_window_check))
register(OpDef("max_pool2d_pick", _max_pool_pick_compute, _pool_infer_second,
               lambda n, gg: [make("max_pool2d_grad", gg, n.inputs[1], **n.attrs), None],
               doc="g (shaped like x) read at the first max of each window of x",
               check=_window_check))
register(OpDef("avg_pool2d", _avg_pool_compute, _pool_infer,
               lambda n, g: [make("avg_pool2d_grad", g, n.inputs[0], **n.attrs)],
               doc="mean over each window (padding counts as zeros)",
               check=_float_window_check))
register(OpDef("avg_pool2d_grad", _avg_pool_grad_compute, _pool_grad_infer,
               lambda n, gg: [make("avg_pool2d", gg, **n.attrs), None],
               doc="gradient of avg_pool2d",
               check=_float_window_check, shape_inputs=(1,)))


def _pool(op, x, ksize, stride, padding):
    ksize = pair_attr(op, "ksize", ksize)
    stride = ksize if stride is None else pair_attr(op, "stride", stride)
    return make(op, x, ksize=ksize, stride=stride, padding=padding_attr(op, padding))


def max_pool2d(x: Operand, ksize: int | Sequence[int] = 2,
               stride: int | Sequence[int] | None = None,
               padding: int | str | Sequence[int] = 0) -> Node:
    return _pool("max_pool2d", x, ksize, stride, padding)


def avg_pool2d(x: Operand, ksize: int | Sequence[int] = 2,
               stride: int | Sequence[int] | None = None,
               padding: int | str | Sequence[int] = 0) -> Node:
    return _pool("avg_pool2d", x, ksize, stride, padding)


__all__ = ["conv2d", "max_pool2d", "avg_pool2d", "pair_attr", "padding_attr", "conv_cost",
           "CHUNK_BYTES", "Scratch", "scratch_bytes", "windows_disjoint"]
