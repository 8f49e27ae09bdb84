"""``python -m megatron_paradyse.training.megatron_lm SCRIPT ...``: Megatron-LM's script with the hooks."""
from . import main

main()
