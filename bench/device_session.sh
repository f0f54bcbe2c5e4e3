#!/usr/bin/env bash
# The GPU work of one session on the device machine, in stages that each fit one call of the device tool
# (10 minutes at most). Run from the repository root; results go to $OUT (default bench/results/tmp).
#
#   bash bench/device_session.sh validate     # install, then the GPU contract tests (about 5 minutes)
#   bash bench/device_session.sh table        # int8 against cuDNN at B = 32, 8 and S = 16k, 64k (about 4 minutes)
#   bash bench/device_session.sh experiments  # where the time goes: memory alone, L2-served reads, the rescale branch
#   bash bench/device_session.sh full         # the whole table of docs/KERNELS.md, V rounded to nearest
#
# Every stage installs the package first (a fresh machine has only the checkout) and stops at the first error.
set -euo pipefail

stage="${1:-}"
out="${OUT:-bench/results/tmp}"
mkdir -p "$out"
sizes=(--batches 32 8 --contexts 16384 65536)

python3 -m pip install -q --no-deps --no-build-isolation -e .

case "$stage" in
validate)
    python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25
    ;;
table)
    python3 bench/bench_kernels.py --v-dither off "${sizes[@]}" \
        --variants sdpa_cudnn int8_nocert int8_cert triton_nocert triton_cert --output "$out/kernels_table.json"
    ;;
experiments)
    # Memory alone: the Gluon loop with its copies and nothing else, against the real kernel in one run.
    python3 bench/whatif_stage1.py copyonly --output "$out/stage1_copyonly.py"
    python3 bench/bench_kernels.py --v-dither off "${sizes[@]}" --baseline-stage1 "$out/stage1_copyonly.py" \
        --variants sdpa_cudnn int8_nocert int8_cert base_nocert --output "$out/whatif_copyonly.json"
    # Everything but DRAM: the same kernels reading 16k slots (18 MB of int8 K and V) that the L2 holds.
    python3 bench/bench_kernels.py --v-dither off "${sizes[@]}" --resident-slots 16384 \
        --variants int8_nocert int8_cert --output "$out/kernels_resident.json"
    # Whether the branch around the output's rescale still pays.
    python3 bench/whatif_stage1.py nobranch --output "$out/stage1_nobranch.py"
    python3 bench/bench_kernels.py --v-dither off "${sizes[@]}" --baseline-stage1 "$out/stage1_nobranch.py" \
        --variants sdpa_cudnn int8_nocert int8_cert base_nocert base_cert --output "$out/whatif_nobranch.json"
    ;;
full)
    python3 bench/bench_kernels.py --v-dither off --output "$out/kernels_full.json"
    ;;
*)
    echo "usage: bash bench/device_session.sh {validate|table|experiments|full}" >&2
    exit 2
    ;;
esac
