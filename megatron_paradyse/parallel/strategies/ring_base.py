"""The base of the ring strategies (``ring``, ``colossal``): attention through a causal ring
from local tokens in the balanced layout, with ZeRO-3-style weights (``zero3.py``)."""
from __future__ import annotations

from .. import zigzag
from .base import Strategy, from_bhsd, geometry, to_bhsd, zero_support
from .zero3 import mlp, qkv_local_tokens, row


class RingStrategy(Strategy):
    """A strategy that attends through a causal ring from local tokens: QKV and output
    projection with gathered weights, the ZeRO MLP, and a ring attention core that
    subclasses provide. The layer's tokens are re-laid out to the balanced (zig-zag) split
    after the layer input and back after the output projection (``zigzag.py``)."""

    def supports(self, config, p):
        return zero_support(config, p)

    def core(self, q, k, v, geo, layout):
        """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` holding ``layout``'s tokens of
        this rank, to the causal output like ``q``."""
        raise NotImplementedError

    def attention(self, attn, hidden_states, rotary_pos_emb):
        geo = geometry(attn)
        layout = zigzag.layout_for(hidden_states, geo.group)
        x = zigzag.to_balanced(hidden_states, layout, geo.group)
        q, k, v = qkv_local_tokens(attn, x, rotary_pos_emb, geo, layout.ranges(geo.rank))
        ctx = self.core(to_bhsd(q), to_bhsd(k).contiguous(), to_bhsd(v).contiguous(), geo, layout)
        y, bias = row(attn.linear_proj, from_bhsd(ctx), geo.group)
        return zigzag.from_balanced(y, layout, geo.group), bias

    def mlp(self, mlp_module, hidden_states):
        return mlp(mlp_module, hidden_states)
