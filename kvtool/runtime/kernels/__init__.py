"""Kernels over the paged store (Triton on CUDA, Numba on CPU), each tested against the torch path it replaces.

* `uniform_decode.py`: one decode step's attention over float and uniform-code blocks (the stores
  of kivi / int8 / uncompressed / float-eviction recipes) in tiles of several blocks, each packed
  byte read once; the fast path `decode_attention.paged_decode_attention` takes for them;
  reference: the store's torch path and the general kernel.
* `decode_attention.py` (+ `body_block.py`, `body_format.py`, `body_rope.py`, `body_lowrank.py`,
  `body_rotated.py`, `body_split.py`, `body_qjl.py`): one decode step's attention over float and
  body blocks of every format, read in place one block at a time; reference: the store's torch path.
* `sparse_decode.py`: RocketKV's stage-2 read of the selected float slots only (with the unread
  tokens' estimated term); reference: the torch sparse path.
* `encode_blocks.py`: full float blocks -> uniform or fp8 body blocks written into their pool
  rows; reference: the quantizer's ``encode_blocks`` (byte-identical).
* `cpu_decode.py` (+ `cpu_decode_kernel.py`, Numba): one decode step's attention over float and
  uniform-code blocks on CPU in one compiled call per layer, optionally writing the step's token;
  the ``numba`` backend; reference: the same dense reference as the Triton kernels.

The Triton modules are imported only when the ``triton`` backend is used, so CPU-only installs never
need Triton (set ``TRITON_INTERPRET=1`` to run them on CPU tensors, as the tests do); the Numba kernel
only when the ``numba`` backend runs.
"""
