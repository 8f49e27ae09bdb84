"""Measuring one decoder layer (and the non-layer part of a step) inside one rank.

Used by the profiler (``profile.py``), the tests and the report. Runs on the real process
group (gloo / NCCL ranks) or, in single-device mode, as one rank of a fake p-way group
(:func:`init_fake`). Memory comes from :mod:`megatron_paradyse.memory` (CUDA peak
statistics, or the CPU live-tensor tracker), measured after a warm-up pass so that
persistent buffers (megatron's global memory buffer: the communication pool) are not counted
(they are reported separately as ``buffer_bytes``).

Definitions (per rank; what ``LayerCost`` predicts):

* ``saved``: bytes the layer's forward leaves alive (its output included: in a stack a layer's
  output is the next layer's saved input, counted once by the layer that made it);
* ``transient``: the most live at once during the layer's forward or backward beyond
  ``saved`` (the output gradient the backward receives is counted, the parameters' already
  allocated gradients are not).

The model is built as training builds it (:mod:`megatron_paradyse.model`: the same Megatron-LM
model flags, ``TransformerConfig``, layer spec and builder, fusions included) on this
process's device (:func:`megatron_paradyse.device.current`: the rank's GPU under NCCL, the CPU
for gloo ranks); every tensor made here lives there.
"""
from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass, replace
import statistics
import time
import types

import torch
import torch.distributed as dist

from .. import device, runtime
from ..memory import pass_memory
from ..layout import ParallelDims
from ..model import FUSION_SWITCHES, ModelFlags, add_model_args, build_gpt_for, complete_model, transformer_config
from ..parallel.buffers import pool_sizes, release_pool
from ..parallel.dispatch import install, set_plan
from ..parallel.packing import PackShape
from . import kernels
from .ranks import init_parallel
from .shape import ModelShape

_TORCH_DTYPE = types.MappingProxyType({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})

# The profiler's defaults for the model flags (the demo's shape, as the shipped profiles were
# measured): 4 layers, hidden 128, 8 heads, byte-level vocabulary, RoPE, no dropout (no
# strategy supports dropout). Every other default is Megatron-LM's, as the trainer's.
DEMO_DEFAULTS = dict(num_layers=4, hidden_size=128, num_attention_heads=8, vocab_size=258,
                     num_query_groups=None, position_embedding_type="rope",
                     hidden_dropout=0.0, attention_dropout=0.0)


def add_model_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The trainer's model flags (``megatron_paradyse.model.add_model_args``, fusion switches
    included) with the demo's defaults, ``--tensor-model-parallel-size`` (alias ``--p``),
    ``--sequence-parallel`` (accepted: always on for p > 1) and ``--seed``.

    Embedding and output weights are always untied (the cost model counts both,
    ``analytic.static_bytes``): ``--untie-embeddings-and-output-weights`` is accepted."""
    add_model_args(parser, defaults=DEMO_DEFAULTS)
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", "--p", dest="tensor_model_parallel_size", type=int,
                   default=None, help="p, the switching group (TP) size")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="accepted for the trainer's command lines: always on for p > 1 (every "
                        "strategy keeps the sequence-parallel layout between layers)")
    g.add_argument("--seed", type=int, default=1234)
    parser.set_defaults(untie_embeddings_and_output_weights=True)
    return parser


def model_flag_names() -> list:
    """The ``args`` attributes :func:`add_model_flags` defines."""
    ap = argparse.ArgumentParser(add_help=False)
    add_model_flags(ap)
    return sorted({a.dest for a in ap._actions if a.dest != "help"})


def model_args_for_shape(shape: ModelShape, **overrides) -> argparse.Namespace:
    """Model flags (not completed) for ``shape`` with the profiler's defaults: what
    ``profile --hidden-size ... --p ...`` parses to for this shape."""
    ap = argparse.ArgumentParser(add_help=False)
    add_model_flags(ap)
    argv = ["--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden),
            "--num-attention-heads", str(shape.heads), "--ffn-hidden-size", str(shape.ffn),
            "--vocab-size", str(shape.vocab), "--tensor-model-parallel-size", str(shape.p)]
    if shape.query_groups != shape.heads:
        argv += ["--group-query-attention", "--num-query-groups", str(shape.query_groups)]
    if shape.swiglu:
        argv.append("--swiglu")
    if not shape.bias:
        argv.append("--disable-bias-linear")
    if shape.dtype == "bf16":
        argv.append("--bf16")
    elif shape.dtype != "fp32":
        raise ValueError(f"the profiler builds fp32 or bf16 models, not {shape.dtype}")
    args = ap.parse_args(argv)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


@dataclass(frozen=True)
class ProfiledModel:
    """Model flags completed for TP = ``p`` (sequence parallelism on for p > 1) and the seed
    the model is built with: what :func:`complete` and :func:`build` return."""

    flags: ModelFlags
    p: int
    seed: int = 1234

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.p, sequence_parallel=self.p > 1)

    @property
    def vocab_size(self) -> int | None:
        return self.flags.vocab_size


def complete(model_args: dict, p: int | None = None, dev: torch.device | None = None,
             max_seq: int | None = None) -> ProfiledModel:
    """The model flags ``model_args`` (a dict of flag values, :func:`add_model_flags`'s names)
    completed for TP = ``p`` (default the dict's ``tensor_model_parallel_size``) on ``dev``
    (default this process's device), as the trainer completes them (``model.complete_model``:
    derived sizes, padded vocabulary, dtype, fusions for the device); ``max_position_embeddings``
    ``max_seq`` where not given. Raises ``model.ModelArgsError``."""
    values = dict(model_args)
    p = int(p if p is not None else values["tensor_model_parallel_size"])
    flags = ModelFlags.from_flags(values)
    if flags.num_query_groups is None:
        flags = replace(flags, num_query_groups=1 if flags.group_query_attention else flags.num_attention_heads)
    if flags.max_position_embeddings is None and max_seq is not None:
        flags = replace(flags, max_position_embeddings=int(max_seq))
    done = complete_model(flags, p, dev if dev is not None else device.current())
    return ProfiledModel(done, p, int(values.get("seed", 1234) or 1234))


def model_config(done: ProfiledModel, **overrides):
    """megatron-core's ``TransformerConfig`` of completed model flags (``model.transformer_config``,
    the trainer's)."""
    return transformer_config(done.flags, done.dims, **overrides)


def shape_of(done: ProfiledModel) -> ModelShape:
    """The ``ModelShape`` of completed model flags."""
    f = done.flags
    dtype = "bf16" if f.bf16 else ("fp16" if f.fp16 else "fp32")
    return ModelShape(num_layers=f.num_layers, hidden=f.hidden_size, heads=f.num_attention_heads,
                      query_groups=f.num_query_groups or f.num_attention_heads,
                      ffn=f.ffn_hidden_size or 4 * f.hidden_size, swiglu=bool(f.swiglu),
                      bias=not f.disable_bias_linear, vocab=int(f.padded_vocab_size), p=done.p, dtype=dtype)


def describe_model(done: ProfiledModel) -> dict:
    """What of the completed flags shapes a layer's cost beyond ``ModelShape`` (for a profile's
    header): norm, position embedding, fusions, dropout, tying."""
    keys = ["normalization", "norm_epsilon", "position_embedding_type", "rotary_percent", "rotary_base",
            "kv_channels", "hidden_dropout", "attention_dropout", "untie_embeddings_and_output_weights",
            "sequence_parallel", "max_position_embeddings"] + [d for d, _ in FUSION_SWITCHES.values()]
    out = {k: done.dims.sequence_parallel if k == "sequence_parallel" else getattr(done.flags, k) for k in keys}
    out["notes"] = list(done.flags.notes)
    return out


def init_fake(rank: int, world: int) -> None:
    """Make this process rank ``rank`` of a fake ``world``-rank group (torch's fake backend).

    Collectives return at once with meaningless (but finite-shaped) results: shapes, compute
    and memory are the real rank's; communication time is not measured.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    if not 0 <= rank < world:
        raise ValueError(f"--fake-rank {rank} is outside a world of {world}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    _hold_async_buffers()


class _HeldWork:
    """A request that keeps its tensors alive until it is waited on, as a real backend does
    (gloo and NCCL hold send and receive buffers until completion; the fake backend completes
    at once, which would let the caller's temporaries die earlier than on a real group)."""

    def __init__(self, work, tensors):
        self._work, self._tensors = work, tensors

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs) if self._work is not None else True
        self._tensors = None
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)




def _fill_receives(ops):
    """Fake receives leave their buffers as allocated (uninitialised: NaNs and denormals make
    CPU kernels many times slower); give each the values of a send of the same shape, as a
    ring neighbour would, else small normal noise."""
    sends = [op.tensor for op in ops if op.op is dist.isend]
    for op in ops:
        if op.op is dist.irecv:
            src = next((x for x in sends if x.shape == op.tensor.shape and x.dtype == op.tensor.dtype), None)
            if src is not None:
                op.tensor.copy_(src)
            else:
                op.tensor.normal_(0.0, 0.02)


def _fill_broadcast(args, kwargs):
    tensor = args[0] if args else kwargs.get("tensor")
    src = kwargs.get("src", args[1] if len(args) > 1 else None)
    if isinstance(tensor, torch.Tensor) and src is not None and src != dist.get_rank() and tensor.is_floating_point():
        tensor.normal_(0.0, 0.02)


def _hold_async_buffers():
    """``torch.distributed``'s collectives wrapped for the fake backend (the registry's patches
    named ``fake_collectives``, ``runtime.py``; the wrappers pass through on other backends)."""
    if runtime.is_installed("fake_collectives"):
        return

    def wrap(name):
        fn = getattr(dist, name)

        def patched(*args, **kwargs):
            res = fn(*args, **kwargs)
            if not is_fake():
                return res
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            if name == "batch_isend_irecv":
                tensors = [op.tensor for op in args[0]]
                _fill_receives(args[0])
                return [_HeldWork(w, tensors) for w in (res or [])] or ([_HeldWork(None, tensors)] if tensors else [])
            if name == "broadcast":
                _fill_broadcast(args, kwargs)
            if res is None:
                return res
            return _HeldWork(res, tensors)

        return runtime.Patch(dist, name, patched)

    names = ("batch_isend_irecv", "broadcast", "reduce", "all_reduce",  # not isend/irecv: P2POp checks them
             "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
    runtime.install("fake_collectives", *[wrap(name) for name in names])


def is_fake() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


def build(shape: ModelShape, num_layers: int | None = None, max_seq: int = 8192, seed: int = 1234,
          model_args: dict | None = None):
    """Megatron initialised over the current world (TP = p) and the stock GPT the trainer
    builds for ``model_args`` (a dict of model flag values, completed here for this process's
    device; default the profiler's flags for ``shape``, seeded with ``seed``), with
    ``num_layers`` layers (default all), on this process's device. Returns
    ``(ProfiledModel, model)``; the model is wrapped in ``Float16Module`` under bf16, as the
    trainer's."""
    if dist.get_world_size() % shape.p:
        raise ValueError(f"the world has {dist.get_world_size()} ranks, not a multiple of the shape's p={shape.p}")
    given = model_args is not None
    a = complete(model_args if given else vars(model_args_for_shape(shape)), shape.p, max_seq=max_seq)
    if shape_of(a) != shape:
        raise ValueError(f"the model flags describe {shape_of(a).describe()}, not {shape.describe()}")
    if not given:
        a = replace(a, seed=seed)
    if num_layers is not None:
        a = replace(a, flags=replace(a.flags, num_layers=num_layers))
    kw = {"create_gloo_process_groups": False} if is_fake() else {}
    init_parallel(shape.p, seed=a.seed, **kw)
    install()
    return a, build_gpt_for(a.flags, model_config(a), seed=a.seed)


def make_batch(vocab: int, batch: int, seq: int, seed: int):
    """Deterministic token ids and labels in ``0 .. vocab-1``, identical on every rank, on this
    process's device."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device.current())
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_vocab(spec, shape: ModelShape) -> int:
    """The token ids a batch draws from: the flags' ``--vocab-size`` (else the padded one)."""
    return int(getattr(spec, "vocab_size", None) or shape.vocab)


def unwrap(model):
    """The ``GPTModel`` inside ``Float16Module`` / DDP wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def is_oom(exc) -> bool:
    """An out-of-memory error (CUDA's, or any whose message says so)."""
    oom = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                            getattr(torch.cuda, "OutOfMemoryError", None)) if isinstance(t, type))
    return isinstance(exc, oom) or "out of memory" in str(exc).lower()


def free_after_oom(model=None) -> None:
    """After an out-of-memory pass (the exception and its traceback already dropped): the
    model's gradients and the communication pool released, garbage collected, then CUDA's
    cache emptied, so the next cell starts from the memory the failed one found."""
    if model is not None:  # (no DDP here yet: its main_grad buffers are not touched)
        for prm in model.parameters():
            prm.grad = None
    release_pool()
    gc.collect()
    if device.current().type == "cuda":
        torch.cuda.empty_cache()


def free_device_bytes() -> int | None:
    """Bytes a pass could still allocate on this process's GPU (free device memory plus what
    the caching allocator holds unused); None on the CPU."""
    dev = device.current()
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))


def _timed(fwd, bwd, warmup, repeats):
    """Wall seconds of ``repeats`` forward+backward passes after ``warmup``, ranks aligned by a barrier."""
    times = []
    for i in range(warmup + repeats):
        _barrier()
        _sync()
        t0 = time.perf_counter()
        bwd(fwd())
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def time_kernel(kernel: str, shape: ModelShape, s: int, b: int, warmup: int = 1, repeats: int = 3) -> list:
    """Wall seconds of the attention kernel class ``kernel`` alone, fwd+bwd (``kernels.pass_fn``),
    on this rank's device: the profile's ``kernel`` rows."""
    fwd, bwd = kernels.pass_fn(kernel, shape, s, b, device.current(), _TORCH_DTYPE[shape.dtype])
    return _timed(fwd, bwd, warmup, repeats)


def _sync():
    device.synchronize()


def _barrier():
    if dist.is_initialized() and not is_fake():
        dist.barrier()


def buffer_bytes() -> int:
    from megatron.core import parallel_state

    buf = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buf is None:
        return 0
    return int(sum(t.numel() * t.element_size() for t in buf.buffer.values()))


def reset_buffers():
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


class LayerRunner:
    """fwd+bwd of decoder layer 0 of ``model`` (whole layer, attention only, MLP only)."""

    def __init__(self, model, shape: ModelShape):
        self.model, self.shape = model, shape
        self.gpt = unwrap(model)
        self.layer = self.gpt.decoder.layers[0]
        self.dtype = _TORCH_DTYPE[shape.dtype]
        self.device = device.current()
        # the memory passes collect garbage before reading the tracker; with megatron loaded a
        # full collection walks ~10^6 objects (~0.3 s): move what exists now out of its reach
        # (frozen objects are never collected: fine in the dedicated profiling processes)
        gc.collect()
        gc.freeze()

    def _inputs(self, s, b):
        """The layer's input ``[T/p, b, h]``, its RoPE table and, for a pack (``s`` a
        ``PackShape``, padded to a multiple of p as the plugin pads it), its ``PackedSeqParams``."""
        params = None
        if isinstance(s, PackShape):
            if b != 1:
                raise ValueError(f"a pack is one micro-batch row (b = 1), got b={b}")
            s = s.padded(self.shape.p)
            params = packed_params(s.lengths, self.device)
            s = s.tokens
        g = torch.Generator().manual_seed(s * 31 + b)
        x = torch.randn(s // self.shape.p, b, self.shape.hidden, generator=g).to(self.device, self.dtype)
        rope = getattr(self.gpt, "rotary_pos_emb", None)  # None without RoPE
        return x.requires_grad_(True), rope(s) if rope is not None else None, params

    def pass_fn(self, part: str, s, b: int):
        """``(forward, backward)`` closures for ``part`` in {"layer", "attn", "mlp"}; ``s`` a
        length or a ``PackShape`` (its documents attend inside themselves, megatron's THD)."""
        x, rope, params = self._inputs(s, b)
        layer = self.layer
        kw = {} if params is None else {"packed_seq_params": params}

        def forward():
            if part == "layer":
                return layer(x, attention_mask=None, rotary_pos_emb=rope, **kw)[0]
            if part == "attn":
                out, bias = layer.self_attention(x, attention_mask=None, rotary_pos_emb=rope, **kw)
            else:
                out, bias = layer.mlp(x)
            return out if bias is None else out + bias

        def backward(out):
            out.backward(torch.ones_like(out))
            x.grad = None

        return forward, backward

    def time(self, part, s, b, warmup=1, repeats=3):
        return _timed(*self.pass_fn(part, s, b), warmup, repeats)

    def pool(self, s, b) -> dict:
        """The communication pool the layer's fwd+bwd allocates (:func:`pool_after`)."""
        return pool_after(*self.pass_fn("layer", s, b))

    def memory(self, part, s, b, passes: int = 2):
        """(saved, transient) bytes of one fwd+bwd: the least over ``passes`` measured passes.

        A backend may keep a finished request's tensors alive for a while on its own thread
        (gloo does), which now and then adds a temporary to one pass's count on one rank;
        the layer's own memory is the same every pass, so the least is the layer's.
        """
        fwd, bwd = self.pass_fn(part, s, b)
        bwd(fwd())  # warm-up: persistent buffers and parameter gradients exist from here on
        saved_min = peak_min = None
        for _ in range(passes):
            gc.collect()
            _sync()
            # garbage in reference cycles would count as saved: collect before reading it
            mem = pass_memory(fwd, bwd, between=gc.collect)
            saved, peak = mem["activations"], mem["peak"]
            saved_min = saved if saved_min is None else min(saved_min, saved)
            peak_min = peak if peak_min is None else min(peak_min, peak)
        return saved_min, peak_min - saved_min


def packed_params(lengths, dev=None):
    """megatron's THD ``PackedSeqParams`` of documents of ``lengths`` (one row of tokens)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for d in lengths:
        bounds.append(bounds[-1] + int(d))
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    m = max(int(d) for d in lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m)


def pool_after(forward, backward) -> dict:
    """``{"name/dtype": bytes}`` of the communication pool one fwd+bwd leaves, from an empty pool:
    what a micro-batch holds in the pool (released before each micro-batch in training)."""
    release_pool()
    backward(forward())
    got = pool_sizes()
    release_pool()
    return got


def set_strategy(model, name):
    set_plan(model, [name] * len(unwrap(model).decoder.layers))
    reset_buffers()


def summarize(times):
    med = statistics.median(times)
    spread = (max(times) - min(times)) / med if med > 0 else 0.0
    return med, spread


class NonLayerRunner:
    """The rest of a step: embedding, final norm, output layer and loss (the decoder's layers
    removed for the pass), and the optimizer step (Adam over this rank's parameters).
    ``spec``: the model flags :func:`build` returned (tokens are drawn below their
    ``vocab_size``)."""

    def __init__(self, model, spec, shape: ModelShape):
        self.model, self.spec, self.shape = model, spec, shape

    def _pass(self, s, b):
        tok, lab = make_batch(token_vocab(self.spec, self.shape), b, s, seed=s)
        pos = torch.arange(s, device=tok.device).unsqueeze(0).expand_as(tok)
        model = self.model

        def forward():
            return model(tok, pos, None, labels=lab).float().mean()

        def backward(loss):
            loss.backward()

        return forward, backward

    def _without_layers(self):
        dec = unwrap(self.model).decoder
        saved = dec.layers
        dec.layers = torch.nn.ModuleList()
        return dec, saved

    def measure(self, s, b, warmup=1, repeats=3):
        dec, layers = self._without_layers()
        try:
            fwd, bwd = self._pass(s, b)
            times = _timed(fwd, bwd, warmup, repeats)
            gc.collect()
            mem = pass_memory(fwd, bwd)
        finally:
            dec.layers = layers
        return times, mem["activations"], mem["peak"] - mem["activations"]

    def pool(self, s, b) -> dict:
        """The communication pool of the non-layer part (megatron's ``mpu`` gather of the output
        layer's input under sequence parallelism)."""
        dec, layers = self._without_layers()
        try:
            return pool_after(*self._pass(s, b))
        finally:
            dec.layers = layers

    def update_times(self, warmup=1, repeats=3) -> dict:
        """``{"grad_sync": [...], "optimizer": [...]}``: seconds of what a training step runs
        after its backward (:class:`TrainingUpdate`), independent of the batch."""
        upd = TrainingUpdate(self.model, self.shape)
        return {key: _timed(lambda: None, lambda _, fn=fn: fn(), warmup, repeats)
                for key, fn in (("grad_sync", upd.grad_sync), ("optimizer", upd.optimizer_step))}


class TrainingUpdate:
    """``model`` set up as megatron-core training runs it after the backward: wrapped in
    megatron's ``DistributedDataParallel`` (gradients accumulate into its buffers), gradients
    finished by ``finalize_model_grads`` (one coalesced TP all-reduce of the
    sequence-parallel parameters' gradients; the DP reduction, a no-op in a TP-only world),
    and megatron's optimizer (Adam, gradients clipped at norm 1.0: one norm all-reduce; fp32
    master weights under bf16). What the plugin's trainer and the benchmark run
    (``training/trainer.py``); the profiler times it once per shape, the report's whole
    steps run it.
    """

    def __init__(self, model, shape: ModelShape):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        bf16 = shape.dtype == "bf16"
        self.ddp = DistributedDataParallel(config=model.config, module=model,
                                           ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=bf16))
        kw = {"use_gloo_process_groups": False} if is_fake() else {}  # the fake world has no gloo groups
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-9, clip_grad=1.0, bf16=bf16,
                            params_dtype=_TORCH_DTYPE[shape.dtype]), [self.ddp], **kw)

    def zero_grad(self):
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def grad_sync(self):
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])

    def optimizer_step(self):
        self.optimizer.step()


def param_bytes(model) -> int:
    return int(sum(p.numel() * p.element_size() for p in model.parameters()))
