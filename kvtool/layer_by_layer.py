"""Layer-by-layer calibration: one decoder layer in memory at a time, resumable after a kill.

`api.calibrate` streams every window through the whole model, so the whole model (and the
K/V samples of every layer) is in memory at once. Here the stack runs one layer at a time
over all windows (`kvtool.models.layer_stack`): the hidden states entering layer i are kept
(N, T, d_model), layer i is loaded (from disk when accelerate offloads it, see
`kvtool.models.offload`), its K/V are captured, its quantizers fitted and measured, its
outputs become layer i+1's inputs, and it is dropped again. Peak memory: one layer, the
hidden states of the windows, and one batch's activations.

Phases (each step saved to the store before the next starts, see `calibration_checkpoint`):

* ``forward``  layers 0..L-1: sample + fit (methods that learn), measure SQNR, next inputs.
  Static scales (fp8 / int_static, fitted from `RangeStats`) see the layer's K/V in the same
  pass as the sample; their rows are drawn per layer from Generator(seed) as in memory.
* Fisher-weighted recipes (KVQuant's fisher-kmeans nuq, Palu's fisher and gradient ranks) need the loss
  gradient w.r.t. every layer's K/V through all later layers. The ``forward`` sweep then only
  stores each layer's inputs; ``head`` runs the model's head on the last outputs and takes
  d loss / d hidden; ``backward`` goes from layer L-1 down to 0, recomputing each layer with
  gradients from its stored inputs and back-propagating the incoming gradient through it:
  the K/V gradients are the same total derivatives as one backward through the whole model
  (`kvtool.sensitivity`), one window at a time as there. Static scales of such a recipe are
  collected there too, by one plain pass of the layer over its stored inputs before the fit.
* Palu ranks are allocated jointly across layers: per-layer bases and samples are kept in the
  store, ``palu`` allocates the ranks at the end (`fit_palu`, one layer's data loaded at a
  time), and ``measure`` runs the layers once more from their stored inputs to measure SQNR.

Batches are cut as in-memory calibration cuts them, so the artifact is the same up to
float rounding (exactly the same for recipes without Fisher weights).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvtool.calibration import (
    QuantErrorStats,
    RangeStats,
    fit_layers,
    fits_queries,
    fits_ranges,
    fits_reservoir,
    needs_fisher,
    needs_gradients,
    needs_fit,
    palu_entry,
    range_parts,
    uses_palu,
)
from kvtool.calibration_checkpoint import CheckpointStore, MemoryStore
from kvtool.capture import CaptureCache, InputSecondMoments, Progress, WindowRope, no_progress, window_rope
from kvtool.errors import RuntimeConfigError
from kvtool.models.layer_stack import LayerCall, head_loss_gradient, record_layer_calls, run_layer
from kvtool.models.offload import execution_device, fingerprint, onloaded
from kvtool.recipe import Recipe
from kvtool.sensitivity import GradientCaptureCache, SampleReservoir, next_token_loss

PARTS = ("keys", "values")


@dataclass(frozen=True)
class LayerByLayer:
    """Options of layer-by-layer calibration.

    checkpoint: folder for resumable checkpoints (`checkpoint_dir_for(out)`); None keeps them in memory.
    resume: continue from the checkpoint's last finished step (start afresh when there is none).
    on_step: called with (phase, layer) after each step is saved (progress, fault injection in tests).
    """

    checkpoint: Path | None = None
    resume: bool = False
    on_step: Callable[[str, int], None] | None = None


@dataclass
class LayerByLayerResult:
    fitted: list[dict] | None  # per layer {"keys.x": t, ...}; None when nothing is fitted
    errors: QuantErrorStats
    tokens: int
    fingerprint: dict


@dataclass
class _Batch:
    ids: torch.Tensor  # (b, T)
    call: LayerCall
    rope: WindowRope  # each layer's RoPE for the batch's positions


class _AsLayerZero:
    """Feeds one layer's observations to a `SampleReservoir` or `RangeStats` under index 0 (a fresh one per layer)."""

    def __init__(self, observer: SampleReservoir | RangeStats) -> None:
        self.observer = observer

    def observe(self, layer, keys_pre_rope, keys, values) -> None:
        self.observer.observe(0, keys_pre_rope, keys, values)


@dataclass
class _Samplers:
    """What one layer's fit reads: token sample (nuq, Palu), static ranges (fp8 / int_static), Palu input moments."""

    reservoir: SampleReservoir | None
    ranges: RangeStats | None
    moments: object  # InputSecondMoments (a context manager) or nullcontext()

    def observers(self) -> list[_AsLayerZero]:
        return [_AsLayerZero(o) for o in (self.reservoir, self.ranges) if o is not None]


class _StoredPart(Mapping):
    """One layer's palu input for one part, read from the store tensor by tensor (so little stays in memory)."""

    KEYS = ("samples", "weights", "gradients", "weight", "bias", "input_second_moment")

    def __init__(self, store, name: str, part: str) -> None:
        self.store, self.name, self.part = store, name, part

    def __getitem__(self, key: str) -> torch.Tensor | None:
        if key not in self.KEYS:
            raise KeyError(key)
        return self.store.tensor(self.name, f"{self.part}.{key}")

    def __iter__(self):
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)


def run_key(recipe: Recipe, windows: torch.Tensor, model_fingerprint: dict, batch_size: int, max_fit_tokens: int) -> dict:
    """What a checkpoint must match to be resumed."""
    digest = hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    return {"recipe": recipe.to_dict(), "windows_sha256": digest, "windows_shape": list(windows.shape),
            "model": model_fingerprint, "batch_size": batch_size, "max_fit_tokens": max_fit_tokens}


def calibrate_layer_by_layer(
    model,
    adapter,
    recipe: Recipe,
    windows: torch.Tensor,
    *,
    batch_size: int,
    max_fit_tokens: int,
    options: LayerByLayer = LayerByLayer(),
    progress: Progress = no_progress,
) -> LayerByLayerResult:
    """Fit and measure the recipe's quantizers on token windows (N, T), one decoder layer at a time."""
    if fits_queries(recipe):
        raise RuntimeConfigError(
            "--layer-by-layer does not capture the attention statistics that TurboQuant's channel_scale: query and "
            "outlier_channels: calibrated are fitted from; calibrate without --layer-by-layer (the model must fit in "
            "memory), or use channel_scale: none and outlier_channels: block"
        )
    model_fingerprint = fingerprint(adapter)
    key = run_key(recipe, windows, model_fingerprint, batch_size, max_fit_tokens)
    store = CheckpointStore(options.checkpoint, key, options.resume) if options.checkpoint else MemoryStore()
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)  # gradients are only ever wanted w.r.t. activations
        run = _Run(model, adapter, recipe, windows, batch_size, max_fit_tokens, store, options.on_step, progress)
        run.execute()
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
        store.close()
    return LayerByLayerResult(run.fitted, run.errors, windows.numel(), model_fingerprint)


class _Run:
    """One layer-by-layer calibration: the phases of the module docstring over a store."""

    def __init__(self, model, adapter, recipe, windows, batch_size, max_fit_tokens, store, on_step, progress) -> None:
        self.model, self.adapter, self.recipe, self.windows = model, adapter, recipe, windows
        self.batch_size, self.max_fit_tokens, self.store = batch_size, max_fit_tokens, store
        self.on_step = on_step or (lambda phase, layer: None)
        self.progress = progress
        self.layers = adapter.layers
        self.num_layers = adapter.geometry.num_layers
        self.fit, self.fisher, self.palu = needs_fit(recipe), needs_fisher(recipe), uses_palu(recipe)
        self.fitted = [{} for _ in range(self.num_layers)] if self.fit else None
        self.errors = QuantErrorStats(recipe, adapter.geometry.head_dim, self.fitted)
        self.device = execution_device(model.get_input_embeddings())
        self._batches: dict[int, list[_Batch]] = {}

    # --- driver ---------------------------------------------------------------------------------
    def execute(self) -> None:
        self._restore()
        phases = ["forward"] + (["head", "backward"] if self.fisher else []) + (["palu", "measure"] if self.palu else [])
        state = self.store.state
        current = state.get("phase", "forward")
        if current == "done":
            return
        for phase in phases[phases.index(current):]:
            start = state.get("layer") if state.get("phase") == phase else None
            getattr(self, f"_{phase}")(start)
        self.store.set_state(phase="done", layer=None)

    def _step_done(self, phase: str, layer: int, next_phase: str, next_layer: int | None) -> None:
        self.store.set_state(phase=next_phase, layer=next_layer)
        self.on_step(phase, layer)

    def _restore(self) -> None:
        """Fitted tensors and SQNR energies of the steps a checkpoint has finished."""
        for layer in range(self.num_layers):
            if self.fit and self.store.has(f"fit.{layer}"):
                self.fitted[layer].update(self.store.load(f"fit.{layer}"))
            if self.store.has(f"energy.{layer}"):
                for part, pair in self.store.load(f"energy.{layer}").items():
                    self.errors.energy[(layer, part)] = pair
        if self.palu and self.store.has("palu.result"):
            self._merge_palu(self.store.load("palu.result"))

    # --- batches --------------------------------------------------------------------------------
    def batches(self, size: int) -> list[_Batch]:
        """The windows cut in batches of ``size``, with every layer's recorded call arguments."""
        if size not in self._batches:
            out = []
            for ids in self.windows.split(size):
                ids = ids.to(self.device)  # (b, T)
                rope = window_rope(self.adapter, ids)  # each layer's RoPE tables for (b, T)
                call = record_layer_calls(self.model, self.layers, ids, CaptureCache(self.adapter, [], rope))
                out.append(_Batch(ids, call, rope))
            self._batches[size] = out
        return self._batches[size]

    def _inputs(self, layer: int, size: int) -> torch.Tensor:
        """Hidden states (N, T, d_model) entering ``layer``: the embeddings, or the stored outputs of layer - 1."""
        if layer == 0:
            return torch.cat([b.call.hidden.cpu() for b in self.batches(size)])
        return self.store.load(f"hidden.{layer}")["hidden"]

    def _pass(self, layer: int, size: int, hidden: torch.Tensor, observers: list, gradient_cache: bool = False) -> torch.Tensor:
        """Run one layer over all windows in batches of ``size``; returns its outputs (N, T, d_model) on CPU."""
        module = self.layers[layer]
        device = execution_device(module)
        outputs = []
        for batch, h in zip(self.batches(size), hidden.split(size)):
            if gradient_cache:  # K/V re-rotated as in the Fisher pass, so later layers see what they saw there
                cache = GradientCaptureCache(self.adapter, batch.rope)
            else:
                cache = CaptureCache(self.adapter, observers, batch.rope)
            with torch.no_grad():
                outputs.append(run_layer(module, h.to(device), batch.call.kwargs[layer], cache).cpu())
        return torch.cat(outputs)

    # --- phases ---------------------------------------------------------------------------------
    def _forward(self, start: int | None) -> None:
        size = 1 if self.fisher else self.batch_size
        start = start or 0
        layers = range(start, self.num_layers)
        for layer in self.progress(layers, "calibrating layer by layer", len(layers)):
            hidden = self._inputs(layer, size)
            with onloaded(self.layers[layer]):
                if self.fisher:
                    outputs = self._pass(layer, size, hidden, [], gradient_cache=True)
                elif self.fit:
                    samplers = self._samplers()
                    with samplers.moments:
                        outputs = self._pass(layer, size, hidden, samplers.observers())
                    self._fit_layer(layer, samplers)
                if not self.fisher and not self.palu:
                    outputs = self._pass(layer, size, hidden, [self.errors])
                    self._save_energy(layer)
            self.store.save(f"hidden.{layer + 1}", {"hidden": outputs})
            self._step_done("forward", layer, "forward", layer + 1)
            if not (self.fisher or self.palu) and layer > 0:
                self.store.delete(f"hidden.{layer}")  # inputs are kept only where a later phase reads them
        if self.fisher:
            self.store.set_state(phase="head", layer=None)

    def _head(self, start: int | None) -> None:
        last = self._inputs(self.num_layers, 1)
        grads = []
        for batch, h in zip(self.batches(1), last.split(1)):
            cache = CaptureCache(self.adapter, [], batch.rope)
            grads.append(head_loss_gradient(self.model, self.layers, batch.ids, h.to(self.device), cache, next_token_loss).cpu())
        self.store.save(f"grad.{self.num_layers}", {"grad": torch.cat(grads)})
        self.store.delete(f"hidden.{self.num_layers}")
        self.store.set_state(phase="backward", layer=self.num_layers - 1)

    def _backward(self, start: int | None) -> None:
        start = self.num_layers - 1 if start is None else start
        layers = range(start, -1, -1)
        for layer in self.progress(layers, "Fisher weights layer by layer", len(layers)):
            hidden = self._inputs(layer, 1)
            incoming = self.store.load(f"grad.{layer + 1}")["grad"]
            with onloaded(self.layers[layer]):
                samplers = self._samplers(fisher=True)
                with samplers.moments:
                    outgoing = self._gradient_pass(layer, hidden, incoming, samplers.reservoir)
                if samplers.ranges is not None:  # static scales: plain K/V, in batches as in memory
                    self._pass(layer, self.batch_size, hidden, [_AsLayerZero(samplers.ranges)])
                self._fit_layer(layer, samplers)
                if not self.palu:
                    self._pass(layer, self.batch_size, hidden, [self.errors])
                    self._save_energy(layer)
            if outgoing is not None:
                self.store.save(f"grad.{layer}", {"grad": outgoing})
            self._step_done("backward", layer, "backward", layer - 1)
            self.store.delete(f"grad.{layer + 1}")
            if not self.palu:
                self.store.delete(f"hidden.{layer}")
        self.store.set_state(phase="palu" if self.palu else "done", layer=None)

    def _palu(self, start: int | None) -> None:
        from kvtool.methods.lowrank.palu import fit_palu

        parts = [part for part, spec in zip(PARTS, (self.recipe.keys, self.recipe.values)) if spec.method == "palu"]
        layers = [{part: _StoredPart(self.store, f"palu.{layer}", part) for part in parts} for layer in range(self.num_layers)]
        fitted = fit_palu(self.recipe, layers)
        result = {f"{layer}.{name}": t for layer, entry in enumerate(fitted) for name, t in entry.items()}
        self.store.save("palu.result", result)
        self._merge_palu(result)
        self.store.set_state(phase="measure", layer=0)

    def _measure(self, start: int | None) -> None:
        start = start or 0
        layers = range(start, self.num_layers)
        for layer in self.progress(layers, "measuring layer by layer", len(layers)):
            hidden = self._inputs(layer, self.batch_size)
            with onloaded(self.layers[layer]):
                self._pass(layer, self.batch_size, hidden, [self.errors])
            self._save_energy(layer)
            self._step_done("measure", layer, "measure", layer + 1)
            if layer > 0:
                self.store.delete(f"hidden.{layer}")

    # --- per layer ------------------------------------------------------------------------------
    def _samplers(self, fisher: bool = False) -> _Samplers:
        """Fresh samplers for one layer, as `api._fit` builds them for the whole model.

        fisher: the reservoir is fed by the gradient pass (always there), else only when a method reads it.
        """
        from contextlib import nullcontext

        recipe, seed = self.recipe, self.recipe.calibration.seed
        sinks = recipe.cache.sink_tokens  # float in the cache: never fitted on (as in api._fit)
        reservoir = None
        if fisher or fits_reservoir(recipe):
            reservoir = SampleReservoir(
                max_tokens=self.max_fit_tokens, seed=seed, skip_first=sinks, keep_gradients=needs_gradients(recipe)
            )
        ranges = None
        if fits_ranges(recipe):
            ranges = RangeStats(max_tokens=self.max_fit_tokens, seed=seed, skip_first=sinks, parts=range_parts(recipe))
        return _Samplers(reservoir, ranges, InputSecondMoments(self.adapter) if self.palu else nullcontext())

    def _gradient_pass(self, layer: int, hidden: torch.Tensor, incoming: torch.Tensor, reservoir) -> torch.Tensor | None:
        """Per window: recompute the layer with gradients, feed K/V and their Fisher weights to the reservoir.

        incoming: d loss / d outputs (N, T, d_model). Returns d loss / d inputs (N, T, d_model), None for layer 0.
        """
        module = self.layers[layer]
        device = execution_device(module)
        outgoing = []
        for batch, h, g in zip(self.batches(1), hidden.split(1), incoming.split(1)):
            x = h.to(device, copy=True).requires_grad_(layer > 0)  # (1, T, d_model)
            cache = GradientCaptureCache(self.adapter, batch.rope)
            with torch.enable_grad():
                out = run_layer(module, x, batch.call.kwargs[layer], cache)
                keys_pre, values = cache.tracked[layer]
                targets = [keys_pre, values] + ([x] if layer > 0 else [])
                grads = torch.autograd.grad(out, targets, grad_outputs=g.to(device, out.dtype), allow_unused=True)
            signed = [torch.zeros_like(t) if d is None else d.float() for t, d in zip((keys_pre, values), grads)]
            fisher = [d.square() for d in signed]
            reservoir.observe_gradients(0, keys_pre.detach(), values.detach(), *fisher, gradients=tuple(signed))
            if layer > 0:
                outgoing.append(grads[2].detach().cpu())
        return torch.cat(outgoing) if outgoing else None

    def _fit_layer(self, layer: int, samplers: _Samplers) -> None:
        reservoir = samplers.reservoir if fits_reservoir(self.recipe) else None
        fitted = fit_layers(self.recipe, self.adapter.geometry.head_dim, 1, reservoir, samplers.ranges)[0]
        if self.palu:
            moments = samplers.moments
            entry = palu_entry(self.recipe, self.adapter, layer, samplers.reservoir, moments.moment, reservoir_layer=0)
            flat = {f"{part}.{k}": v for part, values in entry.items() for k, v in values.items() if v is not None}
            self.store.save(f"palu.{layer}", flat)
            moments.sums.pop(layer, None)
        self.fitted[layer] = fitted
        self.store.save(f"fit.{layer}", fitted)

    def _save_energy(self, layer: int) -> None:
        pairs = {part: self.errors.energy[(layer, part)] for part in PARTS if (layer, part) in self.errors.energy}
        self.store.save(f"energy.{layer}", pairs)

    def _merge_palu(self, result: dict[str, torch.Tensor]) -> None:
        for name, tensor in result.items():
            layer, key = name.split(".", 1)
            self.fitted[int(layer)][key] = tensor
