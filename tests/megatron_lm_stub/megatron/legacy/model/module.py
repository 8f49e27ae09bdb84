"""Test stand-in for ``megatron.legacy.model.module``."""


def param_is_not_shared(param):
    """True unless ``param`` is tagged ``shared`` (embedding copies across pipeline stages)."""
    return not getattr(param, "shared", False)
