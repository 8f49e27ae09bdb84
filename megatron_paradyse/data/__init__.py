"""Data for variable-length training: preprocessing, the default corpus, documents, a length-aware
sampler, micro-batches padded to the switching group, packed micro-batches.

Below ``training``: it may import ``parallel``, ``costmodel`` and ``planner``, never ``training``.
"""
from __future__ import annotations

from .datasets import (DataError, DocumentDataset, FixedLengthView, MicroBatch, MicroBatchLoader, MockDataset,  # noqa: F401
                       build_dataset, pad_to_multiple, padded_length, sample_indices, split_ranges, step_lengths,
                       trim_to_multiple, write_indexed_dataset, LONG_DOC_POLICIES)
from .sampler import LengthAwareSampler, longest_fitting, make_cost_fn  # noqa: F401
from .packing import (PackedLoader, PackedStream, PackScheduler, cu_seqlens_from_positions,  # noqa: F401
                      default_pack_cost, make_pack_fns, pack_documents)
from .tokenizers import ByteTokenizer, build_tokenizer  # noqa: F401
from .preprocess import preprocess, read_meta, plot_length_histogram  # noqa: F401
from .corpus import stdlib_corpus  # noqa: F401
