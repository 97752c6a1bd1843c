"""Tests for kvtool.data: DataSpec parsing, text loading, slicing and token windows."""

import json
from pathlib import Path

import pytest
import torch

from kvtool import data
from kvtool.data import DataSpec, count_tokens, load_text, token_windows
from kvtool.errors import DataError

KVREF = "/work/shared/models/kvref-5m"
STORIES = "/work/shared/models/stories260K"
SHARED_TEXT = Path("/work/shared/data/text")


@pytest.fixture(scope="session", autouse=True)
def datasets_cache(tmp_path_factory):
    """Keep the arrow caches datasets writes for test files out of the user's home cache."""
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))
        yield


@pytest.fixture(scope="session")
def kvref_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(KVREF)


@pytest.fixture(scope="session")
def stories_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(STORIES)


class CharTokenizer:
    """One token per character; optionally a BOS id that it may or may not add by default."""

    def __init__(self, name="chars", bos_token_id=None, adds_bos=False):
        self.name_or_path = name
        self.bos_token_id = bos_token_id
        self.adds_bos = adds_bos
        self.calls = 0

    def __call__(self, text, add_special_tokens=True, verbose=True):
        self.calls += 1
        ids = [ord(c) for c in text]
        if add_special_tokens and self.adds_bos:
            ids = [self.bos_token_id] + ids
        return {"input_ids": ids}


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def words(n, tag="w"):
    """A text of n distinct words, so every window of it is distinct."""
    return " ".join(f"{tag}{i}" for i in range(n))


# ---------------------------------------------------------------- DataSpec


def test_parse_plain_path_and_slices():
    assert DataSpec.parse("a/b.txt") == DataSpec("a/b.txt")
    spec = DataSpec.parse("../shared/data/text/pg2600_war_and_peace.txt[0.9:1.0]")
    assert (spec.source, spec.start, spec.end) == ("../shared/data/text/pg2600_war_and_peace.txt", 0.9, 1.0)
    assert DataSpec.parse("x.jsonl[0.5:]", text_column="body") == DataSpec("x.jsonl", "body", 0.5, 1.0)
    assert DataSpec.parse(" x.txt[:0.25] ") == DataSpec("x.txt", "text", 0.0, 0.25)


def test_parse_hub_id_without_network():
    spec = DataSpec.parse("wikitext:wikitext-2-raw-v1:test[:0.5]")
    assert (spec.source, spec.start, spec.end) == ("wikitext:wikitext-2-raw-v1:test", 0.0, 0.5)
    assert not spec.is_local()
    assert spec.hub_parts() == ("wikitext", "wikitext-2-raw-v1", "test")
    assert DataSpec("org/name").hub_parts() == ("org/name", None, "train")
    assert DataSpec("name:cfg").hub_parts() == ("name", "cfg", "train")
    assert DataSpec("name::validation").hub_parts() == ("name", None, "validation")
    with pytest.raises(DataError, match="name\\[:config\\[:split\\]\\]"):
        DataSpec("a:b:c:d").hub_parts()


def test_is_local_for_path_like_sources(tmp_path):
    assert DataSpec("missing.txt").is_local()
    assert DataSpec("./some/folder").is_local()
    assert DataSpec(str(tmp_path)).is_local()
    assert not DataSpec("roneneldan/TinyStories").is_local()


@pytest.mark.parametrize("text, message", [
    ("x.txt[0.8:0.2]", "0 <= start < end <= 1"),
    ("x.txt[0.5:0.5]", "0 <= start < end <= 1"),
    ("x.txt[-0.1:0.5]", "0 <= start < end <= 1"),
    ("x.txt[0.1:1.5]", "0 <= start < end <= 1"),
    ("x.txt[a:b]", "not a number"),
    ("x.txt[nan:1]", "not a number"),
    ("", "empty"),
    ("[0:0.5]", "empty"),
])
def test_parse_rejects_bad_specs(text, message):
    with pytest.raises(DataError, match=message):
        DataSpec.parse(text)


def test_spec_validation_and_describe():
    spec = DataSpec("x.txt", start=0, end=1)
    assert isinstance(spec.start, float) and isinstance(spec.end, float)
    assert json.loads(json.dumps(spec.describe())) == {"source": "x.txt", "text_column": "text",
                                                        "start": 0.0, "end": 1.0}
    with pytest.raises(DataError, match="text column"):
        DataSpec("x.txt", text_column="")
    with pytest.raises(DataError, match="not a number"):
        DataSpec("x.txt", start=True)


# ---------------------------------------------------------------- load_text


def test_txt_is_read_whole_as_one_document(tmp_path):
    content = "First line.\nSecond line.\n\nNew paragraph.\n\n\nLast.\n"
    assert load_text(DataSpec(str(write(tmp_path / "a.txt", content)))) == content


def test_jsonl_with_custom_column_skips_empty_rows(tmp_path):
    rows = [{"body": "one", "id": 1}, {"body": "two", "id": 2}, {"body": None, "id": 3}, {"body": "", "id": 4}]
    path = write(tmp_path / "b.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_text(DataSpec(str(path), text_column="body")) == "one\n\ntwo"


def test_json_array_and_parquet(tmp_path):
    import pandas as pd

    json_path = write(tmp_path / "c.json", json.dumps([{"text": "j1"}, {"text": "j2"}]))
    assert load_text(DataSpec(str(json_path))) == "j1\n\nj2"
    parquet_path = tmp_path / "d.parquet"
    pd.DataFrame({"text": ["p1", None, "p2"], "n": [1, 2, 3]}).to_parquet(parquet_path)
    assert load_text(DataSpec(str(parquet_path))) == "p1\n\np2"


def test_folder_reads_supported_files_in_name_order(tmp_path):
    import pandas as pd

    write(tmp_path / "2_second.txt", "second file")
    write(tmp_path / "1_first.txt", "first file")
    write(tmp_path / "3_third.jsonl", json.dumps({"text": "third file"}) + "\n")
    pd.DataFrame({"text": ["fourth file"]}).to_parquet(tmp_path / "4_fourth.parquet")
    write(tmp_path / "0_notes.md", "ignored")
    write(tmp_path / ".hidden.txt", "ignored too")
    assert load_text(DataSpec(str(tmp_path))) == "first file\n\nsecond file\n\nthird file\n\nfourth file"


def test_slices_select_character_fractions(tmp_path):
    content = "".join(chr(ord("a") + i % 26) for i in range(1000))
    path = str(write(tmp_path / "abc.txt", content))
    assert load_text(DataSpec.parse(path + "[0.9:1.0]")) == content[900:]
    assert load_text(DataSpec.parse(path + "[:0.25]")) == content[:250]
    assert load_text(DataSpec.parse(path + "[0.1:0.2]")) == content[100:200]


def test_slice_of_real_shared_file():
    path = SHARED_TEXT / "tinyshakespeare_input.txt"
    full = path.read_text(encoding="utf-8")
    n = len(full)
    tail = load_text(DataSpec.parse(f"{path}[0.9:1.0]"))
    head = load_text(DataSpec.parse(f"{path}[0:0.1]"))
    assert tail == full[round(0.9 * n):]
    assert head == full[:round(0.1 * n)]
    assert abs(len(tail) - n / 10) <= 1 and tail != head


# ---------------------------------------------------------------- load_text errors


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="does not exist") as info:
        load_text(DataSpec(str(missing)))
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("blank.txt", "\n \n\n"), ("empty.jsonl", "")])
def test_empty_files(tmp_path, name, content):
    path = write(tmp_path / name, content)
    with pytest.raises(DataError, match=name):
        load_text(DataSpec(str(path)))


def test_empty_slice_of_whitespace(tmp_path):
    path = write(tmp_path / "tail_blank.txt", "words" + " " * 95)
    with pytest.raises(DataError, match="holds no text"):
        load_text(DataSpec.parse(f"{path}[0.5:1.0]"))


def test_unsupported_extension(tmp_path):
    path = write(tmp_path / "table.csv", "text\nhello\n")
    with pytest.raises(DataError, match="unsupported extension '.csv'.*\\.txt"):
        load_text(DataSpec(str(path)))


def test_missing_column_names_existing_columns(tmp_path):
    path = write(tmp_path / "b.jsonl", json.dumps({"body": "x", "title": "y"}) + "\n")
    with pytest.raises(DataError, match="no text column 'text'") as info:
        load_text(DataSpec(str(path)))
    assert "body" in str(info.value) and "title" in str(info.value)


def test_non_text_column(tmp_path):
    path = write(tmp_path / "n.jsonl", json.dumps({"text": 3}) + "\n")
    with pytest.raises(DataError, match="int values, not text"):
        load_text(DataSpec(str(path)))


def test_invalid_json(tmp_path):
    path = write(tmp_path / "bad.jsonl", "{not json\n")
    with pytest.raises(DataError, match="could not be read"):
        load_text(DataSpec(str(path)))


def test_folder_without_supported_files(tmp_path):
    write(tmp_path / "readme.md", "hello")
    with pytest.raises(DataError, match="holds no"):
        load_text(DataSpec(str(tmp_path)))


def test_hub_id_offline_raises_data_error(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # datasets reads the variable at import time, which may already have happened.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    spec = DataSpec.parse("kvtool-test-org/no-such-dataset:cfg:test[0:0.5]")
    with pytest.raises(DataError, match="network access") as info:
        load_text(spec)
    assert "kvtool-test-org/no-such-dataset" in str(info.value)


# ---------------------------------------------------------------- token windows


@pytest.fixture
def words_file(tmp_path):
    return str(write(tmp_path / "words.txt", words(3000)))


def test_windows_shape_and_bos(kvref_tok, stories_tok, words_file):
    spec = DataSpec(words_file)
    for tok, bos in ((kvref_tok, 0), (stories_tok, 1)):
        w = token_windows(tok, spec, samples=5, seq_len=32)
        assert w.shape == (5, 32) and w.dtype == torch.long
        assert (w[:, 0] == bos).all()
        assert (w[:, 1:] != bos).all()


def test_random_windows_are_real_text_runs(kvref_tok, words_file):
    spec = DataSpec(words_file)
    ids = kvref_tok(load_text(spec), add_special_tokens=False)["input_ids"]
    w = token_windows(kvref_tok, spec, samples=6, seq_len=16, seed=3)
    runs = {tuple(ids[i:i + 15]) for i in range(len(ids) - 14)}
    assert all(tuple(row) in runs for row in w[:, 1:].tolist())


def test_random_windows_deterministic_by_seed(kvref_tok, words_file):
    spec = DataSpec(words_file)
    a = token_windows(kvref_tok, spec, samples=4, seq_len=24, seed=7)
    b = token_windows(kvref_tok, spec, samples=4, seq_len=24, seed=7)
    c = token_windows(kvref_tok, spec, samples=4, seq_len=24, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sequential_windows_are_consecutive(kvref_tok, words_file):
    spec = DataSpec(words_file)
    ids = torch.tensor(kvref_tok(load_text(spec), add_special_tokens=False)["input_ids"])
    w = token_windows(kvref_tok, spec, samples=3, seq_len=20, mode="sequential")
    assert w.shape == (3, 20)
    assert torch.equal(w[:, 1:].reshape(-1), ids[:57])


def test_sequential_returns_fewer_windows_when_text_is_short(tmp_path):
    tok = CharTokenizer(bos_token_id=1, adds_bos=True)
    spec = DataSpec(str(write(tmp_path / "short.txt", "x" * 100)))
    w = token_windows(tok, spec, samples=10, seq_len=31, mode="sequential")
    assert w.shape == (3, 31)  # 100 // 30 text tokens per window
    assert token_windows(tok, spec, samples=10, seq_len=101, mode="sequential").shape == (1, 101)


def test_tokenizer_without_default_bos(tmp_path):
    spec = DataSpec(str(write(tmp_path / "abc.txt", "abcdefghij" * 10)))
    for tok in (CharTokenizer(bos_token_id=None), CharTokenizer(bos_token_id=5, adds_bos=False)):
        w = token_windows(tok, spec, samples=2, seq_len=10, mode="sequential")
        assert w.tolist() == [[ord(c) for c in "abcdefghij"]] * 2


def test_too_short_text_names_token_count(kvref_tok, tmp_path):
    spec = DataSpec(str(write(tmp_path / "tiny.txt", "Just a few words.")))
    n = count_tokens(kvref_tok, spec)
    with pytest.raises(DataError, match=f"holds {n} tokens; seq_len 256 needs at least 255"):
        token_windows(kvref_tok, spec, samples=1, seq_len=256)


@pytest.mark.parametrize("kwargs, message", [
    (dict(samples=0, seq_len=16), "samples=0"),
    (dict(samples=2, seq_len=1), "seq_len=1"),
    (dict(samples=2.5, seq_len=16), "samples=2.5"),
    (dict(samples=2, seq_len=16, mode="shuffled"), "mode 'shuffled'"),
])
def test_bad_window_arguments(words_file, kwargs, message):
    with pytest.raises(DataError, match=message):
        token_windows(CharTokenizer(), DataSpec(words_file), **kwargs)


def test_count_tokens_and_cache(kvref_tok, tmp_path):
    spec = DataSpec(str(write(tmp_path / "count.txt", words(200, "c"))))
    assert count_tokens(kvref_tok, spec) == len(kvref_tok(load_text(spec), add_special_tokens=False)["input_ids"])
    tok = CharTokenizer(name="cache-test")
    assert count_tokens(tok, spec) == len(load_text(spec))
    token_windows(tok, spec, samples=2, seq_len=8)
    assert tok.calls == 1  # tokenized once, then served from the cache
    assert len(data._TOKEN_CACHE) <= data._TOKEN_CACHE_MAX


def test_windows_from_real_shared_slice(kvref_tok):
    spec = DataSpec.parse(f"{SHARED_TEXT / 'tinystories_val_head.txt'}[0.9:1.0]")
    ids = kvref_tok(load_text(spec), add_special_tokens=False)["input_ids"]
    w = token_windows(kvref_tok, spec, samples=4, seq_len=64, mode="sequential")
    assert w.shape == (4, 64) and (w[:, 0] == 0).all()
    assert w[:, 1:].reshape(-1).tolist() == ids[:4 * 63]
    head = token_windows(kvref_tok, DataSpec.parse(f"{SHARED_TEXT / 'tinystories_val_head.txt'}[0:0.1]"),
                         samples=4, seq_len=64, mode="sequential")
    assert not torch.equal(w, head)
