"""Test stand-in: Megatron-LM's ``fused_kernels.load`` builds nothing since the kernels moved to megatron-core."""


def load(args):  # noqa: ARG001 - same signature as Megatron-LM's
    return None
