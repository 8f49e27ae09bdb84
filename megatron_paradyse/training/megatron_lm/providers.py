"""The three providers Megatron-LM's ``pretrain()`` takes, ParaDySe's: the forward step, the
document datasets and the local-spec GPT."""
from __future__ import annotations

import torch

from ... import data as pdata
from ...parallel.dispatch import install
from ..dims import dims_of
from ..forward_step import forward_step
from .iterator import planned_iterator
from .schedule import ChunkMicroBatches


def paradyse_forward_step(stock_forward_step=None):
    """A Megatron-LM ``forward_step`` that runs ParaDySe plans when ``--paradyse`` is given.

    Without ``--paradyse`` it calls ``stock_forward_step`` (the script's own) unchanged (or,
    with none, the same data path with every plan ``None``: stock megatron-core layers). With
    it: installs the plugin once, reads each training step's micro-batches ahead (through
    Megatron-LM's TP-rank-0 broadcast), cuts each after its last loss-bearing token (rounded
    up to a multiple of the TP size, with context parallelism of 2 x CP x TP), gives each its
    plan from ``--paradyse-plan``, checks with one all-reduce that all ranks agree, and runs the
    stock GPT forward with Megatron-LM's loss (with CP on this CP rank's two chunks, megatron's
    ``get_batch_on_this_cp_rank`` split; Megatron-LM sums the loss reports over DP x CP).
    """

    def reads_planned(args) -> bool:
        """This step reads the plugin's planned micro-batches (else the stock step runs)."""
        return bool(getattr(args, "paradyse", False)) or stock_forward_step is None

    def _forward_step(data_iterator, model, *unused_args, **unused_kwargs):
        from megatron.training import get_args

        args = get_args()
        if not reads_planned(args):
            return stock_forward_step(data_iterator, model, *unused_args, **unused_kwargs)
        paradyse = bool(getattr(args, "paradyse", False))
        if paradyse:
            install()
        # the interleaved schedule's chunks after the first: the step's micro-batches again
        it = data_iterator if isinstance(data_iterator, ChunkMicroBatches) else planned_iterator(data_iterator, model)
        # with context parallelism this rank runs its CP chunks of the micro-batch read whole
        return forward_step(it, model, paradyse=paradyse, cp=dims_of(args).cp)

    _forward_step._paradyse = True
    _forward_step.reads_planned = reads_planned  # schedule.py: pipeline stages read ahead
    return _forward_step


def paradyse_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-LM datasets provider: one document per sample (``--mock-data`` or one
    ``--data-path`` prefix), padded to ``--seq-length`` with a zero loss mask, so batches
    have variable real lengths. Built where Megatron-LM builds data (TP rank 0)."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = get_args()
    top = _longest_trainable(args)  # every rank: the planner is built at the same point on all
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None, None, None
    if getattr(args, "vocab_size", None) is None:
        args.vocab_size = args.padded_vocab_size
    if args.mock_data:
        ds = pdata.MockDataset(min(args.seq_length, top or args.seq_length), args.vocab_size, seed=args.seed,
                               min_length=args.paradyse_mock_min_length)
    else:
        ds = pdata.DocumentDataset(args.data_path[0], args.seq_length, seed=args.seed, max_length=top)
    # train, validation, test: disjoint index ranges (mock: different synthetic documents; an
    # IndexedDataset: later reshuffled epochs of the same documents, no held-out split)
    packed = getattr(args, "paradyse_pack", "none") == "greedy"
    views = []
    for k, n in enumerate(train_val_test_num_samples):
        if not n:
            views.append(None)
        elif packed:
            views.append(_PackedView(pdata.PackedStream(ds, args.seq_length, first=k << 30), args.seq_length, int(n)))
        else:
            views.append(_MaskedView(ds, args.seq_length, int(n), args.create_attention_mask_in_dataloader,
                                     offset=k << 30))
    return tuple(views)


paradyse_datasets_provider.is_distributed = True


def _longest_trainable(args):
    """With the planner: the longest length any plan fits under the budget (documents are cut
    to it, as in pretrain_gpt_paradyse.py), a ``BudgetError`` at start-up when none fits; else None."""
    if not args.paradyse or args.paradyse_plan is not None:
        return None
    from ..planning import longest_trainable
    from .iterator import megatron_dynamic_cp_planners, megatron_planner

    if not dims_of(args).dynamic_cp:
        return longest_trainable(megatron_planner(args), args)
    planners = megatron_dynamic_cp_planners(args)  # Dynamic CP: the whole pool's, under the cap per node
    top = longest_trainable(planners[max(planners)], args)
    cap = args.max_seqlen_per_dp_cp_rank
    return top if not cap else min(top, dims_of(args).dp * cap)


class _MaskedView(pdata.FixedLengthView):
    """:class:`FixedLengthView` plus Megatron-LM's dataloader attention mask when it wants one."""

    def __init__(self, dataset, seq_length, num_samples, with_mask, offset=0):
        super().__init__(dataset, seq_length, num_samples=max(1, num_samples))
        self.with_mask, self.offset = with_mask, offset

    def __getitem__(self, i):
        if not 0 <= int(i) < len(self):
            raise IndexError(i)
        out = super().__getitem__(int(i) + self.offset)
        if self.with_mask:  # Megatron's convention: True = masked out
            s = self.seq_length
            out["attention_mask"] = ~torch.tril(torch.ones((1, s, s), dtype=torch.bool))
        return out


class _PackedView:
    """Samples that are packs (``data.PackedStream``: consecutive documents up to --seq-length
    tokens), each padded to --seq-length by one padding document (positions from 0, zero loss
    mask), so the forward step finds every document boundary in ``position_ids``."""

    def __init__(self, stream, seq_length: int, num_samples: int):
        self.stream, self.seq_length, self.num_samples = stream, seq_length, max(1, num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i):
        if not 0 <= int(i) < len(self):
            raise IndexError(i)
        mb = self.stream[int(i)]
        pad = self.seq_length - mb.seq_length
        out = {}
        for key, t in (("tokens", mb.tokens), ("labels", mb.labels), ("loss_mask", mb.loss_mask)):
            out[key] = torch.nn.functional.pad(t[0], (0, pad), value=0)
        out["position_ids"] = torch.cat([mb.position_ids[0], torch.arange(pad, dtype=torch.long)])
        return out


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
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
    )
