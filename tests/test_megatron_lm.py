"""Megatron-LM's own, unmodified ``pretrain_gpt.py`` with the plugin (``megatron_paradyse.training.megatron_lm``).

Each test launches the real script under ``torchrun`` on CPU gloo ranks, through the entry
point ``python -m megatron_paradyse.training.megatron_lm SCRIPT ...``, once stock (no
``--paradyse``) and once with ``--paradyse`` and a length rule that mixes strategies per
layer and changes them per micro-batch, and compares Megatron-LM's own per-iteration
``lm loss`` lines (printed with 7 significant digits, so a print-rounding error of at most
about 1e-7 relative; the tolerance is 1e-5).

Where the checkout comes from: ``$MEGATRON_LM_PATH`` (a Megatron-LM checkout: the folder of
its ``pretrain_gpt.py``), else the fixture ``../shared/fixtures/megatron-lm-core_v<X>`` for
the installed megatron-core (0.16.x -> core_v0.16.1, whose ``megatron/training`` is in the
fixture; 0.19.x -> core_v0.19.0, whose ``megatron/training`` comes with the wheel). When
neither exists the tests are SKIPPED with a reason saying Megatron-LM's path was not tested.

The default suite runs the 0.16.1 line's core checks (stock vs ParaDySe, the planner in
Megatron-LM's ``pretrain``; kept short so the whole suite stays under 10 minutes here).
``PARADYSE_MEGATRON_LM_FULL=1`` (set by ``scripts/test_megatron_lm.sh``) adds the checkpoints
in both directions, an indexed dataset, bad flags and the 4-rank runs.
"""
from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB = os.path.join(ROOT, "tests", "megatron_lm_stub")
PY311 = os.path.join(ROOT, "tests", "megatron_lm_py311")
FULL = os.environ.get("PARADYSE_MEGATRON_LM_FULL", "") not in ("", "0")
PLAN = "rule:32=tp_sp,64=ulysses*2+colossal*2,96=ring*2+metp*2,tp_sp+ulysses+ring+metp"
ITERS, SAVE_AT = 10, 5
RUN_TIMEOUT = 420
_TMP = tempfile.mkdtemp(prefix="paradyse_megatron_lm_")
atexit.register(shutil.rmtree, _TMP, True)
# Megatron-LM's NullTokenizer adds an end-of-document id: --vocab-size 255 gives 256 ids, padded
# to 256 at TP=2, the same embedding as pretrain_gpt_paradyse.py's --vocab-size 255 (ids
# 0..254), so checkpoints move between the two trainers.
VOCAB = "255"


def _mcore_version() -> str:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return ""
    return __version__


def _checkout():
    """(folder of pretrain_gpt.py, description) or pytest.skip with the reason."""
    env = os.environ.get("MEGATRON_LM_PATH")
    if env:
        if not os.path.isfile(os.path.join(env, "pretrain_gpt.py")):
            pytest.fail(f"MEGATRON_LM_PATH={env} has no pretrain_gpt.py")
        return env, f"MEGATRON_LM_PATH={env}"
    ver = _mcore_version()
    tag = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}.get(".".join(ver.split(".")[:2]))
    if tag is None:
        pytest.skip(f"Megatron-LM's pretrain() NOT tested: no fixture pairs with megatron-core {ver!r} "
                    "and MEGATRON_LM_PATH is unset")
    path = os.path.normpath(os.path.join(ROOT, "..", "shared", "fixtures", f"megatron-lm-{tag}"))
    if not os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        pytest.skip(f"Megatron-LM's pretrain() NOT tested: neither the fixture {path} nor "
                    "MEGATRON_LM_PATH (a Megatron-LM checkout) is available")
    return path, f"fixture {tag}"


def _env(checkout: str) -> dict:
    paths = [ROOT]
    if os.path.isdir(os.path.join(checkout, "megatron", "training")):
        paths.append(checkout)
        if not os.path.isdir(os.path.join(checkout, "megatron", "legacy")):
            paths.append(STUB)  # the fixture lacks megatron/legacy and megatron/rl
    ver = tuple(int(x) for x in re.findall(r"\d+", _mcore_version())[:2])
    if sys.version_info < (3, 12) and ver >= (0, 17):
        paths.append(PY311)  # megatron-core >= 0.17 forced onto 3.11: typing.override (test only)
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return env


def model_flags(nproc: int, seq: int = 128) -> list:
    return [
        "--tensor-model-parallel-size", str(nproc), "--sequence-parallel",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
        "--train-iters", str(ITERS), "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB,
        "--transformer-impl", "local", "--distributed-backend", "gloo",
        "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--calculate-per-token-loss",
        "--no-create-attention-mask-in-dataloader", "--no-persist-layer-norm",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", str(SAVE_AT), "--seed", "1234",
    ]


class Run:
    def __init__(self, rc, out):
        self.rc, self.out = rc, out
        self.losses = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
            r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|", out)}
        self.valid = {(int(m.group(1)), m.group(3) or "periodic"): float(m.group(4)) for m in re.finditer(
            r"validation loss at iteration\s+(\d+)( on (validation|test) set)? \| lm loss value: ([0-9.E+-]+)",
            out)}
        self.plans = {int(m.group(1)): (m.group(2), m.group(3)) for m in re.finditer(
            r"\[paradyse\] iteration\s+(\d+) \| seq len: ([0-9,]+) \| plan: (\S+)", out)}

    def check(self):
        assert self.rc == 0, f"the run failed (rc {self.rc}); last output:\n{self.out[-6000:]}"
        return self


def launch(args: list, nproc: int = 2, timeout: float = RUN_TIMEOUT) -> Run:
    """``torchrun`` the entry point with Megatron-LM's ``pretrain_gpt.py`` and ``args``; a timeout
    kills the whole process group (never a hang)."""
    checkout, _ = _checkout()
    return _torchrun(["-m", "megatron_paradyse.training.megatron_lm",
                      os.path.join(checkout, "pretrain_gpt.py"), *args], nproc, timeout)


def _torchrun(argv: list, nproc: int, timeout: float) -> Run:
    checkout, _ = _checkout()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *argv]
    proc = subprocess.Popen(cmd, cwd=_TMP, env=_env(checkout), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run timed out after {timeout} s: {argv[:3]}; last output:\n{out[-6000:]}")
    return Run(proc.returncode, out)


def _ckpt_at(src: str, iteration: int) -> str:
    """A load folder holding only ``src``'s checkpoint of ``iteration`` (Megatron-LM loads the
    tracker's latest)."""
    dst = os.path.join(_TMP, f"{os.path.basename(src)}_at{iteration}")
    if not os.path.isdir(dst):
        name = f"iter_{iteration:07d}"
        shutil.copytree(os.path.join(src, name), os.path.join(dst, name))
        with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    return dst


@functools.lru_cache(maxsize=None)
def run(name: str, nproc: int = 2) -> Run:
    """One run per configuration, shared by the tests."""
    data = ["--mock-data", "--paradyse-document-data"]
    # the ParaDySe run recomputes: megatron's block recompute of layer 0 and plan entries ':rc'
    # (test_recompute_in_megatron_lm_pretrain); the pipeline and CP runs use PLAN without it
    para = ["--paradyse", "--paradyse-plan", RC_PLAN] + BLOCK
    save = lambda tag: ["--save", os.path.join(_TMP, f"{tag}{nproc}"), "--save-interval", str(SAVE_AT)]  # noqa: E731
    if name == "stock":
        args = data + (save("stock") if FULL else [])  # its checkpoint: FULL only
    elif name == "paradyse":
        args = data + para + (save("paradyse") if FULL else [])  # its checkpoint: FULL only
    elif name == "paradyse_from_stock":
        run("stock", nproc).check()
        args = data + para + ["--load", _ckpt_at(os.path.join(_TMP, f"stock{nproc}"), SAVE_AT)]
    elif name == "stock_from_paradyse":
        run("paradyse", nproc).check()
        args = data + ["--load", _ckpt_at(os.path.join(_TMP, f"paradyse{nproc}"), SAVE_AT)]
    else:
        raise KeyError(name)
    return launch(model_flags(nproc) + args, nproc)


def launch_core(args: list, nproc: int = 2, timeout: float = RUN_TIMEOUT) -> Run:
    """``pretrain_gpt_paradyse.py`` (the megatron-core trainer) with the same model and data."""
    flags = ["--tensor-model-parallel-size", str(nproc), "--sequence-parallel", "--num-layers", "4",
             "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
             "--train-iters", str(ITERS), "--mock-data", "--vocab-size", VOCAB,
             "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1", "--seed", "1234"]
    return _torchrun([os.path.join(ROOT, "pretrain_gpt_paradyse.py"), *flags, *args], nproc, timeout)


def _assert_close(got: dict, want: dict, iterations, what: str):
    for i in iterations:
        assert i in got and i in want, f"{what}: iteration {i} missing (got {sorted(got)}, want {sorted(want)})"
        rel = abs(got[i] - want[i]) / abs(want[i])
        assert rel < 1e-5, f"{what}: iteration {i}: lm loss {got[i]} vs {want[i]} (rel {rel:.2e})"


def _resumed_expected(stock: dict) -> dict:
    """Megatron-LM's log after a resume at SAVE_AT: its second line (SAVE_AT + 2) prints the mean
    of the first two iterations' losses (measured with stock Megatron-LM resuming its own
    checkpoint, core_v0.16.1, --vocab-size 256: 6.049054 = (6.055610 + 6.042497) / 2, with the
    initial weights before the jit_warmup CPU shim); every
    other line is the iteration's own loss. The weights are unaffected: later iterations equal
    the uninterrupted run."""
    want = dict(stock)
    want[SAVE_AT + 2] = (stock[SAVE_AT + 1] + stock[SAVE_AT + 2]) / 2
    return want


full = pytest.mark.skipif(not FULL, reason="the longer Megatron-LM checks run with PARADYSE_MEGATRON_LM_FULL=1 "
                                           "(bash scripts/test_megatron_lm.sh)")


def test_stock_and_paradyse_losses_equal():
    stock, para = run("stock").check(), run("paradyse").check()
    _assert_close(para.losses, stock.losses, range(1, ITERS + 1), "--paradyse vs stock Megatron-LM")
    # Megatron-LM's evaluation (every SAVE_AT iterations, then the validation and test sets)
    assert len(stock.valid) == 4 and set(para.valid) == set(stock.valid), (stock.valid, para.valid)
    _assert_close(para.valid, stock.valid, sorted(stock.valid), "validation/test loss")
    # the plugin really switched: per-micro-batch plans, several, mixed per layer
    assert not stock.plans, "the stock run must not run the plugin's forward step"
    assert sorted(para.plans) == list(range(1, ITERS + 1))
    plans = {p for _, line in para.plans.values() for p in line.split(",")}
    assert len(plans) >= 3 and any("+" in p for p in plans), plans
    assert any(len(set(line.split(","))) > 1 for _, line in para.plans.values()), \
        "plans must change between the micro-batches of one step"
    lengths = {int(s) for lens, _ in para.plans.values() for s in lens.split(",")}
    assert len(lengths) >= 5 and all(s % 2 == 0 for s in lengths), lengths
    # Megatron-LM parsed the plugin's flags with its own (argparse would refuse a collision)
    assert re.search(r"paradyse_plan \.+ " + re.escape(RC_PLAN), para.out)


@full
def test_stock_checkpoint_resumes_with_paradyse():
    """Megatron-LM's own save_checkpoint (stock run, iteration 5) loaded by a --paradyse run."""
    stock, resumed = run("stock").check(), run("paradyse_from_stock").check()
    assert "successfully loaded checkpoint" in resumed.out
    assert sorted(resumed.plans) == list(range(SAVE_AT + 1, ITERS + 1))
    _assert_close(resumed.losses, _resumed_expected(stock.losses), range(SAVE_AT + 1, ITERS + 1),
                  "--paradyse resumed from a stock checkpoint vs the stock run")


@full
def test_paradyse_checkpoint_resumes_stock():
    """The reverse: a --paradyse run's checkpoint loaded by stock Megatron-LM."""
    stock, resumed = run("stock").check(), run("stock_from_paradyse").check()
    assert "successfully loaded checkpoint" in resumed.out and not resumed.plans
    _assert_close(resumed.losses, _resumed_expected(stock.losses), range(SAVE_AT + 1, ITERS + 1),
                  "stock resumed from a --paradyse checkpoint vs the stock run")


@full  # the planner's hooks also run in the suite's plugin-trainer worlds (tests/test_training.py)
def test_planner_in_megatron_lm_pretrain():
    """--paradyse without --paradyse-plan in Megatron-LM's own pretrain(): the planner chooses
    each micro-batch's plan (a budget of 2.75 MiB per rank, which the analytic model of this
    shape puts between tp_sp's peak at 64 tokens and at 96, forces lean mixes on the longer
    documents), and the losses still equal stock Megatron-LM's."""
    stock = run("stock").check()
    got = launch(model_flags(2) + ["--mock-data", "--paradyse-document-data", "--paradyse",
                                   "--paradyse-memory-budget", str(2.75 / 1024)]).check()
    _assert_close(got.losses, stock.losses, range(1, ITERS + 1), "planner vs stock Megatron-LM")
    assert "> planner: optimal planner" in got.out, got.out[-3000:]
    plans = {p for _, line in got.plans.values() for p in line.split(",")}
    assert "tp_sp*4" in plans and any(p != "tp_sp*4" for p in plans), plans
    assert re.search(r"\[paradyse\] iteration .*\| pred: [0-9.]+ s, peak [0-9.]+ MiB", got.out)


RC_PLAN = "rule:32=tp_sp:rc,64=ulysses:rc*2+colossal*2,96=ring*2+metp:rc*2,tp_sp:rc+ulysses+ring:rc+metp"
BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]


def test_recompute_in_megatron_lm_pretrain():
    """Megatron-LM's --recompute-* flags (block: megatron recomputes layer 0) with a plan whose
    entries recompute other layers (':rc'): the losses equal stock Megatron-LM's (recompute
    changes no number; the same flags on stock are the FULL check below)."""
    stock, got = run("stock").check(), run("paradyse").check()  # the ParaDySe run is this one
    _assert_close(got.losses, stock.losses, range(1, ITERS + 1), "--paradyse with recompute vs stock Megatron-LM")
    plans = {p for _, line in got.plans.values() for p in line.split(",")}
    assert any(":rc" in p for p in plans), plans
    assert re.search(r"recompute_granularity \.+ full", got.out)


@full
def test_recompute_stock_with_the_same_flags():
    stock = launch(model_flags(2) + ["--mock-data", "--paradyse-document-data"] + BLOCK).check()
    _assert_close(stock.losses, run("stock").check().losses, range(1, ITERS + 1),
                  "stock Megatron-LM with --recompute-* vs without")


def one_line(out: Run, needle: str) -> None:
    """A user's mistake: one ``pretrain_gpt.py (megatron_paradyse): error:`` line holding
    ``needle`` (rank 0's; torchrun's summary repeats it), a worker's exit status 2, and no
    traceback from this package or megatron."""
    said = [ln for ln in out.out.splitlines() if ln.startswith("pretrain_gpt.py (megatron_paradyse): error: ")]
    assert out.rc != 0 and len(said) == 1 and needle in said[0], (said, out.out[-4000:])
    assert re.search(r"exitcode\s*:\s*2 ", out.out), out.out[-4000:]
    assert not re.search(r'File ".*(megatron_paradyse|/megatron/)', out.out), out.out[-4000:]


@full
def test_planner_flags_with_a_plan_are_a_clear_error():
    out = launch(model_flags(2) + ["--mock-data", "--paradyse", "--paradyse-plan", "tp_sp",
                                   "--paradyse-gamma", "0.1"])
    one_line(out, "--paradyse-gamma is for the planner")


@full
def test_a_budget_nothing_fits_is_one_line_at_start_up():
    """The datasets provider builds the planner on every rank: a budget that fits no
    micro-batch is refused there, before the first step."""
    out = launch(model_flags(2) + ["--mock-data", "--paradyse-document-data", "--paradyse",
                                   "--paradyse-memory-budget", "0.0001"])
    one_line(out, "--paradyse-memory-budget 0.0001 GiB per rank fits no micro-batch")
    assert "[paradyse] iteration" not in out.out


@full
def test_indexed_dataset():
    """An IndexedDataset (--data-path): Megatron-LM's own GPTDataset (packed, fixed length) and
    the plugin's one-document-per-sample view; stock and --paradyse equal in both."""
    import numpy as np

    from megatron_paradyse.data import write_indexed_dataset

    prefix = os.path.join(_TMP, "docs")
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 250, size=int(n)) for n in rng.integers(8, 200, size=120)]
    write_indexed_dataset(prefix, docs, vocab_size=256)
    base = model_flags(2) + ["--data-path", prefix, "--split", "100,0,0", "--eval-iters", "0"]
    para = ["--paradyse", "--paradyse-plan", "tp_sp+ulysses+ring+metp"]
    for extra in ([], ["--paradyse-document-data"]):
        stock = launch(base + extra).check()
        got = launch(base + extra + para).check()
        assert len(stock.losses) == ITERS
        _assert_close(got.losses, stock.losses, range(1, ITERS + 1), f"indexed dataset {extra}")


def _equal_docs_flags(tp: int) -> list:
    """An IndexedDataset of 400 documents of 16 tokens, one per sample, at --seq-length 64."""
    import numpy as np

    from megatron_paradyse.data import write_indexed_dataset

    prefix = os.path.join(_TMP, "equal_docs")
    if not os.path.isfile(prefix + ".bin"):
        rng = np.random.default_rng(3)
        write_indexed_dataset(prefix, [rng.integers(1, 250, size=17) for _ in range(400)], vocab_size=256)
    return model_flags(tp, seq=64) + ["--data-path", prefix, "--split", "100,0,0", "--eval-iters", "0",
                                      "--paradyse-document-data"]


@functools.lru_cache(maxsize=None)
def packed_run(tp: int, nproc: int, *extra: str, pp: int = 1) -> Run:
    """Stock unpacked (one 16-token document per micro-batch, global batch 8) or ``--paradyse``
    packed (``extra`` with ``--paradyse-pack``: 4 documents a pack of 64, global batch 2): the
    same documents per step; ``pp`` pipeline stages, ``extra``'s other flags on both."""
    mbs_gbs = ("1", "2") if "--paradyse-pack" in extra else ("1", "8")
    flags = _with(_equal_docs_flags(tp), micro_batch_size=mbs_gbs[0], global_batch_size=mbs_gbs[1])
    if pp > 1:
        flags = _with(flags, pipeline_model_parallel_size=pp)
    return launch(flags + list(extra), nproc)


PACKED = ("--paradyse", "--paradyse-plan", "tp_sp+ulysses+ring+metp", "--paradyse-pack", "greedy")


# both in the longer set: the suite runs packs through Megatron-LM in test_dynamic_cp_equals_stock
# (every Dynamic CP micro-batch is a pack of documents, attention inside each)
@full
@pytest.mark.parametrize("nproc", [2, 4])
def test_packed_documents_equal_stock_unpacked(nproc):
    """``--paradyse-pack greedy``: each sample packs consecutive documents up to --seq-length
    (THD, attention inside each document), the forward step reading the boundaries from the
    broadcast positions. Documents of one length (16 tokens, 4 to a pack of 64) make every
    step's packs hold the documents stock Megatron-LM reads unpacked, one per micro-batch, in a
    global batch four times as large (--global-batch-size 8 against 2 packs): their per-token
    losses are equal. (Stock Megatron-LM's own loss over the same 8 documents differs between
    --micro-batch-size 1, 2 and 4 at iteration 1 (5.564410, 5.540153, 5.571390, core_v0.16.1,
    measured with the initial weights before the jit_warmup CPU shim), so the comparison is with its micro-batch size 1.)"""
    stock = packed_run(nproc, nproc).check()
    packed = packed_run(nproc, nproc, *PACKED).check()
    assert len(stock.losses) == ITERS
    _assert_close(packed.losses, stock.losses, range(1, ITERS + 1), "packed vs stock unpacked")
    assert {lens for lens, _ in packed.plans.values()} == {"64,64"}, packed.plans  # two packs of 64 a step


@full
def test_bad_plan_is_one_line_and_every_rank_exits():
    out = launch(model_flags(2) + ["--mock-data", "--paradyse", "--paradyse-plan", "tp_sp,nope"])
    one_line(out, "--paradyse-plan 'tp_sp,nope'")  # rank 0 says it, every rank exits 2
    assert "initializing torch distributed" not in out.out and "already initialized" not in out.out


@full
def test_overlap_param_gather_with_paradyse_is_a_clear_error():
    """DDP finishes --overlap-param-gather's all-gathers in module forward pre-hooks, which the
    gathered-weight strategies bypass: refused in validate_args, before any process group."""
    out = launch(model_flags(2) + ["--mock-data", "--paradyse", "--paradyse-plan", "ulysses",
                                   "--use-distributed-optimizer", "--overlap-grad-reduce",
                                   "--overlap-param-gather"])
    one_line(out, "--overlap-param-gather cannot be used with --paradyse")
    assert "initializing torch distributed" not in out.out and "already initialized" not in out.out


@full
def test_checkpoints_move_between_megatron_lm_and_pretrain_gpt_paradyse():
    """Megatron-LM's stock checkpoint (iteration 5) resumed by ``pretrain_gpt_paradyse.py
    --paradyse`` (the megatron-core trainer), whose checkpoint (iteration 6) stock Megatron-LM
    resumes in turn; every iteration equals the uninterrupted stock Megatron-LM run."""
    stock = run("stock").check()
    core_save = os.path.join(_TMP, "core2")
    core = launch_core(["--load", _ckpt_at(os.path.join(_TMP, "stock2"), SAVE_AT), "--save", core_save,
                        "--save-interval", str(SAVE_AT + 1), "--paradyse", "--paradyse-plan", PLAN]).check()
    assert "loaded checkpoint" in core.out
    _assert_close(core.losses, stock.losses, range(SAVE_AT + 1, ITERS + 1),
                  "pretrain_gpt_paradyse.py --paradyse resumed from Megatron-LM's stock checkpoint")
    back = launch(model_flags(2) + ["--mock-data", "--paradyse-document-data",
                                    "--load", _ckpt_at(core_save, SAVE_AT + 1)]).check()
    assert "successfully loaded checkpoint" in back.out
    want = dict(stock.losses)
    want[SAVE_AT + 3] = (stock.losses[SAVE_AT + 2] + stock.losses[SAVE_AT + 3]) / 2  # the resume quirk
    _assert_close(back.losses, want, range(SAVE_AT + 2, ITERS + 1),
                  "stock Megatron-LM resumed from pretrain_gpt_paradyse.py's --paradyse checkpoint")


@full
def test_pretrain_gpt_paradyse_megatron_trainer():
    """``pretrain_gpt_paradyse.py --paradyse-trainer megatron`` (Megatron-LM 0.16's pretrain() with
    the plugin's model and datasets providers) trains like Megatron-LM's own pretrain_gpt.py."""
    if _mcore_version().startswith("0.16"):
        stock = run("stock").check()
        got = _torchrun([os.path.join(ROOT, "pretrain_gpt_paradyse.py"), "--paradyse-trainer", "megatron",
                         *model_flags(2), "--mock-data", "--paradyse", "--paradyse-plan", PLAN],
                        2, RUN_TIMEOUT).check()
        assert sorted(got.plans) == list(range(1, ITERS + 1))
        _assert_close(got.losses, stock.losses, range(1, ITERS + 1),
                      "pretrain_gpt_paradyse.py --paradyse-trainer megatron vs Megatron-LM's pretrain_gpt.py")
    else:
        pytest.skip("--paradyse-trainer megatron wraps Megatron-LM 0.16's pretrain() signature only; "
                    "0.19 is covered by running its own pretrain_gpt.py (the tests above)")


def test_cpu_shims_for_megatron_training_are_documented():
    """Every shim of cpu_compat_training is named in its docstring with the functions that need
    it, and it is needed on CPU ranks (static: no megatron.training import here; that it does
    nothing on a GPU rank: tests/test_cpu_compat.py)."""
    from megatron_paradyse import cpu_compat_training as c

    assert set(c._SHIMS) == set(c.ALL_SHIMS)
    for name in c.ALL_SHIMS:
        m = re.search(rf"^``{name}``\n((?:    .*\n)+)", c.__doc__, re.M)
        assert m and "Needed by" in m.group(1), f"shim {name!r} is not documented with its users"
    assert c.needed()  # this pytest process chose the CPU (tests/conftest.py)


@full
@pytest.mark.parametrize("tp", [2, 4])
def test_four_ranks(tp):
    """4 gloo ranks: TP=2 x DP=2 (Megatron-LM's data parallelism and DDP around the plugin) and
    TP=4; training and evaluation losses."""
    base = model_flags(tp) + ["--mock-data", "--paradyse-document-data", "--global-batch-size", "8"]
    stock = launch(base, nproc=4).check()
    got = launch(base + ["--paradyse", "--paradyse-plan", PLAN], nproc=4).check()
    assert f"data-parallel size: {4 // tp}" in stock.out and sorted(got.plans) == list(range(1, ITERS + 1))
    _assert_close(got.losses, stock.losses, range(1, ITERS + 1), f"TP={tp} x DP={4 // tp}: --paradyse vs stock")
    assert len(stock.valid) == 4 and set(got.valid) == set(stock.valid)
    _assert_close(got.valid, stock.valid, sorted(stock.valid), f"TP={tp}: validation/test loss")


# ------------------------------------------------------------------ pipeline stages (issue 35)
PP_ITERS = 5  # Megatron-LM evaluates at 5 (--eval-interval), then the validation and test sets


def _with(flags: list, **values) -> list:
    """``flags`` with ``--name value`` replaced (``name`` with underscores) or appended."""
    out = list(flags)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out


def pipeline_flags() -> list:
    """4 ranks: PP = 2 stages x TP = 2 (stage 0: ranks 0-1, stage 1: ranks 2-3), 2 layers a stage."""
    return _with(model_flags(2), pipeline_model_parallel_size=2, train_iters=PP_ITERS) + [
        "--mock-data", "--paradyse-document-data"]


@functools.lru_cache(maxsize=None)
def pipeline_run(*extra: str) -> Run:
    """One 4-rank pipeline run per configuration (the stock one is shared)."""
    return launch(pipeline_flags() + list(extra), nproc=4)


@full  # the default suite runs Megatron-LM's pipeline path through the interleaved test below
def test_pipeline_stages_equal_stock():
    """PP = 2 x TP = 2 on 4 ranks: --paradyse (the plan mixes strategies per layer, so the two
    stages run different ones, and changes per micro-batch) gives stock Megatron-LM's training,
    validation and test losses. Stock sends every activation at --seq-length; ParaDySe's
    transfers have each micro-batch's own length, their shapes from the micro-batches every
    stage read ahead (no shape exchange; megatron_lm/schedule.py)."""
    stock, got = pipeline_run().check(), pipeline_run("--paradyse", "--paradyse-plan", PLAN).check()
    assert re.search(r"pipeline_model_parallel_size \.+ 2\n", stock.out)
    assert "[paradyse]" not in stock.out
    assert "2 pipeline stages (1F1B)" in got.out, got.out[-3000:]
    assert sorted(got.plans) == list(range(1, PP_ITERS + 1))
    _assert_close(got.losses, stock.losses, range(1, PP_ITERS + 1), "PP=2 x TP=2: --paradyse vs stock")
    assert len(stock.valid) == 3 and set(got.valid) == set(stock.valid), (stock.valid, got.valid)
    _assert_close(got.valid, stock.valid, sorted(stock.valid), "PP=2 x TP=2: validation/test loss")
    lengths = {int(s) for lens, _ in got.plans.values() for s in lens.split(",")}
    plans = {p for _, line in got.plans.values() for p in line.split(",")}
    assert len(lengths) >= 5 and len(plans) >= 3, (lengths, plans)


# the interleaved schedule: 2 model chunks per stage, one layer each (stage 0 runs layers 1 and 3,
# stage 1 layers 2 and 4); 4 micro-batches a step, 2 groups of PP; evaluation after training
VPP = ("--num-layers-per-virtual-pipeline-stage", "1")
VPP_ITERS, VPP_SAVE_AT = 3, 2


@functools.lru_cache(maxsize=None)
def interleaved_run(*extra: str) -> Run:
    """One 4-rank run of PP = 2 x V = 2 x TP = 2 per configuration; with the longer checks each
    saves at VPP_SAVE_AT (the checkpoint tests resume from it)."""
    tag = "vpp_paradyse" if "--paradyse" in extra else "vpp_stock"
    save = ["--save", os.path.join(_TMP, tag), "--save-interval", str(VPP_SAVE_AT)] if FULL and "--load" not in extra else []
    return launch(_with(pipeline_flags(), train_iters=VPP_ITERS) + list(VPP) + save + list(extra), nproc=4)


@full  # two 4-rank launches, 96 s of the suite: the plugin trainer's interleaved run covers the schedule there
def test_interleaved_pipeline_equals_stock():
    """PP = 2 x V = 2 x TP = 2: Megatron-LM builds the model chunks and runs megatron-core's
    interleaved schedule; with --paradyse each chunk's layers switch per micro-batch (the plan
    keyed by global layer: the two chunks of a stage run different strategies), and the training,
    validation and test losses equal stock Megatron-LM's interleaved run. The transfers have each
    micro-batch's length, queued in the order each peer sends (megatron_lm/schedule.py)."""
    stock, got = interleaved_run().check(), interleaved_run("--paradyse", "--paradyse-plan", PLAN).check()
    assert re.search(r"virtual_pipeline_model_parallel_size \.+ 2\n", stock.out), stock.out[:3000]
    assert "[paradyse]" not in stock.out
    assert "2 pipeline stages, interleaved (2 model chunks per stage)" in got.out, got.out[-3000:]
    assert sorted(got.plans) == list(range(1, VPP_ITERS + 1))
    _assert_close(got.losses, stock.losses, range(1, VPP_ITERS + 1), "PP=2 x V=2 x TP=2: --paradyse vs stock")
    assert len(stock.valid) == 2 and set(got.valid) == set(stock.valid), (stock.valid, got.valid)
    _assert_close(got.valid, stock.valid, sorted(stock.valid), "PP=2 x V=2 x TP=2: validation/test loss")
    lengths = {int(s) for lens, _ in got.plans.values() for s in lens.split(",")}
    plans = {p for _, line in got.plans.values() for p in line.split(",")}
    assert len(lengths) >= 5 and len(plans) >= 3, (lengths, plans)


def test_pipeline_layout_is_refused():
    """--pipeline-model-parallel-layout (stages of any layers, the embedding or the loss alone) is
    refused with --paradyse: one clear error, locally, from Megatron-LM's parsed arguments; stock
    Megatron-LM keeps the layout (the interleaving flags run: test_interleaved_pipeline_equals_stock)."""
    import argparse

    from megatron_paradyse.training.megatron_lm import check_paradyse_args

    base = dict(paradyse=True, overlap_param_gather=False, paradyse_document_data=False, tensor_model_parallel_size=2,
                sequence_parallel=True, context_parallel_size=1, pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2, transformer_impl="local", hidden_dropout=0.0,
                attention_dropout=0.0, paradyse_pad_multiple=None, num_layers=4, seq_length=128)
    args = argparse.Namespace(**base, pipeline_model_parallel_layout="Et|t|t|tL")
    with pytest.raises(ValueError, match="--pipeline-model-parallel-layout is not supported with --paradyse") as e:
        check_paradyse_args(args)
    assert "\n" not in str(e.value)
    args.paradyse = False
    check_paradyse_args(args)


@full
def test_pipeline_layout_is_one_line_through_megatron_lm():
    out = launch(pipeline_flags() + ["--pipeline-model-parallel-layout", "Et|t|t|tL", "--paradyse",
                                     "--paradyse-plan", PLAN], nproc=4)
    one_line(out, "--pipeline-model-parallel-layout is not supported with --paradyse")
    assert "initializing torch distributed" not in out.out


@full
def test_interleaved_pipeline_packed_equals_stock_unpacked():
    """--paradyse-pack greedy under the interleaved schedule (PP = 2 x V = 2 x TP = 2: 2 packs a step,
    one group of PP), every chunk given each pack's boundaries: equal to stock Megatron-LM's
    interleaved run reading the same documents unpacked."""
    stock = packed_run(2, 4, *VPP, pp=2).check()
    got = packed_run(2, 4, *PACKED, *VPP, pp=2).check()
    assert "interleaved (2 model chunks per stage)" in got.out, got.out[-3000:]
    _assert_close(got.losses, stock.losses, range(1, ITERS + 1), "packed PP=2 x V=2 x TP=2 vs stock unpacked")
    assert {lens for lens, _ in got.plans.values()} == {"64,64"}, got.plans


@full
@pytest.mark.parametrize("direction", ["paradyse_from_stock", "stock_from_paradyse"])
def test_interleaved_checkpoints_move_between_stock_and_paradyse(direction):
    """Megatron-LM's own checkpoint of the interleaved schedule's model chunks (iteration 2; its
    keys model0, model1) resumed with the other mode: iteration 3 and the evaluation equal the
    uninterrupted stock run."""
    stock = interleaved_run().check()
    para = ("--paradyse", "--paradyse-plan", PLAN)
    src = "vpp_stock" if direction == "paradyse_from_stock" else "vpp_paradyse"
    if direction == "stock_from_paradyse":
        interleaved_run(*para).check()
    load = ("--load", _ckpt_at(os.path.join(_TMP, src), VPP_SAVE_AT))
    got = interleaved_run(*(para if direction == "paradyse_from_stock" else ()), *load).check()
    assert "successfully loaded checkpoint" in got.out
    assert sorted(got.plans) == ([VPP_ITERS] if direction == "paradyse_from_stock" else [])
    _assert_close(got.losses, stock.losses, [VPP_ITERS], f"PP=2 x V=2 x TP=2 {direction}")
    _assert_close(got.valid, stock.valid, sorted(stock.valid), f"PP=2 x V=2 x TP=2 {direction}: validation/test")


@full
def test_pipeline_stages_with_the_planner():
    """PP = 2 x TP = 2 without --paradyse-plan: the pipeline planner plans each step's
    micro-batches together over the 1F1B schedule (maybe reordered; a budget of 1.7 MiB per
    rank makes it recompute some layers of the longer ones, per stage) and the losses still
    equal stock Megatron-LM's."""
    stock = pipeline_run().check()
    got = pipeline_run("--paradyse", "--paradyse-memory-budget", str(1.7 / 1024)).check()
    _assert_close(got.losses, stock.losses, range(1, PP_ITERS + 1), "PP=2 x TP=2: planner vs stock")
    _assert_close(got.valid, stock.valid, sorted(stock.valid), "PP=2 x TP=2, planner: validation/test loss")
    assert "one per pipeline stage (2 stages" in got.out, got.out[-3000:]
    plans = {p for _, line in got.plans.values() for p in line.split(",")}
    assert "tp_sp*4" in plans and len(plans) >= 2, plans
    assert re.search(r"\[paradyse\] iteration .*\| pred: [0-9.]+ s, stage peaks [0-9.]+/[0-9.]+ MiB", got.out)


# ------------------------------------------------------------------ context parallelism (issue 36)
CP2 = ("--context-parallel-size", "2")


def cp_flags(*extra: str) -> list:
    """4 ranks: CP = 2 x TP = 2 (CP rank 0: ranks 0-1, CP rank 1: ranks 2-3), the model and data of
    :func:`model_flags` (--seq-length 128, a multiple of 2 x CP x TP = 8)."""
    return model_flags(2) + list(CP2) + ["--mock-data", "--paradyse-document-data", *extra]


@full  # the suite: CP in the plugin trainer (tests/test_training_cp.py), CP groups through this entry (Dynamic CP)
@pytest.mark.parametrize("pp", [2, 1])
def test_context_parallel_equals_stock_without_cp(pp):
    """--paradyse at CP = 2 (the plan mixes every strategy per layer and changes per micro-batch;
    each attends across the two CP ranks) against stock Megatron-LM at the same layout without
    CP, the same global batch and documents: equal training, validation and test losses. With
    pipeline stages (``pp`` 2: PP = 2 x TP = 2 x CP = 2 on 8 ranks against stock PP = 2 x TP = 2
    on 4, whose run test_pipeline_stages_equal_stock shares; each stage's layers under CP, the
    p2p tensors of s / 2 tokens per CP rank, their shapes from the micro-batches read ahead);
    without (``pp`` 1: CP = 2 x TP = 2 on 4 ranks against stock TP = 2 on 2). The forward step
    reads each micro-batch whole, pads it to a multiple of 2 x CP x TP = 8 and runs this CP
    rank's chunks c and 3 - c (the first stage's tokens, the last's labels); Megatron-LM sums
    the loss reports and (--calculate-per-token-loss) the token counts and gradients over DP x CP."""
    if pp == 2:
        stock = pipeline_run().check()
        got = launch(pipeline_flags() + list(CP2) + ["--paradyse", "--paradyse-plan", PLAN], nproc=8).check()
        iters, what = PP_ITERS, "PP=2 x TP=2 x CP=2 --paradyse vs stock PP=2 x TP=2"
        assert "2 pipeline stages (1F1B)" in got.out, got.out[-3000:]
    else:
        stock = run("stock").check()
        got = launch(cp_flags("--paradyse", "--paradyse-plan", PLAN), nproc=4).check()
        iters, what = ITERS, "CP=2 x TP=2 --paradyse vs stock TP=2"
    assert "data-parallel size: 1, context-parallel size: 2" in got.out, got.out[:3000]
    assert sorted(got.plans) == list(range(1, iters + 1))
    _assert_close(got.losses, stock.losses, range(1, iters + 1), what)
    assert len(stock.valid) >= 3 and set(got.valid) == set(stock.valid), (stock.valid, got.valid)
    _assert_close(got.valid, stock.valid, sorted(stock.valid), f"{what}: validation/test loss")
    lengths = {int(s) for lens, _ in got.plans.values() for s in lens.split(",")}
    plans = {p for _, line in got.plans.values() for p in line.split(",")}
    assert all(s % 8 == 0 for s in lengths) and len(lengths) >= 5 and len(plans) >= 3, (lengths, plans)


@full
@pytest.mark.parametrize("pp", [1, 2])
def test_context_parallel_packed_equals_stock_unpacked(pp):
    """--paradyse-pack greedy under CP = 2 x TP = 2: each pack (4 documents of 16 tokens) is split
    into the CP ranks' chunks like a row, its document boundaries the whole pack's; equal to stock
    Megatron-LM at TP = 2 reading the same documents unpacked (test_packed_documents_equal_stock_unpacked);
    with ``pp`` 2 on 8 ranks against stock PP = 2 x TP = 2, every stage given the pack's boundaries."""
    stock = packed_run(2, 2 * pp, pp=pp).check()
    got = packed_run(2, 4 * pp, *PACKED, *CP2, pp=pp).check()
    _assert_close(got.losses, stock.losses, range(1, ITERS + 1), f"packed PP={pp} x CP=2 x TP=2 vs stock unpacked")
    assert {lens for lens, _ in got.plans.values()} == {"64,64"}, got.plans


def test_context_parallel_refusals():
    """What --paradyse cannot run with CP: one clear error naming the flag, locally, from Megatron-LM's
    parsed arguments; without --paradyse none of them is the plugin's business."""
    import argparse

    from megatron_paradyse.training.megatron_lm import check_paradyse_args

    base = dict(paradyse=True, overlap_param_gather=False, paradyse_document_data=False,
                tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, cp_comm_type=["p2p"],
                hierarchical_context_parallel_sizes=None, hybrid_context_parallel=False, seq_length=128,
                transformer_impl="local", hidden_dropout=0.0, attention_dropout=0.0, paradyse_pad_multiple=None,
                paradyse_plan="tp_sp")
    cases = [
        (dict(cp_comm_type=["a2a"]), "--cp-comm-type a2a: with --paradyse"),
        (dict(cp_comm_type=["p2p", "a2a+p2p"]), "--cp-comm-type p2p a2a+p2p"),
        (dict(hierarchical_context_parallel_sizes=[2, 1]), "--hierarchical-context-parallel-sizes is not supported"),
        (dict(hybrid_context_parallel=True), "--dynamic-context-parallel needs --calculate-per-token-loss"),
        (dict(hybrid_context_parallel=True, calculate_per_token_loss=True, position_embedding_type="rope", num_layers=4),
         "--hybrid-context-parallel with --context-parallel-size 2: through Megatron-LM's pretrain() the Dynamic "
         "CP pool is its data parallelism"),
        (dict(seq_length=132), "--seq-length 132 must be a multiple of 2 x --context-parallel-size x "
                               "--tensor-model-parallel-size = 8"),
        (dict(paradyse_pad_multiple=4), "--paradyse-pad-multiple 4 must be a positive multiple of 2 x"),
        (dict(paradyse_cp_links="nvlink4"), "--paradyse-cp-links 'nvlink4': give two names"),
    ]
    for change, needle in cases:
        args = argparse.Namespace(**{**base, **change})
        with pytest.raises(ValueError) as e:
            check_paradyse_args(args)
        assert needle in str(e.value) and "\n" not in str(e.value), (change, str(e.value))
        args.paradyse = False
        if not change.get("hybrid_context_parallel"):  # stock Dynamic CP on local layers: test_dynamic_cp_refusals
            check_paradyse_args(args)


@full
def test_context_parallel_resumes_a_stock_checkpoint():
    """Stock Megatron-LM's TP = 2 checkpoint (iteration 5) resumed at CP = 2 x TP = 2 with
    --paradyse: iterations 6..10 and the evaluation equal the uninterrupted stock run; the CP run
    saves its own (iteration 10)."""
    stock = run("stock").check()
    save = os.path.join(_TMP, "cp_save")
    got = launch(cp_flags("--paradyse", "--paradyse-plan", PLAN, "--load", _ckpt_at(os.path.join(_TMP, "stock2"), SAVE_AT),
                          "--save", save, "--save-interval", str(ITERS)), nproc=4).check()
    assert "successfully loaded checkpoint" in got.out
    _assert_close(got.losses, _resumed_expected(stock.losses), range(SAVE_AT + 1, ITERS + 1),
                  "CP=2 x TP=2 --paradyse resumed from a stock TP=2 checkpoint vs the stock run")
    assert set(got.valid) == {k for k in stock.valid if k[0] == ITERS}
    _assert_close(got.valid, stock.valid, sorted(got.valid), "CP=2 x TP=2 resumed: validation/test loss")
    assert os.path.isdir(os.path.join(save, f"iter_{ITERS:07d}"))


@full
def test_context_parallel_bad_comm_type_is_one_line():
    """--cp-comm-type a2a with --paradyse at CP = 2: one line, every rank exits 2, before
    torch.distributed starts (Megatron-LM's default p2p is what the plugin runs)."""
    out = launch(cp_flags("--paradyse", "--paradyse-plan", PLAN, "--cp-comm-type", "a2a"), nproc=4)
    one_line(out, "--cp-comm-type a2a: with --paradyse every strategy passes K/V on a ring")
    assert "initializing torch distributed" not in out.out


# ------------------------------------------------------------------ Dynamic CP (issue 47)
DCP_ITERS = SAVE_AT  # the stock run's schedule (--lr-decay-iters ITERS), its evaluation at SAVE_AT
DYNAMIC_CP = ("--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", "64")


def dynamic_cp_run(*extra: str) -> Run:
    """4 ranks, a pool of 2 nodes x TP = 2, the shared stock run's model, data and learning rates
    (its first DCP_ITERS iterations and its evaluation at SAVE_AT)."""
    flags = _with(model_flags(2), train_iters=DCP_ITERS, lr_decay_iters=ITERS)
    return launch(flags + ["--mock-data", "--paradyse-document-data", "--paradyse", *DYNAMIC_CP, *extra], nproc=4)


def _check_dynamic_cp(got: Run, stock: Run, what: str) -> list:
    """Equal losses (training; the evaluation at SAVE_AT), and the CP size of each of rank 0's
    micro-batches per step from the plugin's log line."""
    got.check()
    assert "Dynamic CP over a pool of 2 nodes" in got.out, got.out[-3000:]
    _assert_close(got.losses, stock.losses, range(1, DCP_ITERS + 1), what)
    _assert_close(got.valid, stock.valid, [(SAVE_AT, "periodic")], f"{what}: validation loss")
    steps = re.findall(r"\[paradyse\] iteration\s+\d+ \| seq len: ([0-9,]+) \|.*\| cp: ([0-9,]+)", got.out)
    print(f"\n{what}: losses {[got.losses[i] for i in range(1, DCP_ITERS + 1)]} vs stock "
          f"{[stock.losses[i] for i in range(1, DCP_ITERS + 1)]}; (seq len, cp) per step of rank 0: {steps}")
    assert len(steps) == DCP_ITERS
    return [set(cp.split(",")) for _, cp in steps]


@full  # one 4-rank launch, 46 s of the suite: the plugin's Dynamic CP is in tests/test_dynamic_cp_exact.py and test_training_dynamic_cp.py there
def test_dynamic_cp_equals_stock():
    """--hybrid-context-parallel with --paradyse on 4 ranks (a pool of 2 nodes x TP = 2): each step's
    global batch (Megatron-LM's sampler, gathered over DP) runs in rounds, documents over 64 tokens
    (--max-seqlen-per-dp-cp-rank) on both nodes (c = 2, a ring across them), the others one a node
    (c = 1, side by side; the placeholder schedule of --paradyse-plan), each under PLAN; equal
    training and validation losses to stock Megatron-LM at TP = 2 on the same global batches (the
    shared stock run: with --calculate-per-token-loss its DP = 1 trains as DP = 2 would). The
    plugin's log line names each micro-batch's CP size."""
    sizes = _check_dynamic_cp(dynamic_cp_run("--paradyse-plan", PLAN), run("stock").check(), "Dynamic CP, PLAN")
    assert any(s == {"1", "2"} for s in sizes), sizes


@full
def test_dynamic_cp_planner_equals_stock():
    """The Dynamic CP planner (no --paradyse-plan) in Megatron-LM's pretrain(): each micro-batch's c
    and plan chosen together (documents over 64 tokens need both nodes); equal to stock."""
    got = dynamic_cp_run("--paradyse-memory-budget", "0.5")
    sizes = _check_dynamic_cp(got, run("stock").check(), "Dynamic CP planner")
    assert "> planner: Dynamic CP over a pool of 2 nodes" in got.out, got.out[-3000:]
    assert set().union(*sizes) == {"1", "2"}, sizes


@full
def test_dynamic_cp_refusal_is_one_line_through_megatron_lm():
    """--hybrid-context-parallel --paradyse without --calculate-per-token-loss: the plugin's one line
    (checked before Megatron-LM's own assertion on the flag), every rank exits 2, before
    torch.distributed starts."""
    flags = [f for f in model_flags(2) if f != "--calculate-per-token-loss"]
    out = launch(flags + ["--mock-data", "--paradyse-document-data", "--paradyse", "--paradyse-plan", PLAN,
                          "--hybrid-context-parallel"], nproc=4)
    one_line(out, "--dynamic-context-parallel needs --calculate-per-token-loss")
    assert "initializing torch distributed" not in out.out


def test_dynamic_cp_refusals():
    """What Dynamic CP cannot run through Megatron-LM's pretrain(): one line naming the flag, locally,
    from Megatron-LM's parsed arguments, on every rank (before any collective); --hybrid-context-parallel
    without --paradyse on local layers too (stock megatron runs it only with Transformer Engine)."""
    import argparse

    from megatron_paradyse.training.megatron_lm import check_paradyse_args
    from megatron_paradyse.training.megatron_lm.args import check_dynamic_cp_early

    base = dict(paradyse=True, overlap_param_gather=False, paradyse_document_data=True, mock_data=True, data_path=None,
                tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=1, world_size=4,
                pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, cp_comm_type=["p2p"],
                hierarchical_context_parallel_sizes=None, hybrid_context_parallel=True, seq_length=128,
                transformer_impl="local", hidden_dropout=0.0, attention_dropout=0.0, paradyse_pad_multiple=None,
                paradyse_plan="tp_sp", calculate_per_token_loss=True, micro_batch_size=1,
                position_embedding_type="rope", paradyse_pack="none", num_layers=4)
    cases = [
        (dict(calculate_per_token_loss=False), "--dynamic-context-parallel needs --calculate-per-token-loss"),
        (dict(pipeline_model_parallel_size=2), "--dynamic-context-parallel with --pipeline-model-parallel-size 2"),
        (dict(world_size=6), "the pool of DP x CP = 3 nodes (world / TP) must be a power of two"),
        (dict(max_seqlen_per_dp_cp_rank=63), "--max-seqlen-per-dp-cp-rank 63 must be a positive multiple of"),
        (dict(min_dynamic_context_parallel_size=4), "--min-dynamic-context-parallel-size 4 must be a power of two"),
        (dict(paradyse_document_data=False, mock_data=False), "--hybrid-context-parallel with --paradyse needs "
                                                               "--paradyse-document-data"),
        (dict(paradyse=False), "--hybrid-context-parallel needs --paradyse with --transformer-impl local"),
        (dict(paradyse=False, hybrid_context_parallel=False, dynamic_context_parallel=True),
         "--dynamic-context-parallel needs --paradyse"),
    ]
    for change, needle in cases:
        args = argparse.Namespace(**{**base, **change})
        with pytest.raises(ValueError) as e:
            check_dynamic_cp_early(args)  # before Megatron-LM's own assertions
            check_paradyse_args(args)
        assert needle in str(e.value) and "\n" not in str(e.value), (change, str(e.value))
    # stock Megatron-LM's own Dynamic CP with Transformer Engine's layers is not the plugin's business
    check_paradyse_args(argparse.Namespace(**{**base, "paradyse": False, "transformer_impl": "transformer_engine"}))
