"""`kvtool.load` and the ``kvtool-text-generation`` pipeline from plain transformers code.

Oracle: `CompressedRuntime` used directly (what `kvtool generate` runs) gives the same tokens;
the cache handed to ``generate`` really is kvtool's compressed one (fewer bytes than 16-bit).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers

import kvtool
from kvtool import api
from kvtool.errors import ArtifactError, RuntimeConfigError
from kvtool.models.cache_argument import CACHE_ARGUMENT, with_cache
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.cache import KvtoolCache
from tests.conftest import shared_path

PROMPT = "Once upon a time there was"


def direct_tokens(model, tokenizer, recipe, new=12):
    cache = CompressedRuntime.from_recipe(model, load_recipe(recipe)).new_cache()
    enc = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, **with_cache(cache), max_new_tokens=new, do_sample=False)
    return out[0, enc.input_ids.shape[1]:]


def test_load_gives_generate_a_compressed_cache(kvref):
    model, tokenizer = kvref
    kv = kvtool.load(model, "kivi-2bit")
    cache = kv.new_cache()
    assert isinstance(cache, KvtoolCache) and kv.recipe.name == "kivi-2bit"
    enc = tokenizer(PROMPT * 100, return_tensors="pt")  # past the float window (sinks + 128 recent)
    with torch.no_grad():
        out = model.generate(**enc, **with_cache(cache), max_new_tokens=12, do_sample=False)
    assert out.shape[1] == enc.input_ids.shape[1] + 12
    assert cache.memory_report()["bits_per_element"] < 8
    assert torch.equal(kv.generate(**tokenizer(PROMPT, return_tensors="pt"), max_new_tokens=12, do_sample=False)[0, -12:],
                       direct_tokens(model, tokenizer, "kivi-2bit"))


def test_the_cache_goes_under_the_name_the_installed_transformers_declares(kvref):
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; a decoder layer given both takes ``cache``, so
    kvtool must never pass the old name beside the new one, nor rely on a name a later 5.x drops."""
    model, tokenizer = kvref
    assert CACHE_ARGUMENT in inspect.signature(type(model).forward).parameters
    kv = kvtool.load(model, "kivi-2bit")
    enc = tokenizer(PROMPT, return_tensors="pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = kv.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == enc.input_ids.shape[1] + 4
    assert not [w for w in caught if "past_key_values" in str(w.message)], "kvtool passed a deprecated cache argument"
    for name in ("cache", "past_key_values"):
        with pytest.raises(RuntimeConfigError, match=f"leave out {name}"):
            kv.generate(**enc, **{name: kv.new_cache()}, max_new_tokens=2)


def test_load_a_deployable_artifact(kvref, tmp_path):
    model, tokenizer = kvref
    source = str(shared_path("models/kvref-5m"))
    data = f"{shared_path('data/text/wikitext2_valid.txt')}[0:0.2]"
    api.calibrate(data, tmp_path / "c.safetensors", source, "kvquant-3bit-1pct", samples=2, seq_len=64)
    api.export(tmp_path / "c.safetensors", tmp_path / "m.kvt.safetensors", source)
    kv = kvtool.load(model, tmp_path / "m.kvt.safetensors")
    assert kv.recipe.keys.method == "nuq"
    _, _, runtime = api.load_runtime(source, tmp_path / "m.kvt.safetensors")
    enc = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        expected = runtime.model.generate(**enc, **with_cache(runtime.new_cache()), max_new_tokens=10, do_sample=False)
    assert torch.equal(kv.generate(**enc, max_new_tokens=10, do_sample=False), expected)
    with pytest.raises(ArtifactError, match="calibration artifact; this command needs a deployable"):
        kvtool.load(model, tmp_path / "c.safetensors")


def test_load_refuses_what_is_not_a_model():
    with pytest.raises(RuntimeConfigError, match="loaded transformers model"):
        kvtool.load("HuggingFaceTB/SmolLM2-135M", "kivi-4bit")


def test_pipeline_matches_generate_and_is_registered(kvref):
    model, tokenizer = kvref
    expected = tokenizer.decode(direct_tokens(model, tokenizer, "kivi-4bit"), skip_special_tokens=True)
    pipe = kvtool.text_generation_pipeline(model, tokenizer, "kivi-4bit")
    [result] = pipe(PROMPT, max_new_tokens=12, return_memory=True)
    assert result["generated_text"] == expected and result["memory"]["tokens"] == len(tokenizer(PROMPT).input_ids) + 11
    registered = transformers.pipeline("kvtool-text-generation", model=model, tokenizer=tokenizer)
    assert registered(PROMPT, max_new_tokens=12, kvtool="kivi-4bit") == [{"generated_text": expected}]
    with pytest.raises(RuntimeConfigError, match="give the pipeline a compression"):
        transformers.pipeline("kvtool-text-generation", model=model, tokenizer=tokenizer)(PROMPT)


def test_threads_generating_on_one_attached_model_match_serial_calls(kvref):
    """Each thread has its own cache; the runtime (formats, probes) is shared by all of them."""
    import threading

    model, tokenizer = kvref
    kv = kvtool.load(model, "kivi-2bit")
    prompts = ["Once upon a time there was " * 20, "The history of the city " * 25, "In 1990 the team " * 30, "She said that " * 22]

    def run(prompt):
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            return model.generate(**enc, **with_cache(kv.new_cache()), max_new_tokens=16, do_sample=False)[0, -16:]

    serial = [run(p) for p in prompts]
    threaded = [None] * len(prompts)

    def work(i):
        threaded[i] = run(prompts[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(a, b) for a, b in zip(serial, threaded))
