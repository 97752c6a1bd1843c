"""Random tiny models of every tested family, built from their Config classes (no downloads).

Default geometry: 2 layers, hidden 64, 4 query heads, 2 KV heads (GQA), head_dim 32,
vocab 128, 256 positions, no sliding window, float32, eval mode.

`FAMILIES` are the families the mechanics tests of the whole suite run over, with that
plain geometry. `ALL_FAMILIES` are every decoder family kvtool is tested on;
`featured_model(family)` builds one with its family's distinctive attention features
switched on (`FEATURES`: sliding windows, soft-capping, sinks, per-layer RoPE, k-norms,
biases, partial / interleaved / scaled RoPE, MoE blocks), still 2 layers of hidden 64.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"]

ALL_FAMILIES = [
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2",
    "gemma3_text", "olmo2", "granite", "starcoder2", "cohere", "gpt_oss",
]

WINDOW = 16  # sliding window of the featured models: shorter than the test sequences
_TWO_TYPES = ["sliding_attention", "full_attention"]

# Per family: the config fields that switch its distinctive attention features on.
FEATURES: dict[str, dict] = {
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "mistral": {"sliding_window": WINDOW},
    "mixtral": {"num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": ["full_attention", "sliding_attention"]},
    "qwen2_moe": {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "qkv_bias": True},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32},
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    "gemma": {},
    "gemma2": {"sliding_window": WINDOW, "layer_types": _TWO_TYPES, "attn_logit_softcapping": 1.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
    "gemma3_text": {"num_key_value_heads": 1, "sliding_window": WINDOW, "layer_types": _TWO_TYPES, "query_pre_attn_scalar": 16,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}},
    "olmo2": {},
    "granite": {"attention_multiplier": 0.05, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 2.0},
    "starcoder2": {"sliding_window": WINDOW, "use_bias": True},
    "cohere": {"use_qk_norm": True, "logit_scale": 0.5},
    "gpt_oss": {"num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": WINDOW, "layer_types": _TWO_TYPES,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}},
}

# Random tiny models score q.k near 0, where tanh soft-capping changes nothing: scale Q and K so it bites.
_SCORE_GAIN = {"gemma2": 10.0}

# Short names accepted by tiny_model(**overrides) -> config field names.
_ALIASES = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
}


def tiny_config(family: str, **overrides):
    """The Config of a tiny model; overrides use config field names or the short names in _ALIASES."""
    fields = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "sliding_window": None,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    fields.update({_ALIASES.get(key, key): value for key, value in overrides.items()})
    return AutoConfig.for_model(family, **fields)


def tiny_model(family: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A random tiny float32 model of `family` in eval mode, e.g. tiny_model("qwen3", kv_heads=4)."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # parameters some families initialise to zero or leave empty, made to matter
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.normal_(0.0, 1.0)  # GPT-OSS sink logits
    return model.float().eval()


def featured_model(family: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny model of `family` with its distinctive attention features on (FEATURES), plus overrides."""
    model = tiny_model(family, seed=seed, **{**FEATURES[family], **overrides})
    gain = _SCORE_GAIN.get(family)
    if gain:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(gain)
                layer.self_attn.k_proj.weight.mul_(gain)
    return model


def tiny_tokenizer_free_inputs(batch: int = 2, seq: int = 12, vocab: int = 128, seed: int = 0):
    """(input_ids, attention_mask), each (batch, seq) int64; row 1 is left-padded (first 3 positions, pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)  # avoid pad/bos/eos ids
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        input_ids[1, :3] = 0
        attention_mask[1, :3] = 0
    return input_ids, attention_mask
