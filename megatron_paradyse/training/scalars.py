"""TensorBoard and wandb scalars of ``pretrain_gpt_paradyse.py``, as Megatron-LM writes them.

* :func:`check_args`: ``--tensorboard-dir`` without the ``tensorboard`` package, or
  ``--wandb-project`` without ``wandb`` (or without ``--wandb-exp-name``, as Megatron-LM): one
  line at start-up, on every rank, before any collective.
* :class:`ScalarWriter`: built on the last rank only (``rank == world_size - 1``, Megatron-LM's
  ``_set_tensorboard_writer`` / ``_set_wandb_writer``), None on the others. Per step
  (:meth:`~ScalarWriter.step`, every ``--tensorboard-log-interval`` iterations) Megatron-LM's
  tags (``training_log``): ``learning-rate``, ``batch-size``, ``lm loss``, ``grad-norm`` with
  their ``vs samples`` variants, ``throughput`` (tokens/s here), ``iteration-time`` with
  ``--log-timers-to-tensorboard``; the plugin's own under ``paradyse/`` (:func:`plan_shares`, the
  planner's predictions beside the measured step). :meth:`~ScalarWriter.validation` writes
  ``lm loss validation`` and ``lm loss validation ppl`` (``evaluate_and_print_results``' tags).
  wandb gets the same scalars through ``wandb.log(values, step)``.
"""
import importlib.util
import os
import sys

from ..parallel.plans import split_entry
from ..units import MiB

STOCK = "stock"  # the share of layers a plan leaves to megatron's own code (entry None)


def _importable(name: str) -> bool:
    if name in sys.modules:  # already imported (or put there, as tests do)
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def check_args(args, error) -> None:
    """The packages and names the logging flags need, checked locally; ``error(msg)`` raises."""
    if args.tensorboard_dir and not _importable("tensorboard"):
        error(f"--tensorboard-dir {args.tensorboard_dir} needs the tensorboard package: "
              "pip install tensorboard")
    if args.wandb_project:
        if not _importable("wandb"):
            error(f"--wandb-project {args.wandb_project} needs the wandb package: pip install wandb")
        if not args.wandb_exp_name:
            error("--wandb-project needs --wandb-exp-name (the run's name), as in Megatron-LM")
    if args.tensorboard_log_interval < 1:
        error(f"--tensorboard-log-interval must be at least 1, got {args.tensorboard_log_interval}")


def plan_shares(plans) -> dict:
    """``{tag: share}`` over the layers x micro-batches of ``plans`` (one plan per micro-batch):
    each strategy's share (``paradyse/strategy-share/NAME``; ``stock`` for entries None) and the
    share recomputed in backward, whole layer or one block (``paradyse/recompute-share``)."""
    entries = [e for plan in plans if plan is not None for e in plan]
    if not entries:
        return {}
    counts: dict = {}
    recomputed = 0
    for e in entries:
        name, rc = (STOCK, None) if e is None else split_entry(e)
        counts[name] = counts.get(name, 0) + 1
        recomputed += rc is not None
    out = {f"paradyse/strategy-share/{k}": v / len(entries) for k, v in sorted(counts.items())}
    out["paradyse/recompute-share"] = recomputed / len(entries)
    return out


def measure_scalars(measure, stats) -> dict:
    """The planner's predictions beside the measured step (``Trainer.last_measure``; None
    without a planner: the measured seconds alone): seconds, and the peak in MiB where
    measured (a pipeline's: the highest stage's, predicted and measured)."""
    out = {"paradyse/step-seconds/measured": stats.seconds}
    if not measure:
        return out
    out["paradyse/step-seconds/predicted"] = measure["pred_seconds"]
    if "pred_stage_peaks" in measure:  # pipeline: max over the stages
        pred, meas = max(measure["pred_stage_peaks"]), measure.get("stage_peaks")
        meas = None if meas is None else max(meas)
    else:
        pred, meas = measure["pred_peak"], measure.get("peak")
    out["paradyse/peak-MiB/predicted"] = pred / MiB
    if meas is not None:
        out["paradyse/peak-MiB/measured"] = meas / MiB
    return out


class ScalarWriter:
    """The run's TensorBoard ``SummaryWriter`` and/or wandb, with Megatron-LM's tags.

    ``tb``: a ``SummaryWriter`` (or None); ``wandb``: the ``wandb`` module after ``wandb.init``
    (or None). ``batch_size``: the global batch (``batch-size``, consumed samples).
    """

    def __init__(self, tb=None, wandb=None, batch_size: int = 1, log_interval: int = 1,
                 timers: bool = False, cp_size: int = 1):
        self.tb, self.wandb = tb, wandb
        self.batch_size, self.log_interval, self.timers, self.cp_size = batch_size, log_interval, timers, cp_size
        self._strategies: set = set()  # every strategy seen: a share of 0 written once seen

    @classmethod
    def from_args(cls, args, rank: int, world_size: int, cp_size: int = 1):
        """The writer of the flags on the last rank (Megatron-LM's choice), None elsewhere or
        without ``--tensorboard-dir`` and ``--wandb-project``."""
        if rank != world_size - 1 or not (args.tensorboard_dir or args.wandb_project):
            return None
        tb = wb = None
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
        if args.wandb_project:
            import wandb as wb

            save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else "wandb")
            os.makedirs(save_dir, exist_ok=True)
            wb.init(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project,
                    config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})
        return cls(tb, wb, batch_size=args.global_batch_size, log_interval=args.tensorboard_log_interval,
                   timers=args.log_timers_to_tensorboard, cp_size=cp_size)

    def write(self, values: dict, iteration: int, samples: int | None = None) -> None:
        """``values`` at ``iteration`` (TensorBoard: with ``TAG vs samples`` at ``samples`` for
        the tags Megatron-LM writes so; wandb: one ``log`` call)."""
        if self.tb is not None:
            for tag, v in values.items():
                self.tb.add_scalar(tag, v, iteration)
                if samples is not None and not tag.startswith("paradyse/") and tag not in _NO_SAMPLES:
                    self.tb.add_scalar(f"{tag} vs samples", v, samples)
        if self.wandb is not None:
            self.wandb.log(dict(values), step=iteration)

    def step(self, stats, measure=None, plan_seconds: float | None = None) -> None:
        """One training step's scalars (``stats``: a ``trainer.StepStats``); ``measure``: the
        planner's predictions and measured peak of the step; ``plan_seconds``: the planner's
        time on the step's micro-batches."""
        it = stats.iteration
        if it % self.log_interval:
            return
        values = {"learning-rate": stats.lr, "batch-size": self.batch_size, "lm loss": stats.loss,
                  "throughput": stats.tokens_per_second}
        if stats.grad_norm is not None:
            values["grad-norm"] = stats.grad_norm
        if self.timers:
            values["iteration-time"] = stats.seconds
        shares = plan_shares(stats.plans)
        self._strategies.update(k for k in shares if k.startswith("paradyse/strategy-share/"))
        values.update({k: shares.get(k, 0.0) for k in sorted(self._strategies)})
        if shares:
            values["paradyse/recompute-share"] = shares["paradyse/recompute-share"]
            values.update(measure_scalars(measure, stats))
            if plan_seconds is not None:
                values["paradyse/planner-seconds"] = plan_seconds
            if self.cp_size > 1:
                values["paradyse/cp-size"] = self.cp_size
        self.write(values, it, samples=it * self.batch_size)
        if self.wandb is not None:
            self.wandb.log({"samples vs steps": it * self.batch_size}, step=it)

    def validation(self, iteration: int, loss: float, ppl: float, suffix: str = "") -> None:
        """The validation loss and perplexity at ``iteration`` (``suffix``: Megatron-LM's, empty
        for the validation set, e.g. ``" test"`` for the test set), for the evaluation to call."""
        values = {f"lm loss validation{suffix}": loss, f"lm loss validation{suffix} ppl": ppl}
        self.write(values, iteration, samples=iteration * self.batch_size)

    def flush(self) -> None:
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


_NO_SAMPLES = frozenset({"throughput", "iteration-time"})  # Megatron-LM writes these by iteration only
