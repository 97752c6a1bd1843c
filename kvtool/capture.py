"""Stream per-layer K/V statistics through a model without holding its activations.

The model runs unmodified; a pass-through `CaptureCache` sits where the KV cache
would be. Every attention layer hands it the keys (after RoPE) and values of the
batch; the cache rotates the keys back to their pre-RoPE form with the model's
own cos/sin (RoPE is orthogonal, so this is exact up to float rounding) and
gives all three to the observers, then lets the tensors go. Memory is one
batch's activations plus whatever the observers reduce them to.

Observers receive, per layer: keys_pre_rope, keys, values, each (B, H_kv, T, D),
never expanded to query heads.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtool.models.adapter import ModelAdapter
from kvtool.models.attention_hook import attention_handler, eager_attention, install, sdpa_reference
from kvtool.models.cache_argument import with_cache
from kvtool.models.logits_argument import last_logits_only
from kvtool.models.rope import apply_rope, unapply_rope

Progress = Callable[[Iterable, str, int], Iterable]


def no_progress(items: Iterable, description: str, total: int) -> Iterable:
    """Default progress wrapper: none."""
    return items


class Observer(Protocol):
    """Reduces captured activations to statistics."""

    def observe(self, layer: int, keys_pre_rope: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None: ...


class _CaptureLayer(CacheLayerMixin):
    """Pass-through cache layer: reports K/V to the observers and stores nothing."""

    is_sliding = False

    def __init__(self, layer: int, owner: "CaptureCache") -> None:
        super().__init__()
        self.layer, self.owner = layer, owner

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.owner.report(self.layer, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class CaptureCache(Cache):
    """A cache that captures instead of caching, for one forward of a batch without padding."""

    def __init__(self, adapter: ModelAdapter, observers: list[Observer], rope: "WindowRope"):
        super().__init__(layers=[_CaptureLayer(i, self) for i in range(adapter.geometry.num_layers)])
        self.observers, self.rope = observers, rope

    def report(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        keys, values = keys.detach().float(), values.detach().float()  # (B, H_kv, T, D)
        keys_pre = self.rope.unapply(layer, keys)
        for observer in self.observers:
            observer.observe(layer, keys_pre, keys, values)


class WindowRope:
    """Each layer's RoPE at positions 0..T-1 of unpadded windows (b, T).

    Layers may rotate differently (Gemma 3: base 10k on sliding layers, 1M on global ones) and
    the layout may be interleaved (Cohere): every layer uses its own `adapter.layer_spec(i).rope`;
    cos/sin (b, T, R) float32 are computed once per distinct RoPE.
    """

    def __init__(self, adapter: ModelAdapter, batch: torch.Tensor):
        positions = torch.arange(batch.shape[1], device=adapter.rotary_emb_device()).expand(batch.shape[0], -1)  # (b, T)
        self.specs = [adapter.layer_spec(i).rope for i in range(adapter.geometry.num_layers)]
        self.tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, spec in enumerate(self.specs):
            same = next((j for j in range(i) if self.specs[j].same_as(spec)), None)
            if same is not None:
                self.tables.append(self.tables[same])
            else:
                cos, sin = spec.cos_sin(positions)  # (b, T, R)
                self.tables.append((cos.to(batch.device), sin.to(batch.device)))

    def apply(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys (b, H_kv, T, D) -> post-RoPE, as layer ``layer`` rotates them."""
        return apply_rope(keys, *self.tables[layer], self.specs[layer].interleaved)

    def unapply(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys (b, H_kv, T, D) -> pre-RoPE (exact inverse of `apply`, float32 inside)."""
        return unapply_rope(keys, *self.tables[layer], self.specs[layer].interleaved)


def window_rope(adapter: ModelAdapter, batch: torch.Tensor) -> WindowRope:
    """Each layer's RoPE for unpadded windows (b, T) at positions 0..T-1."""
    with torch.no_grad():
        return WindowRope(adapter, batch)


@torch.no_grad()
def stream_batches(
    model,
    adapter: ModelAdapter,
    windows: torch.Tensor,
    observers: list[Observer],
    batch_size: int = 4,
    progress: Progress = no_progress,
) -> int:
    """Run token windows (N, T) through the model batch by batch; return the number of tokens seen."""
    device = next(model.parameters()).device
    batches = windows.split(batch_size)
    seen = 0
    for batch in progress(batches, "capturing K/V statistics", len(batches)):
        batch = batch.to(device)  # (b, T)
        cache = CaptureCache(adapter, observers, window_rope(adapter, batch))
        model(input_ids=batch, **with_cache(cache), use_cache=True, **last_logits_only(model))  # logits unread
        seen += batch.numel()
    return seen


class ChannelStats:
    """Per layer and KV head: mean, std and absmax of every channel of pre-RoPE keys, keys and values.

    Finalised tensors: ``layers.{i}.{kind}.{mean,std,absmax}`` of shape (H_kv, D), and
    ``layers.{i}.{kind}.token_norm`` (H_kv,) the mean L2 norm of a token's vector.
    """

    KINDS = ("keys_pre_rope", "keys", "values")

    def __init__(self) -> None:
        self.sums: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def observe(self, layer, keys_pre_rope, keys, values) -> None:
        for kind, x in zip(self.KINDS, (keys_pre_rope, keys, values)):
            acc = self.sums.setdefault((layer, kind), {})
            flat = x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])  # (H_kv, B*T, D)
            update = {
                "count": torch.tensor(float(flat.shape[1])),
                "sum": flat.sum(dim=1),
                "sumsq": flat.square().sum(dim=1),
                "norm_sum": flat.norm(dim=-1).sum(dim=1),
            }
            for name, value in update.items():
                acc[name] = acc[name] + value if name in acc else value
            absmax = flat.abs().amax(dim=1)
            acc["absmax"] = torch.maximum(acc["absmax"], absmax) if "absmax" in acc else absmax

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for (layer, kind), acc in sorted(self.sums.items()):
            mean = acc["sum"] / acc["count"]
            var = (acc["sumsq"] / acc["count"] - mean.square()).clamp(min=0)
            prefix = f"layers.{layer}.{kind}"
            out[f"{prefix}.mean"] = mean
            out[f"{prefix}.std"] = var.sqrt()
            out[f"{prefix}.absmax"] = acc["absmax"]
            out[f"{prefix}.token_norm"] = acc["norm_sum"] / acc["count"]
        return out


class InputSecondMoments:
    """Second moment E[x x^T] (d_in, d_in) of the hidden states fed into each layer's K/V projections.

    Used by Palu's whitened decomposition (SVD-LLM whitening). Forward hooks on
    `ModelAdapter.kv_projection_inputs_module` accumulate x^T x in float64 while a
    `with` block runs, one (d_in, d_in) matrix per layer, so memory does not grow
    with the amount of calibration text.
    """

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}
        self.handles: list = []

    def _hook(self, layer: int):
        def record(module, args, output) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)  # (tokens, d_in)
            gram = x.T @ x
            self.sums[layer] = self.sums[layer] + gram if layer in self.sums else gram
            self.counts[layer] = self.counts.get(layer, 0) + x.shape[0]

        return record

    def __enter__(self) -> "InputSecondMoments":
        for layer in range(self.adapter.geometry.num_layers):
            module = self.adapter.kv_projection_inputs_module(layer)
            self.handles.append(module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def moment(self, layer: int) -> torch.Tensor:
        """E[x x^T] of one layer, float32 (d_in, d_in)."""
        return (self.sums[layer] / self.counts[layer]).float()


class QueryKeyCapture:
    """Attention handler: hands each layer's (query, key, scaling, value) to ``observe`` and returns plain attention."""

    def __init__(self, observe) -> None:
        self.observe = observe

    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None, s_aux=None) -> torch.Tensor:
        self.observe(module.layer_idx, query.detach(), key.detach(), scaling, value.detach())
        if softcap is None and s_aux is None:
            return sdpa_reference(query, key, value, attention_mask, scaling)
        extra = {name: x for name, x in (("softcap", softcap), ("s_aux", s_aux)) if x is not None}
        return eager_attention(module, query, key, value, attention_mask, scaling=scaling, **extra)[0]


class QueryKeyMoments:
    """Per layer and KV head, every channel's mean square of the keys (after RoPE), of the queries that read them and
    of the values.

    ``observe(layer, query (B, H_q, T, D), key (B, H_kv, T, D), scaling, value (B, H_kv, T, D))`` as `QueryKeyCapture`
    hands them; each KV head's H_q / H_kv query heads are pooled; the first ``skip_first`` positions of every window
    (the cache's float sinks) are left out. float64 sums on CPU.
    """

    def __init__(self, skip_first: int = 0) -> None:
        self.skip_first = skip_first
        self.sums: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}  # layer -> (sum k^2, sum q^2, n_k, n_q)
        self.value_sums: dict[int, torch.Tensor] = {}  # layer -> sum v^2 (H, D), over the keys' n_k tokens

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                value: torch.Tensor | None = None) -> None:
        q, k = query[:, :, self.skip_first :].double(), key[:, :, self.skip_first :].double()
        if k.shape[2] == 0:
            return
        if value is not None:
            v2 = value[:, :, self.skip_first :].double().square().sum(dim=(0, 2)).cpu()  # (H, D)
            self.value_sums[layer] = self.value_sums[layer] + v2 if layer in self.value_sums else v2
        b, hq, t, d = q.shape
        h = k.shape[1]
        k2 = k.square().sum(dim=(0, 2)).cpu()  # (H, D)
        q2 = q.reshape(b, h, hq // h, t, d).square().sum(dim=(0, 2, 3)).cpu()  # (H, D)
        nk, nq = b * t, b * t * (hq // h)
        if layer in self.sums:
            k0, q0, nk0, nq0 = self.sums[layer]
            k2, q2, nk, nq = k0 + k2, q0 + q2, nk0 + nk, nq0 + nq
        self.sums[layer] = (k2, q2, nk, nq)

    def moments(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys' mean squares (H_kv, D), queries' (H_kv, D)) float32 of one layer."""
        if layer not in self.sums:
            raise KeyError(f"no calibration tokens past the sinks for layer {layer}; use longer calibration windows")
        k2, q2, nk, nq = self.sums[layer]
        return (k2 / nk).float(), (q2 / nq).float()

    def value_moments(self, layer: int) -> torch.Tensor:
        """The values' mean squares (H_kv, D) float32 of one layer."""
        if layer not in self.value_sums:
            raise KeyError(f"no calibration values past the sinks for layer {layer}; use longer calibration windows")
        return (self.value_sums[layer] / self.sums[layer][2]).float()


@torch.no_grad()
def stream_queries(
    model, windows: torch.Tensor, observe, batch_size: int = 4, progress: Progress = no_progress,
) -> None:
    """Run token windows (N, T) through the model (no cache) and hand every layer's queries and keys after RoPE to
    ``observe(layer, query, key, scaling)`` (`QueryKeyCapture`)."""
    device = next(model.parameters()).device
    install(model)
    batches = windows.split(batch_size)
    with attention_handler(QueryKeyCapture(observe)):
        for batch in progress(batches, "capturing query statistics", len(batches)):
            model(input_ids=batch.to(device), use_cache=False, **last_logits_only(model))
