"""benchmarks.cache_capacity on a tiny Llama: three witnesses of a cache's bytes agree, and the ratios follow."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.cache_capacity import measure


def _tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def test_bytes_per_token_are_measured_three_ways_and_compressed_caches_fit_more_tokens():
    model = _tiny_llama()
    context, budget = 700, 2**30
    dynamic = measure(model, "DynamicCache", context, budget, "cpu")
    assert dynamic["cache_bytes"] == 2 * 2 * 2 * 64 * context * 2  # layers x (K, V) x KV heads x head_dim x tokens x bf16
    assert dynamic["bytes_per_token"] == 2 * 2 * 2 * 64 * 2
    for recipe in ("kivi-4bit", "kivi-4bit-lean", "kivi-2bit"):
        row = measure(model, recipe, context, budget, "cpu")
        # what the cache reports holding <= what it reserves ~ every storage reachable from it (a few bytes of
        # bookkeeping tensors beside the pools)
        assert 0 < row["cache_bytes"] <= row["reserved_bytes"] <= row["walked_bytes"] <= row["reserved_bytes"] + 4096
        assert row["tokens_in_budget"] == int(budget // row["bytes_per_token"])
        assert row["tokens_in_budget"] > 2 * dynamic["tokens_in_budget"]  # compression really happened


def test_decode_reads_the_bytes_held_after_every_step():
    model = _tiny_llama()
    dynamic = measure(model, "DynamicCache", 400, 2**30, "cpu", decode=40)
    kivi = measure(model, "kivi-4bit", 400, 2**30, "cpu", decode=40)
    per_token = 2 * 2 * 2 * 64 * 2
    assert dynamic["held_per_step"] == [per_token * (400 + step + 1) for step in range(40)]
    assert len(kivi["held_per_step"]) == 40 and kivi["held_min_bytes"] <= kivi["held_mean_bytes"] <= kivi["held_max_bytes"]
    assert kivi["held_max_bytes"] > kivi["held_min_bytes"]  # the float window fills, then flushes into a block
    assert kivi["held_mean_bytes"] < dynamic["held_mean_bytes"] / 2  # compressed on every step, on average
