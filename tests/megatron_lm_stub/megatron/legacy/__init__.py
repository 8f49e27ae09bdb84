"""Test stand-in for Megatron-LM's ``megatron.legacy`` (see tests/megatron_lm_stub/README.md)."""
