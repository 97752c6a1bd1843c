"""Triton kernels over the paged store, each tested against the torch path it replaces.

* `decode_attention.py` (+ `body_block.py`, `body_format.py`, `body_rope.py`, `body_lowrank.py`,
  `body_rotated.py`, `body_split.py`, `body_qjl.py`): one decode step's attention over float and
  body blocks read in place; reference: the store's torch path.
* `sparse_decode.py`: RocketKV's stage-2 read of the selected float slots only (with the unread
  tokens' estimated term); reference: the torch sparse path.
* `encode_blocks.py`: full float blocks -> uniform or fp8 body blocks written into their pool
  rows; reference: the quantizer's ``encode_blocks`` (byte-identical).

Imported only when the ``triton`` backend is used, so CPU-only installs never need Triton
(set ``TRITON_INTERPRET=1`` to run them on CPU tensors, as the tests do).
"""
