"""Host arrays onto the device without making the host wait for the GPU.

The paged store keeps its lengths and block bookkeeping in numpy on the host (cheap to read and decide on) and sends
small arrays to the device every step: lengths, the slots a step writes, rows and columns of table updates. On CUDA,
``torch.from_numpy(x).to("cuda")`` copies from pageable memory, which synchronizes: the host waits until the GPU has
run everything queued before it, so per-layer host work and kernels run one after the other instead of
overlapping. `to_device` stages the array in pinned memory and copies it asynchronously; PyTorch's caching host
allocator records the copy and does not hand the pinned block out again before the copy has run, so a later step
cannot overwrite what an earlier one still has to read.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``: on CPU the array's own memory (no copy; callers never mutate it in place
    afterwards), on CUDA an asynchronous copy through pinned memory, elsewhere an ordinary copy."""
    array = np.asarray(values)
    tensor = torch.from_numpy(array if array.flags.c_contiguous else array.copy(order="C"))
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staged.copy_(tensor)
        return staged.to(device, non_blocking=True)
    return tensor.to(device)
