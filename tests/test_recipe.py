"""Recipes: defaults, bundled files, YAML round trips, and errors that name the bad field."""

from pathlib import Path

import pytest
import yaml

from kvtool.errors import RecipeError
from kvtool.recipe import (
    CacheSpec,
    QuantSpec,
    Recipe,
    bundled_recipe_dir,
    dump_recipe,
    load_recipe,
    recipe_from_dict,
)

REPO_RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def good() -> dict:
    """A complete valid recipe dict (fresh copy each call)."""
    return {
        "name": "t",
        "description": "test",
        "keys": {"method": "uniform", "bits": 4, "axis": "channel", "group_size": 32},
        "values": {"method": "uniform", "bits": 4, "axis": "token", "group_size": 32},
        "cache": {"block_size": 32, "sink_tokens": 4, "recent_tokens": 64, "float_dtype": "float16"},
        "calibration": {"samples": 8, "seq_len": 512, "seed": 0},
    }


def with_field(path: str, value) -> dict:
    raw = good()
    section, key = path.split(".")
    raw[section][key] = value
    return raw


# ----- defaults and bundled recipes ------------------------------------------------------


def test_defaults_valid():
    recipe = Recipe()
    assert recipe == load_recipe(None)
    assert (recipe.keys.method, recipe.keys.bits, recipe.keys.axis) == ("uniform", 4, "channel")
    assert (recipe.values.method, recipe.values.bits, recipe.values.axis) == ("uniform", 4, "token")
    assert recipe.keys.path == "keys" and recipe.values.path == "values"
    assert recipe.cache == CacheSpec()
    assert not recipe.is_noop
    assert recipe_from_dict({}) == recipe  # every section is optional


def test_default_round_trips():
    assert recipe_from_dict(yaml.safe_load(dump_recipe(Recipe()))) == Recipe()


def test_bundled_recipes_are_found():
    assert REPO_RECIPES, "no recipes/*.yaml in the repository"
    assert {p.stem for p in bundled_recipe_dir().glob("*.yaml")} == {p.stem for p in REPO_RECIPES}


@pytest.mark.parametrize("path", REPO_RECIPES, ids=[p.stem for p in REPO_RECIPES])
def test_bundled_recipe_loads_and_round_trips(path):
    by_path = load_recipe(path)
    by_name = load_recipe(path.stem)
    assert by_path == by_name
    assert by_path.name == path.stem  # file name and recipe name agree
    text = dump_recipe(by_path)
    again = recipe_from_dict(yaml.safe_load(text))
    assert again == by_path
    assert again.to_dict() == by_path.to_dict()
    assert (again.keys.path, again.values.path) == ("keys", "values")
    assert dump_recipe(again) == text


def test_uncompressed_is_noop():
    recipe = load_recipe("uncompressed")
    assert recipe.is_noop and recipe.keys.bits == recipe.values.bits == 16


def test_round_trip_through_file(tmp_path):
    recipe = recipe_from_dict(with_field("keys.bits", 2))
    path = tmp_path / "r.yaml"
    path.write_text(dump_recipe(recipe))
    assert load_recipe(path) == recipe
    assert load_recipe(str(path)) == recipe


def test_section_defaults_fill_axis_and_none_bits():
    recipe = recipe_from_dict({"keys": {"bits": 2}, "values": {"method": "none"}})
    assert recipe.keys.axis == "channel" and recipe.values.axis == "token"
    assert recipe.values.bits == 16


# ----- bad values name the field ---------------------------------------------------------


@pytest.mark.parametrize(
    "path, value",
    [
        ("keys.bits", 5),
        ("keys.bits", 16),  # 16 only for method none
        ("values.bits", 1),
        ("keys.bits", 4.0),
        ("keys.method", "kmeans"),
        ("values.axis", "head"),
        ("values.group_size", 48),
        ("values.group_size", 0),
        ("cache.block_size", 48),
        ("cache.block_size", 16),  # 16 only when every quantized side is turboquant
        ("cache.block_size", 8),
        ("cache.block_size", 0),
        ("cache.sink_tokens", -1),
        ("cache.recent_tokens", -4),
        ("cache.recent_tokens", 2.5),
        ("cache.float_dtype", "float64"),
        ("calibration.samples", 0),
        ("calibration.seq_len", 1),
        ("calibration.seed", "x"),
    ],
)
def test_bad_value_names_field(path, value):
    with pytest.raises(RecipeError, match=rf"recipe field '{path}'"):
        recipe_from_dict(with_field(path, value))


@pytest.mark.parametrize("policy, value, message", [
    ("h2o", 0.0, "must be a fraction in \\(0, 1\\]"), ("h2o", 1.5, "must be a fraction"),
    ("cake", 0.5, "sets each layer's budget itself"), ("fastgen", 0.5, "has no budget"), ("none", 0.5, "has no budget"),
])
def test_sliding_budget_is_a_fraction_of_a_budgeted_policy(policy, value, message):
    raw = good()
    raw["eviction"] = {"policy": policy, "budget": 1.0, "sliding_budget": value}
    with pytest.raises(RecipeError, match=rf"recipe field 'eviction\.sliding_budget': .*{message}"):
        recipe_from_dict(raw)
    raw["eviction"] = {"policy": "streamingllm", "budget": 1.0, "sliding_budget": 0.5}
    assert recipe_from_dict(raw).eviction.sliding_budget == 0.5


def test_block_size_16_only_for_turboquant_codes():
    """16-token blocks take turboquant (byte-read codes) on every quantized side, overrides included; uniform codes
    are read as 32-token words, so the error names the method and the fix."""
    raw = good()
    raw["keys"] = {"method": "turboquant", "bits": 3, "extra_bits": 0.5, "outlier_channel_fraction": 0.25}
    raw["values"] = {"method": "turboquant", "bits": 2}
    raw["cache"]["block_size"] = 16
    assert recipe_from_dict(raw).cache.block_size == 16
    raw["values"] = {"method": "none", "bits": 16}
    assert recipe_from_dict(raw).cache.block_size == 16
    raw["values"] = {"method": "uniform", "bits": 4, "axis": "token"}
    with pytest.raises(RecipeError, match=r"'cache\.block_size': 16 needs every quantized side to be turboquant or none.*"
                                          r"uniform.*block_size: 32"):
        recipe_from_dict(raw)
    raw["values"] = {"method": "turboquant", "bits": 2}
    raw["layer_overrides"] = [{"layers": [0], "values": {"method": "uniform", "bits": 4}}]
    with pytest.raises(RecipeError, match=r"'layer_overrides\[0\]\.cache\.block_size'.*uniform"):
        recipe_from_dict(raw)


def test_bits_5_for_uniform_message():
    with pytest.raises(RecipeError, match=r"'keys\.bits': 5 is not supported by 'uniform'; choose one of \[2, 3, 4, 8\]"):
        recipe_from_dict(with_field("keys.bits", 5))


def test_method_none_with_bits_4():
    raw = good()
    raw["values"] = {"method": "none", "bits": 4}
    with pytest.raises(RecipeError, match=r"'values\.bits': method 'none' stores 16-bit floats; got 4"):
        recipe_from_dict(raw)


def test_empty_name_rejected():
    raw = good()
    raw["name"] = "  "
    with pytest.raises(RecipeError, match=r"recipe field 'name'"):
        recipe_from_dict(raw)


def test_unknown_top_level_key():
    raw = good()
    raw["bogus"] = 1
    with pytest.raises(RecipeError, match=r"recipe field 'bogus' is unknown"):
        recipe_from_dict(raw)


@pytest.mark.parametrize("section", ["cache", "keys", "calibration"])
def test_unknown_key_inside_section(section):
    raw = good()
    raw[section]["bogus"] = 1
    with pytest.raises(RecipeError, match=rf"recipe field '{section}\.bogus' is unknown"):
        recipe_from_dict(raw)


def test_every_unknown_field_is_named_with_close_matches(tmp_path):
    raw = good()
    raw.update(colour="red", flavour="x")
    raw["keys"].update(bitz=4, axs="channel")
    raw["cache"]["sinks"] = 4
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith("recipe fields 'colour', 'flavour', 'keys.axs' (did you mean 'axis'?), "
                              "'keys.bitz' (did you mean 'bits'?) and 'cache.sinks' (did you mean 'sink_tokens'?) "
                              "are unknown; allowed top-level fields: [")
    assert "allowed in keys: [" in message and "allowed in cache: ['block_size'" in message
    assert "allowed in values" not in message  # only where something is wrong
    assert message.endswith(f"(in {path})")


def test_section_must_be_mapping():
    raw = good()
    raw["cache"] = [32]
    with pytest.raises(RecipeError, match=r"recipe field 'cache': expected a mapping, got list"):
        recipe_from_dict(raw)


def test_direct_construction_validates():
    with pytest.raises(RecipeError, match=r"'values\.bits'"):
        QuantSpec(bits=7, path="values")
    with pytest.raises(RecipeError, match=r"'cache\.block_size'"):
        CacheSpec(block_size=48)


# ----- files -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("", "NoneType")])
def test_non_mapping_yaml(tmp_path, text, kind):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=rf"must be a mapping at the top level, got {kind}"):
        load_recipe(path)


def test_invalid_yaml_syntax(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nkeys: {method: uniform, bits: 4\n")
    with pytest.raises(RecipeError, match=r"broken\.yaml' is not valid YAML"):
        load_recipe(path)


def test_bad_value_in_file_names_field(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(with_field("cache.float_dtype", "float64")))
    with pytest.raises(RecipeError, match=r"'cache\.float_dtype': 'float64' is not one of"):
        load_recipe(path)


def test_unknown_recipe_name_lists_bundled():
    with pytest.raises(RecipeError, match=r"recipe 'no-such-recipe' not found") as info:
        load_recipe("no-such-recipe")
    for path in REPO_RECIPES:
        assert path.stem in str(info.value)


# ----- with_bits -------------------------------------------------------------------------


def test_with_bits_16_gives_none():
    recipe = Recipe().with_bits(16)
    assert recipe.keys.method == recipe.values.method == "none"
    assert recipe.keys.bits == recipe.values.bits == 16
    assert recipe.is_noop
    assert recipe.cache == Recipe().cache


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_with_bits_keeps_axes(bits):
    recipe = load_recipe("kivi-4bit").with_bits(bits)
    assert (recipe.keys.method, recipe.keys.bits, recipe.keys.axis) == ("uniform", bits, "channel")
    assert (recipe.values.method, recipe.values.bits, recipe.values.axis) == ("uniform", bits, "token")
    assert recipe_from_dict(yaml.safe_load(dump_recipe(recipe))) == recipe


def test_with_bits_from_none_back_to_uniform():
    recipe = load_recipe("uncompressed").with_bits(4)
    assert recipe.keys.method == "uniform" and recipe.keys.bits == 4


def test_with_bits_invalid():
    with pytest.raises(RecipeError, match=r"'keys\.bits': 5"):
        Recipe().with_bits(5)


@pytest.mark.parametrize("field, section", [("sink_tokens", "cache"), ("group_size", "values"), ("samples", "calibration")])
def test_booleans_are_not_integers(field, section):
    with pytest.raises(RecipeError, match=f"{section}.{field}"):
        recipe_from_dict({section: {field: True}})


def test_kvquant_bad_values_are_refused():
    with pytest.raises(RecipeError, match="keys.bits"):
        recipe_from_dict({"keys": {"method": "nuq", "bits": 5, "pre_rope": True}})
    with pytest.raises(RecipeError, match="values.outlier_fraction"):
        recipe_from_dict({"values": {"method": "nuq", "bits": 3, "outlier_fraction": 1.5}})
    with pytest.raises(RecipeError, match="keys.pre_rope"):
        recipe_from_dict({"keys": {"method": "nuq", "bits": 3}})
    with pytest.raises(RecipeError, match="values.pre_rope"):
        recipe_from_dict({"values": {"method": "uniform", "bits": 3, "pre_rope": True}})
    with pytest.raises(RecipeError, match="keys.outlier_fraction"):
        recipe_from_dict({"keys": {"method": "uniform", "bits": 3, "outlier_fraction": 0.01}})
