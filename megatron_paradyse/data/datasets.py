"""Variable-length micro-batches for ParaDySe training.

Every sample is one document, ``L + 1`` token ids (inputs are the first ``L``, labels the
last ``L``), truncated to ``seq_length + 1``. Two sources:

* :class:`DocumentDataset`: megatron-core's ``IndexedDataset`` (``--data-path PREFIX``,
  the ``PREFIX.bin`` / ``PREFIX.idx`` pair written by Megatron-LM's
  ``tools/preprocess_data.py`` or :func:`write_indexed_dataset`), one document per sample,
  read per document from the memory-mapped ``.bin``, shuffled per epoch with the seed.
  megatron-core's own ``GPTDataset`` only yields packed fixed-length samples.
* :class:`MockDataset` (``--mock-data``): a deterministic synthetic corpus whose lengths
  follow a long-tailed (log-uniform) distribution up to ``seq_length``. Each document is a
  learnable pattern (an arithmetic progression of token ids with a per-document start and
  stride), so the loss falls visibly in a demo.

Both are pure functions of ``(seed, index)``: every rank of a switching group computes the
same micro-batch without communication, which is what lets every rank derive the same plan.

:func:`pad_to_multiple` turns a micro-batch of samples into tensors padded at the end to a
multiple of the layout's divisor (``p``: every strategy keeps ``[s/p, b, h]`` between layers),
with a loss mask that removes the padding. Padding sits after the real tokens, so with causal
attention it cannot influence them: the per-token loss summed over the mask, divided by the
number of real tokens in the whole step (across micro-batches and data-parallel replicas, as
megatron's ``calculate_per_token_loss`` does), equals the loss of the unpadded batch, and so
does its gradient.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os

import numpy as np
import torch

from .. import paths
from ..device import copy_to
from ..errors import UserError
from ..layout import DataConfig
from ..parallel.packing import PackShape
from .preprocess import read_meta

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- datasets
class DataError(UserError, ValueError):
    """``--data-path`` names data that is missing, corrupt, or holds nothing trainable (a
    user's mistake: one line, exit status 2)."""


class MockDataset:
    """Deterministic synthetic documents with log-uniform lengths in ``[min_length, seq_length]``.

    ``dataset[i]`` is an int64 array of ``L + 1`` token ids, a function of ``(seed, i)`` only.
    ``documents=(beg, end)``: sample ``i`` is document ``beg + i % (end - beg)`` (a split of the
    corpus, :func:`split_ranges`); None: document ``i``.
    """

    def __init__(self, seq_length: int, vocab_size: int, seed: int = 1234, min_length: int = 16,
                 num_samples: int = 1 << 40, documents: tuple | None = None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.min_length = max(1, min(min_length, seq_length))
        self.num_samples = num_samples
        self.documents = documents

    def __len__(self) -> int:
        return self.num_samples

    def _document(self, i: int) -> int:
        if self.documents is None:
            return int(i)
        beg, end = self.documents
        return beg + int(i) % (end - beg)

    def length(self, i: int) -> int:
        """The number of training tokens (inputs) of sample ``i``."""
        rng = np.random.default_rng([self.seed, self._document(i), 0])
        lo, hi = math.log(self.min_length), math.log(self.seq_length + 1)
        return int(min(self.seq_length, max(self.min_length, math.exp(rng.uniform(lo, hi)))))

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        n = self.length(i) + 1
        rng = np.random.default_rng([self.seed, self._document(i), 1])
        start = int(rng.integers(0, self.vocab_size))
        stride = int(rng.integers(1, 4))
        return (start + stride * np.arange(n, dtype=np.int64)) % self.vocab_size


LONG_DOC_POLICIES = ("split", "truncate", "skip", "error")


def _check_source(prefix: str, seq_length: int, long_docs: str) -> None:
    """The policy and length are valid and the ``.bin``/``.idx`` pair exists."""
    if long_docs not in LONG_DOC_POLICIES:
        raise ValueError(f"long_docs must be one of {LONG_DOC_POLICIES}, got {long_docs!r}")
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    for suffix in (".idx", ".bin"):
        if not os.path.exists(prefix + suffix):
            raise DataError(
                f"{prefix}{suffix} not found: --data-path takes the prefix of a .bin/.idx pair "
                "(python -m megatron_paradyse.data preprocess writes one)")


def check_index(prefix: str) -> None:
    """``--data-path PREFIX`` names a readable ``.bin``/``.idx`` pair whose index megatron-core
    reads and which describes the ``.bin`` (argument validation: before any work)."""
    _check_source(prefix, 1, "split")
    indexed = _open_index(prefix)
    seq_lens = np.asarray(indexed.index.sequence_lengths, dtype=np.int64)
    _token_memmap(prefix, indexed.index, seq_lens, None)


def _open_index(prefix: str):
    """megatron-core's ``IndexedDataset`` of ``prefix`` (a clear error for a bad index)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        return IndexedDataset(prefix)
    except Exception as e:  # noqa: BLE001 - megatron asserts on a bad index
        raise DataError(f"{prefix}.idx is not a megatron-core index ({type(e).__name__}: {e})") from None


def _token_memmap(prefix: str, index, seq_lens, vocab_size: int | None):
    """The ``.bin``'s tokens, memory-mapped, once the index is checked to describe them and
    (with ``vocab_size``) every id to be inside the vocabulary."""
    pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
    itemsize = np.dtype(index.dtype).itemsize
    bin_bytes = os.path.getsize(prefix + ".bin")
    want = int(pointers[-1] + seq_lens[-1] * itemsize) if len(seq_lens) else 0
    if want != bin_bytes or (len(seq_lens) > 1 and np.any(pointers[1:] != pointers[:-1] + seq_lens[:-1] * itemsize)):
        raise DataError(
            f"{prefix}.idx does not match {prefix}.bin: the index describes {want} bytes of "
            f"{np.dtype(index.dtype).name} tokens, the .bin has {bin_bytes} (rewrite both together)")
    tokens = np.memmap(prefix + ".bin", dtype=index.dtype, mode="r") if bin_bytes else np.zeros(0, np.int64)
    if vocab_size is not None and len(tokens):
        top = int(tokens.max())
        if top >= vocab_size:
            bad = int(np.argmax(tokens >= vocab_size))
            raise DataError(
                f"{prefix}: token id {top} is outside the vocabulary (--vocab-size {vocab_size}); "
                f"first at token offset {bad}. Preprocess with the model's tokenizer or raise --vocab-size")
    return tokens


class DocumentDataset:
    """One document of megatron-core's ``IndexedDataset`` per sample, at its natural length.

    A document of ``n`` tokens is a sample of ``n - 1`` training tokens (inputs ``doc[:-1]``,
    labels ``doc[1:]``). A document longer than ``limit = min(seq_length, max_length)`` training
    tokens is handled by ``long_docs``:

    * ``"split"``: consecutive chunks of ``limit`` training tokens (``limit + 1`` ids, each
      chunk's last id is the next chunk's first input, so every token is predicted once);
    * ``"truncate"``: its first ``limit + 1`` ids only (the constructor's default, as before);
    * ``"skip"``: left out;
    * ``"error"``: ``ValueError`` naming it.

    ``max_length`` is the longest sequence the planner can fit in the memory budget (None: no
    such limit); documents above it are named in a warning (or the error). ``documents=(beg,
    end)``: only the documents of that range (a split, :func:`split_ranges`). Documents of fewer
    than two tokens are skipped. Samples are shuffled with a seeded permutation per epoch, so
    ``dataset[i]`` is defined for every ``i >= 0``.

    Checks at construction (clear ``ValueError`` / ``FileNotFoundError``): missing ``.bin`` or
    ``.idx``; an ``.idx`` that does not describe the ``.bin`` (wrong size, wrong pointers);
    token ids ``>= vocab_size`` (when given); no usable document.
    """

    def __init__(self, prefix: str, seq_length: int, seed: int = 1234, shuffle: bool = True,
                 long_docs: str = "truncate", max_length: int | None = None,
                 vocab_size: int | None = None, documents: tuple | None = None):
        _check_source(prefix, seq_length, long_docs)
        self.prefix = prefix
        self.seq_length = seq_length
        self.seed = seed
        self.shuffle = shuffle
        self.long_docs = long_docs
        self.limit = int(min(seq_length, max_length)) if max_length is not None else int(seq_length)
        if self.limit < 1:
            raise DataError(f"no plan fits even the shortest sequence in the memory budget (the longest "
                             f"trainable length is {self.limit}): raise the budget")
        self.indexed = _open_index(prefix)
        seq_lens = np.asarray(self.indexed.index.sequence_lengths, dtype=np.int64)
        self._tokens = _token_memmap(prefix, self.indexed.index, seq_lens, vocab_size)
        bounds = np.asarray(self.indexed.document_indices, dtype=np.int64)
        csum = np.concatenate([[0], np.cumsum(seq_lens)])
        doc_start = csum[bounds[:-1]]
        doc_tokens = csum[bounds[1:]] - doc_start
        meta = _read_meta(prefix)
        names = meta.get("documents") if meta else None
        self.names = names if names is not None and len(names) == len(doc_tokens) else None
        usable = np.nonzero(doc_tokens >= 2)[0]
        if documents is not None:  # a split of the documents (split_ranges)
            usable = usable[(usable >= documents[0]) & (usable < documents[1])]
        if len(usable) == 0:
            raise DataError(f"{prefix}: empty dataset: no document has at least two tokens "
                             f"({len(doc_tokens)} documents)")
        train = doc_tokens[usable] - 1           # training tokens of each document
        long = usable[train > self.limit]
        if len(long):
            self._report_long(long, doc_tokens, max_length)
        self._start, self._count, self.sample_docs = self._samples(usable, doc_start, doc_tokens)
        self.num_documents = int(len(doc_tokens))
        self._perms: dict = {}

    def _samples(self, usable, doc_start, doc_tokens) -> tuple:
        """``(start token offset in the .bin, number of ids, document)`` arrays of the samples:
        each usable document whole, or under the long-document policy."""
        starts, counts, docs = [], [], []
        lim = self.limit
        for d in usable:
            n, a = int(doc_tokens[d]), int(doc_start[d])
            if n - 1 <= lim:
                starts.append(a), counts.append(n), docs.append(d)
            elif self.long_docs == "truncate":
                starts.append(a), counts.append(lim + 1), docs.append(d)
            elif self.long_docs == "split":
                for j in range(0, n - 1, lim):
                    starts.append(a + j), counts.append(min(lim + 1, n - j)), docs.append(d)
        if not starts:
            raise DataError(f"{paths.shown(self.prefix)}: every document is longer than {lim} tokens and "
                             f"long documents are skipped: empty dataset")
        return (np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64),
                np.asarray(docs, dtype=np.int64))

    def _report_long(self, long, doc_tokens, max_length):
        """Documents above the limit: an error (``long_docs="error"``), else a warning on rank 0
        (every rank builds the same dataset) where they are cut for the budget or skipped."""
        from megatron.core.utils import log_single_rank

        fit = max_length is not None and max_length < self.seq_length
        why = (f"longer than {self.limit} tokens, the longest sequence any plan fits in the memory budget"
               if fit else f"longer than --seq-length {self.seq_length}")
        shown = ", ".join(self.doc_name(int(d)) + f" ({int(doc_tokens[d]) - 1} tokens)" for d in long[:5])
        more = f" and {len(long) - 5} more" if len(long) > 5 else ""
        msg = f"{paths.shown(self.prefix)}: {len(long)} document(s) {why}: {shown}{more}"
        if self.long_docs == "error":
            raise DataError(msg + ". Choose split, truncate or skip to train on them")
        if fit or self.long_docs == "skip":
            action = {"split": f"split into chunks of {self.limit}", "truncate": f"truncated to {self.limit}",
                      "skip": "skipped"}[self.long_docs]
            log_single_rank(log, logging.WARNING, msg + f": {action}")

    def doc_name(self, d: int) -> str:
        return f"document {d}" + (f" [{self.names[d]}]" if self.names else "")

    def __len__(self) -> int:
        return len(self._start)

    def _sample_for(self, i: int) -> int:
        n = len(self._start)
        epoch, j = divmod(int(i), n)
        if not self.shuffle:
            return j
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._perms = {epoch: perm}  # keep one epoch's permutation
        return int(perm[j])

    def length(self, i: int) -> int:
        """Training tokens (inputs) of sample ``i`` (no read of the ``.bin``)."""
        if i < 0:
            raise IndexError(i)
        return int(self._count[self._sample_for(i)]) - 1

    def sample_lengths(self) -> np.ndarray:
        """Training tokens of every sample of one epoch (unshuffled order)."""
        return self._count - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            raise IndexError(i)
        k = self._sample_for(i)
        a = int(self._start[k])
        return np.asarray(self._tokens[a:a + int(self._count[k])], dtype=np.int64)


def _read_meta(prefix: str):
    try:
        return read_meta(prefix)
    except (OSError, ValueError):
        return None


def write_indexed_dataset(prefix: str, documents, vocab_size: int) -> None:
    """Write ``documents`` (iterables of token ids) as megatron-core ``PREFIX.bin`` / ``PREFIX.idx``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=DType.optimal_dtype(vocab_size))
    for doc in documents:
        builder.add_item(torch.as_tensor(np.asarray(doc, dtype=np.int64)))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


def split_ranges(split: str, num_documents: int) -> list:
    """megatron-core's split of ``num_documents`` documents by ``split`` (``"969, 30, 1"``):
    ``[(beg, end) or None]`` for train, validation and test, with megatron's own parser, split
    matrix and rounding (``BlendedMegatronDatasetBuilder``: ``round(fraction * documents)``)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    out = []
    for bounds in convert_split_vector_to_split_matrix(parse_and_normalize_split(split)):
        if bounds is None:
            out.append(None)
            continue
        beg, end = (int(round(x * float(num_documents))) for x in bounds)
        out.append((beg, end) if end > beg else None)
    return out


def _num_documents(config: DataConfig) -> int:
    """Documents of the corpus the split divides: the ``.idx``'s, or megatron-core's mock corpus
    size (``MockGPTLowLevelDataset.size``) for ``--mock-data``."""
    if config.mock:
        from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

        return int(MockGPTLowLevelDataset.size)
    return int(len(_open_index(config.data_path).document_indices) - 1)


def build_dataset(config: DataConfig, max_length: int | None = None, split: int = 0):
    """The dataset of split ``split`` (0 train, 1 validation, 2 test: ``config.split`` of the
    documents, :func:`split_ranges`) of the data ``config`` names (synthetic documents,
    ``--mock-data``, or the IndexedDataset prefix ``config.data_path``); None when that split
    holds no document (the training split always does: else a :class:`DataError`).

    ``max_length``: the longest sequence the planner fits in the memory budget (documents
    above it are handled by ``config.long_docs``, with a warning naming them).
    """
    if not config.mock:
        _check_source(config.data_path, config.seq_length, config.long_docs)
    n = _num_documents(config)
    docs = split_ranges(config.split, n)[split]
    if docs is None:
        if split == 0 and n == 0:  # no document at all: the dataset's own error says so
            docs = (0, 0)
        elif split == 0:
            raise DataError(f"--split {config.split!r} leaves no document for training")
        else:
            return None
    if config.mock:
        top = config.seq_length if max_length is None else min(config.seq_length, int(max_length))
        if top < config.seq_length and split == 0:
            from megatron.core.utils import log_single_rank

            log_single_rank(log, logging.INFO, f"> --mock-data: documents of up to {top} tokens, the longest "
                                               f"sequence any plan fits in the memory budget (--seq-length "
                                               f"{config.seq_length})")
        return MockDataset(top, config.vocab_size, seed=config.seed, min_length=config.mock_min_length,
                           documents=docs)
    try:
        return DocumentDataset(config.data_path, config.seq_length, seed=config.seed, long_docs=config.long_docs,
                               max_length=max_length, documents=docs,
                               vocab_size=config.vocab_size if split == 0 else None)  # the .bin's ids: checked once
    except DataError:
        if split == 0:
            raise
        return None  # a validation or test split of unusable documents only: no such split


# --------------------------------------------------------------------------- batches
@dataclasses.dataclass
class MicroBatch:
    """One padded micro-batch. ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` are
    ``[b, s]`` with ``s`` a multiple of the layout's divisor; ``lengths`` are the real lengths.
    A packed micro-batch (``b = 1``, several documents) also has ``cu_seqlens``."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    lengths: tuple
    plan: tuple | None = None  # set by hooks.PlannedIterator: one strategy name per layer
    cu_seqlens: tuple | None = None  # a pack's document boundaries (0, ..., T) (packing.pack_documents)
    choice: object = None  # the planner's choice for it (its predicted seconds and peak), if planned
    cp_block: tuple | None = None  # Dynamic CP: (first node, c) of the block of nodes it runs on

    @property
    def seq_length(self) -> int:
        """The padded length the model runs."""
        return int(self.tokens.shape[1])

    @property
    def num_tokens(self) -> int:
        """Real (loss-bearing) tokens: the loss mask's sum."""
        return int(self.loss_mask.sum())

    @property
    def shape(self) -> tuple:
        return tuple(self.tokens.shape)

    @property
    def plan_length(self):
        """What a planner plans this micro-batch by: its padded length, or for a pack its
        documents (:class:`~megatron_paradyse.parallel.packing.PackShape`, padding included)."""
        if self.cu_seqlens is None:
            return self.seq_length
        c = self.cu_seqlens
        return PackShape(tuple(b - a for a, b in zip(c, c[1:])))

    def to(self, device) -> "MicroBatch":
        """On ``device``, copied without stalling the host (pinned and non-blocking on CUDA)."""
        return dataclasses.replace(
            self, tokens=copy_to(self.tokens, device), labels=copy_to(self.labels, device),
            loss_mask=copy_to(self.loss_mask, device), position_ids=copy_to(self.position_ids, device))


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (at least ``multiple``)."""
    multiple = max(1, int(multiple))
    return max(multiple, -(-int(length) // multiple) * multiple)


def pad_to_multiple(samples, multiple: int, pad_id: int = 0) -> MicroBatch:
    """Pad a micro-batch of documents (each ``L_i + 1`` token ids) to ``s``, a multiple of ``multiple``.

    ``s`` is ``max_i L_i`` rounded up. Inputs are ``doc[:-1]``, labels ``doc[1:]``; positions
    past ``L_i`` hold ``pad_id`` and have ``loss_mask == 0``. With the loss summed over the
    mask and divided by the step's total of ``num_tokens`` (megatron's per-token loss), loss and
    gradient equal those of the unpadded documents, because padding only follows real tokens
    and attention is causal.
    """
    docs = [np.asarray(d, dtype=np.int64).reshape(-1) for d in samples]
    if not docs:
        raise ValueError("a micro-batch needs at least one sample")
    lengths = tuple(len(d) - 1 for d in docs)
    if min(lengths) < 1:
        raise ValueError("every sample needs at least two token ids (one input, one label)")
    s = padded_length(max(lengths), multiple)
    b = len(docs)
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    labels = torch.full((b, s), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, s), dtype=torch.float32)
    for i, d in enumerate(docs):
        n = lengths[i]
        t = torch.from_numpy(d)
        tokens[i, :n] = t[:n]
        labels[i, :n] = t[1:n + 1]
        loss_mask[i, :n] = 1.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
    return MicroBatch(tokens, labels, loss_mask, position_ids, lengths)


def trim_to_multiple(tokens, labels, loss_mask, multiple: int, position_ids=None) -> MicroBatch:
    """A fixed-shape ``[b, seq_length]`` batch (Megatron-LM's data loaders) cut after its last
    loss-bearing position, rounded up to ``multiple``. Causal attention makes the cut exact."""
    mask = loss_mask.float()
    b, full = tokens.shape
    nz = torch.nonzero(mask.sum(0) > 0)
    last = int(nz.max()) + 1 if nz.numel() else 1
    s = padded_length(last, multiple)
    if s > full:
        raise ValueError(f"cannot pad a [{b}, {full}] batch to a multiple of {multiple}")
    lengths = []
    for i in range(b):
        row = torch.nonzero(mask[i] > 0)
        lengths.append(int(row.max()) + 1 if row.numel() else 0)
    if position_ids is None:
        position_ids = torch.arange(full, device=tokens.device).unsqueeze(0).expand(b, full)
    return MicroBatch(tokens[:, :s].contiguous(), labels[:, :s].contiguous(), mask[:, :s].contiguous(),
                      position_ids[:, :s].contiguous(), tuple(lengths))


class FixedLengthView:
    """A dataset of variable-length documents seen as fixed-shape samples of ``seq_length``.

    For Megatron-LM's data loaders (default collation needs equal shapes): each item is a dict
    of ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` padded to ``seq_length``; the
    ParaDySe forward step trims each micro-batch back with :func:`trim_to_multiple`.
    """

    def __init__(self, dataset, seq_length: int, num_samples: int | None = None, pad_id: int = 0):
        self.dataset, self.seq_length, self.pad_id = dataset, seq_length, pad_id
        self.num_samples = num_samples if num_samples is not None else len(dataset)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        mb = pad_to_multiple([self.dataset[int(i)]], 1, self.pad_id)
        s = mb.seq_length
        out = {}
        for key, t in (("tokens", mb.tokens), ("labels", mb.labels), ("loss_mask", mb.loss_mask),
                       ("position_ids", None)):
            row = torch.arange(self.seq_length, dtype=torch.long) if t is None else \
                torch.nn.functional.pad(t[0], (0, self.seq_length - s), value=0 if key == "loss_mask" else self.pad_id)
            out[key] = row
        return out


def sample_indices(step: int, micro: int, global_batch_size: int, micro_batch_size: int,
                   dp_rank: int, dp_size: int, first_sample: int = 0) -> list:
    """Indices of micro-batch ``micro`` of iteration ``step`` on data-parallel rank ``dp_rank``.

    The order of Megatron-LM's ``MegatronPretrainingSampler``: each global batch is read in
    rounds of ``micro_batch_size * dp_size`` consecutive samples, rank ``r`` taking the r-th
    ``micro_batch_size`` of each round.
    """
    base = first_sample + step * global_batch_size + (micro * dp_size + dp_rank) * micro_batch_size
    return list(range(base, base + micro_batch_size))


class MicroBatchLoader:
    """An endless iterator of this data-parallel rank's padded micro-batches, in Megatron order.

    ``consumed_samples`` (``iteration * global_batch_size`` on resume) skips what a previous
    run consumed; every rank of a switching group yields the same micro-batches.
    """

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, dp_rank: int,
                 dp_size: int, multiple: int, consumed_samples: int = 0, pad_id: int = 0,
                 sampler=None):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global batch size {global_batch_size} is not divisible by micro batch "
                             f"size {micro_batch_size} x data-parallel size {dp_size}")
        self.dataset = dataset
        self.mbs, self.gbs, self.dp_rank, self.dp_size = micro_batch_size, global_batch_size, dp_rank, dp_size
        self.multiple, self.pad_id = multiple, pad_id
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        if consumed_samples % global_batch_size:
            raise ValueError(f"consumed samples {consumed_samples} is not a multiple of the global batch size")
        self.step = consumed_samples // global_batch_size
        self.micro = 0
        self.sampler = sampler  # a LengthAwareSampler; None: Megatron's sequential order

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        if self.sampler is not None:
            idx = self.sampler.micro_indices(self.step, self.micro, self.dp_rank)
        else:
            idx = sample_indices(self.step, self.micro, self.gbs, self.mbs, self.dp_rank, self.dp_size)
        self.micro += 1
        if self.micro == self.num_microbatches:
            self.micro, self.step = 0, self.step + 1
        return pad_to_multiple([self.dataset[i] for i in idx], self.multiple, self.pad_id)


def step_lengths(dataset, step: int, global_batch_size: int, sampler=None) -> list:
    """Every document length of iteration ``step`` across all replicas (for logs and planners)."""
    if sampler is not None:
        return [len(dataset[i]) - 1 for per in sampler.step_indices(step) for mb in per for i in mb]
    return [len(dataset[i]) - 1 for i in range(step * global_batch_size, (step + 1) * global_batch_size)]
