"""Test stand-in for ``megatron.rl.parallel_utils``: no RL inference groups."""


def build_inference_pg_collection(*args, **kwargs):
    raise NotImplementedError("the test stand-in of megatron.rl has no RL support: drop the "
                              "--rl-inference-* flags, or use a full Megatron-LM checkout")
