"""Measuring one decoder layer (and the non-layer part of a step) inside one rank.

Used by the profiler (``profile.py``), the tests and the report. Runs on the real process
group (gloo / NCCL ranks) or, in single-device mode, as one rank of a fake p-way group
(:func:`init_fake`). Memory comes from :mod:`megatron_paradyse.parallel.memory` (CUDA peak
statistics, or the CPU live-tensor tracker), measured after a warm-up pass so that
persistent buffers (megatron's global memory buffer: the communication pool) are not counted
(they are reported separately as ``buffer_bytes``).

Definitions (per rank; what ``LayerCost`` predicts):

* ``saved``: bytes the layer's forward leaves alive (its output included: in a stack a layer's
  output is the next layer's saved input, counted once by the layer that made it);
* ``transient``: the most live at once during the layer's forward or backward beyond
  ``saved`` (the output gradient the backward receives is counted, the parameters' already
  allocated gradients are not).
"""
from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from .shape import ModelShape

_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


_PATCHED = {}


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
    if _PATCHED:
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

        _PATCHED[name] = fn
        setattr(dist, name, patched)

    for name in ("batch_isend_irecv", "broadcast", "reduce", "all_reduce",  # not isend/irecv: P2POp checks them
                 "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        wrap(name)


def is_fake() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


def build(shape: ModelShape, num_layers: int | None = None, max_seq: int = 8192, seed: int = 1234):
    """Megatron initialised over the current world (TP = p) and a stock GPT of ``shape``."""
    import megatron_paradyse as mp
    from megatron_paradyse.testing import models as T

    if dist.get_world_size() % shape.p:
        raise ValueError(f"the world has {dist.get_world_size()} ranks, not a multiple of the shape's p={shape.p}")
    kw = {"create_gloo_process_groups": False} if is_fake() else {}
    T.init_megatron(shape.p, **kw)
    mp.install()
    spec = T.TinyGPT(num_layers=num_layers or shape.num_layers, hidden_size=shape.hidden,
                     num_attention_heads=shape.heads,
                     num_query_groups=None if shape.query_groups == shape.heads else shape.query_groups,
                     ffn_hidden_size=shape.ffn, swiglu=shape.swiglu, bias=shape.bias,
                     vocab_size=shape.vocab, max_seq_length=max_seq,
                     params_dtype=_TORCH_DTYPE[shape.dtype])
    return spec, T.build_gpt(spec, shape.p, seed=seed)


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


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
        self.layer = model.decoder.layers[0]
        self.dtype = _TORCH_DTYPE[shape.dtype]
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # the memory passes collect garbage before reading the tracker; with megatron loaded a
        # full collection walks ~10^6 objects (~0.3 s): move what exists now out of its reach
        # (frozen objects are never collected: fine in the dedicated profiling processes)
        gc.collect()
        gc.freeze()

    def _inputs(self, s, b):
        g = torch.Generator().manual_seed(s * 31 + b)
        x = torch.randn(s // self.shape.p, b, self.shape.hidden, generator=g).to(self.device, self.dtype)
        return x.requires_grad_(True), self.model.rotary_pos_emb(s)

    def pass_fn(self, part: str, s: int, b: int):
        """``(forward, backward)`` closures for ``part`` in {"layer", "attn", "mlp"}."""
        x, rope = self._inputs(s, b)
        layer = self.layer

        def forward():
            if part == "layer":
                return layer(x, attention_mask=None, rotary_pos_emb=rope)[0]
            if part == "attn":
                out, bias = layer.self_attention(x, attention_mask=None, rotary_pos_emb=rope)
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
        from megatron_paradyse.parallel.memory import pass_memory

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


def pool_after(forward, backward) -> dict:
    """``{"name/dtype": bytes}`` of the communication pool one fwd+bwd leaves, from an empty pool:
    what a micro-batch holds in the pool (released before each micro-batch in training)."""
    from megatron_paradyse.parallel.buffers import pool_sizes, release_pool

    release_pool()
    backward(forward())
    got = pool_sizes()
    release_pool()
    return got


def set_strategy(model, name):
    import megatron_paradyse as mp

    mp.set_plan(model, [name] * len(model.decoder.layers))
    reset_buffers()


def summarize(times):
    med = statistics.median(times)
    spread = (max(times) - min(times)) / med if med > 0 else 0.0
    return med, spread


class NonLayerRunner:
    """The rest of a step: embedding, final norm, output layer and loss (the decoder's layers
    removed for the pass), and the optimizer step (Adam over this rank's parameters)."""

    def __init__(self, model, spec, shape: ModelShape):
        self.model, self.spec, self.shape = model, spec, shape

    def _pass(self, s, b):
        from megatron_paradyse.testing import models as T

        tok, lab = T.make_batch(self.spec, b, s, seed=s)
        pos = torch.arange(s).unsqueeze(0).expand_as(tok)
        model = self.model

        def forward():
            return model(tok, pos, None, labels=lab).float().mean()

        def backward(loss):
            loss.backward()

        return forward, backward

    def _without_layers(self):
        dec = self.model.decoder
        saved = dec.layers
        dec.layers = torch.nn.ModuleList()
        return dec, saved

    def measure(self, s, b, warmup=1, repeats=3):
        from megatron_paradyse.parallel.memory import pass_memory

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
