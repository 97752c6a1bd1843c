"""benchmarks/sparse_stage2.py on the embedded kvref-5m: stage 2's cost over stage 1, paired, and what it read."""

import pytest

from benchmarks.common import MODELS, SHARED
from benchmarks.sparse_stage2 import STAGE1, measure, parse_variant, variant_recipes, windows_from
from kvtool.models.loading import load_model
from kvtool.recipe import load_recipe

pytestmark = pytest.mark.skipif(not (SHARED / MODELS["kvref-5m"][0]).exists(), reason="needs ../shared/models/kvref-5m")


def test_variants_are_sparse_attention_fields_only():
    assert parse_variant("wide=channels:1.0,min_tokens:8") == ("wide", {"channels": 1.0, "min_tokens": 8})
    assert parse_variant("bundled=") == ("bundled", {})
    with pytest.raises(SystemExit, match="'budget' is not a sparse_attention field"):
        parse_variant("x=budget:0.5")


def test_each_variant_reads_part_of_what_stage_one_keeps_and_is_paired_against_it():
    model, tokenizer = load_model(str(SHARED / MODELS["kvref-5m"][0]))
    windows = windows_from(tokenizer, str(SHARED / MODELS["kvref-5m"][2]), [0.0, 0.5], samples=1, seq_len=320)
    assert windows.shape == (2, 320)
    recipes = variant_recipes(load_recipe("rocketkv"), ["paper=unread:drop,channel_score:query", "all=read_fraction:1.0"])
    rows = {row["variant"]: row for row in measure(model, recipes, windows, prefill=256, batch_size=2)}
    assert list(rows) == ["16-bit", STAGE1, "paper", "all"]
    assert rows[STAGE1]["sparse_read_fraction"] == 1.0 and rows[STAGE1]["kept_fraction"] < 0.75  # stage 1 evicts
    assert rows["paper"]["kept_fraction"] == rows[STAGE1]["kept_fraction"]  # stage 2 frees nothing
    assert 0.25 < rows["paper"]["sparse_read_fraction"] < 0.5  # a quarter, but at least min_tokens (64) of ~160 held
    assert rows["all"]["sparse_read_fraction"] == 1.0
    assert abs(rows["all"]["cost_over_stage1"]["delta_pct"]) < 0.05  # reading everything is stage 1 (fp rounding)
    assert rows["paper"]["cost_over_stage1"]["delta_pct"] != 0.0 and "cost_over_stage1" not in rows[STAGE1]
    assert rows["paper"]["scored_tokens"] == 2 * 63
    assert "delta_over_first_variant" not in rows["paper"]  # the first variant is the reference of the others
    assert rows["all"]["delta_over_first_variant"]["delta_pct"] == pytest.approx(
        -rows["paper"]["cost_over_stage1"]["delta_pct"], abs=0.5)
