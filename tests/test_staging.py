"""`kvtool.runtime.staging.to_device`: host arrays onto the device without a host sync on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtool.runtime.staging import to_device


def test_on_cpu_the_array_is_shared_not_copied():
    values = np.arange(6, dtype=np.int64)
    tensor = to_device(values, torch.device("cpu"))
    assert tensor.dtype == torch.int64 and tensor.tolist() == list(range(6))
    assert tensor.data_ptr() == values.ctypes.data  # the store's lengths rely on this being free


@pytest.mark.parametrize("values", [np.arange(5)[::-2], np.arange(12).reshape(3, 4).T, np.array(7), np.zeros(0, np.int32),
                                    np.array([True, False])])
def test_any_layout_and_shape_arrives_whole(values):
    tensor = to_device(values, torch.device("cpu"))
    assert tuple(tensor.shape) == values.shape and np.array_equal(tensor.numpy(), values)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_copy_does_not_synchronize_and_a_later_write_cannot_overwrite_it():
    device = torch.device("cuda")
    torch.cuda._sleep(50_000_000)  # keep the stream busy: a synchronizing copy would wait for this
    torch.cuda.set_sync_debug_mode("error")
    try:
        staged = [to_device(np.full(1024, i, dtype=np.int64), device) for i in range(8)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [int(t.unique().item()) for t in staged] == list(range(8))  # each copy read its own staging block
