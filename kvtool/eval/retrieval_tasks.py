"""Retrieval prompts: a fact hidden at depth d of an n-token context, asked for at the end.

Two tasks build the same thing, a batch of equal-length prompts (one per seed) plus a way to
score the greedy continuation:

* `PasskeyTask` (text models): held-out filler text with "The pass key is 48213. Remember
  it. 48213 is the pass key." inserted at the sentence boundary nearest to depth d, ending
  in a new line "What is the pass key? The pass key is"; exact match of the first number
  generated. With ``facts=k`` the context holds k such facts for different names (Alice,
  Bob, ...), the asked one at depth d and the others at random depths.
* `CopyTask` (token-id models such as `kvtool.eval.copy_model`): BOS + random filler ids
  with a needle of random ids at depth d; the prompt ends with the needle's first half and
  the model must generate the second half; exact match of every token.

Depth d is the fraction of the filler before the fact: 0 = right after BOS, 1 = right
before the question. Prompts of one (n, d) cell are exactly n tokens for every seed (the
filler is cut to fit), so a cell runs as one batch without padding. Seed s draws the same
key(s) or needle in every cell of the grid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from kvtool.errors import RuntimeConfigError
from kvtool.eval.copy_model import CopyVocab

NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi")
_SENTENCE_END = re.compile(r"[.!?\n][\"')\]]*\s*$")


def _depth_index(depth: float, free: int) -> int:
    return round(depth * free)


@dataclass(frozen=True)
class CopyTask:
    """Needle of ``needle_tokens`` random needle ids in filler ids; the prompt ends with its first half."""

    vocab: CopyVocab
    needle_tokens: int = 16

    def __post_init__(self) -> None:
        if not 2 <= self.needle_tokens <= self.vocab.needle_size:
            raise RuntimeConfigError(
                f"copy needle of {self.needle_tokens} tokens does not fit the model's "
                f"{self.vocab.needle_size} needle ids: use 2 .. {self.vocab.needle_size} tokens"
            )

    @property
    def query_tokens(self) -> int:
        return self.needle_tokens // 2

    @property
    def new_tokens(self) -> int:
        return self.needle_tokens - self.query_tokens

    def min_length(self) -> int:
        return int(self.vocab.bos is not None) + self.needle_tokens + self.query_tokens

    def cases(self, n: int, depth: float, seeds: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompts (S, n), answers (S, new_tokens)) for seeds 0 .. S-1."""
        if n < self.min_length():
            raise RuntimeConfigError(f"context length {n} cannot hold BOS, the {self.needle_tokens}-token needle and "
                                     f"its {self.query_tokens}-token query: use --lengths >= {self.min_length()}")
        prompts, answers = zip(*(self._case(n, depth, seed) for seed in range(seeds)))
        return torch.stack(prompts), torch.stack(answers)

    def _case(self, n: int, depth: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        v, gen = self.vocab, torch.Generator().manual_seed(seed)
        # distinct ids, so the needle's continuation is unambiguous
        needle = torch.randperm(v.needle_size, generator=gen)[: self.needle_tokens] + v.needle_lo  # (N,)
        free = n - self.min_length()
        filler = torch.randint(v.filler_lo, v.filler_hi, (free,), generator=gen)  # (free,)
        at = _depth_index(depth, free)
        bos = torch.tensor([v.bos] if v.bos is not None else [], dtype=torch.long)
        prompt = torch.cat([bos, filler[:at], needle, filler[at:], needle[: self.query_tokens]])  # (n,)
        return prompt, needle[self.query_tokens :]

    def question_tokens(self, n: int, seeds: int) -> int:
        """Tokens at the end of every prompt that form the question (the needle's first half)."""
        return self.query_tokens

    @staticmethod
    def score(generated: torch.Tensor, answers: torch.Tensor) -> list[bool]:
        """Exact match per row of generated (S, <=new) against answers (S, new)."""
        if generated.shape[1] < answers.shape[1]:
            return [False] * answers.shape[0]
        return (generated[:, : answers.shape[1]] == answers).all(dim=1).tolist()

    def describe(self) -> dict:
        return {"needle_tokens": self.needle_tokens, "vocab": vars(self.vocab)}


@dataclass(frozen=True)
class _Fact:
    name: str | None
    key: str

    def sentence(self) -> str:
        who = "the pass key" if self.name is None else f"the pass key of {self.name}"
        return f" {who[0].upper()}{who[1:]} is {self.key}. Remember it. {self.key} is {who}."

    def question(self) -> str:
        """On a new line: the filler before it is cut to length and may end mid-sentence."""
        who = "the pass key" if self.name is None else f"the pass key of {self.name}"
        return f"\nWhat is {who}? {who[0].upper()}{who[1:]} is"


class PasskeyTask:
    """Pass key(s) in held-out text.

    tokenizer: the model's tokenizer. filler: ``filler(count, seed) -> ids (count,)``, a
    seeded window of held-out text token ids without special tokens.
    """

    def __init__(self, tokenizer, filler: Callable[[int, int], torch.Tensor], facts: int = 1) -> None:
        if not 1 <= facts <= len(NAMES):
            raise RuntimeConfigError(f"--facts {facts} is out of range: use 1 .. {len(NAMES)}")
        self.tokenizer, self.filler, self.facts = tokenizer, filler, facts
        self.prefix = _bos_prefix(tokenizer)
        self.new_tokens = len(self._encode(" 99999")) + 2  # the key, and room for a space or a split

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _facts(self, gen: torch.Generator) -> list[_Fact]:
        """The asked fact first; with facts=1 it has no name."""
        keys = torch.randint(10000, 100000, (self.facts,), generator=gen).tolist()
        if self.facts == 1:
            return [_Fact(None, str(keys[0]))]
        names = [NAMES[i] for i in torch.randperm(len(NAMES), generator=gen)[: self.facts].tolist()]
        return [_Fact(name, str(key)) for name, key in zip(names, keys)]

    def cases(self, n: int, depth: float, seeds: int) -> tuple[torch.Tensor, list[str]]:
        """(prompts (S, n), answer keys) for seeds 0 .. S-1."""
        rows = [self._case(n, depth, seed) for seed in range(seeds)]
        return torch.stack([r[0] for r in rows]), [r[1] for r in rows]

    def _case(self, n: int, depth: float, seed: int) -> tuple[torch.Tensor, str]:
        gen = torch.Generator().manual_seed(seed)
        facts = self._facts(gen)
        sentences = [self._encode(f.sentence()) for f in facts]
        question = self._encode(facts[0].question())
        fixed = len(self.prefix) + sum(map(len, sentences)) + len(question)
        if n <= fixed:
            raise RuntimeConfigError(f"context length {n} cannot hold the {len(facts)} fact(s) and the question "
                                     f"({fixed} tokens): use --lengths above {fixed}")
        free = n - fixed
        filler = self.filler(free, seed)  # (free,)
        depths = [depth] + torch.rand(len(facts) - 1, generator=gen).tolist()
        boundaries = self._sentence_boundaries(filler)
        at = [min(boundaries, key=lambda b: (abs(b - _depth_index(d, free)), b)) for d in depths]
        pieces, last = [self.prefix], 0
        for cut, sentence in sorted(zip(at, sentences), key=lambda pair: pair[0]):  # stable: asked fact first on ties
            pieces += [filler[last:cut].tolist(), sentence]
            last = cut
        pieces += [filler[last:].tolist(), question]
        prompt = torch.tensor([t for piece in pieces for t in piece], dtype=torch.long)  # (n,)
        return prompt, facts[0].key

    def question_tokens(self, n: int, seeds: int) -> int:
        """The longest question among seeds 0 .. seeds-1 (tokens at the end of the prompt)."""
        return max(len(self._encode(self._facts(torch.Generator().manual_seed(seed))[0].question())) for seed in range(seeds))

    def _sentence_boundaries(self, filler: torch.Tensor) -> list[int]:
        """Token indices i where a fact may go before filler[i]: 0, the end, and after sentence ends."""
        pieces = self.tokenizer.convert_ids_to_tokens(filler.tolist())
        texts = [self.tokenizer.convert_tokens_to_string([p]) for p in pieces]
        ends = [i + 1 for i, text in enumerate(texts) if _SENTENCE_END.search(text)]
        return sorted({0, filler.numel(), *ends})

    def score(self, generated: torch.Tensor, answers: list[str]) -> list[bool]:
        """Exact match of the first number in each decoded continuation (S, new)."""
        texts = self.tokenizer.batch_decode(generated, skip_special_tokens=True)
        found = [re.search(r"\d+", text) for text in texts]
        return [m is not None and m.group() == key for m, key in zip(found, answers)]

    def describe(self) -> dict:
        return {"facts": self.facts}


def _bos_prefix(tokenizer) -> list[int]:
    """[BOS] if the tokenizer puts one first by default, else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a")["input_ids"]
    return [int(bos)] if bos is not None and ids and ids[0] == bos else []


def text_filler(tokenizer, spec) -> Callable[[int, int], torch.Tensor]:
    """``filler(count, seed)``: ``count`` token ids of a seeded random window of the text ``spec`` (a DataSpec)."""
    from kvtool.data import token_windows

    prefix = len(_bos_prefix(tokenizer))  # token_windows starts windows with BOS when the tokenizer adds one

    def filler(count: int, seed: int) -> torch.Tensor:
        window = token_windows(tokenizer, spec, samples=1, seq_len=max(2, count + prefix), seed=seed, mode="random")[0]
        return window[window.numel() - count :]  # (count,)

    return filler
