"""Triton kernels over the paged store, each tested against the torch path it replaces.

Imported only when the ``triton`` backend is used, so CPU-only installs never need Triton
(set ``TRITON_INTERPRET=1`` to run them on CPU tensors, as the tests do).
"""
