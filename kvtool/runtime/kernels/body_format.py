"""What the decode kernel needs to know about one side (keys or values) of the body blocks.

Kept free of Triton imports so the methods can describe themselves on CPU-only installs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.methods.quant.packing import slice_widths


@dataclass(frozen=True)
class BodyFormat:
    bits: int  # 16: float data (method none, any float dtype); else uniform codes of this many bits
    per_channel: bool  # uniform scales (D,) per block, else (BS, D / group)
    group: int  # channels per scale group (per-token scales)

    def widths(self) -> tuple[int, int, int]:
        """Slice widths of the packed codes, lowest bits first, padded with 0 (16 -> none)."""
        w = [] if self.bits == 16 else slice_widths(self.bits)
        return tuple(w + [0] * (3 - len(w)))
