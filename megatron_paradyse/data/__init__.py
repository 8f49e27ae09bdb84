"""Data for variable-length training: documents, micro-batches padded to the switching group.

Lives beside ``training`` (it may import ``parallel`` and ``costmodel``, never ``training``).
"""
from __future__ import annotations

from .datasets import (DocumentDataset, FixedLengthView, MicroBatch, MicroBatchLoader, MockDataset,  # noqa: F401
                       build_dataset, pad_to_multiple, padded_length, sample_indices, step_lengths,
                       trim_to_multiple, write_indexed_dataset)
