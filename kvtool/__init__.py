"""kvtool: compress the KV cache of Hugging Face causal language models.

Offline, `profile` and `calibrate` study a model on calibration text, `export`
writes one safetensors artifact, and the runtime (`kvtool.runtime`) generates
with a cache that really holds fewer bytes. The plain-function API lives in
`kvtool.api`; the CLI (`kvtool --help`) is a thin layer over it.
"""

__version__ = "0.1.0"


def load(model, artifact_or_recipe=None, **kwargs):
    """Bind kvtool's compressed cache to a loaded transformers model; see `kvtool.hf.load`."""
    from kvtool.hf import load as _load

    return _load(model, artifact_or_recipe, **kwargs)


def text_generation_pipeline(model, tokenizer, artifact_or_recipe=None, **kwargs):
    """A text-generation pipeline with kvtool's cache; see `kvtool.hf.text_generation_pipeline`."""
    from kvtool.hf import text_generation_pipeline as _pipeline

    return _pipeline(model, tokenizer, artifact_or_recipe, **kwargs)
