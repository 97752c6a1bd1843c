"""Forwards whose logits nobody reads ask for the last position's only (`kvtool.models.logits_argument`).

Without it a perplexity window's prefill made (b, prefill, V) float32 logits: 4.3 GB for Gemma 3's 262,144-token
vocabulary at a batch of 4 x 1024 tokens, enough for two evaluations side by side to run out of memory.
"""

import pytest
import torch

import kvtool.eval.perplexity as perplexity_module
from kvtool.eval.perplexity import perplexity
from kvtool.models.logits_argument import last_logits_only
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime
from tests.tiny_models import ALL_FAMILIES, tiny_model


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_supported_family_can_skip_the_unread_logits(family):
    """A transformers upgrade that renamed ``logits_to_keep`` would silently bring the full logits back: fail here."""
    assert last_logits_only(tiny_model(family)) == {"logits_to_keep": 1}


def test_a_forward_without_the_argument_is_called_as_before():
    class Plain(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    assert last_logits_only(Plain()) == {}


def test_perplexity_prefill_keeps_one_logit_row_and_scores_the_same(monkeypatch):
    model = tiny_model("llama")
    windows = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    runtime = CompressedRuntime.from_recipe(model, load_recipe("kivi-4bit"))
    rows: list[tuple[int, int]] = []  # (input tokens, logit rows) per forward
    hook = model.register_forward_hook(lambda module, args, kwargs, out: rows.append(
        (kwargs["input_ids"].shape[1], out.logits.shape[1])), with_kwargs=True)
    try:
        lean = perplexity(model, windows, runtime.new_cache, prefill=16, batch_size=2)
        assert rows[0] == (16, 1), "the prefill forward still returned a logit row per prefilled token"
        assert all(row == (1, 1) for row in rows[1:])
        monkeypatch.setattr(perplexity_module, "last_logits_only", lambda model: {})
        full = perplexity(model, windows, runtime.new_cache, prefill=16, batch_size=2)
    finally:
        hook.remove()
    assert rows[len(rows) // 2] == (16, 16)  # the comparison run did make every row
    assert lean.ppl == full.ppl and lean.scored_tokens == full.scored_tokens
