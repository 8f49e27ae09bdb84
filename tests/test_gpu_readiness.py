"""What a GPU host changes, shown on this CPU: one device decision from the backend, the planner's
margin from the plans' device, the budget from what the device can hand out, the allocator set
on every path."""
import os

import pytest
import torch

from megatron_paradyse import device, units
from megatron_paradyse.testing.spawn import FAKE_CUDA_ENV, run_world

from .exactness import assert_exact, run_cases, stock


@pytest.fixture
def fresh_device():
    saved = list(device._CHOSEN)
    device.reset_for_tests()
    yield
    device._CHOSEN[:] = saved


def _gpu_host_world(rank, world):
    """In a gloo rank on a (faked) GPU host: every strategy and a mixed plan against stock TP=1
    (computed in the same faked world), then planned training steps."""
    import megatron_paradyse as mp
    from megatron_paradyse.training import arguments, trainer

    assert torch.cuda.is_available() and device.current() == torch.device("cpu")
    spec = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, swiglu=True)
    cases = [(spec, [(p, 2, 32, 5) for p in list(mp.STRATEGIES) + [["tp_sp", "ring", "metp", "ulysses"]]])]
    got = run_cases(rank, world, cases)
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "128",
            "--seq-length", "128", "--micro-batch-size", "1", "--train-iters", "3", "--lr", "1e-3",
            "--tensor-model-parallel-size", str(world), "--sequence-parallel", "--mock-data",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--position-embedding-type", "rope",
            "--paradyse", "--paradyse-memory-budget", "1"]
    args = arguments.parse_args(argv, world_size=world)
    tr = trainer.Trainer(args)
    tr.train()
    return got, args.distributed_backend, [h.loss for h in tr.history]


def test_gloo_ranks_on_a_gpu_host_stay_on_the_cpu():
    env = {FAKE_CUDA_ENV: "1"}
    got, backend, losses = run_world(_gpu_host_world, 2, env=env, timeout=300)[0]
    spec = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, swiglu=True)
    ref_cases = stock([(spec, [(None, 2, 32, 5)])])
    ref = run_world(run_cases, 1, ref_cases, env=env, timeout=300)[0][0][0]
    for i, g in enumerate(got[0]):
        assert_exact(g, ref, f"plan {i} on a faked GPU host")
    assert backend == "gloo" and len(losses) == 3 and all(x == x for x in losses)


def test_the_margin_follows_the_plans_device_not_this_machine(monkeypatch):
    from megatron_paradyse.costmodel import ModelShape, build_cost_model
    from megatron_paradyse.costmodel.analytic import AnalyticCostModel
    from megatron_paradyse.planner import build_planner

    shape = ModelShape(num_layers=4, hidden=128, heads=8, query_groups=8, ffn=512, swiglu=False,
                       bias=True, vocab=512, p=4)
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda c=cuda: c)
        cpu_model = build_cost_model(shape)  # the shipped model, profiled on this CPU
        gpu_model = AnalyticCostModel(shape, hardware="h100")
        assert build_planner("optimal", cpu_model, 1 << 30).margin == pytest.approx(0.05 * (1 << 30))
        assert build_planner("optimal", gpu_model, 1 << 30).margin == pytest.approx(0.10 * (1 << 30))
        trained_on_gpu = build_planner("optimal", cpu_model, 1 << 30, device_kind="cuda")
        assert trained_on_gpu.margin == pytest.approx(0.10 * (1 << 30))


def test_nccl_without_cuda_is_a_clear_error(fresh_device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="nccl backend needs CUDA"):
        device.select("nccl")
    with pytest.raises(ValueError, match="unknown distributed backend"):
        device.select("mpi")
    assert device.select("gloo") == torch.device("cpu")


def test_the_budget_is_what_the_device_can_hand_out(monkeypatch, fresh_device):
    GiB = int(units.GiB)
    monkeypatch.setattr(device, "current", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 5 * GiB)
    assert device.usable_memory_bytes() == 70 * GiB + 5 * GiB - device.NON_TORCH_RESERVE_BYTES


def test_the_allocator_is_set_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert device.set_allocator() == "expandable_segments:True"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert device.set_allocator() == "max_split_size_mb:512"


def test_the_slurm_template_keeps_each_argument_whole(tmp_path):
    """``sbatch pretrain_gpt_paradyse_slurm.sh CKPT DATA --paradyse-plan "a b*"`` reaches the
    torchrun template with each argument as given (it used to be re-split through ``$*``)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fake = tmp_path / "root"
    (fake / "scripts").mkdir(parents=True)
    (fake / "scripts" / "pretrain_gpt_paradyse_torchrun.sh").write_text(
        'for a in "$@"; do echo "[$a]"; done; echo "node $NODE_RANK"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nshift\nexec "$@"\n')  # drop --kill-on-bad-exit
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "x y").mkdir()  # a glob that would match if the argument were re-split
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PARADYSE_ROOT=str(fake),
               SLURM_JOB_NODELIST="node0", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0")
    out = subprocess.run(["bash", os.path.join(root, "scripts", "pretrain_gpt_paradyse_slurm.sh"),
                          "ck pt", "data", "--paradyse-plan", "rule:4096=tp_sp,ulysses*2 x*"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["[ck pt]", "[data]", "[--paradyse-plan]", "[rule:4096=tp_sp,ulysses*2 x*]"]
    assert "node 0" in out.stdout


def test_torch_kernels_can_be_forced_where_flash_attn_is_installed(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_paradyse.parallel import attention_kernels as K

    monkeypatch.setattr(K, "_FA", (object(), object()))
    monkeypatch.setattr(K, "FLASH_ATTN_VERSION", "2.8.3")
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 4, 8, 16, dtype=torch.bfloat16, device="cuda")
        assert K.kernel_path(q) == "flash-attn 2.8.3"
        with K.torch_kernels_only():
            assert K.kernel_path(q) == "torch flash"
        assert K.kernel_path(q) == "flash-attn 2.8.3"


def test_resuming_the_distributed_optimizer_without_apex_or_te_is_refused(monkeypatch):
    """Seen on an H100 (megatron-core 0.16.1, torch's Adam): the save works, the resume asserts in
    DistributedOptimizer.state_dict before any step; refused before anything starts instead."""
    from megatron_paradyse.training import arguments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "128",
            "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--distributed-backend", "nccl", "--use-distributed-optimizer"]
    arguments.parse_args(argv, world_size=1)  # no --load: fine
    with pytest.raises(arguments.ArgumentError, match="needs apex or Transformer Engine"):
        arguments.parse_args(argv + ["--load", "ckpt"], world_size=1)
    arguments.parse_args(argv + ["--load", "ckpt", "--no-load-optim"], world_size=1)


def test_the_sp_norm_is_chosen_by_configuration(monkeypatch):
    """RMSNorm and LayerNorm with sequence parallelism get the plugin's SP norm whatever is
    installed (megatron's local spec gives WrappedTorchNorm, which refuses SP, for RMSNorm even
    with apex); a class, since megatron's build_module returns a plain function uncalled."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from megatron_paradyse.model import layer_spec
    from megatron_paradyse.norms import SPTorchNorm

    for norm in ("RMSNorm", "LayerNorm"):
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization=norm,
                                tensor_model_parallel_size=2, sequence_parallel=True,
                                activation_func=F.gelu, use_cpu_initialization=True)
        spec = layer_spec(cfg)
        assert spec.layer_norm is SPTorchNorm and isinstance(SPTorchNorm, type)
        assert all(ls.submodules.input_layernorm is SPTorchNorm and ls.submodules.pre_mlp_layernorm is SPTorchNorm
                   for ls in spec.layer_specs)
        built = SPTorchNorm(cfg, 64, eps=1e-5)
        assert type(built).__name__ == norm and all(p.sequence_parallel for p in built.parameters())


def test_peak_memory_reports_no_reserved_peak_on_cpu():
    from megatron_paradyse.memory import PeakMemory, run_peaks

    with PeakMemory("cpu") as m:
        x = torch.ones(1 << 16)
    del x
    assert m.peak_bytes == 4 << 16 and m.peak_reserved is None and run_peaks("cpu") == (None, None)
