"""Hooks for Megatron-LM's own ``pretrain()``: args provider, forward step, providers.

For a Megatron-LM checkout, or megatron-core >= 0.17 on Python >= 3.12, where
``megatron.training`` imports. NOT exercised against a real ``megatron.training`` by this
repository's tests (megatron-core 0.16.1 has none); only against a stand-in module.
"""
from __future__ import annotations

from .. import data as pdata
from .forward_step import forward_step
from .iterator import PlannedIterator
from ..parallel.plans import parse_plan, rule_plan_fn


# For Megatron-LM's own pretrain() (a Megatron-LM checkout, or megatron-core >= 0.17 on
# Python >= 3.12, where ``megatron.training`` imports). NOT exercised by this repository's
# tests, which run on megatron-core 0.16.1 without megatron.training.

_MEGATRON_ITERATORS: dict = {}


def megatron_training_available() -> bool:
    try:
        import megatron.training  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or 0.17+ on Python 3.11 (typing.override)
        return False
    return True


def _megatron_planned_iterator(data_iterator, model):
    """One :class:`PlannedIterator` per (Megatron data iterator, train/eval)."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = get_args()
    key = (id(data_iterator), bool(model.training))
    it = _MEGATRON_ITERATORS.get(key)
    if it is not None:
        return it
    multiple = args.paradyse_pad_multiple or args.tensor_model_parallel_size

    def source():
        while True:
            if getattr(args, "paradyse_data_on_every_rank", False) and data_iterator is not None:
                batch = next(data_iterator)
            else:  # datasets built on TP rank 0 only: megatron broadcasts over the TP group
                from megatron.training.utils import get_batch_on_this_tp_rank

                batch = get_batch_on_this_tp_rank(data_iterator)
            yield pdata.trim_to_multiple(batch["tokens"], batch["labels"], batch["loss_mask"], multiple,
                                         batch.get("position_ids"))

    if model.training:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        nmb = get_num_microbatches
    else:
        nmb = 1  # evaluation: plan and check each micro-batch on its own
    plan_fn = rule_plan_fn(parse_plan(args.paradyse_plan, args.num_layers)) if args.paradyse else None
    it = PlannedIterator(source(), plan_fn, nmb,
                         group_index=parallel_state.get_data_parallel_rank(),
                         num_groups=parallel_state.get_data_parallel_world_size())
    _MEGATRON_ITERATORS[key] = it
    return it


def paradyse_forward_step(stock_forward_step=None):
    """A Megatron-LM ``forward_step`` that runs ParaDySe plans when ``--paradyse`` is given.

    Without ``--paradyse`` it calls ``stock_forward_step`` (Megatron-LM's own) unchanged.
    Usage in Megatron-LM's ``pretrain_gpt.py``: ``pretrain(..., paradyse_forward_step(forward_step),
    ..., extra_args_provider=add_paradyse_args)``.
    """

    def _forward_step(data_iterator, model, *unused_args, **unused_kwargs):
        from megatron.training import get_args

        args = get_args()
        paradyse = bool(getattr(args, "paradyse", False))
        if not paradyse and stock_forward_step is not None:
            return stock_forward_step(data_iterator, model, *unused_args, **unused_kwargs)
        if paradyse:
            import megatron_paradyse as mp

            mp.install()
        it = _megatron_planned_iterator(data_iterator, model)
        return forward_step(it, model, paradyse=paradyse)

    return _forward_step


def paradyse_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-LM datasets provider: variable-length documents (``--mock-data`` or one
    ``--data-path`` prefix) as fixed-shape samples that the forward step trims per micro-batch.
    Built on every rank (``is_distributed``), so no TP broadcast is needed."""
    from megatron.training import get_args

    args = get_args()
    args.paradyse_data_on_every_rank = True
    if not hasattr(args, "paradyse_mock_min_length"):
        args.paradyse_mock_min_length = 16
    if getattr(args, "vocab_size", None) is None:
        args.vocab_size = args.padded_vocab_size
    ds = pdata.build_dataset(args)
    train = pdata.FixedLengthView(ds, args.seq_length, num_samples=max(1, train_val_test_num_samples[0]))
    return train, None, None


paradyse_datasets_provider.is_distributed = True


def paradyse_model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                            pg_collection=None):
    """Megatron-LM model provider: a stock GPTModel with megatron-core's local layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    if getattr(args, "paradyse", False):
        import megatron_paradyse as mp

        mp.install()
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
    )


def megatron_lm_main() -> None:
    """Train through Megatron-LM's ``pretrain()`` with the ParaDySe hooks (untested here)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from .arguments import add_paradyse_args

    pretrain(paradyse_datasets_provider, paradyse_model_provider, ModelType.encoder_or_decoder,
             paradyse_forward_step(None), extra_args_provider=add_paradyse_args,
             args_defaults={"tokenizer_type": "NullTokenizer"})
