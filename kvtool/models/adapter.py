"""Where each supported model family keeps its attention parts.

An adapter answers "where are the K/V projections, what is the geometry, what RoPE does
this model use" for one loaded Hugging Face causal LM. It holds no compression logic.

Families are registered explicitly in `ADAPTERS`, keyed by `config.model_type`.
All of them use the Llama layout `model.model.layers[i].self_attn` and a shared
rotary module `model.model.rotary_emb`; they differ in:

- phi3: one fused `qkv_proj` (rows: Q, then K, then V) instead of q/k/v_proj;
  RoPE may be partial (`rope_parameters["partial_rotary_factor"]`) and of type longrope.
- qwen3: per-head RMSNorm `k_norm` on keys before RoPE.
- qwen2: biases on k_proj/v_proj.
- gemma: head_dim is set in the config (not hidden_size // num_heads), embeddings are
  scaled by sqrt(hidden_size) inside `embed_tokens`; attention itself is Llama's.
- mistral (and phi3): a single `config.sliding_window` for all layers; qwen2/qwen3 use
  `config.layer_types` to mark which layers slide.
"""

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvtool.errors import ModelError
from kvtool.models import fingerprint
from kvtool.models.fingerprint import kv_weights_sketch


@dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry of one model, as read from its config and modules."""

    family: str  # config.model_type: "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # KV heads (GQA: num_heads is a multiple)
    head_dim: int
    rotary_dim: int  # dims of a head rotated by RoPE (head_dim * partial_rotary_factor)
    max_positions: int  # config.max_position_embeddings
    rope: dict  # JSON-able copy of config.rope_parameters (rope_theta, rope_type, scaling...)
    layer_types: tuple[str, ...] | None = None  # config.layer_types where the config has it
    sliding_windows: tuple[int | None, ...] = ()  # per layer: window length, None = full attention

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


class ModelAdapter:
    """Where a family keeps its attention parts. One subclass per family that differs; registered explicitly.

    The base class handles the Llama layout (separate k_proj / v_proj, no key norm).
    """

    family: str = "llama"
    keys_linear_in_input = True  # pre-RoPE keys = hidden @ K weight^T (+ bias); False where a norm follows

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = _decoder_layers(model)
        self.rotary_emb = _rotary_module(model)
        self.geometry = self._read_geometry()

    # ----- modules -------------------------------------------------------------------

    def attention_modules(self) -> list[nn.Module]:
        """The self-attention module of each decoder layer, in layer order."""
        return [layer.self_attn for layer in self.layers]

    def attention(self, layer: int) -> nn.Module:
        """The self-attention module of decoder layer `layer` (0-based)."""
        if not 0 <= layer < len(self.layers):
            raise ModelError(f"layer {layer} does not exist; the model has {len(self.layers)} layers (0..{len(self.layers) - 1})")
        return self.layers[layer].self_attn

    def kv_projection_inputs_module(self, layer: int) -> nn.Module:
        """Module whose forward input is the hidden state (B, T, d_model) fed into the K/V projections."""
        return self.attention(layer).k_proj

    # ----- weights -------------------------------------------------------------------

    def kv_projection_weights(self, layer: int) -> tuple[Tensor, Tensor]:
        """(K weight, V weight) of a layer, each (H_kv*D, d_model), as views of the model's parameters."""
        attn = self.attention(layer)
        return attn.k_proj.weight, attn.v_proj.weight

    def kv_projection_biases(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(K bias, V bias) of a layer, each (H_kv*D,) or None (only qwen2 has them by default)."""
        attn = self.attention(layer)
        return attn.k_proj.bias, attn.v_proj.bias

    def project_kv(self, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Pre-RoPE keys and values of a layer from its K/V input hidden state.

        hidden: (B, T, d_model), the input of `kv_projection_inputs_module(layer)`.
        Returns (keys, values), each (B, H_kv, T, D); keys are what RoPE is applied to.
        """
        w_k, w_v = self.kv_projection_weights(layer)
        b_k, b_v = self.kv_projection_biases(layer)
        keys = self._to_heads(F.linear(hidden, w_k, b_k))  # (B, H_kv, T, D)
        values = self._to_heads(F.linear(hidden, w_v, b_v))  # (B, H_kv, T, D)
        return keys, values

    def _to_heads(self, x: Tensor) -> Tensor:
        """(B, T, H_kv*D) -> (B, H_kv, T, D)."""
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.geometry.num_kv_heads, self.geometry.head_dim).transpose(1, 2)

    # ----- RoPE ----------------------------------------------------------------------

    def rope_cos_sin(self, position_ids: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """cos and sin, each (B, T, rotary_dim), from the model's own rotary module.

        position_ids: (B, T) LongTensor. For dynamic / longrope RoPE the frequencies depend
        on the largest position in the call (as in the model's forward), so pass the same
        position_ids the model saw. Attention scaling (yarn, longrope) is included in cos/sin.
        """
        device = self.rotary_emb.inv_freq.device
        probe = torch.empty(0, dtype=dtype, device=device)  # only its dtype and device are read
        cos, sin = self.rotary_emb(probe, position_ids.to(device))
        return cos, sin  # (B, T, R) each

    # ----- identity ------------------------------------------------------------------

    def fingerprint(self) -> dict:
        """JSON-able identity of the model: geometry plus a hash of all K/V projection weights.

        kv_weights_sha256 hashes every layer's K then V weight, in layer order, each cast to
        bfloat16 on CPU and taken as raw bytes. kv_weights_sketch identifies the same weights
        in any float dtype (`kvtool.models.fingerprint`, which also compares fingerprints).
        """
        g = self.geometry
        digest = hashlib.sha256()
        weights = [w for layer in range(g.num_layers) for w in self.kv_projection_weights(layer)]
        for weight in weights:
            digest.update(_bf16_bytes(weight))
        return {
            "family": g.family,
            "num_layers": g.num_layers,
            "num_heads": g.num_heads,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "rotary_dim": g.rotary_dim,
            "rope": g.rope,
            "kv_weights_sha256": digest.hexdigest(),
            "kv_weights_sketch": kv_weights_sketch(weights),
        }

    # ----- geometry ------------------------------------------------------------------

    def _read_geometry(self) -> ModelGeometry:
        """Read the geometry from the config, the first attention module and the rotary module."""
        config = self.model.config
        num_heads = config.num_attention_heads
        num_layers = len(self.layers)
        layer_types = tuple(config.layer_types) if getattr(config, "layer_types", None) else None
        return ModelGeometry(
            family=config.model_type,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=self.attention(0).head_dim,
            rotary_dim=2 * self.rotary_emb.inv_freq.numel(),
            max_positions=config.max_position_embeddings,
            rope=_json_copy(getattr(config, "rope_parameters", None) or {}),
            layer_types=layer_types,
            sliding_windows=_sliding_windows(config, num_layers, layer_types),
        )


class LlamaAdapter(ModelAdapter):
    """Llama: k_proj / v_proj per layer, full RoPE, no key norm."""

    family = "llama"


class MistralAdapter(ModelAdapter):
    """Mistral: Llama layout; `config.sliding_window` (if not None) applies to every layer."""

    family = "mistral"


class Qwen2Adapter(ModelAdapter):
    """Qwen2: Llama layout with biases on k_proj / v_proj; sliding layers marked by config.layer_types."""

    family = "qwen2"


class Qwen3Adapter(ModelAdapter):
    """Qwen3: Llama layout plus a per-head RMSNorm `k_norm` on keys before RoPE.

    "Pre-RoPE keys" for qwen3 are k_norm(k_proj(hidden)), i.e. after k_norm: that is
    what RoPE rotates and what `unapply_rope` of a cached key gives back. The K projection
    weight alone does not give them (k_norm is nonlinear).
    """

    family = "qwen3"
    keys_linear_in_input = False

    def project_kv(self, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """As the base, then keys go through the layer's k_norm (over D). Each (B, H_kv, T, D)."""
        keys, values = super().project_kv(layer, hidden)
        return self.attention(layer).k_norm(keys), values


class Phi3Adapter(ModelAdapter):
    """Phi3: one fused qkv_proj whose output rows are [Q (H*D) | K (H_kv*D) | V (H_kv*D)].

    RoPE may be partial (rotary_dim < head_dim) and of type longrope.
    """

    family = "phi3"

    def kv_projection_inputs_module(self, layer: int) -> nn.Module:
        """The fused qkv_proj: its input is the hidden state (B, T, d_model) fed into K/V."""
        return self.attention(layer).qkv_proj

    def kv_projection_weights(self, layer: int) -> tuple[Tensor, Tensor]:
        """(K rows, V rows) of the fused qkv_proj weight, each (H_kv*D, d_model)."""
        q_size, kv_size = self._sizes()
        weight = self.attention(layer).qkv_proj.weight  # (H*D + 2*H_kv*D, d_model)
        return weight[q_size : q_size + kv_size], weight[q_size + kv_size :]

    def kv_projection_biases(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(K bias, V bias) slices of the fused qkv_proj bias, or (None, None)."""
        bias = self.attention(layer).qkv_proj.bias
        if bias is None:
            return None, None
        q_size, kv_size = self._sizes()
        return bias[q_size : q_size + kv_size], bias[q_size + kv_size :]

    def _sizes(self) -> tuple[int, int]:
        """(H*D, H_kv*D): row counts of the Q block and of each K/V block in qkv_proj."""
        g = self.geometry
        return g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim


class GemmaAdapter(ModelAdapter):
    """Gemma (v1): Llama attention layout; head_dim comes from the config (256 in released models)."""

    family = "gemma"


ADAPTERS: dict[str, type[ModelAdapter]] = {
    "llama": LlamaAdapter,
    "mistral": MistralAdapter,
    "qwen2": Qwen2Adapter,
    "qwen3": Qwen3Adapter,
    "phi3": Phi3Adapter,
    "gemma": GemmaAdapter,
}


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter for a loaded causal LM, chosen by model.config.model_type."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    adapter_class = ADAPTERS.get(family)
    if adapter_class is None:
        raise ModelError(
            f"model type '{family}' is not supported; kvtool supports these families: "
            f"{', '.join(ADAPTERS)}. Use a checkpoint of one of them."
        )
    return adapter_class(model)


def compare_fingerprints(expected: dict, actual: dict) -> list[str]:
    """Lines naming each field where `expected` (the artifact) and `actual` (the model) differ; [] if equal."""
    return fingerprint.compare_fingerprints(expected, actual)


# ----- helpers ---------------------------------------------------------------------------


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """model.model.layers of a *ForCausalLM model, or ModelError."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) == 0:
        raise ModelError(
            f"{type(model).__name__} has no decoder layers at model.model.layers; "
            "pass a causal LM loaded with AutoModelForCausalLM"
        )
    return layers


def _rotary_module(model: nn.Module) -> nn.Module:
    """model.model.rotary_emb, the shared RoPE module, or ModelError."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ModelError(
            f"{type(model).__name__} has no rotary embedding at model.model.rotary_emb; "
            "this transformers version lays the model out differently than kvtool expects"
        )
    return rotary


def _sliding_windows(config, num_layers: int, layer_types: tuple[str, ...] | None) -> tuple[int | None, ...]:
    """Per-layer sliding window length (None = full attention)."""
    window = getattr(config, "sliding_window", None)
    if layer_types is None:
        return (window,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _json_copy(value):
    """A JSON round-trip copy (tuples become lists, keys become strings)."""
    return json.loads(json.dumps(value, default=str))


def _bf16_bytes(weight: Tensor) -> bytes:
    """Raw bytes of a tensor cast to bfloat16 on CPU."""
    as_bf16 = weight.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return as_bf16.view(torch.int16).numpy().tobytes()
