#!/usr/bin/env python
"""Text files or JSONL -> megatron-core IndexedDataset (.bin/.idx), one document per sample.

    python scripts/preprocess_data.py --input my_texts/ --pattern '*.txt' --output-prefix data/my_docs
    python scripts/preprocess_data.py --input docs.jsonl --json-key text --output-prefix data/my_docs

Same as ``python -m megatron_paradyse.data preprocess``; train with ``--data-path data/my_docs``.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_paradyse.data.__main__ import main

    sys.exit(main(["preprocess"] + sys.argv[1:]))
