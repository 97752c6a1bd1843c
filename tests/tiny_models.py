"""Random tiny models of every supported family, built from their Config classes (no downloads).

Default geometry: 2 layers, hidden 64, 4 query heads, 2 KV heads (GQA), head_dim 32,
vocab 128, 256 positions, no sliding window, float32, eval mode.
"""

import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"]

_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
}

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
    config_class, _ = _CLASSES[family]
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
    return config_class(**fields)


def tiny_model(family: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A random tiny float32 model of `family` in eval mode, e.g. tiny_model("qwen3", kv_heads=4)."""
    config = tiny_config(family, **overrides)
    _, model_class = _CLASSES[family]
    torch.manual_seed(seed)
    model = model_class(config)
    return model.float().eval()


def tiny_tokenizer_free_inputs(batch: int = 2, seq: int = 12, vocab: int = 128, seed: int = 0):
    """(input_ids, attention_mask), each (batch, seq) int64; row 1 is left-padded (first 3 positions, pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)  # avoid pad/bos/eos ids
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        input_ids[1, :3] = 0
        attention_mask[1, :3] = 0
    return input_ids, attention_mask
