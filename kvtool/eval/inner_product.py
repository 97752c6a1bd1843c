"""Inner-product error of a recipe's stored keys against the model's real queries: the q . k attention sees.

Held-out windows run through the unmodified model with kvtool's attention function and a
`QueryKeyCapture` handler, which gets every layer's queries (B, H_q, T, D) and keys
(B, H_kv, T, D) after RoPE, exactly as the model's attention does. Per layer, the keys the
runtime would encode (every position past the cache's ``sink_tokens`` float sinks, in full
blocks of ``cache.block_size``; before RoPE, undone at their true positions, when the recipe
says ``keys.pre_rope``) are encoded with the layer's key format (`build_formats`, the fitted
tensors of the runtime) and scored with that format's own ``chunk_scores``: the estimate the
runtime's attention uses for q . k (TurboQuant: the query rotated into the codes' domain, plus
the QJL estimator with ``qjl: true``; pre-RoPE formats: RoPE at the true positions; uniform:
scales folded into the query). The queries are scaled by the layer's ``scaling`` as the runtime
scales them. The reference is the same matmul over the exact keys. Keys are encoded from the
model's float keys, as a prefill encodes them (keys that pass through the fp16 recent window
while decoding are rounded to fp16 first: an error far below any code's).

Pairs: query at position i, body key at position j < i (the current token and the recent
window stay in float in the runtime, so only older tokens reach the quantized body; every
past body key is counted, whatever the recent window), and i - j < the layer's sliding
window where it has one. Per (layer, query head), with s = q . k, e = q . k_hat - q . k:

* ``bias`` = mean(e) / std(s) (signed; 0 for an unbiased estimator);
* ``shrink`` = cov(e, s) / var(s): the least-squares slope of q . k_hat on q . k, minus 1
  (negative: the stored keys shrink q . k, as scalar codes that round to cell centroids do);
* ``error_var`` = var(e) / var(s): the estimator's variance, relative to the spread of the
  scores it perturbs;
* ``rel_mse`` = mean(e**2) / var(s) = error_var + bias**2.

`summary` averages each over layers and query heads (``abs_bias``: the mean of |bias|).
"""

from __future__ import annotations

import torch

from kvtool.errors import RuntimeConfigError
from kvtool.capture import QueryKeyCapture
from kvtool.models.attention_hook import attention_handler, install
from kvtool.runtime.layer import LayerPlan, build_formats, storage_dtype
from kvtool.runtime.positions import RopeTable

STATS = ("bias", "shrink", "error_var", "rel_mse")
CHUNK_BLOCKS = 8  # body blocks scored per `chunk_scores` call (bounds the temporaries)


class InnerProductError:
    """Float64 sums over (query, key) pairs per layer and query head: n, s, s^2, e, e^2, e s (see the module docstring)."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}  # layer -> (H_q, 6) float64

    def add(self, layer: int, exact: torch.Tensor, estimate: torch.Tensor, pairs: torch.Tensor) -> None:
        """exact, estimate: (H_q, t, T) float32 scores; pairs: (H_q or 1, t, T) bool, the pairs counted."""
        s, e = exact.double(), (estimate - exact).double()  # e from float32: 0 where the estimate is exact
        w = pairs.expand_as(s).double()
        sums = torch.stack([w, w * s, w * s * s, w * e, w * e * e, w * e * s], dim=-1).sum(dim=(1, 2))  # (H_q, 6)
        self.sums[layer] = self.sums[layer] + sums if layer in self.sums else sums

    def per_head(self) -> dict[str, torch.Tensor]:
        """{stat: (L, H_q) float64} for the layers added, in layer order (see STATS)."""
        n, s, ss, e, ee, es = torch.stack([self.sums[i] for i in sorted(self.sums)]).unbind(-1)  # each (L, H_q)
        mean_s, mean_e = s / n, e / n
        var_s = (ss / n - mean_s.square()).clamp(min=1e-30)
        return {
            "bias": mean_e / var_s.sqrt(),
            "shrink": (es / n - mean_e * mean_s) / var_s,
            "error_var": (ee / n - mean_e.square()).clamp(min=0) / var_s,
            "rel_mse": ee / n / var_s,
        }

    def by_layer(self) -> dict[str, list[float]]:
        """{stat: per layer, the mean over its query heads}."""
        return {name: value.mean(dim=1).tolist() for name, value in self.per_head().items()}

    def summary(self) -> dict[str, float]:
        """Means over layers and query heads, plus ``abs_bias`` and ``pairs`` (per layer and head)."""
        heads = self.per_head()
        out = {name: float(value.mean()) for name, value in heads.items()}
        out["abs_bias"] = float(heads["bias"].abs().mean())
        out["pairs"] = float(torch.stack(list(self.sums.values()))[..., 0].mean())
        return out


class StoredKeyScores:
    """Observer of captured (query, key): scores the body keys through each layer's key format into an `InnerProductError`."""

    def __init__(self, runtime, dtype: torch.dtype) -> None:
        self.runtime, self.recipe = runtime, runtime.recipe
        self.geometry = runtime.adapter.geometry
        self.rope = RopeTable.from_adapter(runtime.adapter)
        self.dtype = storage_dtype(self.recipe, dtype)
        self.formats: dict[int, object] = {}
        self.error = InnerProductError()

    def key_format(self, layer: int):
        """The layer's key format, built as the runtime's cache builds it (`build_formats`)."""
        if layer not in self.formats:
            plan = LayerPlan(self.recipe.for_layer(layer), self.runtime.layer_tensors[layer])
            key_format, _, g = build_formats(plan.recipe, plan.fitted_for, self.geometry.head_dim,
                                             self.geometry.num_kv_heads, self.dtype)
            if g != 1:
                raise RuntimeConfigError(f"recipe '{self.recipe.name}': inner-product error is measured per KV head; "
                                         "palu with group_heads > 1 stores one latent per group of heads")
            self.formats[layer] = key_format
        return self.formats[layer]

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, value=None) -> None:
        b, hq, t, d = query.shape
        h = key.shape[1]
        recipe = self.recipe.for_layer(layer)
        sinks, bs = recipe.cache.sink_tokens, recipe.cache.block_size
        blocks = (t - sinks) // bs
        if blocks <= 0:
            return
        body = torch.arange(sinks, sinks + blocks * bs, device=key.device)  # (T_body,) positions of the body keys
        q = (query.float() * scaling).reshape(b * h, 1, hq // h * t, d)  # (S, 1, R, D), rows: query head of the group, then token
        keys = key.float()[:, :, body].reshape(b * h, 1, body.numel(), d)  # (S, 1, T_body, D) after RoPE
        positions = body.expand(b * h, -1)  # (S, T_body)
        exact, estimate = self._scores(layer, q, keys, positions, recipe.keys.pre_rope)  # (S, 1, R, T_body) each
        query_pos = torch.arange(t, device=key.device)
        pairs = body[None] < query_pos[:, None]  # (t, T_body): strictly older keys
        window = self.geometry.sliding_windows[layer] if layer < len(self.geometry.sliding_windows) else None
        if window:
            pairs &= query_pos[:, None] - body[None] < window
        shape = (b, h, hq // h, t, body.numel())
        self.error.add(layer, _heads_first(exact, shape), _heads_first(estimate, shape), pairs.repeat(b, 1)[None])

    def _scores(self, layer, q, keys, positions, pre_rope: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(exact, estimate) (S, 1, R, T_body): q . k over the exact keys and through the key format's ``chunk_scores``."""
        fmt = self.key_format(layer)
        s, _, n, d = keys.shape
        bs = fmt.block_size
        stored = keys
        if pre_rope:  # stored before RoPE (as `KvtoolLayer._encode`), rotated back at the true positions for scoring
            cos, sin = self.rope.cos_sin(layer, positions)  # (S, T_body, R)
            stored = self.rope.rotate(layer, keys, cos, sin, inverse=True)
        group = torch.arange(self.geometry.num_kv_heads, device=keys.device).repeat(s // self.geometry.num_kv_heads)  # (S,)
        exact, estimate = [], []
        for c0 in range(0, n // bs, CHUNK_BLOCKS):
            c1 = min(n // bs, c0 + CHUNK_BLOCKS)
            chunk = stored[:, :, c0 * bs : c1 * bs].reshape(s, 1, c1 - c0, bs, d).transpose(1, 2)  # (S, nb, 1, S_b, D)
            encoded = fmt.encode_blocks(chunk.reshape(s * (c1 - c0), 1, bs, d), group.repeat_interleave(c1 - c0))
            encoded = {name: x.reshape(s, c1 - c0, *x.shape[1:]) for name, x in encoded.items()}  # {(S, nb, ...)}
            fn = None
            if pre_rope:
                cos_c, sin_c = cos[:, c0 * bs : c1 * bs], sin[:, c0 * bs : c1 * bs]
                fn = lambda k, cos_c=cos_c, sin_c=sin_c: self.rope.rotate(layer, k, cos_c, sin_c)  # noqa: E731
            estimate.append(fmt.chunk_scores(q, encoded, group, fn))  # (S, 1, R, nb * S_b)
            exact.append(torch.matmul(q, keys[:, :, c0 * bs : c1 * bs].transpose(-1, -2)))
        return torch.cat(exact, dim=-1), torch.cat(estimate, dim=-1)


def _heads_first(scores: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """(B*H, 1, G*t, T) -> (H_q, B*t, T): one row per query head, the batch's windows one after another."""
    b, h, g, t, n = shape
    return scores.reshape(b, h, g, t, n).permute(1, 2, 0, 3, 4).reshape(h * g, b * t, n)


@torch.no_grad()
def inner_product_error(runtime, windows: torch.Tensor, batch_size: int = 1) -> InnerProductError:
    """Run token windows (N, T) through ``runtime.model`` and score every layer's body keys as the runtime stores them."""
    model = runtime.model
    device = next(model.parameters()).device
    observer = StoredKeyScores(runtime, next(model.parameters()).dtype)
    install(model)
    with attention_handler(QueryKeyCapture(observer)):
        for batch in windows.split(batch_size):
            model(input_ids=batch.to(device), use_cache=False)
    return observer.error
