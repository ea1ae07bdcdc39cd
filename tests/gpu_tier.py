"""The GPU-without-a-GPU tier's counts, for the summary the test run prints.

tests/test_gpu_compile.py (kernels compiled by NVRTC), tests/test_gpu_hostc.py (kernel
bodies run as host C against numpy) and tests/test_gpu_stream_model.py (schedules run
through the CUDA stream model) add to `counts`; tests/conftest.py gathers them from
every xdist worker and prints them after the run, so CI's log shows what was proven.
"""

from __future__ import annotations

from collections import Counter

# The summary's lines, in order: the key, and how the summary words it.
LINES = (
    ("kernels compiled", "NVRTC kernels compiled (sm_80 + sm_90)"),
    ("compile failures", "NVRTC compile failures"),
    ("refused programs", "programs gpu.py refuses (they run op by op)"),
    ("host-C programs", "host-C programs run against numpy"),
    ("host-C values", "host-C values compared"),
    ("host-C mismatches", "host-C mismatches"),
    ("schedules", "stream schedules checked on the CUDA model"),
    ("removed waits caught", "single removed waits caught"),
    ("removed waits missed", "single removed waits missed"),
)

counts: Counter = Counter()


def add(key: str, amount: int = 1) -> None:
    """Count `amount` more of `key` (one of LINES)."""
    assert key in dict(LINES), key
    counts[key] += amount


def summary(totals: Counter) -> list[str]:
    """The summary's lines for `totals` (none when the tier did not run)."""
    if not totals:
        return []
    return [f"{text}: {totals.get(key, 0)}" for key, text in LINES]
