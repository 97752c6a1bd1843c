"""A tiny induction ("copy") model for retrieval checks, built and trained in seconds on a CPU.

Retrieval tests need a model that really looks far back: given ``... A B C ... A B`` it
must answer ``C``. Small LMs trained on text (kvref-5m) never learned that. This module
makes a 2-layer Llama (hidden 128, 4 query / 2 KV heads, head_dim 32, rope_theta 1e8,
2048 positions) that does: `kvtool.eval.copy_circuit` writes in a previous-token head
(layer 0) and an induction head (layer 1), Olsson et al. 2022, then AdamW trains all
weights on copy sequences. (From random weights the same model stays on the loss plateau,
ln 64, for the first several hundred steps; circuits that formed after ~1000 steps at
short lengths did not carry over to 256+ tokens: far beyond a test's budget.)

Vocabulary (`CopyVocab`, also written to ``config.json`` as ``copy_vocab``):

    0 = BOS, 1 = EOS, 2 = PAD, 3 = unused
    4 .. 63   filler tokens (the "text" a needle hides in)
    64 .. 127 needle tokens (the "digits"; never used as filler)

Needle tokens never occur in filler and a needle holds no token twice, so matching on one
previous token is unambiguous: a model that answers wrong has lost the needle, it was not
misled by a look-alike. Training sequences: BOS, then ``pairs`` blocks of random needle
tokens, each followed by its copy after random filler (from no gap to most of the
sequence); the loss is on each copy from its second token on (the predictable tokens).
`copy_losses` measures the same on held-out blocks: far lower on the copy than on the
original is what "it copies" means.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from kvtool.errors import RuntimeConfigError
from kvtool.eval.copy_circuit import plant_induction_circuit


@dataclass(frozen=True)
class CopyVocab:
    """Token id layout of copy prompts: BOS, filler ids [filler_lo, filler_hi), needle ids [needle_lo, needle_hi)."""

    bos: int | None = 0
    filler_lo: int = 4
    filler_hi: int = 64
    needle_lo: int = 64
    needle_hi: int = 128

    def __post_init__(self) -> None:
        if not (0 <= self.filler_lo < self.filler_hi and 0 <= self.needle_lo < self.needle_hi):
            raise RuntimeConfigError(f"copy vocabulary {self} has an empty filler or needle range")

    @property
    def needle_size(self) -> int:
        return self.needle_hi - self.needle_lo

    @classmethod
    def for_config(cls, config) -> "CopyVocab":
        """The layout saved by `save_copy_model`; for any other model, filler and needles share the vocabulary."""
        saved = getattr(config, "copy_vocab", None)
        if isinstance(saved, dict):
            return cls(**saved)
        specials = [i for i in (config.bos_token_id, config.eos_token_id, config.pad_token_id) if isinstance(i, int)]
        lo = max(specials, default=-1) + 1
        bos = config.bos_token_id if isinstance(config.bos_token_id, int) else None
        return cls(bos=bos, filler_lo=lo, filler_hi=config.vocab_size, needle_lo=lo, needle_hi=config.vocab_size)


@dataclass(frozen=True)
class CopyTraining:
    """Training settings. ``planted``: start from the induction circuit (else from random weights)."""

    steps: int = 30
    batch: int = 8
    seq_len: int = 256
    pairs: int = 3
    block_min: int = 8
    block_max: int = 16
    lr: float = 3e-4
    seed: int = 0
    planted: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.pairs < 1 or not 2 <= self.block_min <= self.block_max:
            raise RuntimeConfigError(f"copy training settings {self} are invalid: "
                                     "need steps, batch, pairs >= 1 and 2 <= block_min <= block_max")
        if 1 + 2 * self.pairs * self.block_max > self.seq_len:
            raise RuntimeConfigError(f"seq_len {self.seq_len} cannot hold {self.pairs} pairs of {self.block_max}-token blocks: "
                                     "raise seq_len or lower pairs / block_max")
        if self.pairs * self.block_max > CopyVocab().needle_size:
            raise RuntimeConfigError(f"{self.pairs} blocks of {self.block_max} distinct needle ids exceed the "
                                     f"{CopyVocab().needle_size} needle ids: lower pairs or block_max")


def copy_config(vocab: CopyVocab = CopyVocab(), max_positions: int = 2048) -> LlamaConfig:
    """2 layers, hidden 128, 4 query heads, 2 KV heads (GQA), head_dim 32, vocab 128, rope_theta 1e8."""
    return LlamaConfig(
        vocab_size=vocab.needle_hi, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_positions,
        rope_theta=1e8, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        copy_vocab=asdict(vocab),
    )


def _training_sequence(cfg: CopyTraining, vocab: CopyVocab, block: int, gen: torch.Generator):
    """One sequence (seq_len,) and its loss mask (seq_len,) bool: True where the token is a predictable copy.

    Layout: BOS, then per pair [filler][block][filler][block], then filler to the end. The filler is split
    among pairs at random cuts; the gap between a block and its copy is a uniform share of its pair's
    filler, and zero for a fifth of the pairs (a copy right after its original, as at depth 1).
    """
    blocks = (torch.randperm(vocab.needle_size, generator=gen)[: cfg.pairs * block] + vocab.needle_lo).view(cfg.pairs, block)
    filler_total = cfg.seq_len - 1 - 2 * cfg.pairs * block
    cuts = torch.randint(0, filler_total + 1, (cfg.pairs,), generator=gen).sort().values
    shares = torch.diff(cuts, prepend=torch.tensor([0]))  # (pairs,) filler of each pair; the rest trails
    split = torch.rand(cfg.pairs, generator=gen) * (torch.rand(cfg.pairs, generator=gen) >= 0.2)  # (pairs,)
    gaps = (split * shares).long()  # (pairs,) filler between a block and its copy
    filler = torch.randint(vocab.filler_lo, vocab.filler_hi, (filler_total,), generator=gen)
    copy_mask = torch.ones(block, dtype=torch.bool)
    copy_mask[0] = False  # the first token of a copy cannot be predicted
    ids, mask, used = [torch.tensor([vocab.bos])], [torch.tensor([False])], 0
    for pair in range(cfg.pairs):
        lead = int(shares[pair] - gaps[pair])
        parts = [filler[used : used + lead], blocks[pair], filler[used + lead : used + int(shares[pair])], blocks[pair]]
        ids += parts
        mask += [torch.zeros(len(parts[0]) + block + len(parts[2]), dtype=torch.bool), copy_mask]
        used += int(shares[pair])
    ids.append(filler[used:])
    mask.append(torch.zeros(filler_total - used, dtype=torch.bool))
    return torch.cat(ids), torch.cat(mask)


def training_batch(cfg: CopyTraining, vocab: CopyVocab, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (batch, seq_len), loss mask (batch, seq_len)); one block length per batch."""
    block = int(torch.randint(cfg.block_min, cfg.block_max + 1, (1,), generator=gen))
    rows = [_training_sequence(cfg, vocab, block, gen) for _ in range(cfg.batch)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def copy_loss(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the masked tokens of ids (B, T) given everything before them."""
    logits = model(input_ids=ids[:, :-1]).logits  # (B, T-1, V)
    targets = ids[:, 1:].masked_fill(~mask[:, 1:], -100)  # (B, T-1)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def train_copy_model(seed: int = 0, steps: int = 30, *, settings: CopyTraining | None = None, log=None) -> LlamaForCausalLM:
    """The copy model: a fresh `copy_config` Llama, the circuit planted, then ``steps`` AdamW steps.

    Seeded (torch.manual_seed and a torch.Generator); float32 on the CPU, returned in eval mode.
    ``settings`` sets everything else (seed and steps come from the arguments); ``log`` gets
    a progress line every 20 steps.
    """
    cfg = dataclasses.replace(settings or CopyTraining(), seed=seed, steps=steps)
    vocab = CopyVocab()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = LlamaForCausalLM(copy_config(vocab))
    if cfg.planted:
        plant_induction_circuit(model, gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(_free_cores())
    try:
        _train(model, cfg, vocab, gen, log)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _free_cores() -> int:
    """Cores this process may use minus the 1-minute load, at least 1.

    Threads beyond the idle cores stall each other: 30 steps took 61 s with 2 threads and
    5 s with 1 on a 2-core machine busy with other work.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(cores, cores - busy))


def _train(model, cfg: CopyTraining, vocab: CopyVocab, gen: torch.Generator, log) -> None:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    start = time.perf_counter()
    for step in range(cfg.steps):
        ids, mask = training_batch(cfg, vocab, gen)
        loss = copy_loss(model, ids, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if log is not None and (step % 20 == 0 or step == cfg.steps - 1):
            log(f"step {step} copy loss {loss.item():.4f} ({time.perf_counter() - start:.1f} s)")


def copy_losses(model, *, samples: int = 8, seq_len: int = 256, block: int = 16, seed: int = 12345) -> tuple[float, float]:
    """Mean loss (nats/token) of held-out blocks' tokens 2.. at their first occurrence and in their copy.

    Each sequence: BOS, filler, a block of distinct needle ids, filler, the block again, filler
    (random places; ``seed`` is not one training uses).
    """
    vocab, gen = CopyVocab.for_config(model.config), torch.Generator().manual_seed(seed)
    free = seq_len - 1 - 2 * block
    ids = torch.randint(vocab.filler_lo, vocab.filler_hi, (samples, seq_len), generator=gen)  # (S, T)
    ids[:, 0] = vocab.bos
    first, second = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids, dtype=torch.bool)
    for row in range(samples):
        lead, gap = sorted(torch.randint(0, free + 1, (2,), generator=gen).tolist())
        starts = (1 + lead, 1 + gap + block)  # the copy starts after the block and (gap - lead) filler
        needle = torch.randperm(vocab.needle_size, generator=gen)[:block] + vocab.needle_lo  # (block,)
        for start, mask in zip(starts, (first, second)):
            ids[row, start : start + block] = needle
            mask[row, start + 1 : start + block] = True
    with torch.no_grad():
        return copy_loss(model, ids, first).item(), copy_loss(model, ids, second).item()


def save_copy_model(model: LlamaForCausalLM, path: str | Path) -> Path:
    """save_pretrained to a folder (config.json with ``copy_vocab``, model.safetensors; no tokenizer)."""
    from kvtool.quiet import quiet_progress_bars

    path = Path(path)
    with quiet_progress_bars():
        model.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m kvtool.eval.copy_model OUT``: build, train and save the copy model (seconds on a CPU)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvtool.eval.copy_model",
                                     description="Build the copy (induction) model for `kvtool eval retrieval --task copy`.")
    parser.add_argument("out", type=Path, help="folder to write (config.json + model.safetensors)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30, help="AdamW steps after planting the circuit")
    args = parser.parse_args(argv)
    model = train_copy_model(seed=args.seed, steps=args.steps)
    first, copy = copy_losses(model)
    save_copy_model(model, args.out)
    print(f"wrote {args.out}: copy loss {copy:.3f} nats/token on held-out needles (first occurrence {first:.3f})")


if __name__ == "__main__":
    main()
