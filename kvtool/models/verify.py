"""Check an adapter against the model it describes, on one short forward.

The generic adapter reads a family it has never seen from its modules and config.
`check_adapter` runs a few tokens through the model with a cache that records what each
layer stores and an attention function that records what each layer's attention is
asked to do, then compares, per layer:

* keys: `layer_spec(i).rope.apply(project_kv(i, hidden)[0])` against the cached keys
  (after RoPE), values against the cached values;
* attention: ``scaling``, ``softcap``, ``s_aux`` (sinks) and ``sliding_window`` passed to
  the attention function against `layer_spec(i)`.

`kvtool.models.loading.load_model` runs it for families outside `TESTED_FAMILIES`;
the test-suite runs it for every tested family.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvtool.capture import _CaptureLayer
from kvtool.errors import ModelError
from kvtool.models.adapter import ModelAdapter, adapter_for
from kvtool.models.attention_hook import eager_attention
from kvtool.models.cache_argument import with_cache

VERIFY_NAME = "kvtool_verify"
_records: dict[int, dict] = {}  # id(attention module) -> what its last attention call was asked


def verify_adapter(model, adapter: ModelAdapter | None = None, tokens: int = 8) -> None:
    """ModelError naming every mismatch between the adapter's reading and the model's own forward."""
    adapter = adapter or adapter_for(model)
    problems = check_adapter(model, adapter, tokens)
    if problems:
        raise ModelError(
            f"kvtool's reading of model type '{adapter.geometry.family}' does not match what the model computes: "
            + "; ".join(problems)
            + ". This family needs an override in kvtool.models.adapter.ADAPTERS"
        )


@torch.no_grad()
def check_adapter(model, adapter: ModelAdapter, tokens: int = 8) -> list[str]:
    """Mismatches (one line each) between the adapter and one forward of `tokens` tokens; [] when they agree."""
    device = next(model.parameters()).device
    vocab = adapter.config.vocab_size
    input_ids = ((torch.arange(tokens, device=device) * 7919 + 3) % vocab)[None]  # (1, T)
    positions = torch.arange(tokens, device=device)[None]  # (1, T)
    hidden: dict[int, torch.Tensor] = {}
    hooks = [
        adapter.kv_projection_inputs_module(i).register_forward_hook(_keep_input(hidden, i))
        for i in range(adapter.geometry.num_layers)
    ]
    cache = _RecordingCache(adapter.geometry.num_layers)
    _records.clear()
    try:
        with _recording_attention(model):
            model(input_ids=input_ids, **with_cache(cache), use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    problems = []
    for i, module in enumerate(adapter.attention_modules()):
        problems += _check_kv(adapter, i, hidden.get(i), cache.layers[i], positions)
        problems += _check_call(adapter, i, _records.get(id(module)))
    return problems


def _keep_input(store: dict, layer: int):
    def hook(module, args, output) -> None:  # returns None: the module's output stays as it is
        store.setdefault(layer, args[0])

    return hook


def _check_kv(adapter: ModelAdapter, i: int, hidden, layer, positions) -> list[str]:
    if hidden is None or layer.keys is None:
        return [f"layer {i}: the forward never reached its K/V projection or cache"]
    keys, values = adapter.project_kv(i, hidden)  # (1, H_kv, T, D) pre-RoPE
    keys = adapter.layer_spec(i).rope.apply(keys.float(), positions)
    tolerance = 1e-4 if layer.keys.dtype == torch.float32 else 3e-2
    out = []
    for name, ours, theirs in (("keys", keys, layer.keys), ("values", values, layer.values)):
        if ours.shape != theirs.shape:
            out.append(f"layer {i}: {name} shape {tuple(ours.shape)} vs cached {tuple(theirs.shape)}")
            continue
        error = ((ours.float() - theirs.float()).norm() / theirs.float().norm().clamp(min=1e-12)).item()
        if error > tolerance:
            out.append(f"layer {i}: {name} rebuilt from the projections differ from the cached ones (relative error {error:.2e})")
    return out


def _check_call(adapter: ModelAdapter, i: int, record: dict | None) -> list[str]:
    if record is None:
        return [f"layer {i}: its attention did not go through transformers' attention interface"]
    spec = adapter.layer_spec(i)
    out = []
    if record["scaling"] is not None and abs(record["scaling"] - spec.scaling) > 1e-6 * spec.scaling:
        out.append(f"layer {i}: attention scaling {record['scaling']} vs spec {spec.scaling}")
    if (record["softcap"] or None) != spec.logit_softcap:
        out.append(f"layer {i}: attention softcap {record['softcap']} vs spec {spec.logit_softcap}")
    if record["sinks"] != spec.has_sinks:
        out.append(f"layer {i}: attention sinks passed: {record['sinks']} vs spec has_sinks {spec.has_sinks}")
    if record["sliding_window"] and record["sliding_window"] != spec.sliding_window:
        out.append(f"layer {i}: attention sliding_window {record['sliding_window']} vs spec {spec.sliding_window}")
    return out


def _record_and_attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function: remember the call's arguments, then run the family's own eager attention."""
    _records[id(module)] = {
        "scaling": None if scaling is None else float(scaling),
        "softcap": kwargs.get("softcap"),
        "sinks": kwargs.get("s_aux") is not None,
        "sliding_window": kwargs.get("sliding_window"),
    }
    scaling = module.head_dim**-0.5 if scaling is None else scaling
    return eager_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


class _recording_attention:
    """Switch the model to the recording attention function for a `with` block, then back."""

    def __init__(self, model) -> None:
        self.model, self.previous = model, model.config._attn_implementation

    def __enter__(self) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

        if VERIFY_NAME not in AttentionInterface._global_mapping:
            AttentionInterface.register(VERIFY_NAME, _record_and_attend)
            ALL_MASK_ATTENTION_FUNCTIONS.register(VERIFY_NAME, eager_mask)
        self.model.set_attn_implementation(VERIFY_NAME)

    def __exit__(self, *exc) -> None:
        self.model.set_attn_implementation(self.previous)


class _RecordingLayer(_CaptureLayer):
    """Keeps the keys/values (B, H_kv, T, D) of one forward, returns them unchanged (a pass-through layer)."""

    def __init__(self) -> None:
        super().__init__(layer=-1, owner=None)
        self.keys = self.values = None

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _RecordingCache(Cache):
    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[_RecordingLayer() for _ in range(num_layers)])
