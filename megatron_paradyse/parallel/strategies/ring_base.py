"""The base of the ring strategies (``ring``, ``colossal``): attention through a causal ring
from local tokens in the balanced layout, with ZeRO-3-style weights (``zero3.py``)."""
from __future__ import annotations

from .. import context, pack_layout, zigzag
from ..ring_comm import RingComm
from .base import Strategy, from_bhsd, geometry, to_bhsd, zero_support
from .zero3 import mlp, qkv_local_tokens, row


class RingStrategy(Strategy):
    """A strategy that attends through a causal ring from local tokens: QKV and output
    projection with gathered weights, the ZeRO MLP, and a ring attention core that
    subclasses provide. The layer's tokens are re-laid out to the balanced (zig-zag) split
    after the layer input and back after the output projection (``zigzag.py``). With context
parallelism the ring runs over TP inside CP (``ring_comm.TwoLevelRing``, ``context.py``)."""

    zero_weights = True

    def supports(self, config, p):
        return zero_support(config, p)

    def core(self, q, k, v, ring: RingComm, scale: float, layout):
        """``q [b, n, s/p, d]``, ``k``/``v`` ``[b, kv, s/p, d]`` holding ``layout``'s tokens of
        this rank (``ring``'s owner), to the causal output like ``q``."""
        raise NotImplementedError

    def attention(self, attn, hidden_states, rotary_pos_emb, docs=None):
        geo = geometry(attn)
        cp = context.cp_of(attn.config)
        layout = ring_layout(hidden_states, geo.group, docs, cp)
        x = arrange(hidden_states, layout, geo.group)
        span = context.ring_span(layout, geo.group, geo.rank, cp, docs, hidden_states.device)
        q, k, v = qkv_local_tokens(attn, x, rotary_pos_emb, geo, span.positions)
        ctx = self.core(to_bhsd(q), to_bhsd(k).contiguous(), to_bhsd(v).contiguous(), span.ring, geo.scale,
                        span.layout)
        y, bias = row(attn, "linear_proj", from_bhsd(ctx), geo.group)
        return restore(y, layout, geo.group), bias

    def mlp(self, mlp_module, hidden_states):
        return mlp(mlp_module, hidden_states)


def ring_layout(hidden_states, group, docs=None, cp=None):
    """The layer's in-node ring layout: the balanced zig-zag split of one sequence per row, or a
    pack's :class:`~..pack_layout.PackedLayout` (with CP: of this CP rank's local tokens)."""
    if docs is None:
        return zigzag.layout_for(hidden_states, group)
    if cp is None:
        return pack_layout.packed_layout(group.size(), docs)
    p = group.size()
    return context.inner_layout(p, cp.size, cp.rank, hidden_states.shape[0] * p, docs)


def arrange(x, layout, group):
    """Layer input ``[s/p, b, h]`` to ``layout``'s tokens of this rank (backward: the inverse)."""
    if layout.packed:
        return pack_layout.arrange(x, layout, group)
    return zigzag.to_balanced(x, layout, group)


def restore(y, layout, group):
    """``layout``'s tokens of this rank back to the contiguous ``[s/p, b, h]`` chunk."""
    if layout.packed:
        return pack_layout.restore(y, layout, group)
    return zigzag.from_balanced(y, layout, group)
