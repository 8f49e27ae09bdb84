"""``tp_sp``: Megatron tensor + sequence parallelism (the paper's MegatronTS).

Forward: all-gather the sequence, column-parallel QKV, attention on this rank's heads over
the whole sequence, row-parallel projection, reduce-scatter; the same for the MLP.
Backward: megatron's own ``LinearWithGradAccumulationAndAsyncCommunication`` re-gathers the
input, reduce-scatters the input gradient and computes the shard's weight gradient. The
linears are megatron-core's, unchanged; only the attention kernel differs from megatron's
local spec: torch's ``scaled_dot_product_attention`` (flash), so that attention memory is
linear in s as with Transformer Engine. The MLP is megatron's own forward.
With context parallelism, attention also covers the other CP ranks' keys by a K/V ring over
the CP group (``ring.sequence_attention``). Memory: the stock shard only; full-sequence activations of width h/p, one gathered
``[s, b, h]`` input per linear.
"""
from __future__ import annotations

from .. import context
from .base import Strategy, apply_rope, from_bhsd, geometry, rope_freqs, stock_forward, to_bhsd
from .ring import sequence_attention


class TPSP(Strategy):
    name = "tp_sp"
    description = "Megatron TP+SP: all-gather / reduce-scatter of activations, weights stay put"

    def attention(self, attn, hidden_states, rotary_pos_emb, docs=None):
        geo = geometry(attn)
        q, k, v = attn.get_query_key_value_tensors(hidden_states)
        qf, kf = rope_freqs(rotary_pos_emb)
        cp = context.cp_of(attn.config)
        pos = context.rope_positions(cp, docs, [(0, q.shape[0])], q.device)
        q, k = apply_rope(q, qf, attn.config, pos), apply_rope(k, kf, attn.config, pos)
        ctx = sequence_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), geo.scale, docs, cp)
        return attn.linear_proj(from_bhsd(ctx))

    def mlp(self, mlp, hidden_states):
        return stock_forward(mlp, hidden_states)
