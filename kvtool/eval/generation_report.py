"""What `generate()` reports besides the text: the cache against the 16-bit baseline, and decode step timings."""

from __future__ import annotations

from kvtool.eval.baselines import model_dtype_fields
from kvtool.eval.caveats import uncompressed_note
from kvtool.eval.speed import DecodeClock, machine_load, speed_note


def generation_memory(cache, model, recipe) -> dict:
    """``cache.memory_report()`` plus the baseline's name, the model-dtype cache's bytes and a note if nothing is compressed."""
    memory = cache.memory_report()
    memory.update(model_dtype_fields(model, memory["fp16_cache_bytes"]))
    note = uncompressed_note(recipe, memory["tokens"], memory.get("kept_fraction"))
    if note:
        memory["note"] = note
    return memory


def generation_timing(clock: DecodeClock, batch: int) -> dict:
    """Median and best decode-step rates (tokens/s, all sequences), the prefill time and a note when noisy."""
    steps = clock.steps(batch)
    load = machine_load()
    timing = {**steps.summary(), "prefill_seconds": clock.prefill_seconds(), "machine": load}
    note = speed_note([steps], load)
    if note:
        timing["speed_note"] = note
    return timing
