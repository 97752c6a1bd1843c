#!/usr/bin/env bash
# One call on a lent GPU machine: versions, the kernel tests on CUDA, the decode-attention table, the tiled kernel's
# tuning sweep and end-to-end decoding. Each step has its own time limit so one slow step cannot eat the others.
#   bash benchmarks/gpu_check.sh [tests] [table] [splits] [sweep] [generate] [ncu]   (default: tests table sweep generate)
# Environment: TESTS_K / TESTS_S, TABLE_ARGS / TABLE_S, SPLITS_S, SWEEP_ARGS / SWEEP_S, GENERATE_RECIPES / GENERATE_S, NCU_S.
# Logs and JSON go to $OUT when it is set (the device tool's folder), else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
steps="${*:-tests table sweep generate}"
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried to the device (a newer transformers than its image's)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for step in $steps; do
  start=$(date +%s)
  case "$step" in
    tests) timeout "${TESTS_S:-240}" python3 -m pytest tests/test_kernels.py tests/test_turboquant_norm8.py tests/test_staging.py \
             tests/test_float_block_size.py tests/test_turboquant_calibrated_channels.py tests/test_turboquant.py tests/test_byte_float_blocks.py -m gpu -p no:cacheprovider -rf \
             -k "${TESTS_K:-(uniform_kernel and (128-4 or tiles_of_any)) or fp8_bytes or merge_reads or on_cuda or (256-8 and (palu or turboquant-2.5)) or 8_bit_norms or float_blocks or calibrated_channels or quarter_bit or float8}" \
             > "$out/gpu_tests.log" 2>&1; grep -E "^FAILED|passed|failed" "$out/gpu_tests.log" | cut -c1-300 | tail -n 12 ;;
    table) timeout "${TABLE_S:-200}" python3 -m benchmarks.gpu_attention ${TABLE_ARGS:---general} --out "$out/gpu_attention.json" \
             > "$out/gpu_attention.log" 2>&1; grep -E "rror" "$out/gpu_attention.log" | cut -c1-300 | tail -n 4 ;;
    splits) timeout "${SPLITS_S:-120}" python3 -m benchmarks.gpu_attention --split-sweep --out "$out/gpu_attention.json" \
             > "$out/gpu_splits.log" 2>&1; grep -E "rror" "$out/gpu_splits.log" | cut -c1-300 | tail -n 4 ;;
    sweep) timeout "${SWEEP_S:-240}" python3 -m benchmarks.gpu_attention --sweep ${SWEEP_ARGS:-} --out "$out/gpu_attention.json" \
             > "$out/gpu_sweep.log" 2>&1; grep -E "best|rror" "$out/gpu_sweep.log" | cut -c1-400 | tail -n 12 ;;
    generate) timeout "${GENERATE_S:-180}" python3 -m benchmarks.gpu_generate --random-weights --batch 32 --context 8192 \
             --recipes ${GENERATE_RECIPES:-kivi-4bit kivi-4bit-lean kivi-2bit} --out "$out/gpu_generate.json" > "$out/gpu_generate.log" 2>&1; tail -n 14 "$out/gpu_generate.log" ;;
    ncu) timeout "${NCU_S:-60}" ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
             --section ComputeWorkloadAnalysis --section LaunchStats -k regex:uniform_partials --launch-skip 3 -c 1 \
             python3 -m benchmarks.gpu_attention --profile-one > "$out/ncu.txt" 2>&1
           grep -E "Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Issue Slots|Warp Cycles Per Issued|Duration|Local Memory" \
             "$out/ncu.txt" | cut -c1-110 | head -n 16 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "== $step: $(( $(date +%s) - start )) s"
done
