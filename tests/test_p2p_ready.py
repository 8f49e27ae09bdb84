"""Point-to-point batches some rank skips are safe on NCCL: every rank of a group joins one
all-reduce before the plugin's first batch on it (``collectives.ensure_ready``), because torch's
``batch_isend_irecv`` is undefined when it is a group's first collective and not every rank
takes part. Here a ring step where only some ranks have something to send."""
from megatron_paradyse.testing.spawn import run_world


def _world(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_paradyse.parallel import collectives, ring_comm

    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(k.get("group")), real(*a, **k))[1]
    try:
        group = dist.new_group(list(range(world)))
        got = torch.zeros(2)
        # rank 0 sends to 1; rank 2 (and 3) take part in nothing: the group's first collective
        sends = [(torch.ones(2), 1)] if rank == 0 else []
        recvs = [(got, 0)] if rank == 1 else []
        collectives.wait(ring_comm._p2p(sends, recvs, group))
        ring_comm._p2p([], [], group)  # a second time: no second all-reduce
    finally:
        dist.all_reduce = real
    return len([g for g in calls if g is group]), got.tolist()


def test_every_rank_joins_one_all_reduce_before_the_first_batch():
    out = run_world(_world, 3, timeout=120)
    assert [n for n, _ in out] == [1, 1, 1]
    assert out[1][1] == [1.0, 1.0]
