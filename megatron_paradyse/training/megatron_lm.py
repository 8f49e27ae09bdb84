"""Megatron-LM's own, unmodified ``pretrain_gpt.py`` with ParaDySe: an entry point, no patch.

    torchrun --nproc-per-node 8 -m megatron_paradyse.training.megatron_lm \\
        /path/to/Megatron-LM/pretrain_gpt.py <Megatron-LM flags> \\
        --transformer-impl local --sequence-parallel --paradyse --paradyse-plan "rule:4096=tp_sp,ulysses"

(``--paradyse`` without ``--paradyse-plan``: the planner chooses each micro-batch's plan,
``--paradyse-memory-budget`` and the other planner flags as in ``pretrain_gpt_paradyse.py``.)

The entry point installs hooks into ``megatron.training`` and then runs the user's script
as ``__main__`` (its directory first on ``sys.path``, as ``python
script.py`` would). The hooks (:func:`install_hooks`, idempotent):

* ``megatron.training.arguments.parse_args`` (and the copy ``initialize.py`` imported): the
  script's ``extra_args_provider`` (ModelOpt's, or none) is composed with
  :func:`add_megatron_lm_args`, so Megatron-LM parses the ``--paradyse*`` flags with its own.
* ``megatron.training.arguments.validate_args``: after Megatron-LM's own validation, the
  ParaDySe flags are checked (plan syntax and length, what each strategy supports for this
  model), locally on every rank, before any process group exists.
* ``megatron.training.pretrain``: the script's ``forward_step`` is wrapped by
  :func:`paradyse_forward_step` (stock when ``--paradyse`` is absent); its datasets provider
  is replaced by :func:`paradyse_datasets_provider` only with ``--paradyse-document-data``
  (one document per sample, variable lengths; for stock and ParaDySe runs alike).

Without ``--paradyse`` (and without ``--paradyse-document-data``) the script runs exactly as
Megatron-LM ships it. With ``--distributed-backend gloo`` (Megatron-LM's default is nccl;
gloo without CUDA) :mod:`megatron_paradyse.cpu_compat_training` is applied first (CPU ranks;
this is how the repository tests it).

Tested on CPU gloo ranks against Megatron-LM's unmodified files at core_v0.16.1 (with
megatron-core 0.16.1) and core_v0.19.0 (with megatron-core 0.19.2); docs/megatron_lm.md says
what ran, on what. On one H100 (p = 1, NCCL): core_v0.16.1's script stock and with
``--paradyse`` gave equal losses (docs/gpu.md).
"""
from __future__ import annotations

import os
import sys

from .. import data as pdata
from .planning import planner_from_args
from ..parallel.plans import describe_plans, parse_plan, rule_plan_fn
from .arguments import add_paradyse_args, add_planner_args
from .forward_step import forward_step
from .iterator import PlannedIterator

_MEGATRON_ITERATORS: dict = {}
_HOOKS: dict = {}


def megatron_training_available() -> bool:
    try:
        import megatron.training  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or 0.17+ on Python 3.11 (typing.override)
        return False
    return True


# ---------------------------------------------------------------------------- arguments
def add_megatron_lm_args(parser):
    """Megatron-LM ``extra_args_provider``: the plugin's flags, plus the entry point's data flag."""
    if "--paradyse" in getattr(parser, "_option_string_actions", {}):
        return parser  # a script that already adds them (e.g. through paradyse_args_provider)
    add_paradyse_args(parser)
    add_planner_args(parser)
    g = parser.add_argument_group("ParaDySe data (Megatron-LM entry point)")
    g.add_argument("--paradyse-document-data", action="store_true",
                   help="Replace the script's datasets with one document per sample, padded to "
                        "--seq-length with a zero loss mask (--mock-data: synthetic documents of "
                        "log-uniform lengths; --data-path PREFIX: an IndexedDataset's documents). "
                        "Works with and without --paradyse; the ParaDySe forward step cuts each "
                        "micro-batch after its last real token (rounded up to the TP size).")
    return parser


def compose_args_providers(first, second=add_megatron_lm_args):
    """An ``extra_args_provider`` running ``first`` (may be None) then ``second``."""
    if first is None:
        return second

    def provider(parser):
        parser = first(parser) or parser
        return second(parser) or parser

    return provider


def check_paradyse_args(args) -> None:
    """Check the ParaDySe flags against Megatron-LM's parsed ``args``; ValueError naming the flags.

    Local (no collective): runs on every rank inside Megatron-LM's ``validate_args``.
    """
    if getattr(args, "paradyse_document_data", False):
        if bool(args.mock_data) == bool(args.data_path):
            raise ValueError("--paradyse-document-data needs exactly one of --mock-data and "
                             "--data-path PREFIX")
        if args.data_path and len(args.data_path) != 1:
            raise ValueError("--paradyse-document-data takes one --data-path prefix (no blends)")
    if not getattr(args, "paradyse", False):
        return
    if getattr(args, "overlap_param_gather", False):
        from .arguments import OVERLAP_PARAM_GATHER_WITH_PARADYSE

        raise ValueError(OVERLAP_PARAM_GATHER_WITH_PARADYSE)
    tp = args.tensor_model_parallel_size
    if tp > 1 and not args.sequence_parallel:
        raise ValueError("--paradyse needs --sequence-parallel: every strategy keeps the "
                         "[s/p, b, h] sequence-parallel layout between layers")
    if args.pipeline_model_parallel_size != 1 or args.context_parallel_size != 1:
        raise ValueError("--paradyse needs --pipeline-model-parallel-size 1 and "
                         "--context-parallel-size 1 (the strategies switch inside the TP group)")
    if getattr(args, "transformer_impl", "local") != "local":
        raise ValueError("--paradyse needs --transformer-impl local (the strategies run "
                         "megatron-core's local layer modules; Transformer Engine layers are not "
                         "switchable)")
    if args.hidden_dropout or args.attention_dropout:
        raise ValueError("--paradyse needs --hidden-dropout 0 --attention-dropout 0")
    if args.paradyse_pad_multiple is not None and (
            args.paradyse_pad_multiple < 1 or args.paradyse_pad_multiple % tp):
        raise ValueError(f"--paradyse-pad-multiple {args.paradyse_pad_multiple} must be a positive "
                         f"multiple of --tensor-model-parallel-size {tp}")
    from megatron.training.arguments import core_transformer_config_from_args

    from .arguments import validate_planner_args

    config = core_transformer_config_from_args(args)
    validate_planner_args(args, tp, config)  # the planner's flags; an error if given with a plan
    if args.paradyse_plan is None:
        if args.paradyse_refine == "on":
            raise ValueError("--paradyse-refine on is not available through Megatron-LM's pretrain(): "
                             "its step loop feeds no measured step back to the planner (use "
                             "pretrain_gpt_paradyse.py, or leave --paradyse-refine at auto/off)")
        return  # the planner chooses each micro-batch's plan (paradyse_planner_strategies: usable)
    try:
        rule = parse_plan(args.paradyse_plan, args.num_layers)
    except ValueError as e:
        raise ValueError(f"--paradyse-plan {args.paradyse_plan!r}: {e}") from None

    import megatron_paradyse as mp

    for name in rule.strategies():
        ok, why = mp.supports(name, config, tp)
        if not ok:
            raise ValueError(f"--paradyse-plan uses {name!r}, which cannot run this model over "
                             f"TP={tp}: {why}")


# ---------------------------------------------------------------------------- forward step
def _megatron_planned_iterator(data_iterator, model):
    """The :class:`PlannedIterator` for training, or the one for evaluation.

    Keyed by train/eval only, not by the data iterator: on TP ranks other than 0 Megatron-LM's
    data iterators are ``None`` (the batch comes by broadcast), so their identity cannot tell
    the validation and test sets apart there, while it does on TP rank 0. Every rank calls the
    forward step equally often, so the step counters agree; the micro-batches are read from
    the iterator of the current call.
    """
    from megatron.core import parallel_state
    from megatron.training import get_args

    import torch

    args = get_args()
    key = bool(model.training)
    cached = _MEGATRON_ITERATORS.get(key)
    if cached is not None:
        holder, it = cached
        holder[0] = data_iterator
        return it
    multiple = args.paradyse_pad_multiple or args.tensor_model_parallel_size
    holder = [data_iterator]

    def source():
        from megatron.training import utils as mutils

        get_batch_on_this_tp_rank = getattr(mutils, "get_batch_on_this_tp_rank", None)
        while True:
            if get_batch_on_this_tp_rank is not None:  # 0.16: data on TP rank 0, broadcast
                batch = get_batch_on_this_tp_rank(holder[0])
            else:  # 0.19: megatron.core.utils's takes the batch read on TP rank 0
                batch = _get_batch_019(holder[0], args)
            yield pdata.trim_to_multiple(batch["tokens"], batch["labels"], batch["loss_mask"], multiple,
                                         batch.get("position_ids"))

    if model.training:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        nmb = get_num_microbatches
    else:
        nmb = 1  # evaluation: plan and check each micro-batch on its own
    plan_fn = None
    if args.paradyse and args.paradyse_plan is not None:
        plan_fn = rule_plan_fn(parse_plan(args.paradyse_plan, args.num_layers))
    elif args.paradyse:
        plan_fn = _megatron_planner(args)
    it = _LoggedPlannedIterator(source(), plan_fn, nmb,
                                group_index=parallel_state.get_data_parallel_rank(),
                                num_groups=parallel_state.get_data_parallel_world_size(),
                                start_step=int(getattr(args, "iteration", 0) or 0))
    it.log = model.training and torch.distributed.get_rank() == 0
    _MEGATRON_ITERATORS[key] = (holder, it)
    return it


def _megatron_planner(args):
    """The planner's ``plan_fn`` (built once: training and evaluation share it and its cache)."""
    if "planner" not in _MEGATRON_PLANNER:
        import torch

        log = print if torch.distributed.get_rank() == 0 else (lambda *a, **k: None)
        _MEGATRON_PLANNER["planner"] = planner_from_args(args, lambda msg: log(msg, flush=True),
                                                         can_refine=False)
    return _MEGATRON_PLANNER["planner"][1]


_MEGATRON_PLANNER: dict = {}


class _LoggedPlannedIterator(PlannedIterator):
    """Prints each training step's micro-batch lengths and plans on global rank 0, one line per
    step, next to Megatron-LM's own iteration lines (rank 0's micro-batches); with the planner,
    also the step's predicted time (sum over micro-batches, plus the update once) and peak
    (largest)."""

    log = False

    def prefetch(self):
        fresh = not self._buffer
        items = super().prefetch()
        if fresh and self.log:
            lens = ",".join(str(mb.seq_length) for mb in items)
            line = (f" [paradyse] iteration {self.step:8d} | seq len: {lens} | plan: "
                    f"{describe_plans([mb.plan for mb in items])}")
            choices = getattr(self.plan_fn, "choices", None)
            if choices:
                got = [choices.get(i) for i in range(len(items))]
                got = [c for c in got if c is not None]
                if got:
                    update = self.plan_fn.planner.update_seconds()  # once per step
                    line += (f" | pred: {sum(c.seconds for c in got) + update:.3f} s, peak "
                             f"{max(c.peak_bytes for c in got) / 2 ** 20:.1f} MiB")
            print(line, flush=True)
        return items


def _get_batch_019(data_iterator, args):
    """Megatron-LM >= 0.19's TP broadcast (``megatron.core.utils.get_batch_on_this_tp_rank``)."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank

    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {k: (v.cuda(non_blocking=True) if v is not None else None)
                 for k, v in next(data_iterator).items()}
    return get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False,
        is_hybrid_cp=False, create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=1, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False, pipeline_model_parallel_size=1,
        is_pipeline_first_stage=True, is_pipeline_last_stage=True)


def paradyse_forward_step(stock_forward_step=None):
    """A Megatron-LM ``forward_step`` that runs ParaDySe plans when ``--paradyse`` is given.

    Without ``--paradyse`` it calls ``stock_forward_step`` (the script's own) unchanged (or,
    with none, the same data path with every plan ``None``: stock megatron-core layers). With
    it: installs the plugin once, reads each training step's micro-batches ahead (through
    Megatron-LM's TP-rank-0 broadcast), cuts each after its last loss-bearing token (rounded
    up to a multiple of the TP size), gives each its plan from ``--paradyse-plan``, checks with
    one all-reduce that all ranks agree, and runs the stock GPT forward with Megatron-LM's loss.
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

    _forward_step._paradyse = True
    return _forward_step


# ---------------------------------------------------------------------------- datasets
def paradyse_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron-LM datasets provider: one document per sample (``--mock-data`` or one
    ``--data-path`` prefix), padded to ``--seq-length`` with a zero loss mask, so batches
    have variable real lengths. Built where Megatron-LM builds data (TP rank 0)."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = get_args()
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None, None, None
    if getattr(args, "vocab_size", None) is None:
        args.vocab_size = args.padded_vocab_size
    if args.mock_data:
        ds = pdata.MockDataset(args.seq_length, args.vocab_size, seed=args.seed,
                               min_length=getattr(args, "paradyse_mock_min_length", 16))
    else:
        ds = pdata.DocumentDataset(args.data_path[0], args.seq_length, seed=args.seed)
    # train, validation, test: disjoint index ranges (mock: different synthetic documents; an
    # IndexedDataset: later reshuffled epochs of the same documents, no held-out split)
    views = []
    for k, n in enumerate(train_val_test_num_samples):
        views.append(_MaskedView(ds, args.seq_length, int(n), args.create_attention_mask_in_dataloader,
                                 offset=k << 30) if n else None)
    return tuple(views)


paradyse_datasets_provider.is_distributed = True


class _MaskedView(pdata.FixedLengthView):
    """:class:`FixedLengthView` plus Megatron-LM's dataloader attention mask when it wants one."""

    def __init__(self, dataset, seq_length, num_samples, with_mask, offset=0):
        super().__init__(dataset, seq_length, num_samples=max(1, num_samples))
        self.with_mask, self.offset = with_mask, offset

    def __getitem__(self, i):
        import torch

        if not 0 <= int(i) < len(self):
            raise IndexError(i)
        out = super().__getitem__(int(i) + self.offset)
        if self.with_mask:  # Megatron's convention: True = masked out
            s = self.seq_length
            out["attention_mask"] = ~torch.tril(torch.ones((1, s, s), dtype=torch.bool))
        return out


# ---------------------------------------------------------------------------- hooks
def _wrap_parse_args(orig):
    def parse_args(extra_args_provider=None, *args, **kwargs):
        return orig(compose_args_providers(extra_args_provider), *args, **kwargs)

    parse_args._paradyse = True
    return parse_args


def _wrap_validate_args(orig):
    def validate_args(args, *rest, **kwargs):
        out = orig(args, *rest, **kwargs)
        check_paradyse_args(args)
        return out

    validate_args._paradyse = True
    return validate_args


def _wrap_pretrain(orig):
    def pretrain(*args, **kwargs):
        args = list(args)
        # 0.16: pretrain(datasets_provider, model_provider, model_type, forward_step, ...);
        # 0.19: pretrain(full_config, datasets_provider, model_type, forward_step, ...).
        ds_index = 0 if callable(args[0]) else 1
        ds = args[ds_index]

        def datasets_provider(*a, **k):
            from megatron.training import get_args

            if getattr(get_args(), "paradyse_document_data", False):
                return paradyse_datasets_provider(*a, **k)
            return ds(*a, **k)

        datasets_provider.is_distributed = True  # ours is; the script's sets it too
        args[ds_index] = datasets_provider
        if "forward_step_func" in kwargs:
            kwargs["forward_step_func"] = paradyse_forward_step(kwargs["forward_step_func"])
        else:
            args[3] = paradyse_forward_step(args[3])
        return orig(*args, **kwargs)

    pretrain._paradyse = True
    return pretrain


def _prebuilt_dataset_helpers() -> None:
    """megatron-core's pip wheel ships ``datasets/helpers_cpp`` compiled, without the Makefile
    that ``compile_helpers`` (called by Megatron-LM's ``initialize_megatron`` on rank 0) runs:
    with a wheel's megatron-core, ``make`` fails and Megatron-LM exits. Skip the build when the
    compiled module already imports (a source checkout keeps its own ``make``)."""
    from megatron.core.datasets import utils as dutils

    orig = dutils.compile_helpers
    if getattr(orig, "_paradyse", False):
        return
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return

    def compile_helpers():
        return None

    compile_helpers._paradyse = True
    _HOOKS[(dutils, "compile_helpers")] = orig
    dutils.compile_helpers = compile_helpers


def install_hooks() -> None:
    """Install the hooks into ``megatron.training`` (idempotent). Needs ``megatron.training``."""
    if _HOOKS:
        return
    _prebuilt_dataset_helpers()
    import megatron.training as mt
    from megatron.training import arguments, initialize, training

    for mod in (arguments, initialize):
        if hasattr(mod, "parse_args"):
            _HOOKS[(mod, "parse_args")] = mod.parse_args
            mod.parse_args = _wrap_parse_args(mod.parse_args)
        if hasattr(mod, "validate_args"):
            _HOOKS[(mod, "validate_args")] = mod.validate_args
            mod.validate_args = _wrap_validate_args(mod.validate_args)
    new = _wrap_pretrain(training.pretrain)
    for mod in (training, mt):
        _HOOKS[(mod, "pretrain")] = mod.pretrain
        mod.pretrain = new


def uninstall_hooks() -> None:
    for (mod, name), orig in _HOOKS.items():
        setattr(mod, name, orig)
    _HOOKS.clear()


def _select_device(argv) -> None:
    """The device decision from Megatron-LM's ``--distributed-backend`` (its default nccl; gloo
    without CUDA), made before Megatron initialises: the allocator settings and the current
    device on GPUs, the CPU shims on CPU ranks. With sequence parallelism megatron's
    ``WrappedTorchNorm`` (the local spec's RMSNorm on every image) builds the SP torch norm."""
    import torch

    from ..device import select
    from ..norms import install_sp_norm

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    for i, a in enumerate(argv):
        if a == "--distributed-backend" and i + 1 < len(argv):
            backend = argv[i + 1]
        elif a.startswith("--distributed-backend="):
            backend = a.split("=", 1)[1]
    select(backend)
    if backend == "gloo":
        from .. import cpu_compat_training

        cpu_compat_training.apply()
    if "--sequence-parallel" in argv:
        install_sp_norm()


def run_script(script: str, argv: list) -> None:
    """Run Megatron-LM's ``script`` as ``__main__`` with ``argv``, with the hooks installed."""
    script = os.path.abspath(script)
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_paradyse.training.megatron_lm: no such script: {script}")
    sys.path.insert(0, os.path.dirname(script))  # its gpt_builders / model_provider / megatron/
    _select_device(argv)
    install_hooks()
    sys.argv = [script] + list(argv)
    # Not runpy.run_path: it would make the script ``sys.modules["__main__"]``, and the
    # processes that megatron's checkpoint writer starts with multiprocessing "spawn" (its
    # result-queue manager) would re-import the script, without the hooks and shims (and
    # import torch and megatron again). ``__main__`` stays this module, with its spec and file
    # hidden while the script runs, so spawned helpers re-import nothing: they need nothing
    # from ``__main__``.
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    namespace = {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__,
                 "__package__": None, "__spec__": None, "__cached__": None, "__doc__": None}
    main_module = sys.modules["__main__"]
    hidden = {k: main_module.__dict__.pop(k) for k in ("__file__",) if k in main_module.__dict__}
    spec, main_module.__spec__ = getattr(main_module, "__spec__", None), None
    try:
        exec(code, namespace)  # noqa: S102 - running the user's training script is the point
    finally:
        main_module.__spec__ = spec
        main_module.__dict__.update(hidden)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or not argv[0].endswith(".py"):
        print(__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    run_script(argv[0], argv[1:])


def megatron_lm_main() -> None:
    """``pretrain_gpt_paradyse.py --paradyse-trainer megatron``: Megatron-LM's ``pretrain()``
    with a local-spec GPT, ParaDySe's forward step and document datasets (needs
    ``megatron.training`` of Megatron-LM 0.16; ran on core_v0.16.1, equal to its own
    ``pretrain_gpt.py``). For 0.19 and later, use :func:`main` with Megatron-LM's script."""
    from megatron.core.enums import ModelType

    _select_device(sys.argv[1:])
    install_hooks()
    import inspect

    from megatron.training import pretrain

    first = next(iter(inspect.signature(_HOOKS[(sys.modules["megatron.training.training"], "pretrain")])
                      .parameters))
    if first != "train_valid_test_dataset_provider":  # 0.19+: pretrain(cfg_container, ...)
        raise SystemExit("pretrain_gpt_paradyse.py --paradyse-trainer megatron supports Megatron-LM "
                         "0.16's pretrain() only; with Megatron-LM >= 0.19 run its own script: "
                         "torchrun ... -m megatron_paradyse.training.megatron_lm "
                         "/path/to/Megatron-LM/pretrain_gpt.py <flags> --paradyse-document-data ...")
    pretrain(paradyse_datasets_provider, paradyse_model_provider, ModelType.encoder_or_decoder,
             None, args_defaults={"tokenizer_type": "NullTokenizer"})


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


if __name__ == "__main__":
    main()
