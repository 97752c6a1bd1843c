"""KNorm (Devoto et al., 2024): keys with a low L2 norm draw attention; keep the lowest norms.

RoPE is a rotation, so the norm of a stored post-RoPE key equals its pre-RoPE norm.
"""

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


@register_policy("knorm")
class KNorm(EvictionPolicy):
    uses_keys = True
    uses_attention = False

    def token_scores(self, view: StreamView):
        return -view.keys.float().norm(dim=-1)  # (n,): lower norm = better
