"""Dynamic CP through Megatron-LM's ``pretrain()``: ``--hybrid-context-parallel`` (or
``--dynamic-context-parallel``) with ``--paradyse`` runs the plugin trainer's Dynamic CP data path
(``training/dynamic_cp.py``) on Megatron-LM's own data iterator.

After Megatron-LM's argument validation its own Dynamic CP is switched off (``args.py``: its
sampler, data-loader wrapper, schedule and groups; the plugin keeps ``dynamic_context_parallel``):
the model is built at CP = 1 and Megatron-LM's data parallelism is the pool of nodes. At a
training step every rank reads its own micro-batches from Megatron-LM's sampler (TP rank 0
reads, Megatron-LM's TP broadcast), the step's global batch is gathered over the data-parallel
group in Megatron-LM's sample order, each row one document (its loss-bearing tokens); the step's
schedule (the Dynamic CP planner's, or with ``--paradyse-plan`` the placeholder schedule) is the
same on every rank, and each rank runs its node's pack of every round. The wrapper of
``get_forward_backward_func`` (``schedule.py``) reads the step ahead and hands megatron's
schedule the step's number of rounds as ``num_microbatches``; Megatron-LM's own count (samples
per global batch) is left as it is. Evaluation runs each micro-batch Megatron-LM reads on its
own node (c = 1).
"""
from __future__ import annotations

import logging
from functools import partial

import numpy as np

from ...errors import UserError
from ...parallel import dynamic_cp
from ...parallel.plans import parse_plan, rule_plan_fn
from ..dims import dims_of
from ..dynamic_cp import DynamicCPLoader, assigned_plan, placeholder_schedule
from ..planning import dynamic_cp_schedule_fn
from .batches import tp_batch

log = logging.getLogger(__name__)


def ensure_groups(args) -> None:
    """Every Dynamic CP group of the pool, made once on every rank (at the first schedule call,
    which every rank makes; Megatron-LM's parallel state exists by then)."""
    if dynamic_cp.enabled():
        return
    dims = dims_of(args)
    groups = dynamic_cp.DynamicCPGroups(dims.tp, min_size=dims.dcp_min_size)
    dynamic_cp.enable(groups)
    log.info(f" [paradyse] Dynamic CP over a pool of {dims.dp} nodes (TP = {dims.tp} each): CP sizes "
             f"{list(groups.sizes)} per micro-batch")


def _document(tokens, labels, mask):
    """One sample row as a document (its ``n`` loss-bearing tokens and the last label: ``n + 1``
    ids), or None without one."""
    real = np.nonzero(mask > 0)[0]
    if not len(real):
        return None
    n = int(real[-1]) + 1
    if len(real) != n:
        raise UserError("Dynamic CP reads each sample as one document: its loss mask must be ones up to "
                        "its last loss-bearing token (--paradyse-document-data)")
    return np.concatenate([tokens[:n], labels[n - 1:n]]).astype(np.int64)


def gathered_documents(data_iterator, args, count: int) -> list:
    """The step's global batch as documents, the same list on every rank: this rank's ``count``
    micro-batches read through Megatron-LM's TP broadcast, gathered over the data-parallel
    group, in Megatron-LM's order (micro-batch i of every DP rank, in rank order)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ...parallel.plan_check import collective_device

    dev = collective_device()
    rows = [tp_batch(data_iterator, args) for _ in range(count)]
    mine = torch.stack([torch.cat([b[k].to(dev, torch.long) for b in rows]) for k in ("tokens", "labels", "loss_mask")])
    group = ps.get_data_parallel_group()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    parts = [p.cpu().numpy() for p in parts]
    mbs, docs = args.micro_batch_size, []
    for i in range(count):
        for part in parts:
            for j in range(i * mbs, (i + 1) * mbs):
                doc = _document(part[0, j], part[1, j], part[2, j])
                if doc is not None:
                    docs.append(doc)
    return docs


class MegatronDynamicCPLoader(DynamicCPLoader):
    """:class:`DynamicCPLoader` whose step's documents are Megatron-LM's global batch
    (:func:`gathered_documents` from ``holder[0]``, the current forward step's data iterator)."""

    def __init__(self, holder: list, args, count_fn, node: int, schedule_fn, start_step: int = 0):
        dims = dims_of(args)
        super().__init__(None, args.global_batch_size, dims.dp, node, dims.tp, schedule_fn, start_step=start_step)
        self.holder, self.args, self.count_fn = holder, args, count_fn

    def documents(self, step: int) -> list:
        return gathered_documents(self.holder[0], self.args, int(self.count_fn()))


def dynamic_cp_source(holder: list, args, planners=None) -> tuple:
    """``(loader, plan_fn)`` of a training step under Dynamic CP: with ``planners`` (the
    Dynamic CP planner's ``{c: planner}``) its schedule and each micro-batch's assigned plan;
    else the placeholder schedule under ``--paradyse-plan``'s rule."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    dims = dims_of(args)
    if planners is not None:
        schedule_fn, plan_fn = dynamic_cp_schedule_fn(args, planners), assigned_plan
    else:
        schedule_fn = partial(placeholder_schedule, nodes=dims.dp, min_size=dims.dcp_min_size,
                              max_seqlen=args.max_seqlen_per_dp_cp_rank)
        plan_fn = rule_plan_fn(parse_plan(args.paradyse_plan, args.num_layers))
    loader = MegatronDynamicCPLoader(holder, args, get_num_microbatches, ps.get_data_parallel_rank(), schedule_fn,
                                     start_step=int(getattr(args, "iteration", 0) or 0))
    return loader, plan_fn
