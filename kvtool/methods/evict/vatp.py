"""VATP (Guo et al., 2024, "Attention Score is not All You Need"): accumulated attention x value L1 norm."""

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


@register_policy("vatp")
class VATP(EvictionPolicy):
    uses_feature = True
    attention_from = ("all",)  # never the window's sums

    def token_feature(self, keys, values):
        return values.abs().sum(dim=-1)  # (S, t): the value's L1 norm, fixed once the token exists

    def token_scores(self, view: StreamView):
        return view.attention * view.feature
