"""Quantizers that store blocks of keys or values as packed integer codes."""
