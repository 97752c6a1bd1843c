"""Where a model keeps its attention parts, and what each layer's attention computes.

An adapter answers "where are the K/V projections, what is the geometry, what RoPE and
what attention does each layer use" for one loaded Hugging Face causal LM. It holds no
compression logic.

The base `ModelAdapter` reads everything from the model and its config (see
`kvtool.models.layout` for the module layout, `kvtool.models.rotary` for RoPE,
`kvtool.models.layer_spec` for windows, soft-capping, sinks and scaling), so any decoder
whose attention goes through transformers' attention interface works without code of
its own. A family needs an entry in the explicit `ADAPTERS` registry only where it
departs from what the generic reading finds:

- gemma3 / gemma3_text: the attention modules keep ``attn_logit_softcapping`` from the
  config but transformers 5.x never applies it, so the spec says no soft-capping.

Families whose cache is not per-head K/V (multi-head latent attention: DeepSeek-V2/V3)
are refused with the reason (`kvtool.models.layout.mla_reason`). `TESTED_FAMILIES` are
the families checked on tiny models in the test-suite; others go through the generic
path, and `kvtool.models.verify.verify_adapter` checks it against a real forward.
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
from kvtool.models.layer_spec import LayerAttentionSpec, layer_types_and_windows
from kvtool.models.layout import ATTENTION_NAMES, AttentionParts, attention_parts, find_decoder, mla_reason, text_config
from kvtool.models.rope import RopeSpec
from kvtool.models.rotary import layer_ropes, rotary_module

TESTED_FAMILIES: tuple[str, ...] = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2",
    "gemma3_text", "gemma3", "olmo2", "granite", "starcoder2", "cohere", "gpt_oss",
)


@dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry of one model, as read from its config and modules."""

    family: str  # config.model_type: "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma3_text", ...
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # KV heads (GQA: num_heads is a multiple)
    head_dim: int
    rotary_dim: int  # dims of a head rotated by RoPE (head_dim * partial_rotary_factor)
    max_positions: int  # config.max_position_embeddings
    rope: dict  # JSON-able copy of config.rope_parameters (rope_theta, rope_type, scaling...; per layer type for Gemma 3)
    layer_types: tuple[str, ...] | None = None  # config.layer_types where the config has it
    sliding_windows: tuple[int | None, ...] = ()  # per layer: window length, None = full attention

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


class ModelAdapter:
    """Generic adapter: reads a decoder's attention parts from its modules and config.

    Subclass (and register in `ADAPTERS`) only to override what a family does differently.
    """

    family: str = "generic"

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = text_config(model)
        self.decoder = find_decoder(model)
        self.layers = self.decoder.layers
        num_heads, num_kv_heads, head_dim = self._heads()
        self.parts: list[AttentionParts] = [
            attention_parts(layer, i, num_heads, num_kv_heads, head_dim) for i, layer in enumerate(self.layers)
        ]
        self.rotary_emb = rotary_module(self.decoder, type(model).__name__)  # forward hooks here see position_ids
        kinds = layer_types_and_windows(self.config, len(self.layers))
        ropes = layer_ropes(self.rotary_emb, self.config, [kind for kind, _ in kinds])
        self.layer_specs: list[LayerAttentionSpec] = [
            self._layer_spec(i, window, rope) for i, ((_, window), rope) in enumerate(zip(kinds, ropes))
        ]
        self.geometry = self._read_geometry(num_heads, num_kv_heads, head_dim)

    # ----- modules -------------------------------------------------------------------

    def attention_modules(self) -> list[nn.Module]:
        """The self-attention module of each decoder layer, in layer order."""
        return [part.module for part in self.parts]

    def attention(self, layer: int) -> nn.Module:
        """The self-attention module of decoder layer `layer` (0-based)."""
        return self._part(layer).module

    def kv_projection_inputs_module(self, layer: int) -> nn.Module:
        """Module whose forward input is the hidden state (B, T, d_model) fed into the K/V projections."""
        return self._part(layer).kv_input

    @property
    def keys_linear_in_input(self) -> bool:
        """True when pre-RoPE keys = hidden @ K weight^T (+ bias): no key norm in between (False for Qwen3, Gemma 3, OLMo 2)."""
        return all(part.key_norm is None for part in self.parts)

    # ----- per-layer attention -------------------------------------------------------

    def layer_spec(self, layer: int) -> LayerAttentionSpec:
        """What layer `layer`'s attention computes: window, soft-cap, sinks, scaling and RoPE."""
        self._part(layer)  # range check with the message
        return self.layer_specs[layer]

    def attention_sinks(self, layer: int) -> Tensor | None:
        """The learned sink logits (H_q,) of a layer (GPT-OSS), as a view of the parameter; None without sinks."""
        sinks = getattr(self.attention(layer), "sinks", None)
        return sinks if isinstance(sinks, Tensor) else None

    # ----- weights -------------------------------------------------------------------

    def kv_projection_weights(self, layer: int) -> tuple[Tensor, Tensor]:
        """(K weight, V weight) of a layer, each (H_kv*D, d_model), as views of the model's parameters."""
        part = self._part(layer)
        if part.fused:
            q_size, kv_size = self._sizes()
            weight = part.kv_input.weight  # (H*D + 2*H_kv*D, d_model)
            return weight[q_size : q_size + kv_size], weight[q_size + kv_size :]
        return part.module.k_proj.weight, part.module.v_proj.weight

    def kv_projection_biases(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(K bias, V bias) of a layer, each (H_kv*D,) or None (Qwen2, Starcoder2, GPT-OSS have them)."""
        part = self._part(layer)
        if part.fused:
            bias = part.kv_input.bias
            if bias is None:
                return None, None
            q_size, kv_size = self._sizes()
            return bias[q_size : q_size + kv_size], bias[q_size + kv_size :]
        return part.module.k_proj.bias, part.module.v_proj.bias

    def project_kv(self, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Pre-RoPE keys and values of a layer from its K/V input hidden state.

        hidden: (B, T, d_model), the input of `kv_projection_inputs_module(layer)`.
        Returns (keys, values), each (B, H_kv, T, D); keys are what RoPE is applied to
        (after the layer's k_norm where it has one).
        """
        part = self._part(layer)
        w_k, w_v = self.kv_projection_weights(layer)
        b_k, b_v = self.kv_projection_biases(layer)
        keys = self._normed_heads(F.linear(hidden, w_k, b_k), part.key_norm, part.key_norm_per_head)
        values = self._normed_heads(F.linear(hidden, w_v, b_v), part.value_norm, part.value_norm_per_head)
        return keys, values  # (B, H_kv, T, D) each

    def _normed_heads(self, x: Tensor, norm: nn.Module | None, per_head: bool) -> Tensor:
        """(B, T, H_kv*D) -> optional norm -> (B, H_kv, T, D)."""
        batch, seq, _ = x.shape
        if norm is not None and not per_head:
            x = norm(x)  # over the whole projection (OLMo 2)
        x = x.view(batch, seq, self.geometry.num_kv_heads, self.geometry.head_dim)  # (B, T, H_kv, D)
        if norm is not None and per_head:
            x = norm(x)  # over D, per head (Qwen3, Gemma 3, Cohere)
        return x.transpose(1, 2)

    # ----- RoPE ----------------------------------------------------------------------

    def rope_cos_sin(
        self, position_ids: Tensor, dtype: torch.dtype = torch.float32, layer: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """cos and sin, each (B, T, rotary_dim), for position_ids (B, T) long, computed from the layer's `RopeSpec`.

        The model's rotary module is not called (its forward hooks do not fire). For longrope /
        dynamic RoPE the frequencies depend on the largest position in the call (as in the
        model's forward), so pass the same position_ids the model saw. Attention scaling
        (yarn, longrope) is included in cos/sin. layer=None is allowed only where every layer
        shares one RoPE (not Gemma 3, whose local and global layers differ).
        """
        cos, sin = self._rope(layer).cos_sin(position_ids.to(self.rotary_emb_device()))
        return cos.to(dtype), sin.to(dtype)  # (B, T, R) each

    def rotary_emb_device(self) -> torch.device:
        """Device of the rotary module's buffers (where cos/sin are computed)."""
        buffer = next(self.rotary_emb.buffers(), None)
        return buffer.device if buffer is not None else torch.device("cpu")

    def _rope(self, layer: int | None) -> RopeSpec:
        if layer is not None:
            return self.layer_spec(layer).rope
        first = self.layer_specs[0].rope
        if any(not spec.rope.same_as(first) for spec in self.layer_specs[1:]):
            raise ModelError(
                f"{self.geometry.family} uses a different RoPE on different layers (e.g. local and global layers); "
                "ask for one layer's cos/sin: rope_cos_sin(position_ids, layer=i) or layer_spec(i).rope"
            )
        return first

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

    def _heads(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim) from the config and the first attention module."""
        config = self.config
        num_heads = getattr(config, "num_attention_heads", None)
        if not num_heads:
            raise ModelError(f"the config of {type(self.model).__name__} has no num_attention_heads")
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        first = next((getattr(self.layers[0], n) for n in ATTENTION_NAMES if hasattr(self.layers[0], n)), None)
        head_dim = getattr(first, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ModelError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        return num_heads, num_kv_heads, int(head_dim)

    def _layer_spec(self, layer: int, window: int | None, rope: RopeSpec) -> LayerAttentionSpec:
        attn = self.parts[layer].module
        scaling = getattr(attn, "scaling", None)
        return LayerAttentionSpec(
            sliding_window=window,
            logit_softcap=self._logit_softcap(attn),
            has_sinks=isinstance(getattr(attn, "sinks", None), Tensor),
            scaling=float(scaling) if scaling is not None else float(attn.head_dim) ** -0.5,
            rope=rope,
        )

    def _logit_softcap(self, attn: nn.Module) -> float | None:
        """The soft-cap the attention passes as ``softcap`` (Gemma 2's attn_logit_softcapping), or None."""
        cap = getattr(attn, "attn_logit_softcapping", None)
        return float(cap) if cap else None

    def _read_geometry(self, num_heads: int, num_kv_heads: int, head_dim: int) -> ModelGeometry:
        """The geometry from the config, the attention modules and the layer specs."""
        config = self.model.config
        text = self.config
        layer_types = tuple(text.layer_types) if getattr(text, "layer_types", None) else None
        return ModelGeometry(
            family=config.model_type,
            num_layers=len(self.layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=self.layer_specs[0].rope.rotary_dim,
            max_positions=text.max_position_embeddings,
            rope=_json_copy(getattr(text, "rope_parameters", None) or {}),
            layer_types=layer_types,
            sliding_windows=tuple(spec.sliding_window for spec in self.layer_specs),
        )

    def _part(self, layer: int) -> AttentionParts:
        if not 0 <= layer < len(self.parts):
            raise ModelError(f"layer {layer} does not exist; the model has {len(self.parts)} layers (0..{len(self.parts) - 1})")
        return self.parts[layer]

    def _sizes(self) -> tuple[int, int]:
        """(H*D, H_kv*D): row counts of the Q block and of each K/V block in a fused qkv_proj."""
        g = self.geometry
        return g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim


class Gemma3Adapter(ModelAdapter):
    """Gemma 3 (text model, or the language model of the multimodal checkpoint): the generic reading,
    except that its attention never applies ``attn_logit_softcapping`` (transformers 5.x passes no softcap).
    Sliding (local) and full (global) layers have their own RoPE (bases 10k and 1M) from one rotary module
    called per layer type; the generic reading handles that."""

    family = "gemma3_text"

    def _logit_softcap(self, attn: nn.Module) -> float | None:
        return None


ADAPTERS: dict[str, type[ModelAdapter]] = {
    "gemma3_text": Gemma3Adapter,
    "gemma3": Gemma3Adapter,
}


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of a loaded causal LM: the `ADAPTERS` override for its model_type, else the generic one.

    Raises ModelError for refused architectures (MLA) and where the generic reading fails.
    """
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    reason = refusal_reason(config)
    if reason:
        raise ModelError(reason)
    adapter_class = ADAPTERS.get(family, ModelAdapter)
    try:
        return adapter_class(model)
    except ModelError as exc:
        if family in TESTED_FAMILIES:
            raise
        raise ModelError(
            f"model type '{family}' is not one kvtool has tested ({', '.join(TESTED_FAMILIES)}) and reading it "
            f"generically failed: {exc}"
        ) from exc


def refusal_reason(config) -> str | None:
    """Why kvtool refuses an architecture from its config alone (None: not refused)."""
    if config is None:
        return "the model has no config; pass a transformers causal LM"
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return mla_reason(text)


def compare_fingerprints(expected: dict, actual: dict) -> list[str]:
    """Lines naming each field where `expected` (the artifact) and `actual` (the model) differ; [] if equal."""
    return fingerprint.compare_fingerprints(expected, actual)


# ----- helpers ---------------------------------------------------------------------------


def _json_copy(value):
    """A JSON round-trip copy (tuples become lists, keys become strings)."""
    return json.loads(json.dumps(value, default=str))


def _bf16_bytes(weight: Tensor) -> bytes:
    """Raw bytes of a tensor cast to bfloat16 on CPU."""
    as_bf16 = weight.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return as_bf16.view(torch.int16).numpy().tobytes()
