"""NCCLTransport's parts that run without NCCL or a GPU: a clear error when CuPy or
libnccl is missing, every dtype NCCL can reduce, and the unique id's round trip in
the form CuPy's binding uses (a tuple of 128 signed chars)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from tinyflow import transports
from tinyflow.graph import TinyFlowError
from tinyflow.transports import NCCLTransport

# What NCCL reduces (ncclDataType_t, less bfloat16, which numpy lacks).
NCCL_DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
               "float32", "float64"]


class _Bootstrap:
    rank, size, timeout = 0, 2, 5.0


def _fake_cupy(monkeypatch, nccl_available: bool) -> types.ModuleType:
    """A `cupy` whose `cupy.cuda.nccl` says whether libnccl loaded, as CuPy's does;
    everything else is missing (no GPU is touched before the check)."""
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.ModuleType("cupy.cuda")
    cupy.cuda.nccl = types.ModuleType("cupy.cuda.nccl")
    cupy.cuda.nccl.available = nccl_available
    for name, module in (("cupy", cupy), ("cupy.cuda", cupy.cuda),
                         ("cupy.cuda.nccl", cupy.cuda.nccl)):
        monkeypatch.setitem(sys.modules, name, module)
    return cupy


def test_nccl_transport_without_libnccl_is_a_clear_error(monkeypatch):
    _fake_cupy(monkeypatch, nccl_available=False)
    with pytest.raises(TinyFlowError, match="cannot load the NCCL library"):
        NCCLTransport(_Bootstrap())


def test_nccl_transport_without_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # import cupy -> ImportError
    with pytest.raises(TinyFlowError, match="NCCLTransport needs CuPy"):
        NCCLTransport(_Bootstrap())


def test_with_the_real_cupy_and_no_libnccl_the_error_is_the_same():
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if nccl.available:
        pytest.skip("libnccl is installed here")
    with pytest.raises(TinyFlowError, match="cannot load the NCCL library"):
        NCCLTransport(_Bootstrap())


class _FakeNccl:
    """ncclDataType_t codes as CuPy names them, and ncclSum."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32 = 0, 1, 2, 3
    NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 4, 5, 6, 7, 8
    NCCL_SUM = 0


def _transport_with(calls: list) -> NCCLTransport:
    """An NCCLTransport around fakes: its comm records allReduce calls."""
    transport = object.__new__(NCCLTransport)
    transport.rank, transport.size, transport.nccl = 0, 2, _FakeNccl
    transport.comm = types.SimpleNamespace(allReduce=lambda *args: calls.append(args))
    stream = types.SimpleNamespace(ptr=0)
    transport.xp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: stream))
    transport._wait = lambda stream, peer, tag: None
    return transport


class _DeviceArray:
    """Enough of a CuPy array for native_allreduce: dtype, size, data.ptr."""

    def __init__(self, dtype):
        self.dtype, self.size = np.dtype(dtype), 4
        self.data = types.SimpleNamespace(ptr=1234)


@pytest.mark.parametrize("dtype", NCCL_DTYPES)
def test_native_allreduce_knows_every_dtype_nccl_reduces(dtype):
    calls = []
    _transport_with(calls).native_allreduce(_DeviceArray(dtype))
    (send, recv, count, code, op, stream), = calls
    assert code == getattr(_FakeNccl, f"NCCL_{dtype.upper()}") and count == 4


def test_the_transport_lists_the_dtypes_nccl_reduces():
    assert list(transports.NCCL_DTYPES) == NCCL_DTYPES


@pytest.mark.parametrize("dtype", ["bool", "int16", "uint16", "complex64"])
def test_native_allreduce_of_a_dtype_nccl_lacks_is_a_clear_error(dtype):
    with pytest.raises(TinyFlowError, match=f"NCCL cannot reduce {dtype}"):
        _transport_with([]).native_allreduce(_DeviceArray(dtype))
    with pytest.raises(TinyFlowError):
        transports.nccl_dtype(_FakeNccl, dtype)


def test_the_unique_id_survives_the_trip_as_bytes():
    """CuPy's get_unique_id() is a tuple of 128 C chars (signed); rank 0 sends it as
    bytes and every rank gives NcclCommunicator the same tuple back."""
    rng = np.random.default_rng(0)
    made = tuple(int(v) for v in rng.integers(-128, 128, 128))
    sent = transports.nccl_id_bytes(made)
    assert sent.dtype == np.uint8 and sent.size == NCCLTransport.UID_BYTES
    assert transports.nccl_id_tuple(sent.copy()) == made
    as_bytes = bytes(sent)
    assert transports.nccl_id_tuple(transports.nccl_id_bytes(as_bytes)) == made
