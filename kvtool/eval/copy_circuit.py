"""Write the two-head induction circuit (Olsson et al. 2022) into a fresh 2-layer Llama.

Trained from random weights, a 2-layer model sits on a loss plateau for thousands of steps
before induction heads form (the time grows with the square of the context length), far
beyond a test's budget on two CPU cores. `plant_induction_circuit` sets the weights of the
circuit directly; `kvtool.eval.copy_model` then trains all weights with AdamW.

Residual stream (hidden 128): channel 0 is a constant (a bias unit every embedding carries),
channels 1..16 the token's code, channels 17..32 the previous token's code, the rest zero.
Codes are ±1/4 vectors (unit norm, any two at |cos| <= 0.5).

* layer 0, head 0, a previous-token head: query and key read only the constant channel,
  shaped so that RoPE's 8 fastest pairs peak at distance 1; value/output copy the code of
  the attended (previous) token into channels 17..32.
* layer 1, head 0, the induction head: the query is the current token's code, the key the
  previous-token code of each position, both placed in the slowest RoPE pairs (head dims
  8..15 and 24..31; with rope_theta 1e8 they turn by < 0.2 rad over 2048 positions), so
  position s scores high where token[s-1] == token[t], at any distance; value/output add
  the attended token's code (times `OUTPUT_GAIN`) to the token channels, so the tied
  unembedding reads "the token after the earlier occurrence".

Other heads and the MLPs start silent (zero output projections).
"""

from __future__ import annotations

import math

import torch

CODE_DIMS = 16
TOKEN, PREVIOUS = slice(1, 1 + CODE_DIMS), slice(1 + CODE_DIMS, 1 + 2 * CODE_DIMS)
PREV_HEAD_PAIRS = tuple(range(8))  # the fast RoPE pairs; with fewer, far positions alias distance 1
PREV_HEAD_BETA = 14.0  # per-pair key length: >= 16 nats between distance 1 and any other up to 2048
MATCH_SCORE = 40.0  # induction score (after 1/sqrt(d) scaling) of a perfect code match
OUTPUT_GAIN = 8.0  # induction output vs the current token's own code in the residual
FINAL_NORM_GAIN = 4.0  # logit sharpness


def token_codes(vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """(vocab_size, CODE_DIMS) ±1/4 codes, pairwise |cos| <= 0.5, chosen greedily from random draws."""
    codes: list[torch.Tensor] = []
    while len(codes) < vocab_size:
        candidate = (torch.randint(0, 2, (CODE_DIMS,), generator=generator) * 2 - 1).float() / math.sqrt(CODE_DIMS)
        if all(abs(float(candidate @ c)) <= 0.5 for c in codes):
            codes.append(candidate)
    return torch.stack(codes)


def _rms_gain(active: int, hidden: int) -> float:
    """RMSNorm's factor for a residual made of ``active`` unit-norm parts (weight 1)."""
    return math.sqrt(hidden / active)


def _slow_dims(head_dim: int) -> torch.Tensor:
    """Head dims of the CODE_DIMS / 2 slowest RoPE pairs (pair i = dims i and i + head_dim / 2)."""
    half = head_dim // 2
    pairs = torch.arange(half - CODE_DIMS // 2, half)
    return torch.cat([pairs, pairs + half])  # (CODE_DIMS,)


@torch.no_grad()
def plant_induction_circuit(model, generator: torch.Generator) -> None:
    """Overwrite ``model``'s weights with the circuit above (a 2-layer Llama, hidden >= 33)."""
    config, inner = model.config, model.model
    hidden, d = config.hidden_size, config.head_dim
    if config.num_hidden_layers != 2 or hidden < 1 + 2 * CODE_DIMS or d != 2 * CODE_DIMS:
        raise ValueError(f"the induction circuit needs a 2-layer Llama with hidden >= {1 + 2 * CODE_DIMS} and head_dim {2 * CODE_DIMS}")
    embed = inner.embed_tokens.weight  # (V, hidden), tied to the LM head
    embed.zero_()
    embed[:, 0] = 1.0
    embed[:, TOKEN] = token_codes(config.vocab_size, generator)
    for layer in inner.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    _plant_previous_token_head(inner.layers[0].self_attn, inner.rotary_emb.inv_freq, hidden, d)
    _plant_induction_head(inner.layers[1].self_attn, hidden, d)
    inner.norm.weight.fill_(FINAL_NORM_GAIN)


def _plant_previous_token_head(attn, inv_freq: torch.Tensor, hidden: int, d: int) -> None:
    """Query head 0 / KV head 0 attend to the previous position and copy its code into PREVIOUS."""
    gain = _rms_gain(2, hidden)  # input: constant + token code
    half = d // 2
    attn.q_proj.weight[:d] = 0  # (d, hidden) rows of query head 0
    attn.k_proj.weight[:d] = 0
    for pair in PREV_HEAD_PAIRS:
        theta = float(inv_freq[pair])
        # key (beta, 0) on the pair; query = key turned back by one step, so q.R(s - t)k peaks at s = t - 1
        attn.k_proj.weight[pair, 0] = PREV_HEAD_BETA / gain
        attn.q_proj.weight[pair, 0] = PREV_HEAD_BETA * math.cos(theta) / gain
        attn.q_proj.weight[pair + half, 0] = -PREV_HEAD_BETA * math.sin(theta) / gain
    attn.v_proj.weight[:d] = 0
    attn.v_proj.weight[torch.arange(CODE_DIMS), torch.arange(TOKEN.start, TOKEN.stop)] = 1.0 / gain
    attn.o_proj.weight[torch.arange(PREVIOUS.start, PREVIOUS.stop), torch.arange(CODE_DIMS)] = 1.0


def _plant_induction_head(attn, hidden: int, d: int) -> None:
    """Query head 0 / KV head 0 match the current code against each position's previous-token code."""
    gain = _rms_gain(3, hidden)  # input: constant + token code + previous code
    slow = _slow_dims(d)
    scale = math.sqrt(MATCH_SCORE * math.sqrt(d)) / gain  # q.k / sqrt(d) = MATCH_SCORE for equal codes
    tokens, previous = torch.arange(TOKEN.start, TOKEN.stop), torch.arange(PREVIOUS.start, PREVIOUS.stop)
    for proj, source in ((attn.q_proj, tokens), (attn.k_proj, previous)):
        proj.weight[:d] = 0
        proj.weight[slow, source] = scale
    attn.v_proj.weight[:d] = 0
    attn.v_proj.weight[torch.arange(CODE_DIMS), tokens] = 1.0 / gain
    attn.o_proj.weight[tokens, torch.arange(CODE_DIMS)] = OUTPUT_GAIN
