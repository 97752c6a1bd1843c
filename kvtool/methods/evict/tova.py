"""TOVA (Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024): token omission via attention.

At every step the cache is over budget, drop the tokens that received the least attention
from the *current* query, with no memory of earlier steps (unlike H2O's accumulated sum).
At prefill the "current" queries are the last ``window`` prompt tokens (the paper uses the
last one: set ``window: 1`` for the exact rule); while decoding it is the one new query.
Scores are per KV head, summed over the group's query heads (the paper averages over all
heads of a layer; per-head sets keep the runtime's per-stream budgets exact). Sinks and the
recent window stay protected as for every policy.
"""

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


@register_policy("tova")
class TOVA(EvictionPolicy):
    def token_scores(self, view: StreamView):
        return view.current_attention if view.current_attention is not None else view.attention  # (S, N)
