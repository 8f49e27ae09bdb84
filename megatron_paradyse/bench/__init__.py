"""The benchmark: stock megatron-core, every static strategy, the ParaDySe planners and the
per-batch oracle on the same batches under one memory budget (``python -m megatron_paradyse.bench``),
and an analytic simulation at GPU scale (``--simulate``). Imports no ``testing``.
"""
