"""Where a decoder keeps its attention parts, read from the modules themselves.

The generic reading covers every transformers 5.x decoder whose attention goes through
the attention interface with the Llama-style layout:

* decoder: ``model.get_decoder()`` (``model.model`` for *ForCausalLM, the language model of
  a multimodal wrapper such as Gemma 3's) holding ``layers`` and ``rotary_emb``;
* attention module of layer i: ``layers[i].self_attn``;
* K/V: separate ``k_proj`` / ``v_proj`` (biases where the checkpoint has them: Qwen2,
  Starcoder2, GPT-OSS), or one fused ``qkv_proj`` whose rows are [Q | K | V] (Phi-3);
* key/value norms before RoPE: ``k_norm`` (``v_norm``) over each head's D (Qwen3, Gemma 3;
  Cohere's per-head LayerNorm with (H_kv, D) weights) or over the whole H_kv*D
  projection (OLMo 2), told apart by the norm's weight shape.

Anything else raises ModelError naming the part that was not found.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from kvtool.errors import ModelError

ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")


@dataclass(frozen=True, eq=False)
class AttentionParts:
    """One layer's attention module and where its K/V come from."""

    module: nn.Module
    kv_input: nn.Module  # its forward input is the hidden state (B, T, d_model) fed to K and V
    fused: bool  # kv_input is a fused qkv_proj with rows [Q (H*D) | K (H_kv*D) | V (H_kv*D)]
    key_norm: nn.Module | None  # applied to keys before RoPE
    key_norm_per_head: bool  # True: over D of each head; False: over the whole H_kv*D projection
    value_norm: nn.Module | None
    value_norm_per_head: bool


def text_config(model: nn.Module):
    """The decoder's config (the text config of a multimodal wrapper), or ModelError."""
    config = getattr(model, "config", None)
    if config is None:
        raise ModelError(f"{type(model).__name__} has no .config; pass a transformers causal LM")
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def find_decoder(model: nn.Module) -> nn.Module:
    """The module that holds the decoder layers, or ModelError."""
    candidates = []
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(model.get_decoder())
        except (AttributeError, ValueError, NotImplementedError):
            pass
    candidates.append(getattr(model, "model", None))
    for decoder in candidates:
        layers = getattr(decoder, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return decoder
    raise ModelError(
        f"{type(model).__name__} has no decoder layers (looked at get_decoder().layers and model.layers); "
        "pass a causal LM loaded with AutoModelForCausalLM"
    )


def attention_parts(layer: nn.Module, index: int, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionParts:
    """Read layer `index`'s attention parts; ModelError names what is missing or inconsistent."""
    attn = next((getattr(layer, name) for name in ATTENTION_NAMES if hasattr(layer, name)), None)
    if attn is None:
        raise ModelError(f"decoder layer {index} ({type(layer).__name__}) has no attention module ({'/'.join(ATTENTION_NAMES)})")
    kv_size = num_kv_heads * head_dim
    if _is_linear(getattr(attn, "k_proj", None)) and _is_linear(getattr(attn, "v_proj", None)):
        kv_input, fused, k_rows = attn.k_proj, False, attn.k_proj.out_features
    elif _is_linear(getattr(attn, "qkv_proj", None)):
        kv_input, fused, k_rows = attn.qkv_proj, True, attn.qkv_proj.out_features - num_heads * head_dim - kv_size
        if attn.qkv_proj.out_features != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ModelError(
                f"layer {index}: fused qkv_proj has {attn.qkv_proj.out_features} output rows, expected "
                f"(heads {num_heads} + 2 * KV heads {num_kv_heads}) * head_dim {head_dim}"
            )
    else:
        raise ModelError(
            f"layer {index}'s attention ({type(attn).__name__}) has neither k_proj/v_proj linears nor a fused qkv_proj; "
            "kvtool cannot find where its keys and values are projected"
        )
    if k_rows != kv_size:
        raise ModelError(f"layer {index}: the K projection has {k_rows} rows, expected KV heads {num_kv_heads} * head_dim {head_dim}")
    key_norm, key_per_head = _norm(attn, "k_norm", index, num_kv_heads, head_dim)
    value_norm, value_per_head = _norm(attn, "v_norm", index, num_kv_heads, head_dim)
    return AttentionParts(attn, kv_input, fused, key_norm, key_per_head, value_norm, value_per_head)


def mla_reason(config, attention: nn.Module | None = None) -> str | None:
    """Why a multi-head latent attention model (DeepSeek-V2/V3 style) is refused, or None."""
    if getattr(config, "kv_lora_rank", None) or (attention is not None and hasattr(attention, "kv_a_proj_with_mqa")):
        return (
            f"model type '{getattr(config, 'model_type', '?')}' uses multi-head latent attention (MLA): its cache already "
            "holds a compressed latent (kv_lora_rank) plus a shared RoPE key, not per-head keys and values, so kvtool "
            "would have to compress that latent instead; MLA models are not supported"
        )
    return None


def _is_linear(module) -> bool:
    return isinstance(module, nn.Linear)


def _norm(attn: nn.Module, name: str, index: int, num_kv_heads: int, head_dim: int) -> tuple[nn.Module | None, bool]:
    """(norm module or None, per_head) for k_norm / v_norm, told apart by the weight's size."""
    norm = getattr(attn, name, None)
    if norm is None or isinstance(norm, nn.Identity):
        return None, True
    weight = getattr(norm, "weight", None)
    if weight is None or weight.numel() == head_dim or tuple(weight.shape) == (num_kv_heads, head_dim):
        return norm, True  # no weight, (D,) weights, or Cohere's (H_kv, D) per-head weights
    if weight.numel() == num_kv_heads * head_dim:
        return norm, False
    raise ModelError(
        f"layer {index}: {name} has a weight of shape {tuple(weight.shape)}, neither head_dim ({head_dim}) nor "
        f"KV heads * head_dim ({num_kv_heads * head_dim}); kvtool cannot tell what it normalises"
    )
