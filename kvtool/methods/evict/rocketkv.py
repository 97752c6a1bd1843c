"""RocketKV stage 1 (Behnam et al., 2025, "RocketKV: Accelerating Long-Context LLM Inference via Two-Stage KV
Cache Compression", arXiv 2502.14051): permanent eviction of the prompt, then no eviction while decoding.

Stage 1 is SnapKV++: each prompt token is scored by the attention of the last ``window`` prompt
queries, summed over the query heads of its KV head's GQA group (kvtool's streams are KV heads,
so a group keeps one set of tokens and no head is expanded), max-pooled over neighbouring
positions (``pooling``), and each stream keeps its ``budget`` best (sinks and the window always).
The paper then keeps every generated token (the cache grows by one token per step and is never
cut again while decoding); a later multi-token forward (a new chat turn) scores and evicts again.

Stage 2 (hybrid sparse attention: per-block key summaries, top-k blocks per decode step) is
the recipe's ``sparse_attention`` section (`kvtool.methods.sparse.rocketkv`): it saves reads,
not memory, and composes with this policy because this policy needs no attention while decoding.

Not done as in the paper: SnapKV++'s pooling kernel is the recipe's ``pooling`` (the paper adapts
it to the task; 63 in its code), and the paper splits one token budget between the two stages
(`get_params_for_token_budget`), where kvtool takes both from the recipe.
"""

from kvtool.methods.evict.base import register_policy
from kvtool.methods.evict.snapkv import SnapKV


@register_policy("rocketkv")
class RocketKV(SnapKV):
    """SnapKV's scores (`SnapKV.token_scores`); only multi-token forwards evict."""

    evicts_while_decoding = False  # the prompt is cut once; generated tokens stay
    attention_from = ("window",)  # it never scores while decoding, so the all-query sums would go unread
