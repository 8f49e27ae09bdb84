"""A micro-batch from Megatron-LM's data iterator on every TP rank, as each release line reads
it: 0.16 reads and broadcasts it in ``megatron.training.utils``, 0.19 broadcasts the batch TP
rank 0 read with ``megatron.core.utils``."""
from __future__ import annotations

from ... import data as pdata


def tp_batches(holder: list, args, multiple: int):
    """Endless micro-batches from ``holder[0]`` (the data iterator of the current forward step;
    ``None`` off TP rank 0), each cut after its last loss-bearing token (rounded up to
    ``multiple``)."""
    from megatron.training import utils as mutils

    get_batch_on_this_tp_rank = getattr(mutils, "get_batch_on_this_tp_rank", None)
    while True:
        if get_batch_on_this_tp_rank is not None:  # 0.16: data on TP rank 0, broadcast
            batch = get_batch_on_this_tp_rank(holder[0])
        else:  # 0.19: megatron.core.utils's takes the batch read on TP rank 0
            batch = get_batch_019(holder[0], args)
        mb = pdata.trim_to_multiple(batch["tokens"], batch["labels"], batch["loss_mask"], multiple,
                                    batch.get("position_ids"))
        if getattr(args, "paradyse_pack", "none") != "none":  # a pack: boundaries where positions restart
            mb.cu_seqlens = pdata.cu_seqlens_from_positions(mb.position_ids, mb.seq_length)
        yield mb


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
