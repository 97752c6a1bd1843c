"""Models loaded with accelerate offload (``device_map``, ``max_memory``, disk): parse limits, onload a module.

transformers loads a model that does not fit with ``device_map="auto"`` and ``max_memory``:
modules that do not fit go to the CPU or to "disk" (read back from the checkpoint's
safetensors, or from ``offload_folder``). accelerate hooks every offloaded leaf module:
its parameters sit on the meta device and each forward loads them, computes, and drops
them again. `onloaded` keeps a whole block (a decoder layer) loaded for a ``with`` block,
so layer-by-layer calibration reads each layer once instead of once per batch.
`fingerprint` is `ModelAdapter.fingerprint` for such models, one attention module at a time.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from kvtool.errors import ModelError

_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMGT]i?B|B)?$", re.IGNORECASE)


def parse_max_memory(text: str | None) -> dict[str | int, str] | None:
    """``"cpu=2GiB,0=20GiB"`` -> {"cpu": "2GiB", 0: "20GiB"}; a bare size (``"2GiB"``) limits the CPU.

    Sizes are accelerate's: a number with B, KB, MB, GB, KiB, MiB, GiB (bytes without a unit).
    """
    if text is None:
        return None
    limits: dict[str | int, str] = {}
    for part in (p.strip() for p in text.split(",")):
        device, _, size = part.rpartition("=")
        device = device.strip() or "cpu"
        size = size.strip()
        if not _SIZE.match(size):
            raise ModelError(
                f"--max-memory '{text}': '{part}' is not a size; write e.g. 'cpu=2GiB' or '0=20GiB,cpu=64GiB' "
                "(units B, KB, MB, GB, KiB, MiB, GiB)"
            )
        if device.isdigit():
            limits[int(device)] = size
        elif device in ("cpu", "disk") or device.startswith(("cuda", "mps", "xpu")):
            limits[device] = size
        else:
            raise ModelError(f"--max-memory '{text}': unknown device '{device}'; use cpu or a GPU index such as 0")
    return limits


def _offloading_hooks(module: nn.Module) -> list[tuple[nn.Module, object]]:
    """(submodule, accelerate hook) for every submodule whose parameters the hook loads per forward."""
    found = []
    for sub in module.modules():
        hook = getattr(sub, "_hf_hook", None)
        if hook is not None and getattr(hook, "offload", False):
            found.append((sub, hook))
    return found


def has_offloaded_modules(model: nn.Module) -> bool:
    """True if accelerate loads some of the model's weights only for the duration of a forward."""
    return bool(_offloading_hooks(model))


@contextmanager
def onloaded(module: nn.Module) -> Iterator[nn.Module]:
    """Load every offloaded parameter of ``module`` once, keep it for the block, drop it afterwards.

    A no-op for modules accelerate does not offload (a model fully in memory). Inside the
    block the hooks still move inputs to their execution device but do not reload weights.
    """
    hooks = _offloading_hooks(module)
    loaded = []
    try:
        for sub, hook in hooks:
            hook.pre_forward(sub)  # weights -> execution device
            hook.offload = False  # the forwards inside the block reuse them
            loaded.append((sub, hook))
        yield module
    finally:
        for sub, hook in loaded:
            hook.offload = True
            hook.post_forward(sub, None)  # weights back to meta


def execution_device(module: nn.Module) -> torch.device:
    """The device a module computes on: its accelerate hook's, else its first parameter's (CPU without any)."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


def fingerprint(adapter) -> dict:
    """`adapter.fingerprint()`, loading one layer's attention weights at a time when they are offloaded."""
    if not has_offloaded_modules(adapter.model):
        return adapter.fingerprint()
    read = adapter.kv_projection_weights

    def weights(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        with onloaded(adapter.attention(layer)):
            return tuple(w.detach().to("cpu", copy=True) for w in read(layer))

    adapter.kv_projection_weights = weights  # instance attribute: shadows the method for this call only
    try:
        return adapter.fingerprint()
    finally:
        del adapter.kv_projection_weights
