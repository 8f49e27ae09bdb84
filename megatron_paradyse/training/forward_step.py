"""megatron's ``forward_step_func`` with ParaDySe: install the micro-batch's plan, run the stock forward."""
from __future__ import annotations

from functools import partial

import torch

from ..parallel.buffers import release_pool
from ..parallel import dynamic_cp
from ..parallel.context import split_for_cp
from ..parallel.dispatch import set_plan
from ..parallel.packing import attach_documents, to_device


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's per-token GPT loss: (sum of masked token losses, real tokens, report)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model, paradyse: bool = True, cp: int = 1):
    """megatron ``forward_step_func``: install this micro-batch's plan, then the stock forward.

    With ParaDySe the communication pool is released first (``parallel.buffers.release_pool``),
    so it holds the buffers of the micro-batch that runs, not of the longest one seen. That is
    safe with micro-batches in flight too (pipeline stages under 1F1B, where earlier
    micro-batches' backwards are still to come): a pooled buffer is only ever the target of the
    collective that fills it, and nothing a later backward reads (a saved activation, a gathered
    weight) is left in the pool; a backward allocates what it receives into again. A recompute
    replays its own forward's plan (``parallel/recompute.py``), and a pack's document boundaries
    travel with its own ``PackedSeqParams``: no other state is kept between micro-batches.

    With context parallelism (``cp`` > 1) this rank runs its CP chunks of the micro-batch
    (megatron's ``get_batch_on_this_cp_rank`` order; a pack's boundaries stay the whole pack's)
    and its loss is its chunks' sum: megatron's per-token loss sums tokens over DP x CP. Under
    Dynamic CP the micro-batch's block (``mb.cp_block``) gives its CP group and this rank's
    place in it (``parallel/dynamic_cp.py``), set here and left for its backward.
    """
    mb = next(data_iterator)
    if paradyse:
        release_pool()
        set_plan(model, mb.plan)
    dev = next(model.parameters()).device
    mb = mb.to(dev)
    extra = {} if mb.cu_seqlens is None else {"packed_seq_params": packed_seq_params(mb.cu_seqlens, dev)}
    if dynamic_cp.enabled():
        place = dynamic_cp.place_of(mb.cp_block)
        dynamic_cp.use_place(place)
        tokens, positions, labels, mask = (t if place is None else split_for_cp(t, place.size, place.rank)
                                           for t in (mb.tokens, mb.position_ids, mb.labels, mb.loss_mask))
    else:
        tokens, positions, labels, mask = cp_chunks(cp, mb.tokens, mb.position_ids, mb.labels, mb.loss_mask)
    output = model(tokens, positions, None, labels=labels, **extra)
    return output, partial(loss_func, mask)


def cp_chunks(cp: int, *tensors):
    """This CP rank's chunks of each ``[b, s]`` tensor (all of them without CP)."""
    if cp == 1:
        return tensors
    from megatron.core import parallel_state

    rank = parallel_state.get_context_parallel_rank()
    return tuple(split_for_cp(t, cp, rank) for t in tensors)


def packed_seq_params(cu_seqlens, device):
    """megatron's ``PackedSeqParams`` (THD) of a pack's document boundaries ``(0, ..., T)``
    (host values): ``cu_seqlens`` copied to the device without a host stall, and the host
    boundaries handed to the plugin with it (``packing.attach_documents``), so nothing reads
    them back from the device."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = to_device(cu_seqlens, torch.int32, device)
    longest = max(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    attach_documents(params, cu_seqlens)
    return params
