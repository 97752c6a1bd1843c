"""KNorm (Devoto et al., 2024): keys with a low L2 norm draw attention; keep the lowest norms.

RoPE is a rotation, so the norm of a post-RoPE key equals its pre-RoPE norm; it is computed
once, when the token arrives, and kept beside the token (no key is decoded to score it).
"""

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


@register_policy("knorm")
class KNorm(EvictionPolicy):
    uses_feature = True
    uses_attention = False

    def token_feature(self, keys, values):
        return keys.norm(dim=-1)  # (S, t)

    def token_scores(self, view: StreamView):
        return -view.feature  # lower norm = better
