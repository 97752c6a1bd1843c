"""Compression methods: one method per file, registered explicitly in `registry.py`."""
