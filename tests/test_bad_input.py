"""Bad input fails with a clear error on every rank, before any collective: never a hang."""
import time

import megatron_paradyse as mp
from megatron_paradyse.testing.spawn import run_world


def _try(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _bad_inputs(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_paradyse.testing import models as T

    T.init_megatron(world)
    mp.install()
    spec = T.TinyGPT(num_layers=2)
    model = T.build_gpt(spec, world)
    errors = {
        "wrong_length": _try(lambda: mp.set_plan(model, ["tp_sp"] * 3)),
        "unknown_name": _try(lambda: mp.set_plan(model, ["tp_sp", "zigzag_magic"])),
        "not_a_name": _try(lambda: mp.set_plan(model, ["tp_sp", 3])),
    }
    mp.set_plan(model, "ring")
    tok, lab = T.make_batch(spec, 2, 4 * world + 1, seed=0)
    errors["seq_not_divisible"] = _try(lambda: T.forward_backward(model, tok, lab))

    model.config.attention_dropout = 0.1
    errors["unsupported_config"] = _try(lambda: mp.set_plan(model, "ulysses"))
    model.config.attention_dropout = 0.0
    model.config.sequence_parallel = False
    errors["no_sequence_parallel"] = _try(lambda: mp.set_plan(model, "tp_sp"))
    model.config.sequence_parallel = True

    # fail closed: an argument a strategy does not handle is an error naming it
    mp.set_plan(model, "ring")
    layer = model.decoder.layers[0]
    h = torch.zeros(4, 2, spec.hidden_size)
    errors["attention_bias"] = _try(lambda: layer.self_attention(h, None, attention_bias=torch.zeros(1)))
    errors["unknown_attention_arg"] = _try(lambda: layer.self_attention(h, None, new_megatron_arg=1))
    errors["positional_attention_arg"] = _try(lambda: layer.self_attention(h, None, torch.zeros(1)))
    errors["per_token_scale"] = _try(lambda: layer.mlp(h, per_token_scale=torch.ones(8)))
    errors["unknown_mlp_arg"] = _try(lambda: layer.mlp(h, new_megatron_arg=1))
    from megatron.core.transformer.enums import AttnMaskType

    layer.self_attention.attn_mask_type = AttnMaskType.no_mask
    errors["not_causal"] = _try(lambda: layer.self_attention(h, None))
    layer.self_attention.attn_mask_type = AttnMaskType.causal
    # selective recompute of modules the dense layer does not have is refused; bad entries too
    model.config.recompute_granularity, model.config.recompute_modules = "selective", ["moe_act"]
    errors["recompute"] = _try(lambda: mp.set_plan(model, "tp_sp"))
    model.config.recompute_granularity, model.config.recompute_modules = None, None
    errors["rc_entry"] = _try(lambda: mp.set_plan(model, "tp_sp:recompute"))

    # the group is still healthy: a collective and a correct step both work afterwards
    t = torch.ones(1)
    dist.all_reduce(t)
    mp.set_plan(model, ["ulysses", "ring"])
    tok, lab = T.make_batch(spec, 2, 4 * world, seed=0)
    loss, _ = T.forward_backward(model, tok, lab)
    return {"errors": errors, "allreduce": t.item(), "loss": loss.item()}


def test_bad_input_errors_on_every_rank_without_hanging():
    t0 = time.monotonic()
    out = run_world(_bad_inputs, 2, timeout=240)
    assert time.monotonic() - t0 < 200
    for res in out:
        e = res["errors"]
        assert "ValueError" in e["wrong_length"] and "3 entries" in e["wrong_length"] and "2 layers" in e["wrong_length"]
        assert "unknown ParaDySe strategy 'zigzag_magic'" in e["unknown_name"] and "tp_sp" in e["unknown_name"]
        assert "TypeError" in e["not_a_name"]
        assert "ValueError" in e["seq_not_divisible"] and "not divisible" in e["seq_not_divisible"]
        assert "'ulysses' cannot run" in e["unsupported_config"] and "dropout" in e["unsupported_config"]
        assert "sequence_parallel" in e["no_sequence_parallel"]
        assert "NotImplementedError" in e["attention_bias"] and "attention_bias" in e["attention_bias"]
        assert "NotImplementedError" in e["unknown_attention_arg"] and "new_megatron_arg" in e["unknown_attention_arg"]
        assert "TypeError" in e["positional_attention_arg"] and "keyword only" in e["positional_attention_arg"]
        assert "NotImplementedError" in e["per_token_scale"] and "per_token_scale" in e["per_token_scale"]
        assert "NotImplementedError" in e["unknown_mlp_arg"] and "new_megatron_arg" in e["unknown_mlp_arg"]
        assert "causal" in e["not_causal"] and "no_mask" in e["not_causal"]
        assert "'tp_sp' cannot run" in e["recompute"] and "moe_act is not supported" in e["recompute"]
        assert "bad plan entry 'tp_sp:recompute'" in e["rc_entry"] and "tp_sp:rc" in e["rc_entry"]
        assert res["allreduce"] == 2.0
    assert out[0]["loss"] == out[1]["loss"]


def test_supports_reports_reasons():
    from megatron_paradyse.testing.models import TinyGPT

    cfg = TinyGPT().transformer_config(2, True)
    for name in mp.STRATEGIES:
        assert mp.supports(name, cfg, 2) == (True, "")
    cfg.attention_dropout = 0.1
    ok, why = mp.supports("ring", cfg, 2)
    assert not ok and "dropout" in why
    cfg.attention_dropout = 0.0
    cfg.recompute_granularity, cfg.recompute_modules = "selective", ["core_attn", "mlp"]
    for name in mp.STRATEGIES:
        assert mp.supports(name, cfg, 2) == (True, ""), name
    cfg.recompute_modules = ["mla_up_proj"]
    for name in mp.STRATEGIES:
        ok, why = mp.supports(name, cfg, 2)
        assert not ok and "selective recompute of mla_up_proj" in why, (name, why)
    try:
        mp.supports("nope", cfg, 2)
    except ValueError as e:
        assert "unknown ParaDySe strategy" in str(e)
    else:
        raise AssertionError("unknown name accepted")


def test_set_plan_before_install_is_an_error():
    import pytest

    mp.uninstall()
    with pytest.raises(RuntimeError, match="install"):
        mp.set_plan(object(), "tp_sp")


def test_install_and_uninstall_are_idempotent_and_restore_stock():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    mp.uninstall()
    stock = (SelfAttention.forward, MLP.forward, GPTModel.forward)
    mp.install()
    patched = (SelfAttention.forward, MLP.forward, GPTModel.forward)
    assert all(a is not b for a, b in zip(stock, patched))
    mp.install()
    assert (SelfAttention.forward, MLP.forward, GPTModel.forward) == patched
    mp.uninstall()
    mp.uninstall()
    assert (SelfAttention.forward, MLP.forward, GPTModel.forward) == stock
    assert not mp.installed()


def test_overlap_param_gather_is_refused_with_paradyse():
    """Megatron's DDP finishes --overlap-param-gather's all-gathers in forward pre-hooks of the
    modules owning the parameters; the gathered-weight strategies read those weights without
    calling the modules. Both trainers refuse the combination in argument validation, before
    any collective."""
    import argparse

    import pytest

    from megatron_paradyse.training.arguments import ArgumentError, parse_args
    from megatron_paradyse.training.megatron_lm import check_paradyse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "128", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--attention-dropout", "0", "--hidden-dropout", "0"]
    for extra in (["--paradyse-plan", "ulysses"], []):  # a plan, or the planner
        argv = base + ["--paradyse", "--overlap-param-gather", "--use-distributed-optimizer",
                       "--overlap-grad-reduce"] + extra
        with pytest.raises(ArgumentError, match="--overlap-param-gather cannot be used with --paradyse") as e:
            parse_args(argv, world_size=2)
        assert "forward pre-hooks" in str(e.value) and "linear_qkv" in str(e.value)
    # stock: Megatron-LM's own requirements
    with pytest.raises(ArgumentError, match="needs --use-distributed-optimizer and --overlap-grad-reduce"):
        parse_args(base + ["--overlap-param-gather", "--distributed-backend", "gloo"], world_size=2)
    assert not parse_args(base + ["--paradyse"], world_size=2).overlap_param_gather

    # Megatron-LM's entry point: the check inside its validate_args (Megatron-LM's parsed args)
    args = argparse.Namespace(paradyse=True, overlap_param_gather=True, paradyse_document_data=False,
                              tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="--overlap-param-gather cannot be used with --paradyse"):
        check_paradyse_args(args)
    args.paradyse = False  # stock Megatron-LM keeps its flag
    check_paradyse_args(args)
