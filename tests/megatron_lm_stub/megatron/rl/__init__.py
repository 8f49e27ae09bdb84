"""Test stand-in for Megatron-LM's ``megatron.rl`` (see tests/megatron_lm_stub/README.md)."""
