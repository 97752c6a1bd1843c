"""kvtool: compress the KV cache of Hugging Face causal language models.

Offline, `profile` and `calibrate` study a model on calibration text, `export`
writes one safetensors artifact, and the runtime (`kvtool.runtime`) generates
with a cache that really holds fewer bytes. The plain-function API lives in
`kvtool.api`; the CLI (`kvtool --help`) is a thin layer over it.
"""

__version__ = "0.1.0"
