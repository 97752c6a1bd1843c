"""Calibration and evaluation text: where it comes from, and how it becomes token windows.

A `DataSpec` names a source (a local .txt/.jsonl/.json/.parquet file, a local folder of such
files, or a Hugging Face hub id "name[:config[:split]]") plus a character-fraction slice, so
that calibration and evaluation can use disjoint parts of the same text (e.g. [0:0.9] and
[0.9:1.0]). `load_text` reads it with `datasets.load_dataset`; `token_windows` cuts it into
(samples, seq_len) token-id tensors.

`datasets` and `torch` are imported inside functions (seconds each on a busy machine), so that
`DataSpec.parse` and `check_source` can refuse bad input before anything heavy loads.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.errors import DataError
from kvtool.quiet import quiet_progress_bars

# datasets builder used for each supported file extension.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
MODES = ("random", "sequential")
DOC_SEPARATOR = "\n\n"

_SLICE_RE = re.compile(r"^(?P<source>.*)\[(?P<start>[^\[\]:]*):(?P<end>[^\[\]:]*)\]$")
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")

if TYPE_CHECKING:  # torch is imported where tensors are made: parsing and checking a spec stay instant
    import torch

# (spec, tokenizer name_or_path) -> token ids (n_tokens,); see `_token_ids`.
_TOKEN_CACHE: dict[tuple, torch.Tensor] = {}
_TOKEN_CACHE_MAX = 8


@dataclass(frozen=True)
class DataSpec:
    """Where text comes from and which character fraction [start, end) of it to use.

    source: a local file (.txt/.jsonl/.json/.parquet), a local folder of such files, or a hub
        id "name[:config[:split]]" (split defaults to "train").
    text_column: the column holding text in .jsonl/.json/.parquet files and hub datasets
        (.txt files are always read whole).
    start, end: fractions of the concatenated text, by characters; 0 <= start < end <= 1.
    """

    source: str
    text_column: str = "text"
    start: float = 0.0
    end: float = 1.0

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source.strip():
            raise DataError(f"data source {self.source!r} is empty: give a file, a folder or a hub id")
        if not isinstance(self.text_column, str) or not self.text_column:
            raise DataError(f"text column {self.text_column!r} for data '{self.source}' is empty: "
                            "give a column name such as 'text'")
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DataError(f"data slice {name}={value!r} for '{self.source}' is not a number: "
                                "give a fraction between 0 and 1")
            object.__setattr__(self, name, float(value))
        if not 0.0 <= self.start < self.end <= 1.0:
            raise DataError(f"data slice [{self.start}:{self.end}] for '{self.source}' is invalid: "
                            "need 0 <= start < end <= 1, e.g. '[0.9:1.0]' for the last 10%")

    @classmethod
    def parse(cls, text: str, text_column: str = "text") -> DataSpec:
        """Parse a CLI string such as 'data/book.txt[0.9:1.0]' or 'wikitext:wikitext-2-raw-v1:test[:0.5]'.

        The optional '[start:end]' suffix holds character fractions; an empty side means 0 or 1.
        """
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"data spec {text!r} is empty: give a file, a folder or a hub id, "
                            "optionally with a slice such as '[0.9:1.0]'")
        text = text.strip()
        match = _SLICE_RE.match(text)
        if match is None:
            if "[" in text and not os.path.exists(os.path.expanduser(text)):
                raise DataError(f"data slice in '{text}' is malformed: write [start:end] with fractions "
                                "after the source, e.g. 'book.txt[0.9:1]' for the last 10%")
            return cls(text, text_column)
        start = _parse_fraction(match["start"], 0.0, text)
        end = _parse_fraction(match["end"], 1.0, text)
        return cls(match["source"].strip(), text_column, start, end)

    def describe(self) -> dict:
        """JSON-able provenance of the data."""
        return {"source": self.source, "text_column": self.text_column, "start": self.start, "end": self.end}

    def label(self) -> str:
        """The spec as the CLI takes it: 'book.txt', 'book.txt[0.9:1]', plus '(column c)' when not 'text'."""
        text = self.source
        if (self.start, self.end) != (0.0, 1.0):
            text += f"[{self.start:g}:{self.end:g}]"
        return text if self.text_column == "text" else f"{text} (column {self.text_column})"

    @classmethod
    def label_of(cls, described) -> str:
        """`label()` of a `describe()` dict read back from a manifest; other values as they are."""
        if isinstance(described, dict) and "source" in described:
            try:
                return cls(**{key: described[key] for key in ("source", "text_column", "start", "end") if key in described}).label()
            except (DataError, TypeError):
                pass
        return str(described)

    def is_local(self) -> bool:
        """True if the source is a local file or folder (existing or written like a path)."""
        source = os.path.expanduser(self.source)
        return (os.path.exists(source) or self.source.startswith(_PATH_PREFIXES)
                or Path(source).suffix.lower() in BUILDERS)

    def hub_parts(self) -> tuple[str, str | None, str]:
        """Split a hub id "name[:config[:split]]" into (name, config or None, split)."""
        parts = self.source.split(":")
        if len(parts) > 3 or not parts[0].strip():
            raise DataError(f"hub id '{self.source}' is malformed: write it as name[:config[:split]], "
                            "e.g. 'wikitext:wikitext-2-raw-v1:test'")
        parts += [""] * (3 - len(parts))
        name, config, split = (part.strip() for part in parts)
        return name, config or None, split or "train"


def _parse_fraction(text: str, default: float, spec: str) -> float:
    """One side of a '[start:end]' slice: a float, or `default` when empty."""
    if not text.strip():
        return default
    try:
        return float(text)
    except ValueError:
        raise DataError(f"data slice '{text}' in '{spec}' is not a number: "
                        "write fractions such as '[0.9:1.0]'") from None


def check_source(spec: DataSpec) -> None:
    """Cheap checks before any model loads: a local path exists, has a supported type and is not empty.

    Hub ids are only checked for their form (reading them needs the network).
    """
    if not spec.is_local():
        spec.hub_parts()
        return
    path = Path(os.path.expanduser(spec.source))
    if not path.exists():
        raise DataError(f"data path '{spec.source}' does not exist: check the path "
                        f"(supported: a {'/'.join(BUILDERS)} file, a folder of them, or a hub id)")
    files = [path] if not path.is_dir() else [
        p for p in path.iterdir() if p.is_file() and p.suffix.lower() in BUILDERS and not p.name.startswith(".")]
    if not files:
        raise DataError(f"data folder '{spec.source}' holds no {'/'.join(BUILDERS)} files: add some or point at a file")
    for file in files:
        if file.suffix.lower() not in BUILDERS:
            raise DataError(f"data file '{file}' has unsupported extension '{file.suffix}': "
                            f"use one of {', '.join(BUILDERS)} (or a folder of them)")
    if all(file.stat().st_size == 0 for file in files):
        raise DataError(f"data '{spec.source}' is empty (0 bytes): give a file with text")


def load_text(spec: DataSpec) -> str:
    """All texts of the source joined with '\\n\\n', sliced to characters [start, end) of the whole."""
    if spec.is_local():
        texts = _local_texts(spec)
    else:
        texts = _hub_texts(spec)
    full = DOC_SEPARATOR.join(texts)
    n = len(full)
    text = full[round(spec.start * n):round(spec.end * n)]
    if not text.strip():
        raise DataError(f"data '{spec.source}' slice [{spec.start}:{spec.end}] holds no text "
                        f"({n} characters in all): give a file with text or a wider slice")
    return text


def _local_texts(spec: DataSpec) -> list[str]:
    """Texts of a local file, or of every supported file of a local folder in name order."""
    path = Path(os.path.expanduser(spec.source))
    if not path.exists():
        raise DataError(f"data path '{spec.source}' does not exist: check the path "
                        f"(supported: a {'/'.join(BUILDERS)} file, a folder of them, or a hub id)")
    if not path.is_dir():
        return _file_texts(path, spec.text_column)
    files = sorted(p for p in path.iterdir()
                   if p.is_file() and p.suffix.lower() in BUILDERS and not p.name.startswith("."))
    if not files:
        raise DataError(f"data folder '{spec.source}' holds no {'/'.join(BUILDERS)} files: "
                        "add some or point at a file")
    return [text for file in files for text in _file_texts(file, spec.text_column)]


def _file_texts(path: Path, text_column: str) -> list[str]:
    """Texts of one local file, read with the datasets builder for its extension."""
    import datasets

    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"data file '{path}' has unsupported extension '{path.suffix}': "
                        f"use one of {', '.join(BUILDERS)} (or a folder of them)")
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        with quiet_progress_bars():
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception as exc:  # datasets raises many kinds (even a bare StopIteration for an empty .jsonl)
        raise DataError(f"data file '{path}' could not be read by datasets' '{builder}' loader "
                        f"({type(exc).__name__}: {exc}): "
                        f"check that it is a valid, non-empty {path.suffix} file") from exc
    column = "text" if builder == "text" else text_column
    return _column_texts(dataset, column, f"data file '{path}'")


def _hub_texts(spec: DataSpec) -> list[str]:
    """Texts of a hub dataset split; needs network access or a local datasets cache."""
    import datasets

    name, config, split = spec.hub_parts()
    try:
        with quiet_progress_bars():
            dataset = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, not found, bad config or split, ...
        raise DataError(f"hub dataset '{spec.source}' (name={name!r}, config={config!r}, split={split!r}) "
                        f"could not be loaded ({type(exc).__name__}: {exc}): hub ids need network access "
                        "or a local datasets cache; otherwise download the text and give a local file "
                        "(if you meant a local file, check its path)") from exc
    return _column_texts(dataset, spec.text_column, f"hub dataset '{spec.source}'")


def _column_texts(dataset, column: str, where: str) -> list[str]:
    """The non-empty strings of `column` of a datasets.Dataset; DataError naming the columns if absent."""
    if column not in dataset.column_names:
        columns = ", ".join(dataset.column_names)
        raise DataError(f"{where} has no text column '{column}' (columns: {columns}): "
                        "pass the right column name (--text-column)")
    values = dataset.select_columns([column])[:][column]
    bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
    if bad is not None:
        raise DataError(f"{where} column '{column}' holds {type(bad).__name__} values, not text: "
                        "pass a column of strings (--text-column)")
    return [v for v in values if v]


def count_tokens(tokenizer, spec: DataSpec) -> int:
    """Number of tokens of load_text(spec), without special tokens."""
    return int(_token_ids(tokenizer, spec).numel())


def _token_ids(tokenizer, spec: DataSpec) -> torch.Tensor:
    """Token ids of load_text(spec) without special tokens, shape (n_tokens,).

    Cached per (spec, tokenizer name_or_path); tokenizers without a name_or_path are not cached.
    """
    import torch

    name = getattr(tokenizer, "name_or_path", "") or ""
    key = (spec, name)
    if name and key in _TOKEN_CACHE:
        return _TOKEN_CACHE[key]
    ids = tokenizer(load_text(spec), add_special_tokens=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)  # (n_tokens,)
    if name:
        if len(_TOKEN_CACHE) >= _TOKEN_CACHE_MAX:
            _TOKEN_CACHE.pop(next(iter(_TOKEN_CACHE)))  # drop the oldest entry
        _TOKEN_CACHE[key] = ids
    return ids


def _default_bos(tokenizer) -> int | None:
    """The BOS id if the tokenizer has one and puts it first by default, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def token_windows(tokenizer, spec: DataSpec, *, samples: int, seq_len: int, seed: int = 0,
                  mode: str = "random") -> torch.LongTensor:
    """`samples` windows of `seq_len` token ids cut from load_text(spec). Shape (samples, seq_len).

    If the tokenizer adds a BOS by default, each window is BOS + seq_len-1 text tokens.
    mode='random': window starts drawn with torch.Generator().manual_seed(seed) (windows may overlap).
    mode='sequential': consecutive non-overlapping windows from the start; fewer than `samples`
    rows (at least 1) when the text is too short for all of them.
    """
    import torch

    _check_window_args(samples, seq_len, mode)
    ids = _token_ids(tokenizer, spec)  # (n_tokens,)
    bos = _default_bos(tokenizer)
    body = seq_len - 1 if bos is not None else seq_len
    n = ids.numel()
    if n < body:
        raise DataError(f"data '{spec.source}' slice [{spec.start}:{spec.end}] holds {n} tokens; "
                        f"seq_len {seq_len} needs at least {body}: "
                        "give more text, a wider slice or lower seq_len")
    if mode == "random":
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, n - body + 1, (samples,), generator=generator)  # (samples,)
    else:
        starts = torch.arange(min(samples, n // body)) * body  # (rows,)
    windows = ids[starts[:, None] + torch.arange(body)]  # (rows, body)
    if bos is not None:
        windows = torch.cat([torch.full((windows.shape[0], 1), bos, dtype=torch.long), windows], dim=1)
    return windows  # (rows, seq_len)


def _check_window_args(samples: int, seq_len: int, mode: str) -> None:
    """DataError unless samples >= 1, seq_len >= 2 and mode is known."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise DataError(f"samples={samples!r} is invalid: need a whole number >= 1")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"seq_len={seq_len!r} is invalid: need a whole number >= 2")
    if mode not in MODES:
        raise DataError(f"window mode {mode!r} is unknown: use one of {', '.join(MODES)}")
