#!/usr/bin/env bash
# GPU runs on the device machine, in stages that each fit one call of the device tool (10 minutes at most).
# Run from the repository root; results go to $OUT (default bench/results/tmp).
#
#   bash bench/lab/device_session.sh auto            # by the card that came: on an H200 the table, the kernel paired
#                                                    # with the per-token certificate's stage 1 (dddfc61; carry
#                                                    # bench/results/tmp with it, written by whatif_stage1.py none --rev
#                                                    # dddfc61 --output bench/results/tmp/stage1_per_token.py) with the
#                                                    # reads in the L2, then ws_session.sh's table and lab (about 11 minutes: a
#                                                    # call stopped at 10 returns what the earlier stages wrote); on
#                                                    # another card that pairing alone (the decode targets are set on
#                                                    # the H200; about 2 minutes)
#   bash bench/lab/device_session.sh validate        # install, then the GPU contract tests (about 5 minutes);
#                                                    # with .whl/ carried (bench/e2e_wheels.sh), the cache and
#                                                    # aggregator GPU tests too (about 1 minute more)
#   bash bench/lab/device_session.sh table           # int8 against cuDNN at B = 32, 8 and S = 16k, 64k (about 4 minutes)
#   bash bench/lab/device_session.sh vdither         # the same with V dithered: the Gluon stage 1 against the Triton one
#   bash bench/lab/device_session.sh memory          # the loop's copies alone, and the kernels with reads served by the L2
#   bash bench/lab/device_session.sh shuffled        # the table's sizes with each row's pages of 1, then 16 slots in
#                                                    # random order (a pool after churn), the loop's copies alone
#                                                    # beside it (about 3 minutes)
#   bash bench/lab/device_session.sh whatifs NAME..  # what-ifs that keep the contract, paired with the kernel,
#                                                    # with DRAM and with the reads in the L2
#                                                    # (bench/lab/whatif_stage1.py's names; about 2 minutes each)
#   bash bench/lab/device_session.sh resident NAME.. # what-ifs with the reads in the L2 alone, beside the kernel with and
#                                                    # without the certificate (about 1 minute each)
#   bash bench/lab/device_session.sh whatif_tests NAME  # the Gluon GPU tests with a what-if in the kernel's place
#   bash bench/lab/device_session.sh against FILE    # the table's sizes, the kernel paired with the stage 1 of FILE
#                                                    # (whatif_stage1.py none --rev REV: an earlier commit's), with
#                                                    # DRAM and with the reads in the L2, then validate (about 8 minutes)
#   bash bench/lab/device_session.sh caps            # the Gluon register caps (4 programs per SM at 128)
#   bash bench/lab/device_session.sh profile [NAME]  # ncu's issue, scheduler and stall figures at B = 32, S = 16k,
#                                                    # for the kernel or a what-if (about 2 minutes)
#   bash bench/lab/device_session.sh occupancy       # four programs per SM (cap 128, the certified loop's q in shared
#                                                    # memory: whatif qshared) against three (168), with DRAM and with
#                                                    # the reads in the L2 (about 6 minutes)
#   bash bench/lab/device_session.sh stalls          # ncu's per-instruction stall samples of the kernel without and with
#                                                    # the certificate, reads in the L2 (B = 32, S = 16k; about 3 minutes)
#   bash bench/lab/device_session.sh stage2          # stage 2's warps paired inside the decode call (B = 8 and 32, S = 16k),
#                                                    # then its variants timed alone (bench/lab/stage2_variants.py; about
#                                                    # 2 minutes)
#   bash bench/lab/device_session.sh full            # every size of bench_kernels.py, V rounded to nearest
#
# Every stage installs the package first (a fresh machine has only the checkout) and stops at the first error.
set -euo pipefail

stage="${1:-}"
out="${OUT:-bench/results/tmp}"
mkdir -p "$out"
sizes=(--batches 32 8 --contexts 16384 65536)
whatif_sizes=(--batches 32 --contexts 16384 65536)

stages="auto validate table vdither memory shuffled whatifs resident whatif_tests against caps occupancy profile stalls stage2 full"
if [[ " $stages " != *" $stage "* ]]; then
    echo "usage: bash bench/lab/device_session.sh {${stages// /|}}" >&2
    exit 2
fi
python3 -m pip install -q --no-deps --no-build-isolation -e .

validate() {
    local tests=(tests/test_kernels_gpu.py)
    if compgen -G ".whl/*.whl" > /dev/null; then
        # The image lacks the telemetry and transformers packages that these two import.
        python3 -m pip install -q --no-index --no-deps .whl/*.whl
        tests+=(tests/test_cache_gpu.py tests/test_aggregator_gpu.py)
    else
        echo "no .whl/: tests/test_cache_gpu.py and tests/test_aggregator_gpu.py not run (bench/e2e_wheels.sh)" >&2
    fi
    PYTHONSAFEPATH=1 python3 -m pytest -q -m gpu "${tests[@]}" -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25
}

table() {
    python3 bench/bench_kernels.py --v-dither off "${sizes[@]}" \
        --variants sdpa_cudnn int8_nocert int8_cert triton_nocert triton_cert --output "$out/kernels_table.json"
}

vdither() {
    python3 bench/bench_kernels.py --v-dither on "${sizes[@]}" \
        --variants sdpa_cudnn int8_nocert int8_cert triton_nocert triton_cert --output "$out/kernels_vdither.json"
}

memory() {
    # Memory alone: the Gluon loop with its copies and nothing else, against the real kernel in one run.
    python3 bench/lab/whatif_stage1.py copyonly --output "$out/stage1_copyonly.py"
    python3 bench/bench_kernels.py --v-dither off "${whatif_sizes[@]}" --baseline-stage1 "$out/stage1_copyonly.py" \
        --variants sdpa_cudnn int8_nocert int8_cert base_nocert --output "$out/whatif_copyonly.json"
    # Everything but DRAM: the same kernels reading 16k slots (18 MB of int8 K and V) that the L2 holds.
    python3 bench/bench_kernels.py --v-dither off "${whatif_sizes[@]}" --resident-slots 16384 \
        --variants int8_nocert int8_cert --output "$out/kernels_resident.json"
}

shuffled() {
    # A pool after churn, pages of 1 and 16 slots: DRAM locality lost to random slots, for the kernel and for its
    # copies alone.
    python3 bench/lab/whatif_stage1.py copyonly --output "$out/stage1_copyonly.py"
    local page
    for page in 1 16; do
        python3 bench/bench_kernels.py --v-dither off "${sizes[@]}" --slot-order shuffled --page-size "$page" \
            --baseline-stage1 "$out/stage1_copyonly.py" --variants sdpa_cudnn int8_nocert int8_cert base_nocert \
            --output "$out/kernels_shuffled_page$page.json"
    done
}

whatifs() {
    local name
    for name in "$@"; do
        python3 bench/lab/whatif_stage1.py "$name" --output "$out/stage1_$name.py"
        python3 bench/bench_kernels.py --v-dither off "${whatif_sizes[@]}" --baseline-stage1 "$out/stage1_$name.py" \
            --variants sdpa_cudnn int8_nocert int8_cert base_nocert base_cert --output "$out/whatif_$name.json"
        whatif_resident "$name"
    done
}

whatif_resident() {
    # With the reads in the L2, where the kernel's own instructions set its pace (the H200's case); the kernel
    # without the certificate beside it gives each certificate's cost.
    python3 bench/lab/whatif_stage1.py "$1" --output "$out/stage1_$1.py"
    python3 bench/bench_kernels.py --v-dither off "${whatif_sizes[@]}" --baseline-stage1 "$out/stage1_$1.py" \
        --resident-slots 16384 --variants int8_nocert int8_cert base_cert --output "$out/whatif_${1}_resident.json"
}

per_token_resident() {
    # The kernel against the Gluon stage 1 with per-token certificate sums (dddfc61), the reads in the L2. The
    # machine has no git history: the file is written here and carried.
    local file=bench/results/tmp/stage1_per_token.py
    [[ -f "$file" ]] || { echo "missing $file: python bench/lab/whatif_stage1.py none --rev dddfc61 --output $file," \
        "then carry bench/results/tmp" >&2; return 2; }
    python3 bench/bench_kernels.py --v-dither off "${whatif_sizes[@]}" --resident-slots 16384 \
        --baseline-stage1 "$file" --variants int8_nocert int8_cert base_nocert base_cert \
        --output "$out/kernels_cells_resident.json"
}

occupancy() {
    python3 bench/lab/whatif_stage1.py qshared --output "$out/stage1_qshared.py"
    local paired=(--baseline-stage1 "$out/stage1_qshared.py" --baseline-maxnreg 128
                  --variants int8_nocert int8_cert base_nocert base_cert)
    python3 bench/bench_kernels.py --v-dither off "${sizes[@]}" "${paired[@]}" --output "$out/occupancy.json"
    python3 bench/bench_kernels.py --v-dither off "${whatif_sizes[@]}" --resident-slots 16384 "${paired[@]}" \
        --output "$out/occupancy_resident.json"
}

stalls() {
    # Where the certificate's instructions wait once DRAM is out of the picture: the stall reasons' shares and
    # the opcodes sampled, with and without it (the reports stay on the machine; their SASS pages come back).
    local certificate
    for certificate in off on; do
        ncu --clock-control none --kernel-name regex:decode_stage1 --launch-skip 4 --launch-count 1 \
            --section WarpStateStats --section SchedulerStats --section SourceCounters -f -o "/tmp/stalls_$certificate" \
            python3 bench/lab/profile_decode.py --batch 32 --context 16384 --resident-slots 16384 \
            --certificate "$certificate" > "$out/stalls_$certificate.txt" 2>&1
        ncu -i "/tmp/stalls_$certificate.ncu-rep" --page details >> "$out/stalls_$certificate.txt"
        ncu -i "/tmp/stalls_$certificate.ncu-rep" --page source --csv --print-source sass \
            | gzip > "$out/stalls_${certificate}_sass.csv.gz"
        python3 bench/lab/ncu_stalls.py "$out/stalls_${certificate}_sass.csv.gz" --top 20 \
            | tee -a "$out/stalls_$certificate.txt"
    done
}

case "$stage" in
auto)
    card="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    echo "card: $card" | tee "$out/card.txt"
    # In order of need: a call stopped at its time limit still returns what the earlier stages wrote.
    if [[ "$card" == *H200* ]]; then
        # What the H200 has not measured yet: the table on the kernel as it is (the certificate from cells),
        # the certificate's cost against the per-token sums' with the reads in the L2, then the warp-specialised
        # kernel and the copy mechanisms.
        table
        per_token_resident
        OUT="$out" bash bench/lab/ws_session.sh table lab
    else
        # Another card is memory-bound at these sizes: with the reads in the L2 it stands in for the H200.
        per_token_resident
    fi
    ;;
validate)
    validate
    ;;
table)
    table
    ;;
vdither)
    vdither
    ;;
memory)
    memory
    ;;
shuffled)
    shuffled
    ;;
whatifs)
    [[ $# -gt 1 ]] || { echo "whatifs: name the what-ifs to time (bench/lab/whatif_stage1.py --help)" >&2; exit 2; }
    whatifs "${@:2}"
    ;;
resident)
    [[ $# -gt 1 ]] || { echo "resident: name the what-ifs to time (bench/lab/whatif_stage1.py --help)" >&2; exit 2; }
    for name in "${@:2}"; do whatif_resident "$name"; done
    ;;
whatif_tests)
    [[ $# -eq 2 ]] || { echo "whatif_tests: name one what-if (bench/lab/whatif_stage1.py --help)" >&2; exit 2; }
    # The what-if in the kernel's place for this call only (each call gets a fresh copy of the checkout).
    python3 bench/lab/whatif_stage1.py "$2" --output kernels/gluon_decode.py
    python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider -k gluon 2>&1 \
        | tee "$out/gpu_tests_$2.log" | tail -25
    ;;
against)
    [[ $# -eq 2 && -f "$2" ]] || { echo "against: name a stage 1 file (bench/lab/whatif_stage1.py none --rev REV)" >&2; exit 2; }
    paired=(--baseline-stage1 "$2" --variants sdpa_cudnn int8_nocert int8_cert base_nocert base_cert)
    python3 bench/bench_kernels.py --v-dither off "${sizes[@]}" "${paired[@]}" --output "$out/against.json"
    python3 bench/bench_kernels.py --v-dither off "${whatif_sizes[@]}" --resident-slots 16384 "${paired[@]}" \
        --output "$out/against_resident.json"
    validate
    ;;
caps)
    python3 bench/bench_kernels.py --v-dither off --batches 32 --contexts 16384 --sweep gluon \
        --variants sdpa_cudnn int8_nocert int8_cert --output "$out/sweep_caps.json"
    ;;
profile)
    # What the certificate kernel waits on: issue, scheduler, warp-state and occupancy figures.
    what="${2:-kernel}"
    stage1=()
    if [[ $# -ge 2 ]]; then
        python3 bench/lab/whatif_stage1.py "$2" --output "$out/stage1_$2.py"
        stage1=(--stage1-file "$out/stage1_$2.py")
    fi
    ncu --clock-control none --kernel-name regex:decode_stage1 --launch-skip 4 --launch-count 1 \
        --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section Occupancy \
        python3 bench/lab/profile_decode.py --batch 32 --context 16384 --certificate on ${stage1[@]+"${stage1[@]}"} \
        > "$out/ncu_$what.txt" 2>&1
    tail -60 "$out/ncu_$what.txt"
    ;;
occupancy)
    occupancy
    ;;
stalls)
    stalls
    ;;
stage2)
    for batch in 8 32; do
        python3 bench/lab/profile_decode.py --batch "$batch" --context 16384 --kernel-times --stage2-warps 1 2 4 \
            | tee "$out/stage2_warps_b$batch.txt"
    done
    python3 bench/lab/stage2_variants.py --batches 8 32 --context 16384 --output "$out/stage2_variants.json"
    ;;
full)
    python3 bench/bench_kernels.py --v-dither off --output "$out/kernels_full.json"
    ;;
esac
