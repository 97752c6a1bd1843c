"""TurboQuant's rotated blocks in the decode kernel: attention stays in the rotated domain.

Layout read (`kvtool.methods.quant.turboquant`, one instance: no outlier split): a body
block of one side holds, for its BS tokens,

* ``codes`` (cap, BS * b / 8, D) uint8 bit-sliced, token-split b-bit indices into the Lloyd-Max
  ``codebook`` (2**b,) float32 of the rotated unit vector ``y = P x / ||x||``;
* ``norm`` (cap, BS) fp16, ``||x||`` per token (``norm_bits: 8``: (cap, BS + 4) uint8, 8-bit log codes over
  the block's range, ``BodyFormat.scales == "norm8"``, `body_block.token_norms`);

read by `body_block.load_body` as ``codebook[code] * norm`` (``BodyFormat.scales == "norm"`` or ``"norm8"``):
``norm * y_hat``, the token in the rotated domain. ``P = H diag(s)`` (orthonormal Walsh-Hadamard
times the seed's random signs) comes as the side's ``rotation`` (D, D) float32 (`kernel_tensors`).

Nothing is rotated back per token (the paper's point; the torch path does the same):

* keys: ``q . x = (P q) . (P x)``, so the query rows are rotated once per step (`rotated_query`,
  one (S R, D) @ (D, D) product in torch) and the kernel scores body keys against ``P q``,
  float blocks and the new token against ``q``;
* values: ``sum_t p_t x_t = P^T sum_t p_t (P x_t)``: the kernel sums body values in the rotated
  domain in a second accumulator (same online-softmax rescaling as the first) and writes it beside
  the partials; `fold_rotated_values` rotates each program's partial back once (linear, so it
  commutes with pass 2's rescaling) and adds it before the merge.

Each costs O(D^2) per stream and step instead of per token. The outlier split (a channel subset
and rotation per block, chosen per block) is read by `body_split.py`; keys' QJL residual
(``qjl: true``) adds a term per key, scored against the query sketched once per step, ``G P q``
(`body_qjl.py`).
"""

from __future__ import annotations

import torch


def rotated_query(q: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Query rows q (S, R, D) float32 -> P q (S, R, D) contiguous, in the keys' rotated domain."""
    return (q @ tensors["rotation"].T).contiguous()


def fold_rotated_values(acc: torch.Tensor, rotated: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """acc (S, SPLITS, BR, BD) += P^T rotated: each partial's body values, summed in the rotated domain, rotated back."""
    d = tensors["rotation"].shape[0]
    acc[..., :d] += rotated[..., :d] @ tensors["rotation"]  # row form of P^T y
