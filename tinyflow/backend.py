"""Array backends: numpy on the CPU, CuPy on an NVIDIA GPU.

Ops receive the array module as `xp` and never import cupy themselves; this file is
the one place that finds out whether a GPU is there.
"""

from __future__ import annotations

from typing import Any

from tinyflow.graph import TinyFlowError


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def cuda_array_module() -> Any:
    """Return the cupy module, or raise a clear error when no GPU can be used."""
    try:
        import cupy
    except ImportError:
        raise TinyFlowError("device='cuda' needs CuPy: pip install 'tinyflow[gpu]' "
                            "on a machine with an NVIDIA GPU and CUDA 12") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        raise TinyFlowError(f"device='cuda': CuPy is installed but no GPU is usable ({err})"
                            ) from None
    if count == 0:
        raise TinyFlowError("device='cuda': CuPy is installed but sees no GPU")
    return cupy
