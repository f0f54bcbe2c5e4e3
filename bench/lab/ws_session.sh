#!/usr/bin/env bash
# The GPU runs of the warp-specialised decode stage 1 (kernels/gluon_decode_ws.py) and the copy mechanisms, in stages
# that each fit one call of the device tool (10 minutes at most). Run from the repository root; results go to $OUT
# (default bench/results/tmp).
#
#   bash bench/lab/ws_session.sh lab        # the copy-only mechanisms table (bench/lab/copy_mechanisms.py)
#   bash bench/lab/ws_session.sh validate   # the GPU contract tests of the warp-specialised stage 1
#   bash bench/lab/ws_session.sh ab         # B = 32, S = 16k: today's Gluon stage 1 against the warp-specialised one
#   bash bench/lab/ws_session.sh table      # the table: cuDNN, Gluon and warp-specialised, B = 32, 8, S = 16k, 64k
#   bash bench/lab/ws_session.sh extend     # extend: the certificate's cost on the tiled kernel against the SDPA path
#
# Stages can be joined: `bash bench/lab/ws_session.sh validate ab lab`. Each stops at the first error.
set -euo pipefail
out="${OUT:-bench/results/tmp}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { tail -5 "$out/pip.log"; exit 1; }
for stage in "$@"; do
    echo "== $stage $(date +%T)"
    case "$stage" in
    lab)
        timeout 300 python3 bench/lab/copy_mechanisms.py --isolate --single-split --child-timeout 100 --shapes 32x16384 8x16384 --output "$out/copy_mechanisms.json" \
            2>&1 | grep -v "leaked\|nanobind\|skipped remainder" | tee "$out/copy_mechanisms.log"
        ;;
    validate)
        timeout 420 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k gluon_ws -p no:cacheprovider -x 2>&1 \
            | tee "$out/gpu_tests_ws.log" | tail -15
        ;;
    ab)
        timeout 300 python3 bench/bench_kernels.py --v-dither off --batches 32 --contexts 16384 \
            --variants int8_nocert int8_cert ws_nocert ws_cert ws128_nocert ws128_cert --output "$out/kernels_ws_ab.json"
        ;;
    table)
        timeout 480 python3 bench/bench_kernels.py --v-dither off --batches 32 8 --contexts 16384 65536 \
            --variants sdpa_cudnn int8_nocert int8_cert ws_nocert ws_cert \
            --output "$out/kernels_ws_table.json"
        ;;
    extend)
        timeout 300 python3 bench/bench_extend.py --shapes 16384:512 0:4096 8x4096:256 --per-row-up-to 0 \
            --variants sdpa_fp16 gathered_sdpa_bounds tiled tiled_cert --output "$out/extend_certificate_cost.json"
        ;;
    *)
        echo "unknown stage $stage (lab, validate, ab, table, extend)" >&2
        exit 2
        ;;
    esac
done
