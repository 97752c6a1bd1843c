"""Which implementation computes attention over the store: ``auto``, ``torch`` or ``triton``.

Resolved once per runtime and reported in every memory report (``backend``):

* ``torch``: the pure-torch reference (`paged_attention.py` and the methods' ``chunk_*``), any device;
* ``triton``: fused kernels reading the store in place (CUDA; the Triton kernels are not part of
  this release yet, so asking for them is an error that says so);
* ``auto``: ``triton`` where it can run, else ``torch``.
"""

from __future__ import annotations

import torch

from kvtool.errors import RuntimeConfigError

BACKENDS = ("auto", "torch", "triton")


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernels can run on ``device``."""
    return False  # the Triton decode kernels arrive with the GPU runtime


def resolve_backend(requested: str, device: torch.device) -> str:
    """The backend a runtime on ``device`` uses for ``requested``; RuntimeConfigError when impossible."""
    if requested not in BACKENDS:
        raise RuntimeConfigError(f"--backend '{requested}' is unknown: use one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch"
    if requested == "triton" and not triton_available(torch.device(device)):
        raise RuntimeConfigError(
            "--backend triton: kvtool's Triton kernels are not available in this build yet; "
            "use --backend torch (or auto)"
        )
    return "triton" if triton_available(torch.device(device)) else "torch"
