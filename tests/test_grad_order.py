"""Replicas with different plans launch their gradient reductions in one order (``parallel/grad_order.py``).

Two replicas (TP = 1 x DP = 2, and p = 2 x DP = 2) train with ``--overlap-grad-reduce`` and a
bucket size small enough that fc1 and fc2 fall in different buckets; replica 0's last
micro-batch of a step runs ``metp`` (all of a layer's weight gradients from one autograd
node), replica 1's ``tp_sp`` (fc2's long before fc1's), recompute on some steps. Every rank's
posted collectives are recorded (``megatron_paradyse/trace.py``) and NCCL's ordering rule is checked:
each group's sequence the same on all members. Without the ordering the data-parallel group's
sequences differ (the control world below); with it they agree, and the losses and
parameters equal stock megatron's DDP without overlap.
"""
from __future__ import annotations

import pytest

from megatron_paradyse import trace
from megatron_paradyse.testing.spawn import run_world

from .test_training import _param_rel

STEPS = 4
BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
    "--vocab-size", "128", "--make-vocab-size-divisible-by", "32",
    "--micro-batch-size", "1", "--global-batch-size", "4",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "2e-3", "--clip-grad", "1.0",
    "--mock-data", "--paradyse-mock-min-length", "6", "--seed", "1234", "--log-interval", "1",
    "--train-iters", str(STEPS),
]
# fc1 (64 x 256 + 256) and fc2 (256 x 64 + 64) each over the bucket size: their own buckets
BUCKET = ["--overlap-grad-reduce", "--ddp-bucket-size", "4000"]


class _ReplicaPlans:
    """Replica 0's last micro-batch runs metp, replica 1's tp_sp; every other one tp_sp; layer
    0 recomputed on odd steps (``tp_sp:rc``, ``metp:rc``)."""

    def __init__(self, dp_rank: int):
        self.dp_rank = dp_rank

    def __call__(self, config, p):
        layers, dp = config.num_layers, self.dp_rank

        def plan_fn(mb, step, index):
            last = index == 1
            name = "metp" if (last and dp == 0) else "tp_sp"
            plan = [name] * layers
            if step % 2:
                plan[0] += ":rc"
            return tuple(plan)

        return plan_fn


def _train(rank, world, tp, extra, paradyse, ordered=True):
    import megatron_paradyse as mp
    from megatron_paradyse.parallel import grad_order
    from megatron_paradyse.testing.models import gather_full
    from megatron_paradyse.training import arguments, trainer as training

    argv = BASE + ["--tensor-model-parallel-size", str(tp)] + list(extra)
    if tp > 1:
        argv.append("--sequence-parallel")
    if paradyse:
        argv.append("--paradyse")
    args = arguments.parse_args(argv, world_size=world)
    plan_fn = None
    if paradyse:
        dp_rank = rank // tp
        plan_fn = _ReplicaPlans(dp_rank)(arguments.transformer_config_from_args(args), tp)
    if not ordered:
        grad_order.order_grad_sync = lambda ddp: setattr(ddp, "_paradyse_grad_order", [])
    tr = training.Trainer(args, plan_fn=plan_fn)
    buckets = len(tr.model.bucket_groups)
    tr.train()
    params = gather_full(mp.unwrap(tr.model)) if rank < tp else None
    mp.uninstall()
    return dict(losses=[h.loss for h in tr.history], plans=[h.plans for h in tr.history],
                params=params, buckets=buckets)


def _world(rank, world, tp, ordered=True):
    return dict(stock=_train(rank, world, tp, [], paradyse=False),
                paradyse=_train(rank, world, tp, BUCKET, paradyse=True, ordered=ordered))


@pytest.mark.parametrize("tp", [1, 2])
def test_replicas_with_different_plans_launch_buckets_in_one_order(tp):
    traces = []
    got = run_world(_world, 2 * tp, tp, timeout=300, traces=traces)
    r0, r1 = got[0]["paradyse"], got[tp]["paradyse"]
    assert r0["buckets"] >= 4  # fc1 and fc2 of each layer apart
    assert r0["plans"][0][-1][0] == "metp" and r1["plans"][0][-1][0] == "tp_sp"  # the plans differ
    assert any(":rc" in plans[0][0] for plans in r0["plans"])
    summary = trace.check(traces)  # run_world checked it too; the DP groups are in it
    dp_groups = [g for g, s in summary.items() if len(s["members"]) == 2 and s["members"][1] - s["members"][0] == tp]
    assert dp_groups and max(summary[g]["collectives"] for g in dp_groups) >= STEPS * r0["buckets"]
    stock, pd = got[0]["stock"], r0
    worst = max(abs(a - b) / abs(b) for a, b in zip(pd["losses"], stock["losses"]))
    assert worst < 1e-5, (pd["losses"], stock["losses"])
    perr = _param_rel(pd["params"], stock["params"])  # the key bias compared in the global norm only
    assert perr < 1e-5
    print(f"\nTP={tp} x DP=2, --overlap-grad-reduce, {r0['buckets']} buckets, {STEPS} steps: "
          f"loss rel. err {worst:.1e}, params {perr:.1e}, collectives on the data-parallel group "
          f"{max(summary[g]['collectives'] for g in dp_groups)}, the same sequence on both replicas")


def test_without_the_order_the_replicas_differ():
    """The control: megatron's own launch order (the ordering switched off) gives the two
    replicas different sequences on the data-parallel group, which the trace check reports."""
    with pytest.raises(trace.TraceError, match="collective .* differs|posts .* collectives"):
        run_world(_world, 2, 1, False, timeout=300, trace=True)


def _ddp_world(rank, world, use_distributed_optimizer):
    """megatron's DDP built directly (no optimizer) with ``use_distributed_optimizer``: its
    buckets reduce-scatter (the distributed optimizer's path, whose optimizer megatron-core
    refuses on CPU tensors). TP = 1, one replica per rank; replica 0 runs metp, the other
    tp_sp; three steps, then the reduced gradients."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import megatron_paradyse as mp
    from megatron_paradyse.testing import models as T

    T.init_megatron(1)
    mp.install()
    spec = T.TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4)
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=4000,
                                        use_distributed_optimizer=use_distributed_optimizer)
    module = T.build_gpt(spec, 1)
    model = DistributedDataParallel(module.config, cfg, module)
    buckets = len(model.bucket_groups)
    for step in range(3):
        model.zero_grad_buffer()
        mp.set_plan(model, "metp" if rank == 0 else "tp_sp")
        loss, _ = T.forward_backward(model.module, *T.make_batch(spec, 1, 32, seed=10 * step + rank))
        model.finish_grad_sync()
    grads = torch.cat([b.grad_data.view(-1) for b in model.buffers])
    mp.uninstall()
    return buckets, grads


@pytest.mark.parametrize("distopt", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_bucket_order_with_the_distributed_optimizers_reduce_scatter(distopt):
    got = run_world(_ddp_world, 2, distopt, timeout=300, trace=True)
    assert got[0][0] >= 4
    if not distopt:  # all-reduced: both replicas hold the same summed gradients
        assert bool((got[0][1] == got[1][1]).all())
