"""Results that cannot mean anything say so: a cache that compressed nothing yet, retrieval at chance.

Each function returns a one-sentence note for tables and JSON (``note`` keys), or None when
the figure means what it seems to.
"""

from __future__ import annotations

import math

from kvtool.recipe import Recipe

SIGNIFICANCE = 0.01  # one-sided binomial p-value below which accuracy counts as above chance


def first_compressed_length(recipe: Recipe) -> int:
    """Tokens a sequence must hold before the first block of the body is quantized (sinks + recent + one block)."""
    cache = recipe.cache
    return cache.sink_tokens + cache.recent_tokens + cache.block_size


def uncompressed_note(recipe: Recipe, tokens: int, kept_fraction: float | None = None) -> str | None:
    """Why a cache holding ``tokens`` tokens per sequence has compressed nothing yet, or None if it has.

    tokens: the longest sequence the cache holds (prompt + generated, or a window).
    """
    if recipe.is_noop:
        return None
    cache = recipe.cache
    nothing_quantized = not recipe.quantizes or tokens < first_compressed_length(recipe)
    nothing_evicted = not recipe.evicts or (kept_fraction is not None and kept_fraction >= 1.0)
    if not (nothing_quantized and nothing_evicted):
        return None
    notes = []
    if recipe.quantizes:
        notes.append(
            f"all {tokens} tokens are still in the {cache.sink_tokens} sink + {cache.recent_tokens} recent float "
            f"window: the first block of {cache.block_size} tokens is quantized once a sequence holds "
            f"{first_compressed_length(recipe)} tokens"
        )
    if recipe.evicts:
        spec = recipe.eviction
        notes.append(f"no token has been evicted yet: the {tokens} tokens fit the {spec.policy} budget "
                     f"({spec.sink_tokens} sink + {spec.window} recent tokens are always kept)")
    return "nothing compressed yet: " + "; ".join(notes) + " (use a longer prompt or more tokens)"


def chance_accuracy(task: str, describe: dict) -> float:
    """Exact-match accuracy of guessing: a 5-digit pass key, or every token of a copy needle's second half."""
    if task == "passkey":
        return 1 / 90000  # keys are drawn uniformly from 10000..99999
    vocab = describe.get("vocab", {})
    needle_ids = vocab.get("needle_hi", 128) - vocab.get("needle_lo", 64)
    needle, asked = describe.get("needle_tokens", 16), describe.get("needle_tokens", 16) // 2
    guesses = 1.0
    for i in range(needle - asked):  # distinct ids not in the query half
        guesses *= max(1, needle_ids - asked - i)
    return 1 / guesses


def above_chance(hits: int, trials: int, chance: float) -> bool:
    """One-sided binomial test: P(>= hits | chance) < SIGNIFICANCE."""
    if trials == 0 or hits == 0:
        return False
    def log_term(k: int) -> float:  # log of C(n, k) p^k (1-p)^(n-k), in logs: C(n, k) overflows floats
        return (math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1)
                + k * math.log(chance) + (trials - k) * math.log1p(-chance))

    tail = sum(math.exp(log_term(k)) for k in range(hits, trials + 1))
    return tail < SIGNIFICANCE


def retrieval_note(report: dict) -> str | None:
    """A note when the uncompressed baseline (or, without one, the compressed cache) is not above chance."""
    trials = len(report["grid"]) * report["seeds"]
    chance = report["chance_accuracy"]
    if report.get("baseline_accuracy") is not None:
        hits = round(report["baseline_accuracy"] * trials)
        if above_chance(hits, trials, chance):
            return None
        return (f"the baseline ({report.get('baseline', 'uncompressed')}) scores {report['baseline_accuracy']:.2f}, "
                f"not above chance "
                f"({chance:.2g}): this model cannot do the {report['task']} task at these lengths, so the "
                "compressed figure says nothing about compression; use a model that can (e.g. --task copy "
                "with `python -m kvtool.eval.copy_model`, or a real pretrained model)")
    hits = round(report["accuracy"] * trials)
    if above_chance(hits, trials, chance):
        return None
    return (f"accuracy {report['accuracy']:.2f} is not above chance ({chance:.2g}) and no baseline was run: "
            "run with --baseline to see whether the model can do this task at all")
