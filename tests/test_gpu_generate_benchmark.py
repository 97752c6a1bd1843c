"""benchmarks.gpu_generate's sync counter, without a GPU: CUDA's sync debug mode is stood in for by warnings."""

from __future__ import annotations

import warnings

import numpy as np
import torch

import benchmarks.gpu_generate as gpu_generate


def test_syncs_are_counted_per_step_and_traced_to_the_kvtool_line(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    from kvtool.runtime import staging

    real = staging.np.asarray

    def syncing_asarray(values):  # a "synchronizing operation" inside kvtool's own code
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
        return real(values)

    monkeypatch.setattr(staging.np, "asarray", syncing_asarray)

    def step(i):
        staging.to_device(np.arange(3), torch.device("cpu"))
        if i == 0:
            warnings.warn("called a synchronizing CUDA operation", UserWarning)  # outside kvtool: file and line

    per_step, sites = gpu_generate.count_syncs(step, 4)
    assert per_step == 5 / 4
    assert sites[0][1] == 4 and sites[0][0].startswith("runtime/staging.py:") and "(to_device)" in sites[0][0]
    assert sites[1][1] == 1 and "test_gpu_generate_benchmark.py" in sites[1][0]
    assert modes == ["warn", "default"]  # the debug mode is switched off again
