"""Test stand-in for ``megatron.legacy.model``: no legacy models (``--use-legacy-models`` fails)."""


class GPTModel:  # noqa: D101 - referenced in type hints by model_provider.py
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the test stand-in of megatron.legacy has no legacy models: "
                                  "drop --use-legacy-models, or use a full Megatron-LM checkout")
