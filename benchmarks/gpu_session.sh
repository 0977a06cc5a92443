#!/usr/bin/env bash
# One prepared run for a lent GPU machine, whose python3 holds torch, transformers and peft: the CUDA tests
# (failures with their one-line reasons), then the step tables at Llama-3.2-1B's shape.  About 6 minutes on
# one H200.  Writes its outputs under ${OUT:-gpu-out}/.
#     bash benchmarks/gpu_session.sh
set -o pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest tests/test_cuda.py -m cuda -q -p no:cacheprovider --tb=line -rf -W ignore 2>&1 \
    | tail -40 | tee "$out/cuda_tests.txt"
timeout 240 python3 benchmarks/gpu_step_bench.py --layers 16 --seq-len 2048 8192 --batch 4 1 --precision autocast \
    --methods hutch ghost exact hutchpp --steps 6 --rounds 1 2>&1 | tee "$out/gpu_autocast.txt"
timeout 60 python3 benchmarks/gpu_step_bench.py --layers 16 --seq-len 2048 --batch 4 --precision bf16 \
    --methods hutch --steps 6 --rounds 1 2>&1 | tee "$out/gpu_bf16.txt"
