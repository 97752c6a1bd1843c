"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks plus a recent window; score = recency."""

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


@register_policy("streamingllm")
class StreamingLLM(EvictionPolicy):
    """Keep the first ``sink_tokens`` and the most recent tokens that fit the budget."""

    uses_attention = False

    def token_scores(self, view: StreamView):
        return view.positions.float()  # newer = better
