"""kvtool from plain transformers code: `load` and the ``kvtool-text-generation`` pipeline.

    import kvtool
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M")
    tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M")
    kv = kvtool.load(model, "kivi-4bit")          # a recipe name / YAML, a Recipe, or a deployable artifact
    # transformers >= 5.24 takes the cache as `cache=`; earlier 5.x versions as `past_key_values=`
    out = model.generate(**tokenizer("Hello", return_tensors="pt"), cache=kv.new_cache(), max_new_tokens=20)

    pipe = kvtool.text_generation_pipeline(model, tokenizer, "model.kvt.safetensors")
    pipe("Once upon a time", max_new_tokens=20)   # [{"generated_text": ...}]

`load` validates the artifact against the model (the same checks as the CLI) and never changes
the model's weights; each `new_cache()` is a fresh, empty cache for one ``generate`` call (a
cache holds one conversation: do not share one between calls or threads). The pipeline is also
registered with transformers as ``"kvtool-text-generation"`` once this module is imported:
``transformers.pipeline("kvtool-text-generation", model=model, tokenizer=tokenizer, kvtool="kivi-4bit")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Pipeline, PreTrainedModel
from transformers.pipelines import PIPELINE_REGISTRY

from kvtool.errors import RuntimeConfigError
from kvtool.models.cache_argument import CACHE_ARGUMENTS, with_cache
from kvtool.recipe import Recipe

TASK = "kvtool-text-generation"


@dataclass
class Compression:
    """What `load` returns: the runtime bound to one model; `new_cache()` per generate call."""

    runtime: object  # kvtool.runtime.attach.CompressedRuntime

    @property
    def model(self):
        return self.runtime.model

    @property
    def recipe(self) -> Recipe:
        return self.runtime.recipe

    def new_cache(self):
        """A fresh `KvtoolCache` to pass as ``cache`` (``past_key_values`` before transformers 5.24); it switches the model to kvtool attention."""
        return self.runtime.new_cache()

    def generate(self, **kwargs) -> torch.Tensor:
        """``model.generate(**kwargs)`` with a fresh compressed cache."""
        given = [name for name in CACHE_ARGUMENTS if name in kwargs]
        if given:
            raise RuntimeConfigError(f"Compression.generate makes its own cache: leave out {given[0]}")
        with torch.no_grad():
            return self.model.generate(**kwargs, **with_cache(self.new_cache()))


def load(model, artifact_or_recipe: str | Path | Recipe | None = None, *, profile: str | Path | None = None,
         backend: str = "auto") -> Compression:
    """Bind kvtool's compressed cache to a loaded transformers causal LM.

    artifact_or_recipe: a deployable artifact (``.safetensors`` from `kvtool export`), a bundled
    recipe name or recipe YAML path, a `Recipe`, or None (uncompressed, kvtool's runtime).
    profile: a `kvtool profile` artifact, for a recipe that evicts and needs one.
    """
    from kvtool.api import with_token_classes
    from kvtool.artifact import check_model, load_artifact
    from kvtool.models.adapter import adapter_for
    from kvtool.recipe import load_recipe
    from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe

    if not isinstance(model, PreTrainedModel):
        raise RuntimeConfigError(
            f"kvtool.load needs a loaded transformers model (got {type(model).__name__}); "
            "load it with AutoModelForCausalLM.from_pretrained first"
        )
    source = artifact_or_recipe
    if isinstance(source, (str, Path)) and str(source).endswith(".safetensors"):
        if profile is not None:
            raise RuntimeConfigError("a deployable artifact carries its profile: export it with --profile instead of passing both")
        return Compression(CompressedRuntime.from_artifact(model, load_artifact(source, expect_kind="deployable"), backend=backend))
    if isinstance(source, Recipe):
        recipe = source
    else:
        recipe = load_recipe(source) if source is not None else uncompressed_recipe()
    profile_tensors = None
    if profile is not None:
        prof = load_artifact(profile, expect_kind="profile")
        check_model(prof, adapter_for(model).fingerprint(), source=f"profile '{profile}'")
        profile_tensors = prof.tensors
    profile_tensors = with_token_classes(model, recipe, profile_tensors)  # FastGen chosen per prompt
    return Compression(CompressedRuntime.from_recipe(model, recipe, profile=profile_tensors, backend=backend))


class KvtoolTextGenerationPipeline(Pipeline):
    """Text generation with kvtool's compressed cache: ``pipe(prompt, max_new_tokens=..., kvtool=...)``.

    The compression is given once (``kvtool=`` when building it, or `text_generation_pipeline`)
    and can be changed per call with ``kvtool=``. Returns ``[{"generated_text": new text}]`` per
    prompt; ``memory`` (what the cache held at the end) is added with ``return_memory=True``.
    """

    _compression: Compression | None = None
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, kvtool=None, max_new_tokens=None, return_memory=False, **generate_kwargs):
        forward = dict(generate_kwargs)
        if kvtool is not None:
            forward["kvtool"] = kvtool
        if max_new_tokens is not None:
            forward["max_new_tokens"] = max_new_tokens
        return {}, forward, {"return_memory": return_memory}

    def preprocess(self, prompt):
        if not isinstance(prompt, str) or not prompt:
            raise RuntimeConfigError("the kvtool pipeline takes a non-empty prompt string")
        return self.tokenizer(prompt, return_tensors="pt")

    def _forward(self, inputs, kvtool=None, max_new_tokens=32, **generate_kwargs):
        compression = self._compression
        if kvtool is not None:
            compression = kvtool if isinstance(kvtool, Compression) else load(self.model, kvtool)
            if self._compression is None:
                self._compression = compression
        if compression is None:
            raise RuntimeConfigError("give the pipeline a compression: kvtool='kivi-4bit' (a recipe) or an artifact path")
        cache = compression.new_cache()
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
        out = self.model.generate(**inputs, **with_cache(cache), max_new_tokens=max_new_tokens, **generate_kwargs)
        return {"new_ids": out[0, inputs["input_ids"].shape[1] :], "memory": cache.memory_report()}

    def postprocess(self, outputs, return_memory=False):
        result = {"generated_text": self.tokenizer.decode(outputs["new_ids"], skip_special_tokens=True)}
        if return_memory:
            result["memory"] = outputs["memory"]
        return [result]


def text_generation_pipeline(model, tokenizer, artifact_or_recipe: str | Path | Recipe | None = None, *,
                             profile: str | Path | None = None) -> KvtoolTextGenerationPipeline:
    """A `KvtoolTextGenerationPipeline` bound to ``model`` with the given compression."""
    pipe = KvtoolTextGenerationPipeline(model=model, tokenizer=tokenizer)
    pipe._compression = load(model, artifact_or_recipe, profile=profile)
    return pipe


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=KvtoolTextGenerationPipeline, pt_model=PreTrainedModel, type="text")
