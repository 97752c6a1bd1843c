"""Fisher sensitivity of the KV cache (KVQuant) and a bounded sample of K/V token vectors.

`stream_with_gradients` runs token windows through the model with a pass-through
`GradientCaptureCache` in place of the KV cache. Each attention layer hands the cache
its post-RoPE keys and its values; the cache rotates the keys back to pre-RoPE form
(k_pre, float32), marks k_pre and the values (float32) as tensors whose gradient is
wanted, and returns `apply_rope(k_pre)` and the values, cast back to the model's dtype,
so attention is computed from exactly those tensors. After the forward, the loss (summed
next-token cross-entropy) is differentiated w.r.t. all of them at once with
`torch.autograd.grad`, and every observer gets, per layer, the activations and their
squared gradients (the diagonal Fisher information of KVQuant) and the signed gradients.

The gradients are total derivatives: a layer's K/V are NOT detached from the graph, so
the gradient of layer i's keys includes the paths through the keys and values of the
later layers (detaching every layer's K/V would silently drop those paths). Layer 0's
K/V have no gradient history (parameters do not require grad), so they become leaves.

The model's parameters never get a .grad: requires_grad is switched off on all of them
for the pass and restored afterwards, and autograd.grad only computes the gradients it
is asked for.

`SampleReservoir` keeps a uniform random sample of token rows per layer, fed either
with gradients (`observe_gradients`) or without (`observe`, the plain capture Observer).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from kvtool.capture import Progress, WindowRope, _CaptureLayer, no_progress, window_rope
from kvtool.models.adapter import ModelAdapter
from kvtool.models.cache_argument import with_cache

PARTS = ("keys_pre_rope", "values")


class GradientObserver(Protocol):
    """Reduces activations and their Fisher weights (squared loss gradients) to statistics.

    gradients: the signed loss gradients (keys_pre_rope, values) the Fisher weights are the squares of.
    """

    def observe_gradients(
        self,
        layer: int,
        keys_pre_rope: torch.Tensor,
        values: torch.Tensor,
        keys_pre_rope_fisher: torch.Tensor,
        values_fisher: torch.Tensor,
        gradients: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None: ...


class _GradientLayer(_CaptureLayer):
    """Pass-through cache layer: stores the K/V nodes whose gradients are wanted, returns K/V built from them."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys_pre, values = self.owner.track(self.layer, key_states, value_states)
        keys = self.owner.rope.apply(self.layer, keys_pre)
        return keys.to(key_states.dtype), values.to(value_states.dtype)


class GradientCaptureCache(Cache):
    """A cache for one forward of a batch without padding that makes every layer's K/V differentiable.

    After the forward, `tracked[layer]` is (keys_pre_rope, values), each (B, H_kv, T, D)
    float32, part of the autograd graph (or leaves requiring grad, for layer 0).
    """

    def __init__(self, adapter: ModelAdapter, rope: WindowRope):
        super().__init__(layers=[_GradientLayer(i, self) for i in range(adapter.geometry.num_layers)])
        self.rope = rope  # each layer's RoPE (Gemma 3's local and global layers differ)
        self.tracked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def track(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 pre-RoPE keys and values of a layer, recorded for the gradient; not detached."""
        keys_pre = self.rope.unapply(layer, keys.float())  # a new tensor, always
        values = values.to(torch.float32, copy=True)  # a new tensor even for float32 models
        for tensor in (keys_pre, values):
            if not tensor.requires_grad:  # no gradient history (layer 0): make it a leaf
                tensor.requires_grad_()
        self.tracked[layer] = (keys_pre, values)
        return keys_pre, values


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits (B, T, V) predicting input_ids[:, 1:], SUMMED over all B*(T-1) positions (float32)."""
    predicted = logits[:, :-1].float().reshape(-1, logits.shape[-1])  # (B*(T-1), V)
    targets = input_ids[:, 1:].reshape(-1)  # (B*(T-1),)
    return F.cross_entropy(predicted, targets, reduction="sum")


def stream_with_gradients(
    model,
    adapter: ModelAdapter,
    windows: torch.Tensor,
    observers: list[GradientObserver],
    batch_size: int = 1,
    progress: Progress = no_progress,
) -> int:
    """Run token windows (N, T) through the model with gradients; return the number of tokens seen.

    Per batch (no padding): forward with a `GradientCaptureCache`, loss = next-token
    cross-entropy SUMMED over all predicted positions of the batch (B*(T-1) of them; not
    averaged, so a token's Fisher weight does not depend on the batch size), gradients of
    the loss w.r.t. every layer's pre-RoPE keys and values (total derivatives), then each
    observer's `observe_gradients(layer, keys_pre_rope, values, keys_pre_rope_fisher,
    values_fisher, gradients=(keys_pre_rope_grad, values_grad))` for layers 0..L-1, all
    (B, H_kv, T, D) float32 detached, fisher = grad**2.

    The model is run as it is (put it in eval mode: dropout would make the gradients noisy).
    Parameters get no .grad; their requires_grad flags are switched off for the pass and
    restored. One batch of activations and its graph live at a time.
    """
    device = next(model.parameters()).device
    batches = windows.split(batch_size)
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    seen = 0
    try:
        for p in params:
            p.requires_grad_(False)
        for batch in progress(batches, "capturing K/V gradients", len(batches)):
            _gradient_batch(model, adapter, batch.to(device), observers)
            seen += batch.numel()
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return seen


def _gradient_batch(model, adapter: ModelAdapter, batch: torch.Tensor, observers: list[GradientObserver]) -> None:
    """One batch (b, T): forward, backward, hand activations and Fisher weights to the observers."""
    cache = GradientCaptureCache(adapter, window_rope(adapter, batch))
    with torch.enable_grad():
        logits = model(input_ids=batch, **with_cache(cache), use_cache=True).logits  # (b, T, V)
        loss = next_token_loss(logits, batch)
        del logits
        layers = sorted(cache.tracked)
        inputs = [t for layer in layers for t in cache.tracked[layer]]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)  # frees the graph
    del loss
    for i, layer in enumerate(layers):
        keys_pre, values = (t.detach() for t in cache.tracked[layer])
        keys_grad, values_grad = grads[2 * i], grads[2 * i + 1]
        keys_grad = torch.zeros_like(keys_pre) if keys_grad is None else keys_grad.float()
        values_grad = torch.zeros_like(values) if values_grad is None else values_grad.float()
        for observer in observers:
            observer.observe_gradients(
                layer, keys_pre, values, keys_grad.square(), values_grad.square(), gradients=(keys_grad, values_grad)
            )
    cache.tracked.clear()


class SampleReservoir:
    """A uniform random sample of at most `max_tokens` token rows per layer, over everything observed.

    Fed by `stream_with_gradients` (`observe_gradients`: rows and their Fisher weights) or
    by `capture.stream_batches` (`observe`: rows only, Fisher None); one reservoir takes one
    kind of feed. Per layer, a token's keys_pre_rope row and values row are kept or dropped
    together (the samples of the two parts are the same tokens, in the same order), and
    since every layer draws from its own Generator(seed), all layers keep the same tokens.

    Sampling: each token gets an independent uniform random tag; the reservoir keeps the
    max_tokens tokens with the smallest tags (a uniform sample without replacement of
    all tokens seen, computed batch by batch). Rows are kept in stream order and stored on
    CPU as float32. Memory: at most max_tokens rows per layer and part, plus one batch.

    keep_gradients: also keep the signed loss gradients of the sampled rows (`gradients`; Palu's
    ``gradient`` rank search projects reconstruction errors on them). They must then be fed, and
    the Fisher weights `samples` returns are their squares (not kept twice).
    """

    def __init__(self, max_tokens: int = 4096, seed: int = 0, skip_first: int = 0, keep_gradients: bool = False):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens, self.seed = max_tokens, seed
        # the first positions of every window are the cache's float sinks: never compressed, so never sampled
        self.skip_first = skip_first
        self._generators: dict[int, torch.Generator] = {}
        self._tags: dict[int, torch.Tensor] = {}  # layer -> (n,) float64 tags of the kept rows
        self._rows: dict[tuple[int, str], torch.Tensor] = {}  # (layer, part) -> (n, H_kv, D)
        self._fisher: dict[tuple[int, str], torch.Tensor | None] = {}
        self.keep_gradients = keep_gradients
        self._gradients: dict[tuple[int, str], torch.Tensor] = {}
        self._seen: dict[int, int] = {}
        self._with_fisher: bool | None = None

    # ----- feeding -------------------------------------------------------------------

    def observe_gradients(self, layer, keys_pre_rope, values, keys_pre_rope_fisher, values_fisher, gradients=None) -> None:
        """Sample token rows of (B, H_kv, T, D) activations, their Fisher weights and (``keep_gradients``) gradients."""
        if self.keep_gradients and gradients is None:
            raise ValueError("this SampleReservoir keeps signed gradients: pass gradients=(keys_pre_rope_grad, values_grad)")
        self._add(layer, (keys_pre_rope, values), (keys_pre_rope_fisher, values_fisher), gradients if self.keep_gradients else None)

    def observe(self, layer, keys_pre_rope, keys, values) -> None:
        """Plain capture Observer: sample token rows without Fisher weights (post-RoPE keys are ignored)."""
        self._add(layer, (keys_pre_rope, values), None)

    def _add(
        self,
        layer: int,
        parts: tuple[torch.Tensor, ...],
        fishers: tuple[torch.Tensor, ...] | None,
        gradients: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        with_fisher = fishers is not None
        if self._with_fisher is None:
            self._with_fisher = with_fisher
        elif self._with_fisher != with_fisher:
            raise ValueError("a SampleReservoir is fed either with gradients (observe_gradients) or without (observe), not both")
        skip = self.skip_first
        new_rows = [_token_rows(x[:, :, skip:]) for x in parts]  # (B*T', H_kv, D) each, on the data's device
        new_fisher = [_token_rows(f[:, :, skip:]) for f in fishers] if with_fisher else [None, None]
        new_grads = [_token_rows(g[:, :, skip:]) for g in gradients] if gradients is not None else [None, None]
        count = new_rows[0].shape[0]
        generator = self._generators.setdefault(layer, torch.Generator().manual_seed(self.seed))
        new_tags = torch.rand(count, generator=generator, dtype=torch.float64)
        old_tags = self._tags.get(layer, torch.empty(0, dtype=torch.float64))
        tags = torch.cat([old_tags, new_tags])
        if tags.numel() > self.max_tokens:
            keep = tags.topk(self.max_tokens, largest=False).indices.sort().values
        else:
            keep = torch.arange(tags.numel())
        n_old = old_tags.numel()
        keep_old, keep_new = keep[keep < n_old], keep[keep >= n_old] - n_old
        self._tags[layer] = tags[keep]
        self._seen[layer] = self._seen.get(layer, 0) + count
        for part, rows, fisher, grad in zip(PARTS, new_rows, new_fisher, new_grads):
            key = (layer, part)
            self._rows[key] = _merge(self._rows.get(key), keep_old, rows, keep_new)
            if grad is not None:  # the Fisher weights are their squares: kept once, squared in `samples`
                self._gradients[key] = _merge(self._gradients.get(key), keep_old, grad, keep_new)
                self._fisher[key] = None
            else:
                self._fisher[key] = _merge(self._fisher.get(key), keep_old, fisher, keep_new) if with_fisher else None

    # ----- reading -------------------------------------------------------------------

    def samples(self, layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, fisher) of a layer and part ("keys_pre_rope" or "values"): (n, H_kv, D) float32 each; fisher None without gradients."""
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        if (layer, part) not in self._rows:
            raise KeyError(f"no samples for layer {layer}; layers observed: {self.layers()}")
        gradients = self._gradients.get((layer, part))
        return self._rows[(layer, part)], gradients.square() if gradients is not None else self._fisher[(layer, part)]

    def gradients(self, layer: int, part: str) -> torch.Tensor | None:
        """Signed loss gradients (n, H_kv, D) float32 of the rows `samples` returns; None unless ``keep_gradients``."""
        self.samples(layer, part)  # the same checks
        return self._gradients.get((layer, part))

    def layers(self) -> list[int]:
        """The layers observed so far, ascending."""
        return sorted(self._tags)

    def tokens_seen(self, layer: int) -> int:
        """How many token rows of a layer have flowed through the reservoir."""
        return self._seen.get(layer, 0)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B*T, H_kv, D) token rows, batch-major then position."""
    batch, heads, seq, dim = x.shape
    return x.detach().transpose(1, 2).reshape(batch * seq, heads, dim)


def _merge(old: torch.Tensor | None, keep_old: torch.Tensor, new: torch.Tensor, keep_new: torch.Tensor) -> torch.Tensor:
    """Kept old rows, then kept new rows (moved to CPU float32): (n, H_kv, D)."""
    picked = new[keep_new.to(new.device)].to(device="cpu", dtype=torch.float32)
    if old is None:
        return picked  # advanced indexing copied it: no view of the batch is kept
    return torch.cat([old[keep_old], picked])
