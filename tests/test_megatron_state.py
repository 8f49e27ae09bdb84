"""Megatron's parallel state made again and again in one process leaves no process group
behind (``parallel/megatron_state.py``): ``destroy_model_parallel`` alone forgets its groups
but torch keeps them, each gloo group with a transport thread that wakes every 10 ms, and a
test world that trained stock and ParaDySe six times over had 630 threads per rank and slowed
every job beside it several times. Four ranks, PP = 2 x TP = 2, with the plugin installed (its
twins kept across states) and the collective trace recording (it holds groups weakly)."""
from megatron_paradyse.testing.spawn import run_world

ROUNDS = 5


def _threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _world(rank, world, destroy):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d as c10d

    from megatron_paradyse.parallel import dynamic_cp, groups, megatron_state
    from megatron_paradyse.parallel.dispatch import install

    install()
    counts = []
    for _ in range(ROUNDS):
        if destroy:
            megatron_state.initialize("test", tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
            with megatron_state.owned():
                dynamic_cp.DynamicCPGroups(2)  # a pool of 2 nodes: one CP group of 2 per TP rank
        else:  # what the trainers did before
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
            dynamic_cp.DynamicCPGroups(2)
        t = torch.ones(1)
        dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
        dist.all_reduce(t, group=groups.weight_group(parallel_state.get_tensor_model_parallel_group()))
        counts.append((len(c10d._world.pg_map), _threads(), t.item()))
    if destroy:
        megatron_state.teardown()
        counts.append((len(c10d._world.pg_map), _threads(), None))
    return counts


def test_remade_parallel_state_keeps_no_old_groups_or_threads():
    kept = run_world(_world, 4, True, timeout=180, trace=True)
    grew = run_world(_world, 4, False, timeout=180)
    for counts in kept:
        groups_per_round = {g for g, _, _ in counts[:ROUNDS]}
        threads = [n for _, n, _ in counts[:ROUNDS]]
        assert len(groups_per_round) == 1, counts  # the same number of live groups every round
        assert max(threads[1:]) <= threads[0] + 4, counts  # no thread piles up (a few of torch's own)
        assert counts[-1][0] == 1 + 1  # after the teardown: the world and the twin of this TP group
        assert all(v == 4.0 for _, _, v in counts[:ROUNDS])  # the remade groups work
    # the check can fail: megatron's destroy alone piles groups and threads up
    for counts in grew:
        assert counts[-1][0] > counts[0][0] + 10 and counts[-1][1] > counts[0][1] + 20, counts
    print(f"\nrank 0 threads per round: remade {[n for _, n, _ in kept[0]]}, "
          f"megatron's destroy alone {[n for _, n, _ in grew[0]]}")
