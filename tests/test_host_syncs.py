"""No host stall on the GPU path between a step's first forward and its optimizer step.

A device-to-host read (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()`` of a device tensor)
or a host-to-device copy from pageable memory makes the host wait for every queued kernel.
The training step (megatron's schedule, DDP with ``--overlap-grad-reduce``, the plugin's
``forward_step`` and every strategy) runs here on the *meta* device, which holds no values:
``testing/syncs.py`` counts each read of device values and each blocking copy to the device.
Fake CUDA tensors (``FakeTensorMode``) cannot run the whole model on this CPU-only build of
torch (indexing a fake CUDA tensor asks for a CUDA device guard), so the meta device stands
in for it; torch's fake process group plays a p = 2 switching group. The host-side pack
boundaries are also checked on fake CUDA tensors (the path from ``forward_step`` to the
strategies' documents).

Three packed micro-batches per step, two steps: the second step reads nothing from the device
and makes no blocking copy (the first makes one, megatron moving its RoPE table to the device
once). The control: the same pack without host-side boundaries reads them back.
"""
from __future__ import annotations

import pytest

from megatron_paradyse.launch import run_ranks

P = 2
PACKS = [(0, 10, 39, 64), (0, 5, 20, 64), (0, 30, 64)]


def _meta_world(rank, world, strategies, host_bounds=True):
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import megatron_paradyse as mp
    from megatron_paradyse.data.datasets import MicroBatch
    from megatron_paradyse.parallel import kernel_select
    from megatron_paradyse.testing import models as T
    from megatron_paradyse.testing.syncs import SyncCounter
    from megatron_paradyse.training import forward_step as fs
    from megatron_paradyse.training.iterator import PlannedIterator

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=0, world_size=P)
    _coalesced_one_by_one()
    T.init_megatron(P, create_gloo_process_groups=False)
    torch.cuda.current_device = lambda: torch.device("meta")  # megatron's buffers on the device under test
    mp.install()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = T.TinyGPT(num_layers=len(strategies), hidden_size=64, num_attention_heads=4)
    module = T.build_gpt(spec, P).to("meta")
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(overlap_grad_reduce=True),
                                    module)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = model.no_sync
    if not host_bounds:  # the control: megatron's PackedSeqParams alone, as before the host bounds
        fs.attach_documents = lambda params, bounds: None

    def micro(bounds):
        n = bounds[-1]
        z = torch.zeros(1, n, dtype=torch.long)
        return MicroBatch(z, z, torch.ones(1, n), torch.zeros(1, n, dtype=torch.long), (n,), cu_seqlens=bounds)

    plan = tuple(strategies)
    data = PlannedIterator(iter([micro(b) for b in PACKS] * 2), lambda mb, step, i: plan, len(PACKS))
    fwd_bwd = get_forward_backward_func()
    counts = []
    for _ in range(2):
        model.zero_grad_buffer()
        with kernel_select.only(kernel_select.MATH), SyncCounter("meta") as c:
            data.prefetch()
            try:
                fwd_bwd(forward_step_func=fs.forward_step, data_iterator=data, model=[model],
                        num_microbatches=len(PACKS), seq_length=64, micro_batch_size=1, forward_only=False)
            except ValueError:  # the control: boundaries read back as zeros are refused
                if host_bounds:
                    raise
        counts.append((c.reads(), c.blocking_copies()))
    return counts


def _coalesced_one_by_one():
    """torch has no meta kernel for ``c10d::allreduce_coalesced_`` (DDP's bucket all-reduce):
    on the fake group, all-reduce the bucket's tensors one by one (the fake backend moves no data)."""
    from torch._C._distributed_c10d import AllreduceOptions, ProcessGroup

    def allreduce_coalesced(self, tensors, opts):
        one = AllreduceOptions()
        one.reduceOp = opts.reduceOp
        work = None
        for t in tensors:
            work = self.allreduce([t], one)
        return work

    ProcessGroup.allreduce_coalesced = allreduce_coalesced


PLANS = [("tp_sp", "ulysses"), ("ring", "colossal"), ("metp", "tp_sp")]


def _meta_worlds(rank, world):
    """Every plan of :data:`PLANS` in one process (torch's fake group is made and torn down per plan)."""
    import torch.distributed as dist

    out = []
    for plan in PLANS:
        out.append(_meta_world(rank, world, list(plan)))
        dist.destroy_process_group()
    return out


def test_the_second_step_never_stalls_the_host():
    (got,) = run_ranks(_meta_worlds, 1, backend="fake", fake_device="gloo", timeout=300)
    for plan, (first, second) in zip(PLANS, got):
        reads, copies = second
        assert reads == [] and copies == [], f"{plan}: step 2 stalled the host: reads {reads}, blocking copies {copies}"
        assert first[0] == [] and len(first[1]) <= 1, (plan, first)  # megatron's RoPE table, moved once
        print(f"\n{plan}: step 1 {len(first[0])} reads, {len(first[1])} blocking copies; step 2 none")


def test_without_host_bounds_the_pack_is_read_back():
    """The control: a pack whose boundaries exist only on the device is read back each micro-batch."""
    (_, second), = run_ranks(_meta_world, 1, ["tp_sp", "tp_sp"], False, backend="fake", fake_device="gloo",
                             timeout=300)
    assert second[0], second
    assert any("documents_from" in w or "check_cu_seqlens" in w for w in second[0])


def test_host_bounds_on_fake_cuda(monkeypatch):
    """``forward_step``'s PackedSeqParams, the padded pack and its documents on fake CUDA tensors:
    nothing reads the boundaries back (``FakeTensorMode`` raises on any read), and the one copy
    to the device is the non-blocking one (a CPU-only torch cannot copy a fake tensor to CUDA,
    so the copy is replaced by a fake CUDA tensor of the same values' shape)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_paradyse.device import copy_to as real_copy
    from megatron_paradyse.parallel import packing
    from megatron_paradyse.testing.syncs import SyncCounter
    from megatron_paradyse.training import forward_step as fs

    moved = []

    def fake_copy(host, device):
        moved.append(torch.device(device).type)
        return torch.empty(host.shape, dtype=host.dtype, device=device)

    monkeypatch.setattr(packing, "copy_to", fake_copy)
    with FakeTensorMode(allow_non_fake_inputs=True), SyncCounter("cuda") as c:
        params = fs.packed_seq_params((0, 7, 30), "cuda")
        padded, pad = packing.pad_pack(params, 30, 4)
        docs = packing.documents_from(padded, 32)
        assert params.cu_seqlens_q.device.type == "cuda" and pad == 2 and docs.bounds == (0, 7, 30, 32)
        assert docs.cu_seqlens("cuda").device.type == "cuda" and docs.positions([(0, 16)], "cuda").shape == (16,)
    assert c.events == [] and moved and set(moved) == {"cuda"}
    assert real_copy(torch.ones(2), "cpu").device.type == "cpu"
