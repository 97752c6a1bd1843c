"""Bytes measured from outside the cache: every tensor reachable from an object, by unique storage.

A cache's own report (`nbytes`, `reserved_nbytes`) is checked against this walk in tests and
benchmarks: a tensor kept alive by accident (a view of the prefill K/V, a cos/sin table, a
pinned input) shows up here even when the cache's own formula forgets it. Modules
(the model) are not descended into: their weights are not cache memory.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


def reachable_tensors(root, skip=(torch.nn.Module,)) -> list:
    """Tensors (and numpy arrays) reachable from ``root`` through attributes, dicts, lists, tuples and sets."""
    seen_objects: set[int] = set()
    found: list[torch.Tensor] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, skip):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, type)):
            continue
        elif callable(obj) and not hasattr(obj, "__dict__"):
            continue
        else:
            if dataclasses.is_dataclass(obj):
                stack.extend(getattr(obj, f.name, None) for f in dataclasses.fields(obj))
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for slot in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, slot, None))
    return found


def storage_nbytes(tensors) -> int:
    """Bytes of the unique storages behind tensors and numpy arrays (a view counts its whole storage,
    once; a tensor sharing a numpy array's memory counts once)."""
    storages = {}
    for tensor in tensors:
        if isinstance(tensor, np.ndarray):
            base = tensor
            while isinstance(base.base, np.ndarray):
                base = base.base  # the array that owns the memory
            if isinstance(base.base, torch.Tensor):  # a host view of a tensor (`BlockPool.host_flat`): its storage, once
                tensor = base.base
            else:  # numpy's own memory (or a buffer it wraps)
                storages[(base.__array_interface__["data"][0], "cpu")] = base.nbytes
                continue
        storage = tensor.untyped_storage()
        device = "cpu" if tensor.device.type == "cpu" else str(tensor.device)
        storages[(storage.data_ptr(), device)] = storage.nbytes()
    return sum(storages.values())


def walked_nbytes(root) -> int:
    """Bytes of every storage reachable from ``root`` (modules excluded)."""
    return storage_nbytes(reachable_tensors(root))
