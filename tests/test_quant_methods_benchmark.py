"""benchmarks/quant_bits.py --suite methods: the inner-product and pass-key columns (issue 12), on kvref-5m.

kvref-5m cannot retrieve a pass key (see its README): only the mechanics are checked here, that
every row carries the columns, that the uncompressed baseline reads exactly 0 error, and that the
pass-key grid is the one asked for. The figures are in benchmarks/RESULTS.md ("Quantization
methods: inner-product bias and pass-key").
"""

import dataclasses
import json
import math

import pytest
from rich.console import Console

from benchmarks.quant_bits import bench_methods, passkey_grid, with_key_rope
from kvtool.errors import RecipeError
from kvtool.recipe import load_recipe
from tests.conftest import shared_path


def test_methods_suite_reports_inner_product_and_passkey(tmp_path):
    shared_path("models/kvref-5m")  # skips (or fails in CI) without ../shared
    out = tmp_path / "quant_methods.json"
    grid = passkey_grid(5, 128)
    bench_methods(["kvref-5m"], samples=1, seq_len=256, decode=0, calib_samples=1, out=out, console=Console(quiet=True),
                  only=["int4-static-channel", "turboquant-3bit qjl-keys"], passkey=grid, score_perplexity=False)
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert [r["recipe"] for r in rows] == ["uncompressed", "int4-static-channel", "turboquant-3bit qjl-keys"]
    assert saved["passkey_grid"] == {"lengths": [128], "depths": [0.0, 0.25, 0.5, 0.75, 1.0], "seeds": 1}
    base = rows[0]
    assert base["ip_bias"] == base["ip_shrink"] == base["ip_error_var"] == base["ip_rel_mse"] == 0.0
    for row in rows[1:]:
        assert row["ip_rel_mse"] > 0 and row["ip_error_var"] > 0 and row["keys_sqnr_db"] is not None
        assert row["ip_rel_mse"] >= row["ip_error_var"]  # rel MSE = error variance + bias^2, per head
    for row in rows:
        assert 0.0 <= row["passkey_accuracy"] <= 1.0 and len(row["passkey_by_depth"]) == 5


def test_passkey_cases_are_whole_seeds_over_the_five_depths():
    assert passkey_grid(0, 1024) is None
    assert passkey_grid(10, 1024).seeds == 2
    with pytest.raises(SystemExit, match="multiple of 5"):
        passkey_grid(7, 1024)


def test_key_rope_variants_override_the_recipe_and_say_so_in_their_name():
    recipe = load_recipe("int8-static-channel")
    pre, post = with_key_rope(recipe, "pre"), with_key_rope(recipe, "post")
    assert (pre.keys.pre_rope, post.keys.pre_rope) == (True, False)
    assert (pre.name, post.name) == ("int8-static-channel pre-rope keys", "int8-static-channel post-rope keys")
    assert pre.values == post.values == recipe.values and pre.keys.bits == recipe.keys.bits
    with pytest.raises(RecipeError, match="turboquant rotates keys after RoPE"):
        with_key_rope(load_recipe("turboquant-3bit"), "pre")  # not every method can store keys before RoPE


def test_sqnr_by_position_measures_both_spans_and_leaves_values_alone():
    """benchmarks/key_sqnr_by_position on kvref-5m: mechanics (figures in benchmarks/RESULTS.md)."""
    from benchmarks.common import SHARED
    from benchmarks.key_sqnr_by_position import sqnr_by_span
    from kvtool.data import DataSpec, token_windows
    from kvtool.models.loading import load_model

    model, tokenizer = load_model(str(shared_path("models/kvref-5m")))
    windows = token_windows(tokenizer, DataSpec.parse(str(SHARED / "data/text/wikitext2_test.txt")), samples=1, seq_len=192,
                            mode="sequential")
    recipe = load_recipe("int8-static-channel")
    recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, samples=1))
    pre, post = (sqnr_by_span(model, tokenizer, "kvref-5m", with_key_rope(recipe, rope), windows, 64) for rope in ("pre", "post"))
    for row in (pre, post):
        assert all(math.isfinite(row[f"{span}_{part}_sqnr_db"]) for span in ("near", "far") for part in ("keys", "values"))
    assert pre["near_keys_sqnr_db"] != post["near_keys_sqnr_db"]  # the keys really were stored differently
    assert pre["far_values_sqnr_db"] == post["far_values_sqnr_db"]  # where keys are stored does not touch values


def test_a_recipe_the_inner_product_cannot_measure_keeps_its_row_and_says_why(tmp_path):
    """Palu latents of grouped heads have no per-head key to score: the row says so (n/a) and the suite goes on."""
    shared_path("models/kvref-5m")
    out = tmp_path / "quant_methods.json"
    bench_methods(["kvref-5m"], samples=1, seq_len=256, decode=0, calib_samples=1, out=out, console=Console(quiet=True),
                  only=["palu-30-3bit", "int4-static-channel"], score_perplexity=False)
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    palu = rows["palu-30-3bit"]
    assert palu["ip_bias"] is None and palu["ip_rel_mse"] is None and "group" in palu["ip_unmeasured"]
    assert palu["keys_sqnr_db"] is not None  # the rest of the row is measured
    assert rows["int4-static-channel"]["ip_rel_mse"] > 0 and "ip_unmeasured" not in rows["int4-static-channel"]
