"""A micro-batch from Megatron-LM's data iterator on every TP rank, as each release line reads
it: 0.16 reads and broadcasts it in ``megatron.training.utils``, 0.19 broadcasts the batch TP
rank 0 read with ``megatron.core.utils``; with pipeline stages the first stage's, on every
stage."""
from __future__ import annotations

from ... import data as pdata
from ..dims import dims_of


def tp_batches(holder: list, args, multiple: int):
    """Endless micro-batches from ``holder[0]`` (the data iterator of the current forward step;
    ``None`` off TP rank 0), each cut after its last loss-bearing token (rounded up to
    ``multiple``). With pipeline stages every stage gets the whole micro-batch from the first
    stage (:func:`pipeline_batch`)."""
    pipelined = dims_of(args).pp_on
    while True:
        batch = pipeline_batch(holder[0], args) if pipelined else tp_batch(holder[0], args)
        mb = pdata.trim_to_multiple(batch["tokens"], batch["labels"], batch["loss_mask"], multiple,
                                    batch.get("position_ids"))
        if getattr(args, "paradyse_pack", "none") != "none":  # a pack: boundaries where positions restart
            mb.cu_seqlens = pdata.cu_seqlens_from_positions(mb.position_ids, mb.seq_length)
        yield mb


def tp_batch(data_iterator, args) -> dict:
    """One whole micro-batch (tokens, labels, loss mask, positions) on every rank of this TP
    group: read on TP rank 0, broadcast by Megatron-LM's own code."""
    from megatron.training import utils as mutils

    get_batch_on_this_tp_rank = getattr(mutils, "get_batch_on_this_tp_rank", None)
    if get_batch_on_this_tp_rank is None:  # 0.19: megatron.core.utils's takes the batch read on TP rank 0
        return get_batch_019(data_iterator, args)
    # 0.16: data on TP rank 0, broadcast; with pipeline stages it sends a stage only what its
    # own forward step needs, except with mtp_on_this_rank (MTP's layers need it all): so do we
    return get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=True)


def pipeline_batch(data_iterator, args) -> dict:
    """With pipeline stages: the first stage reads the micro-batch (:func:`tp_batch`) and
    broadcasts it over each pipeline group, so every stage plans, checks and pads the same
    micro-batches (middle stages have no data iterator; the last stage's is not read)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ...parallel.plan_check import collective_device

    dev = collective_device()
    shape = (args.micro_batch_size, args.seq_length)
    first = ps.is_pipeline_first_stage(ignore_virtual=True)
    if first:
        batch = tp_batch(data_iterator, args)
        ints = torch.stack([batch[k].to(dev, torch.long) for k in ("tokens", "labels", "position_ids")])
        mask = batch["loss_mask"].to(dev, torch.float32).contiguous()
    else:
        ints = torch.empty((3, *shape), dtype=torch.long, device=dev)
        mask = torch.empty(shape, dtype=torch.float32, device=dev)
    group = ps.get_pipeline_model_parallel_group()
    src = ps.get_pipeline_model_parallel_first_rank()
    for t in (ints, mask):
        dist.broadcast(t, src, group=group)
    return {"tokens": ints[0], "labels": ints[1], "position_ids": ints[2], "loss_mask": mask}


def get_batch_019(data_iterator, args):
    """Megatron-LM >= 0.19's TP broadcast (``megatron.core.utils.get_batch_on_this_tp_rank``)."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank

    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {k: (v.cuda(non_blocking=True) if v is not None else None)
                 for k, v in next(data_iterator).items()}
    return get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False,
        is_hybrid_cp=False, create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=1, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False, pipeline_model_parallel_size=1,
        is_pipeline_first_stage=True, is_pipeline_last_stage=True)
