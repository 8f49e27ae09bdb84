#!/usr/bin/env bash
# What ran on the H200 lent to issue 37 (device tool, p = 1), from the repository root with
# megatron-core's wheel in .whl/: the GPU-host tests, the determinism probe, and the check's env,
# kernels, exactness and timing sections. Logs: results/gpu/h200/fast_paths/final_*.
python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONWARNINGS=ignore PYTHONPATH=$PWD
timeout 40 python -m pytest -q tests/test_gpu_kernels.py tests/test_varlen.py tests/test_merge_lse.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log
timeout 30 python scripts/gpu_determinism.py > $OUT/determinism.log 2>&1; cat $OUT/determinism.log | tail -12
timeout 170 bash scripts/check.sh --sections env,kernels,exactness,timing --timing-seqs 4096,8192 --out $OUT/check.json > $OUT/check.log 2>&1; grep -v "^\[check\]" $OUT/check.log | tail -60
