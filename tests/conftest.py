"""Shared test setup: one BLAS thread per test process, a deterministic hypothesis
profile, isolated TF1 globals, and the GPU tier's counts printed after the run."""

import json
import os
from collections import Counter

# `pytest -n 2` runs two test processes on two cores; a multi-threaded BLAS in each
# would put four spinning threads on two cores, and a small matmul can then take
# 100x longer. Set before numpy loads (conftest is imported before any test module).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import hypothesis  # noqa: E402
import pytest  # noqa: E402

import numpy as np  # noqa: E402

from tinyflow import api, ops  # noqa: E402

# Property tests draw the same examples on every run and machine (CI must not flake),
# and no per-example deadline: a first Session.run compiles, which is slow once.
hypothesis.settings.register_profile("ci", derandomize=True, deadline=None,
                                     print_blob=True)
hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _fresh_random_state():
    """Each test draws the random numbers it would draw in a fresh process: TinyFlow's
    op seeds count the random ops built before (TF1 semantics) and numpy's global
    generator moves with every draw, so without this a test's data and initial
    weights depended on which tests ran before it in the same worker (an MNIST
    example's accuracy went from 0.83 to 0.71 with the order xdist picked)."""
    ops.set_random_seed(0)
    np.random.seed(0)
    yield


@pytest.fixture(autouse=True)
def _isolated_variable_lists():
    """Each test sees the TF1 global lists (initializers, variables) as it found them,
    so `tf.initialize_all_variables()` in one test never runs another test's leftovers."""
    saved = (list(api._initializers), list(api._global_variables),
             list(api._trainable_variables), list(api.update_ops), dict(api.deferred_shapes),
             dict(api.deferred_fills), dict(api._initializer_of))
    yield
    for target, value in zip((api._initializers, api._global_variables,
                              api._trainable_variables, api.update_ops), saved[:4]):
        target[:] = value
    for target, value in zip((api.deferred_shapes, api.deferred_fills, api._initializer_of),
                             saved[4:]):
        target.clear()
        target.update(value)


# ----------------------------------------------------------------------------------
# The GPU tier's counts (tests/gpu_tier.py), summed over xdist workers and printed
# at the end of the run
# ----------------------------------------------------------------------------------

_GPU_TIER_KEY = "tinyflow_gpu_tier"
_gpu_tier_totals: Counter = Counter()


class _GatherWorkerCounts:
    """On the xdist controller: add each finished worker's counts."""

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        _gpu_tier_totals.update(json.loads(node.workeroutput.get(_GPU_TIER_KEY, "{}")))


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_GatherWorkerCounts(), "tinyflow-gpu-tier")


def pytest_sessionfinish(session):
    import gpu_tier
    if hasattr(session.config, "workeroutput"):  # an xdist worker: report home
        session.config.workeroutput[_GPU_TIER_KEY] = json.dumps(dict(gpu_tier.counts))
    else:
        _gpu_tier_totals.update(gpu_tier.counts)


def pytest_terminal_summary(terminalreporter):
    import gpu_tier
    lines = gpu_tier.summary(_gpu_tier_totals)
    if lines:
        terminalreporter.section("GPU path, checked without a GPU")
        for line in lines:
            terminalreporter.write_line(line)
