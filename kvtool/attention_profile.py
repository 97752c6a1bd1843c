"""Attention profiling for FastGen head policies and fitted layer budgets (run by `kvtool profile`).

Calibration windows stream through the model with an `AttentionProfiler` set as
kvtool's attention handler. For every layer and KV head it takes the attention of
each query row i (keys 0..i, the query heads of the GQA group together) and asks:
if the cache held this stream with row i the latest token, which tokens would each
FastGen policy keep (`fastgen_keep_rows`, heavy hitters scored by attention
accumulated over rows 0..i), and what share of row i's attention do they recover?
Probabilities are computed ``chunk_rows`` query rows at a time, so the largest
temporary is (B, H_kv, G, chunk_rows, T), never T x T per head.

Tensors (L layers, H = KV heads, 5 FastGen policies):

* ``heads.mass`` (L, H, 5) float32: attention mass each policy's kept set recovers
  (group-averaged), mean over rows and windows; non-decreasing, the last is 1.
* ``heads.kept_fraction`` (L, H, 5) float32: fraction of the i+1 tokens each keeps.
* ``heads.policy`` (L, H) int8: the cheapest policy recovering >= threshold.
* ``layers.attention_need`` (L,) float32: mean fraction of keys (largest first)
  needed to reach attention mass threshold, over heads and rows.
* ``layers.attention_entropy`` (L,) float32: mean entropy (nats) of a query head's row.
* ``layers.budget_weight`` (L,) float32: `fitted_weights` of the need (mean 1).
* ``tokens.special`` / ``tokens.punctuation`` int64: the token ids of the two classes.

The first ``skip_rows`` (16) rows of a window are left out: with so few keys every
policy keeps nearly everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.capture import Progress, no_progress
from kvtool.artifact import load_artifact
from kvtool.errors import DataError, ModelError
from kvtool.methods.budget.pyramid import fitted_weights
from kvtool.methods.evict.fastgen import FASTGEN_POLICIES, FREQUENT, choose_policies, fastgen_keep_rows, recovered_mass
from kvtool.models.attention_hook import attention_handler, eager_attention, install, sdpa_reference
from kvtool.recipe import EvictionSpec

MIN_PROFILE_TOKENS = 32
SKIP_ROWS = 16
CHUNK_ROWS = 128
NUM_POLICIES = len(FASTGEN_POLICIES)


@dataclass(frozen=True)
class AttentionProfile:
    """The profile's attention tensors (see the module docstring) and the cache fraction they imply."""

    tensors: dict[str, Tensor]
    expected_cache_fraction: float  # mean over layers and KV heads of kept_fraction at the chosen policy


class AttentionProfiler:
    """Attention handler that accumulates FastGen and layer-budget statistics per layer and KV head.

    Call `begin_batch` with the token classes of each batch before its forward; the
    handler returns the normal attention output, so the model runs unchanged.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, spec: EvictionSpec,
                 chunk_rows: int = CHUNK_ROWS, skip_rows: int = SKIP_ROWS) -> None:
        self.spec, self.chunk_rows, self.skip_rows = spec, chunk_rows, skip_rows
        f64 = torch.float64
        self.mass_sum = torch.zeros(num_layers, num_kv_heads, NUM_POLICIES, dtype=f64)
        self.kept_sum = torch.zeros(num_layers, num_kv_heads, NUM_POLICIES, dtype=f64)
        self.rows = torch.zeros(num_layers, dtype=f64)  # (window, row) pairs seen per head
        self.need_sum = torch.zeros(num_layers, dtype=f64)
        self.entropy_sum = torch.zeros(num_layers, dtype=f64)
        self.is_special: Tensor | None = None  # (B, T) bool of the running batch
        self.is_punct: Tensor | None = None

    def begin_batch(self, is_special: Tensor, is_punct: Tensor) -> None:
        """Token classes (B, T) bool of the batch about to run."""
        self.is_special, self.is_punct = is_special, is_punct

    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None, s_aux=None) -> Tensor:
        self.observe_attention(module.layer_idx, query, key, attention_mask, scaling, softcap, s_aux)
        if softcap is None and s_aux is None:
            return sdpa_reference(query, key, value, attention_mask, scaling)
        extra = {name: x for name, x in (("softcap", softcap), ("s_aux", s_aux)) if x is not None}
        return eager_attention(module, query, key, value, attention_mask, scaling=scaling, **extra)[0]  # SDPA has neither

    def observe_attention(self, layer: int, query: Tensor, key: Tensor, attention_mask: Tensor | None,
                          scaling: float, softcap: float | None = None, s_aux: Tensor | None = None) -> None:
        """Softmax attention chunk by chunk of query rows; query (B, H_q, t, D), key (B, H_kv, T, D).

        softcap: Gemma 2's logit soft-capping (cap * tanh(logits / cap)); s_aux (H_q,): GPT-OSS's learned
        sink logits, which take their share of each row's softmax without being a token.
        """
        b, hq, t, d = query.shape
        hkv, total = key.shape[1], key.shape[2]
        q = query.float().reshape(b, hkv, hq // hkv, t, d)  # (B, H_kv, G, t, D)
        k_t = key.float().transpose(-1, -2)[:, :, None]  # (B, H_kv, 1, D, T)
        positions = torch.arange(total - t, total, device=query.device)  # (t,) query rows' positions
        keys = torch.arange(total, device=query.device)  # (T,)
        accumulated = torch.zeros(b, hkv, total, device=query.device)  # (B, H_kv, T)
        for start in range(0, t, self.chunk_rows):
            rows = slice(start, start + self.chunk_rows)
            logits = (q[:, :, :, rows] @ k_t) * scaling  # (B, H_kv, G, C, T)
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            if attention_mask is None:
                allowed = keys <= positions[rows, None]  # (C, T)
            else:
                allowed = attention_mask[:, :, None, rows].bool()  # (B, 1, 1, C, T)
            logits = logits.masked_fill(~allowed, float("-inf"))
            if s_aux is not None:  # one sink logit per query head joins every row's softmax, then is dropped
                sink = s_aux.float().reshape(1, hkv, hq // hkv, 1, 1).expand(*logits.shape[:-1], 1)
                probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1].nan_to_num(0.0)
            else:
                probs = logits.softmax(dim=-1).nan_to_num(0.0)  # (B, H_kv, G, C, T)
            accumulated = self.observe_probabilities(layer, probs, positions[rows], accumulated)

    def observe_probabilities(self, layer: int, probs: Tensor, positions: Tensor, accumulated: Tensor) -> Tensor:
        """Add one chunk of rows: probs (B, H_kv, G, C, T) at query positions (C,); returns the new accumulation.

        accumulated (B, H_kv, T): attention each key received from the earlier rows (group summed).
        """
        group = probs.sum(dim=2)  # (B, H_kv, C, T): the group's query heads together
        scores = accumulated[:, :, None] + group.cumsum(dim=2)  # (B, H_kv, C, T): received through each row
        after = scores[:, :, -1]  # (B, H_kv, T)
        use = positions >= self.skip_rows  # (C,)
        if not bool(use.any()):
            return after
        probs, group, scores, positions = probs[:, :, :, use], group[:, :, use], scores[:, :, use], positions[use]
        mean_probs = group / probs.shape[2]  # (B, H_kv, C', T) group-averaged
        lengths = positions + 1  # (C',) tokens in the stream at each row
        for policy in range(NUM_POLICIES):
            # only `frequent` reads the scores: the other kept sets are the same for every head, (B, 1, C', T)
            policy_scores = scores if policy == FREQUENT else scores[:, :1]
            kept = fastgen_keep_rows(policy, self.is_special[:, None], self.is_punct[:, None], policy_scores, lengths,
                                     self.spec.local_ratio, self.spec.frequent_ratio)  # (B, 1 or H_kv, C', T)
            fraction = (kept.sum(dim=-1) / lengths).expand(mean_probs.shape[:-1])  # (B, H_kv, C')
            self.mass_sum[layer, :, policy] += recovered_mass(mean_probs, kept).sum(dim=(0, 2)).double().cpu()
            self.kept_sum[layer, :, policy] += fraction.sum(dim=(0, 2)).double().cpu()
        self.rows[layer] += group.shape[0] * group.shape[2]
        self.need_sum[layer] += _keys_needed(mean_probs, lengths, self.spec.threshold).sum().double().cpu() / group.shape[1]
        self.entropy_sum[layer] += torch.special.entr(probs).sum(dim=-1).mean(dim=2).sum().double().cpu() / group.shape[1]
        return after

    def finish(self, special_ids: Tensor, punct_ids: Tensor) -> AttentionProfile:
        """Averages, chosen policies and budget weights (see the module docstring)."""
        missing = torch.nonzero(self.rows == 0).reshape(-1).tolist()
        if missing:
            raise ModelError(f"attention of layers {missing} never reached kvtool's attention function, so they "
                             "cannot be profiled; this model's attention is not supported by `kvtool profile`")
        mass = (self.mass_sum / self.rows[:, None, None]).float()  # (L, H, 5)
        kept = (self.kept_sum / self.rows[:, None, None]).float()  # (L, H, 5)
        need = (self.need_sum / self.rows).float()  # (L,)
        policy = choose_policies(mass, self.spec.threshold)  # (L, H)
        expected = PolicyMap(policy=policy, kept_fraction=kept).expected_cache_fraction
        tensors = {
            "heads.mass": mass,
            "heads.kept_fraction": kept,
            "heads.policy": policy.to(torch.int8),
            "layers.attention_need": need,
            "layers.attention_entropy": (self.entropy_sum / self.rows).float(),
            "layers.budget_weight": fitted_weights(need),
            "tokens.special": special_ids.to(torch.int64).cpu(),
            "tokens.punctuation": punct_ids.to(torch.int64).cpu(),
        }
        return AttentionProfile(tensors=tensors, expected_cache_fraction=expected)


def _keys_needed(mean_probs: Tensor, lengths: Tensor, threshold: float) -> Tensor:
    """(B, H_kv, C) fraction of a row's keys, largest probabilities first, that reach mass ``threshold``."""
    ordered = mean_probs.sort(dim=-1, descending=True).values.cumsum(dim=-1)  # (B, H_kv, C, T)
    count = ((ordered < threshold).sum(dim=-1) + 1).clamp(max=lengths)  # (B, H_kv, C)
    return count / lengths


def token_masks(batch: Tensor, special_ids: Tensor, punct_ids: Tensor, sink_tokens: int) -> tuple[Tensor, Tensor]:
    """(is_special, is_punct) (B, T) bool: special = a special id or one of the first ``sink_tokens`` positions."""
    positions = torch.arange(batch.shape[1], device=batch.device)  # (T,)
    is_special = torch.isin(batch, special_ids.to(batch.device)) | (positions < sink_tokens)  # (B, T)
    is_punct = torch.isin(batch, punct_ids.to(batch.device))  # (B, T)
    return is_special, is_punct


@torch.no_grad()
def profile_attention(
    model,
    adapter,
    windows: Tensor,
    special_ids: Tensor,
    punct_ids: Tensor,
    spec: EvictionSpec,
    batch_size: int = 4,
    progress: Progress = no_progress,
    chunk_rows: int = CHUNK_ROWS,
) -> AttentionProfile:
    """FastGen head statistics and layer-budget need of ``model`` on token windows (N, T), T >= 32."""
    if windows.shape[1] < MIN_PROFILE_TOKENS:
        raise DataError(
            f"attention profiling needs windows of at least {MIN_PROFILE_TOKENS} tokens, got {windows.shape[1]}: "
            "raise --seq-len"
        )
    geometry = adapter.geometry
    profiler = AttentionProfiler(geometry.num_layers, geometry.num_kv_heads, spec, chunk_rows=chunk_rows)
    install(model)
    device = next(model.parameters()).device
    batches = windows.split(batch_size)
    with attention_handler(profiler):
        for batch in progress(batches, "profiling attention", len(batches)):
            batch = batch.to(device)  # (b, T)
            profiler.begin_batch(*token_masks(batch, special_ids, punct_ids, spec.sink_tokens))
            model(input_ids=batch, use_cache=False)
    return profiler.finish(special_ids, punct_ids)


@dataclass(frozen=True)
class PolicyMap:
    """What `kvtool profile` / `kvtool inspect` show: chosen FastGen policy per layer x KV head.

    policy (L, H) int64 indices into FASTGEN_POLICIES; kept_fraction (L, H, 5) or None;
    attention_need and budget_weight (L,) or None.
    """

    policy: Tensor
    kept_fraction: Tensor | None = None
    attention_need: Tensor | None = None
    budget_weight: Tensor | None = None

    @property
    def expected_cache_fraction(self) -> float | None:
        """Mean over layers and KV heads of the fraction of tokens the chosen policy keeps."""
        if self.kept_fraction is None:
            return None
        return float(self.kept_fraction.gather(-1, self.policy[..., None]).mean())


def policy_map(tensors: dict[str, Tensor]) -> PolicyMap | None:
    """The policy map of a profile's tensors, or of a deployable's (names prefixed ``profile.``); None if absent."""
    for prefix in ("", "profile."):
        policy = tensors.get(f"{prefix}heads.policy")
        if policy is not None:
            return PolicyMap(
                policy=policy.to(torch.int64),
                kept_fraction=tensors.get(f"{prefix}heads.kept_fraction"),
                attention_need=tensors.get(f"{prefix}layers.attention_need"),
                budget_weight=tensors.get(f"{prefix}layers.budget_weight"),
            )
    return None


def load_policy_map(path) -> PolicyMap | None:
    """`policy_map` of the artifact at ``path`` (any kind; None when it holds no attention profile)."""
    return policy_map(load_artifact(path).tensors)
