#!/usr/bin/env bash
# One short GPU lease (the device tool: 15 minutes of device time, the machine's start included) spent on
# BENCHMARKS.md's pending GPU rows, most wanted first, inside one call:
#   bash benchmarks/gpu_lease.sh OUT_DIR [SECONDS]       # default 500 s of benchmarks after the install
# On the lent machine, with `.whl` carried (benchmarks/gpu_wheels.sh fills it here). Each row is one
# command of benchmarks/gpu.sh (GPU_SH_ONLY); GPU_SH_DEADLINE cuts the last ones short or skips them, so
# the call ends in time and the logs come back. OUT_DIR gets one archive (the device tool returns at
# most 8 files): every command's log, the loop runs' profile.txt and log.jsonl, the device's state;
# it is rewritten after every row, so a call that runs past its timeout still brings back the rows done.
set -u
OUT_DIR=${1:?usage: gpu_lease.sh OUT_DIR [SECONDS]}
BUDGET=${2:-500}
LOGS=/tmp/gpu-logs
mkdir -p "$LOGS" "$OUT_DIR"
compgen -G ".whl/*.whl" >/dev/null || { echo "gpu_lease.sh: no wheels in .whl: run bash benchmarks/gpu_wheels.sh" \
    "on the development machine and carry .whl (the device tool's carry)"; exit 1; }
install_wheels() {  # install_wheels DIR TARGET: each package of DIR once, the wheel for this python3 (gpu_wheels.sh
    local names      # carries one per Python version where the package has them)
    names=$(for wheel in "$1"/*.whl; do basename "$wheel" | cut -d- -f1; done | sort -u)
    # shellcheck disable=SC2086  # one word per package
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" --find-links "$1" \
        $names || { echo "gpu_lease.sh: $1 has no wheel of some package for $(python3 -V): run GPU_PYTHONS=<its" \
                         "version> bash benchmarks/gpu_wheels.sh on the development machine"; return 1; }
}
install_wheels .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export GPU_SH_DEADLINE=$(($(date +%s) + BUDGET))
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
        --format=csv
    python3 -c 'import torch, triton, transformers, deepspeed, megatron.core as m
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
      "deepspeed", deepspeed.__version__, "megatron-core", m.__version__)
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, "SMs")'
} >"$LOGS/device.txt" 2>&1
cat "$LOGS/device.txt"

# STEP ROW...: most wanted first. Session 21's two H200 leases measured the first wave of rows, session
# 24's two the flat engine, session 29's two (leases 5-6) the attention kernels, the Flex sweep, the head and
# five loop rows, session 60's two (leases 7-8) our Triton kernels: right on the GPU, and the loop on them at
# 29.9% MFU (base, packed, micro-batch 16, the recipe's attention dropout), 31.1% without attention dropout,
# 30-34% large at micro-batch 8 (BENCHMARKS.md). Next: session 62's dK/dV with queries along rows (among the
# autotuner's candidates) and session 74's model.triton_dq=atomic (dQ added by the dK/dV kernel) checked against
# the fp64 reference and timed beside the other candidates, then the base row with the recipe's dropout again
# (29.9% on lease 8) and with the atomic dQ, large (30-34%) and with the atomic dQ; then base at micro-batch 32 (in lease 8's
# profile the host, not the GPU, was the slower side at 16), there with the head and its loss compiled (~6 ms
# of the 152 ms of kernels per update are the eager loss's passes over [n, V]); large at micro-batch 16 and 32,
# base at the recipe's 32 micro-batches per update (the Pile run's loop), with CUDA graphs, with the compiled head
# at 16, with the FFN kernels and no attention dropout, the loader's handover, the FFN kernels' benchmark (now timed
# over calls queued back to back) and the attention kernels with the autotuner's picks printed; then the loop
# on dropout-free Flex, the packed rows on Flex, the Pile recipe's update, CUDA graphs on DeepSpeed,
# ModernBERT, 8192, the host-overhead step. A second call (LEASE_ROWS) takes what is left.
export FLEX_TUNE_LENGTHS=${FLEX_TUNE_LENGTHS:-4096,8192} ATTENTION_LENGTHS=${ATTENTION_LENGTHS:-2048,8192}
export TRITON_PRINT_AUTOTUNING=1  # each kernel's pick per shape, into the row's log: what to tune next
# LEASE_ROWS="STEP ROW...;STEP ROW..." replaces the list (a second, shorter lease)
ROWS=(
    "triton triton-check-2048 triton-check-atomic triton-candidates packed-2048-triton-flat-micro16-ffn packed-2048-triton-flat-micro16-ffn-atomic packed-2048-large-triton-flat-ffn packed-2048-large-triton-flat-ffn-atomic"
    "triton packed-2048-triton-flat-micro32-ffn packed-2048-triton-flat-micro32-ffn-head packed-2048-large-triton-flat-ffn-micro16 packed-2048-large-triton-flat-ffn-micro16-atomic"
    "triton packed-2048-large-triton-flat-ffn-micro32 packed-2048-triton-flat-micro16-ffn-accum32"
    "triton packed-2048-triton-flat-micro16-ffn-cudagraphs packed-2048-triton-flat-micro16-ffn-head packed-2048-triton-flat-micro16-ffn-nodropout"
    "profile loader-handover"
    "head cross-entropy"
    "triton bias-activation triton-attention"
    "loop loop-2048-flex-flat-nodropout loop-2048-flex-flat-nodropout-micro16"
    "triton loop-2048-large-triton-flat packed-2048-triton-flat-nodropout"
    "loop loop-2048-flat-compiled-micro16 loop-2048-flat-compiled-micro16-head loop-2048-large-flex-flat-nodropout"
    "packed packed-2048-flex-flat packed-2048-flex-flat-dropout"
    "loop loop-2048-recipe loop-2048-recipe-flat loop-2048-large-flat"
    "head head-memory"
    "loop loop-2048-cudagraphs"
    "throughput base-zero-clap-flex-dropout base-baseline"
    "modernbert modernbert-sdpa modernbert-flex modernbert-varlen modernbert-triton"
    "loop loop-8192 loop-8192-documents"
    "flex-tune flex-tune"
    "profile host-overhead"
    "loop loop-2048-alibi-flash-compiled loop-2048-compiled loop-2048-large"
)
[ -z "${LEASE_ROWS:-}" ] || IFS=';' read -r -a ROWS <<<"$LEASE_ROWS"
pack() {  # the archive as it stands: rewritten after every row, so a call cut short still returns what ran
    for run in runs/*/; do  # the loop rows' own profile and event log
        [ -d "$run" ] || continue
        name=$(basename "$run")
        for f in profile.txt log.jsonl; do [ -f "$run$f" ] && cp "$run$f" "$LOGS/$name.$f"; done
    done
    tar czf "$OUT_DIR/gpu-logs.tar.gz.part" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" &&
        mv "$OUT_DIR/gpu-logs.tar.gz.part" "$OUT_DIR/gpu-logs.tar.gz"
}
for row in "${ROWS[@]}"; do
    read -r step names <<<"$row"
    GPU_SH_ONLY="$names" bash benchmarks/gpu.sh "$LOGS" "$step"
    pack
done
echo "=== kernel time by kind (benchmarks/profile_summary.py)"
compgen -G "$LOGS/*.profile.txt" >/dev/null &&
    python3 benchmarks/profile_summary.py "$LOGS"/*.profile.txt | grep -E "kernels per update|attention|matmul|beyond"
echo "=== summary (full logs in gpu-logs.tar.gz)"
for log in "$LOGS"/*.log; do
    echo "--- $(basename "$log" .log)"
    grep -E "^(megamlm|hf|flex|sdpa|eager|torch|Inductor|bf16|fp16)[ ,]|^ *[0-9]+ +[0-9.]|per round|^update [0-9]+/|^profile:|^done|Error" "$log" |
        tail -n 8 | cut -c1-230
done
