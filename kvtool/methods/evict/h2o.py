"""H2O (Zhang et al., NeurIPS 2023): heavy hitters by accumulated attention plus a recent window."""

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


@register_policy("h2o")
class H2O(EvictionPolicy):
    """Score = attention a token has received from every query so far (the group's query heads summed)."""

    attention_from = ("all",)  # never the window's sums

    def token_scores(self, view: StreamView):
        return view.attention
