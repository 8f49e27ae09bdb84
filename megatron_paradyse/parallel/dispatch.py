"""Install the switchable layers into megatron-core and set per-layer plans on a model.

:func:`install` wraps ``SelfAttention.forward`` and ``MLP.forward`` so that a module
carrying a strategy name dispatches to that strategy; a module without one runs stock
megatron code. Parameters are untouched; every replaced method is a patch of the registry
(``runtime.py``, names ``dispatch``, ``recompute``, ``groups``, ``grad_order``), and
:func:`uninstall` restores the stock methods. :func:`set_plan` only sets attributes, so it costs nothing,
needs no communication, and can change before every micro-batch: autograd replays
whichever strategy ran in forward.
"""
from __future__ import annotations

import copy
import functools

import torch

from .. import runtime
from . import context, grad_order, groups, prefetch, recompute, strategies
from .packing import documents_from, pad_pack
from .plan_check import PlanMismatchError, verify_plans
from .plans import normalize_plan, split_entry
from .strategies.base import STOCK_FORWARD, STRATEGY_ATTR

_ATTR = STRATEGY_ATTR
_NAME = "dispatch"  # the registry's name of these patches


def installed() -> bool:
    return runtime.is_installed(_NAME)


@functools.lru_cache(maxsize=None)
def _classes() -> tuple:
    """megatron's patched classes (imported on first use: the package imports without megatron)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return DotProductAttention, SelfAttention, MLP, GPTModel, TransformerLayer


def install() -> None:
    """Patch megatron.core's attention, MLP, layer and GPT forwards and its checkpoint function
    (a recompute re-runs the plan of its forward, ``recompute.py``); idempotent. The patches
    are the registry's (``runtime.py``, name ``dispatch``)."""
    if installed():
        return
    DotProductAttention, SelfAttention, MLP, GPTModel, TransformerLayer = _classes()
    runtime.install(
        _NAME,
        runtime.Patch(DotProductAttention, "__init__", _dpa_init),
        # the stock forwards, kept where strategies call them (``strategies/base.py``)
        runtime.Patch(SelfAttention, STOCK_FORWARD, SelfAttention.forward),
        runtime.Patch(MLP, STOCK_FORWARD, MLP.forward),
        runtime.Patch(SelfAttention, "forward", _attention_forward),
        runtime.Patch(MLP, "forward", _mlp_forward),
        runtime.Patch(GPTModel, "forward", _gpt_forward),
        runtime.Patch(TransformerLayer, "forward", _layer_forward),
        runtime.Patch(TransformerLayer, "_forward_attention", _attention_block),
        runtime.Patch(TransformerLayer, "_forward_mlp", _mlp_block))
    recompute.install()
    groups.install()  # the weight communicators, created now or with megatron's parallel state
    grad_order.install()  # DDP's overlapped gradient reductions in bucket order on every replica


def uninstall() -> None:
    """Restore stock megatron-core behaviour; idempotent. Plans set on models are ignored."""
    if not installed():
        return
    runtime.restore(_NAME)
    recompute.uninstall()
    groups.uninstall()
    grad_order.uninstall()


_DPA, _ATTENTION, _MLP, _GPT, _LAYER = range(5)  # _classes()'s order


def _original(cls: int, attribute: str):
    """megatron's own ``attribute`` of ``_classes()[cls]``, which the plugin replaced."""
    return runtime.original(_NAME, _classes()[cls], attribute)


# Fail closed: a strategy runs only on arguments it handles. Every other argument must be
# absent or None; anything else is an error naming it (a new megatron argument included).
# what strategies read: RoPE at global positions; a pack's document boundaries (THD)
_ATTENTION_ARGS = ("rotary_pos_emb", "packed_seq_params")
_MLP_ARGS = ("padding_mask",)  # megatron's dense MLP ignores it as well (MoE routing only)


def _unhandled(kwargs, handled) -> list:
    return sorted(k for k, v in kwargs.items() if k not in handled and v is not None)


def _dpa_init(self, config, *args, **kwargs):
    """megatron's local ``DotProductAttention`` refuses ``context_parallel_size > 1`` when built.
    With the plugin installed it is built from a copy of the config at CP = 1: strategies attend
    across CP ranks themselves, and the stock attention refuses to run under CP
    (:func:`_attention_forward`), so its local-only softmax is never used."""
    if getattr(config, "context_parallel_size", 1) > 1:
        config = copy.copy(config)
        config.context_parallel_size = 1
    _original(_DPA, "__init__")(self, config, *args, **kwargs)


def _layer_forward(self, *args, **kwargs):
    return recompute.layer_forward(_original(_LAYER, "forward"), self, args, kwargs)


def _attention_block(self, *args, **kwargs):
    return recompute.block_forward(_original(_LAYER, "_forward_attention"), self, "attn", args, kwargs)


def _mlp_block(self, *args, **kwargs):
    return recompute.block_forward(_original(_LAYER, "_forward_mlp"), self, "mlp", args, kwargs)


def _attention_forward(self, hidden_states, attention_mask=None, *args, **kwargs):
    name = recompute.lookup(self, _ATTR)
    cp = context.cp_size(self.config)
    if name is None and cp > 1:
        raise NotImplementedError(
            f"context_parallel_size={cp}: megatron's local attention cannot attend across CP ranks "
            "(stock megatron runs CP with Transformer Engine only); set a ParaDySe plan on every layer "
            "(megatron_paradyse.set_plan, or --paradyse)")
    if name is None:
        return _original(_ATTENTION, "forward")(self, hidden_states, attention_mask, *args, **kwargs)
    if args:
        raise TypeError(f"ParaDySe strategy {name!r}: attention takes its optional arguments by "
                        f"keyword only (got {len(args)} more positional)")
    used = _unhandled(kwargs, _ATTENTION_ARGS)
    if used:
        raise NotImplementedError(f"ParaDySe strategy {name!r} does not handle the attention "
                                  f"argument(s) {', '.join(used)} (training with causal "
                                  f"self-attention only; handled: {', '.join(_ATTENTION_ARGS)})")
    if attention_mask is not None:
        raise NotImplementedError(f"ParaDySe strategy {name!r} implements the causal mask itself; "
                                  "pass attention_mask=None")
    mask_type = getattr(getattr(self, "attn_mask_type", None), "name", None)
    if mask_type != "causal":
        raise NotImplementedError(f"ParaDySe strategy {name!r} implements causal attention only; "
                                  f"this layer's attn_mask_type is {mask_type}")
    params = kwargs.get("packed_seq_params")
    docs = None
    if params is not None:
        docs = documents_from(params, hidden_states.shape[0] * self.config.tensor_model_parallel_size * cp)
    return strategies.get(name).attention(self, hidden_states, kwargs.get("rotary_pos_emb"), docs)


def _mlp_forward(self, hidden_states, *args, **kwargs):
    name = recompute.lookup(self, _ATTR)
    if name is None:
        return _original(_MLP, "forward")(self, hidden_states, *args, **kwargs)
    if args:
        raise TypeError(f"ParaDySe strategy {name!r}: MLP takes its optional arguments by "
                        f"keyword only (got {len(args)} more positional)")
    used = _unhandled(kwargs, _MLP_ARGS)
    if used:
        raise NotImplementedError(f"ParaDySe strategy {name!r} does not handle the MLP argument(s) "
                                  f"{', '.join(used)} (plain dense MLPs only)")
    return strategies.get(name).mlp(self, hidden_states)


def _gpt_forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
    plan = getattr(self, "_paradyse_plan", None)
    if plan is None or input_ids is None:
        return _original(_GPT, "forward")(self, input_ids, position_ids, attention_mask, *args, **kwargs)
    p = self.config.tensor_model_parallel_size
    s = input_ids.shape[1]
    params = kwargs.get("packed_seq_params")
    cp = context.cp_size(self.config)
    if cp > 1:
        _check_cp_batch(input_ids, params, s, cp, p)
        return _original(_GPT, "forward")(self, input_ids, position_ids, attention_mask, *args, **kwargs)
    if params is None:
        if s % p:
            raise ValueError(
                f"sequence length {s} is not divisible by the switching group size p={p}: every "
                f"strategy keeps [s/p, b, h] between layers; pad the batch to a multiple of {p} "
                "(megatron_paradyse.data.pad_to_multiple does this and masks the padding)")
        return _original(_GPT, "forward")(self, input_ids, position_ids, attention_mask, *args, **kwargs)
    if input_ids.shape[0] != 1:
        raise ValueError(f"a packed micro-batch is one row of tokens [1, T] (THD), got {tuple(input_ids.shape)}")
    if args:
        raise TypeError("ParaDySe: with packed_seq_params pass GPTModel.forward's optional arguments by keyword")
    kwargs["packed_seq_params"], pad = pad_pack(params, s, p)
    if pad:  # one trailing padding document; its outputs are cut off below
        input_ids, position_ids = _pad_row(input_ids, pad), _pad_row(position_ids, pad, positions=True)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = _pad_row(kwargs["labels"], pad)
    out = _original(_GPT, "forward")(self, input_ids, position_ids, attention_mask, **kwargs)
    # the last stage's [b, T] loss or logits lose the padding; an earlier pipeline stage's
    # output is the padded [T/p, 1, h] activation the next stage receives
    return out[:, :s] if pad and torch.is_tensor(out) and self.post_process else out


def _check_cp_batch(input_ids, params, s: int, cp: int, p: int) -> None:
    """This CP rank's ``s`` tokens (megatron's ``get_batch_on_this_cp_rank`` chunks) split into
    two chunks over p ranks; a pack's boundaries are the whole pack's, already padded (a pack
    cannot be padded here: its tokens are spread over the CP ranks)."""
    context.check_local_length(s, cp, p)
    if params is None:
        return
    if input_ids.shape[0] != 1:
        raise ValueError(f"a packed micro-batch is one row of tokens [1, T] (THD), got {tuple(input_ids.shape)}")
    documents_from(params, s * cp)


def _pad_row(x, pad: int, positions: bool = False):
    """``[1, T]`` with ``pad`` more entries: zeros, or positions 0.. of the padding document."""
    if x is None:
        return None
    tail = torch.arange(pad, device=x.device, dtype=x.dtype) if positions else x.new_zeros(pad)
    return torch.cat([x, tail.unsqueeze(0)], dim=1)


def unwrap(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers (or a list of one)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("set_plan takes one model chunk (no virtual pipeline stages)")
        model = model[0]
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    if not hasattr(model, "decoder"):
        raise TypeError(f"expected a megatron GPTModel (or a wrapper of one), got {type(model).__name__}")
    return model


_VERIFIED_CALLS = [0]


def set_plan(model, plan, verify: bool = False, group=None) -> tuple:
    """Run each decoder layer of ``model`` with the strategy the plan names.

    ``plan`` is one entry for all layers or a list with one entry per layer of the whole
    model (``config.num_layers``; a pipeline stage takes its own layers' entries); an entry is a
    strategy name, or one with ``:rc`` (``tp_sp:rc``: that layer is also recomputed in
    backward). A recompute, planned or megatron's own (``recompute_granularity``), re-runs the
    plan of its forward, whatever plan is set by then (``recompute.py``). Every check
    (length, names, what each strategy supports for this model and group size) happens here,
    locally, before any collective, so a bad plan fails on every rank alike. Returns the plan
    as a tuple. ``set_plan(model, None)`` returns the layers to stock megatron code.

    ``verify=True`` (collective over ``group``, default the model's tensor-parallel group,
    i.e. the switching group): one all-reduce of a few integers checks that every rank of the
    group set the same plan; a divergent plan, or a bad plan on some ranks only, raises
    :class:`~megatron_paradyse.parallel.plan_check.PlanMismatchError` on every rank of the
    group (naming each rank's plan) and restores the previous plan, instead of a hang in the
    next forward. Every rank of the group must call it the same number of times.
    """
    if not verify:
        return _set_plan(model, plan)
    previous, result, error, exc = None, None, None, None
    try:
        previous = get_plan(model)
        result = _set_plan(model, plan)
    except Exception as e:  # noqa: BLE001 - agreed on with the group below
        error, exc = f"{type(e).__name__}: {e}", e
    if group is None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_tensor_model_parallel_group()
    call = _VERIFIED_CALLS[0]
    _VERIFIED_CALLS[0] += 1
    try:
        verify_plans(call, [(result, ())], 1, 0, 1, error, group, where=f"set_plan(verify=True) call {call}")
    except PlanMismatchError as e:
        if exc is None:
            _set_plan(model, previous)
        raise e from exc
    return result


def _set_plan(model, plan) -> tuple:
    if not installed():
        raise RuntimeError("call megatron_paradyse.install() before set_plan()")
    gpt = unwrap(model)
    layers = list(gpt.decoder.layers)
    if plan is None:
        for layer in layers:
            setattr(layer.self_attention, _ATTR, None)
            setattr(layer.mlp, _ATTR, None)
            setattr(layer, recompute.RC_ATTR, None)
        gpt._paradyse_plan = None
        return None
    plan = normalize_plan(plan, gpt.config.num_layers)
    cfg = gpt.config
    p = cfg.tensor_model_parallel_size
    if p > 1 and not cfg.sequence_parallel:
        raise ValueError("ParaDySe needs sequence_parallel=True: every strategy keeps the "
                         "[s/p, b, h] sequence-parallel layout between layers")
    for name in sorted({split_entry(e)[0] for e in plan}):
        ok, why = strategies.supports(name, cfg, p)
        if not ok:
            raise ValueError(f"strategy {name!r} cannot run this model over p={p}: {why}")
    if not getattr(gpt, _MODULES_CHECKED, False):  # once per model: set_plan runs every micro-batch
        check_model(gpt)
        setattr(gpt, _MODULES_CHECKED, True)
    prefetch.link(layers)  # each layer's neighbours, for the gathers prefetched across layers
    for layer, entry in zip(layers, stage_entries(plan, layers)):
        name, rc = split_entry(entry)
        setattr(layer.self_attention, _ATTR, name)
        setattr(layer.mlp, _ATTR, name)
        setattr(layer, recompute.RC_ATTR, rc)
    gpt._paradyse_plan = plan
    return plan


def stage_entries(plan: tuple, layers) -> tuple:
    """The entries of a whole-model ``plan`` for ``layers``, by megatron's global (1-based)
    ``layer_number``: with pipeline stages each stage runs its own slice of one plan."""
    return tuple(plan[layer.layer_number - 1] for layer in layers)


def get_plan(model):
    return getattr(unwrap(model), "_paradyse_plan", None)


_MODULES_CHECKED = "_paradyse_modules_checked"


def _local_spec_modules() -> dict:
    """Each decoder-layer submodule the strategies read or replace, and the types megatron-core's
    local layer spec (``get_gpt_layer_local_spec``) builds there (exact types, no subclasses)."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    # the local spec's norms: apex's FusedLayerNorm, or torch's (WrappedTorchNorm and the
    # plugin's SPTorchNorm return torch.nn.LayerNorm / RMSNorm instances)
    norms = tuple(t for t in (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", None), FusedLayerNorm) if t)
    return {
        "input_layernorm": norms,
        "self_attention": (SelfAttention,),
        "self_attention.linear_qkv": (ColumnParallelLinear,),
        "self_attention.core_attention": (DotProductAttention,),
        "self_attention.linear_proj": (RowParallelLinear,),
        "self_attention.q_layernorm": (IdentityOp, type(None)),  # qk-layernorm: not supported
        "self_attention.k_layernorm": (IdentityOp, type(None)),
        "pre_mlp_layernorm": norms,
        "mlp": (MLP,),
        "mlp.linear_fc1": (ColumnParallelLinear,),
        "mlp.linear_fc2": (RowParallelLinear,),
    }


def supports_model(model) -> tuple[bool, str]:
    """(True, "") if every decoder layer of ``model`` is built of megatron-core's local layer
    spec modules, which every strategy (``tp_sp`` included) reads or replaces, else (False,
    the first module that is not, named by its path)."""
    gpt = unwrap(model)
    expected = _local_spec_modules()
    for i, layer in enumerate(gpt.decoder.layers):
        for path, types in expected.items():
            module = layer
            for attr in path.split("."):
                module = getattr(module, attr, None)
            if type(module) in types:
                continue
            want = " or ".join(t.__name__ for t in types if t is not type(None))
            got = "missing" if module is None else f"{type(module).__name__}"
            return False, (
                f"decoder.layers.{i}.{path} is {got}, where megatron-core's local layer spec has "
                f"{want}: ParaDySe strategies run the local spec's modules (ColumnParallelLinear, "
                "RowParallelLinear, DotProductAttention, MLP, unfused norms) and would skip or "
                "replace others (e.g. Transformer Engine's LayerNorm fused into linear_qkv, its "
                "attention); build the model with megatron-core's local spec (Megatron-LM: "
                "--transformer-impl local)")
    return True, ""


def check_model(model) -> None:
    """:func:`supports_model`, raising ``TypeError`` with its reason (what ``set_plan`` runs
    once per model)."""
    ok, why = supports_model(model)
    if not ok:
        raise TypeError(why)
