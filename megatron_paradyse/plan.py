"""``python -m megatron_paradyse.plan --cost-model M --seq-lens 4k,32k,256k --memory-budget 70``:
explain the planners' choice per length (see :mod:`megatron_paradyse.planner.cli`)."""
import sys

from .planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
