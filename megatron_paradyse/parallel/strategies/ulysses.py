"""``ulysses``: DeepSpeed-Ulysses with ZeRO-3-style weights (the paper's UlyssesZ).

Forward: QKV for this rank's tokens and all heads with the weight gathered just in time;
RoPE at the tokens' global positions; all-to-all from sequence-sharded to head-sharded;
causal attention over the whole sequence for ``heads/p`` heads; all-to-all back; output
projection with the gathered weight. MLP: both weights gathered just in time.
Backward: the all-to-alls' adjoints are all-to-alls; each linear re-gathers its weight and
reduce-scatters the weight gradient to the owner (see ``zero3.py``).
With fewer KV heads than ranks, each KV head is replicated to the ranks whose query heads
read it, and its gradient summed back.
With context parallelism, attention also covers the other CP ranks' keys by a K/V ring over
the CP group (``ring.sequence_attention``). Memory: full-width activations of local tokens (``[s/p, b, 3h]``), one gathered weight
at a time (the largest is fc1's), attention over ``s`` for ``heads/p`` heads.
"""
from __future__ import annotations

from megatron.core.tensor_parallel.mappings import all_to_all_hp2sp, all_to_all_sp2hp

from .. import context
from . import zero3
from .base import Strategy, geometry, to_bhsd, zero_support
from .ring import sequence_attention


def seq_to_head(x, group):
    """``[s/p, b, heads, d]`` (all heads, local tokens) to ``[s, b, heads/p, d]`` (megatron's all-to-all)."""
    sl, b, n, d = x.shape
    p = group.size()
    return all_to_all_sp2hp(x.reshape(sl, b, n * d), group=group).view(sl * p, b, n // p, d)


def head_to_seq(x, group):
    """``[s, b, heads/p, d]`` to ``[s/p, b, heads*d]``, the inverse of :func:`seq_to_head`."""
    s, b, n, d = x.shape
    p = group.size()
    return all_to_all_hp2sp(x.reshape(s, b, n * d), group=group).view(s // p, b, p * n * d)


class Ulysses(Strategy):
    name = "ulysses"
    description = "DeepSpeed-Ulysses all-to-all attention, ZeRO-3 weights gathered just in time"
    zero_weights = True

    def supports(self, config, p):
        ok, why = zero_support(config, p)
        if not ok:
            return ok, why
        groups = config.num_query_groups or config.num_attention_heads
        if config.num_attention_heads % p:
            return False, f"num_attention_heads ({config.num_attention_heads}) must be divisible by p ({p})"
        if groups % p and p % groups:
            return False, f"num_query_groups ({groups}) must divide or be divisible by p ({p})"
        return True, ""

    def attention(self, attn, hidden_states, rotary_pos_emb, docs=None):
        geo = geometry(attn)
        sl = hidden_states.shape[0]
        cp = context.cp_of(attn.config)
        pos = context.rope_positions(cp, docs, [(geo.rank * sl, (geo.rank + 1) * sl)], hidden_states.device)
        q, k, v = zero3.qkv_local_tokens(attn, hidden_states, rotary_pos_emb, geo, pos)
        if geo.groups < geo.p:
            rep = geo.p // geo.groups
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (seq_to_head(t, geo.group) for t in (q, k, v))
        ctx = sequence_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), geo.scale, docs, cp)
        ctx = head_to_seq(ctx.permute(2, 0, 1, 3), geo.group)
        return zero3.row(attn, "linear_proj", ctx, geo.group)

    def mlp(self, mlp, hidden_states):
        return zero3.mlp(mlp, hidden_states)
