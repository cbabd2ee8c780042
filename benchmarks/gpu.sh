#!/usr/bin/env bash
# The GPU benchmark set behind BENCHMARKS.md's GPU tables, in one run on one GPU:
#   bash benchmarks/gpu.sh [LOG_DIR] [STEP ...]      # default: every step, logs in benchmarks/results/gpu
# Steps: throughput (roberta.base at 2048: baseline vs Hugging Face, zero-clap = ALiBi-offset + CLAP
# with SDPA + bias and with FlexAttention, without and with attention dropout), compiled (the same with
# torch.compile per layer), large (roberta.large at 2048), attention (ALiBi kernels 512..8192),
# flex-tune (FlexAttention kernel_options candidates at 2048..8192), profile (megamlm base's top
# kernels), loop (the real training loop, base zero-clap at 2048 with the reference's attention dropout
# on SDPA, eager and compiled, and on compiled FlexAttention, large zero-clap on SDPA; at 8192 on FlexAttention, also with
# attention kept within each packed document (the BlockMask skips the other documents' blocks), bf16,
# WikiText-103), packed (the same loop at 2048 with data.packing=packed on SDPA and on compiled
# FlexAttention, next to the padded SDPA row, and the learned-position baseline padded on SDPA vs packed
# on varlen FlashAttention; real tokens/s and the fill are in each log's update lines), modernbert
# (modernbert-base at 8192, 14 of 22 layers through a 128-token window, vs transformers'
# ModernBertForMaskedLM: SDPA with the window in the bias, Flex whose BlockMask skips the blocks outside
# it, varlen with the kernel's window). Each step has its own time limit and log file; a failed step is
# reported and the next one runs.
# shellcheck disable=SC2086  # the command variables are meant to split into words
set -u
LOG_DIR=${1:-benchmarks/results/gpu}
shift || true
STEPS=${*:-throughput compiled large attention flex-tune profile loop packed modernbert}
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python3}
TP="$PY benchmarks/train_throughput.py --dtype bf16 --seq-length 2048"
FLEX="model.attention_backend=flex model.attention_dropout=0"

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$?
    grep -v "^\[\|Warning\|warn(" "$LOG_DIR/$name.log" | tail -n 8
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

train_run() {  # train_run NAME LENGTH MICRO_BATCH OVERRIDES UPDATES: base zero-clap, 2 micro-batches per update
    local name=$1 length=$2 micro=$3 extra=$4 updates=$5
    step "$name" 420 $PY -m megamlm train --config configs/pile/base-zero-clap.yaml $extra \
        "data.build_from=[data/wikitext-103/valid.txt,data/wikitext-103/test.txt]" \
        data.shards=cache/wikitext-103-s$length data.seq_length=$length model.max_positions=$length \
        data.long_docs=split data.valid_fraction=0.02 train.precision=bf16 \
        train.micro_batch_size=$micro train.global_batch_size=$((2 * micro)) train.steps=$updates \
        optim.warmup_steps=10 optim.period_steps=$updates train.log_interval=10 train.eval_interval=$updates \
        train.eval_batches=4 train.save_interval=100000 train.run_dir=runs/$name
}

for s in $STEPS; do
    case $s in
    throughput)
        step base-baseline 240 $TP --model base --batch 8
        step base-zero-clap-sdpa 240 $TP --model base --batch 8 --variant zero-clap
        step base-zero-clap-flex 300 $TP --model base --batch 8 --variant zero-clap --set $FLEX
        # the reference recipe's attention dropout 0.1 on Flex (two passes, flex.py) vs the sdpa row above
        step base-zero-clap-flex-dropout 300 $TP --model base --batch 8 --variant zero-clap \
            --set model.attention_backend=flex ;;
    compiled)
        step base-baseline-compiled 360 $TP --model base --batch 8 --compile
        step base-zero-clap-flex-compiled 360 $TP --model base --batch 8 --variant zero-clap --set $FLEX --compile
        # train.compile_mode=reduce-overhead: each layer also a CUDA graph
        step base-baseline-cudagraphs 420 $TP --model base --batch 8 --compile --compile-mode reduce-overhead ;;
    large)
        step large-baseline 300 $TP --model large --batch 8
        step large-zero-clap-flex 300 $TP --model large --batch 8 --variant zero-clap --set $FLEX ;;
    modernbert)
        MB="$PY benchmarks/train_throughput.py --dtype bf16 --seq-length 8192 --model modernbert-base"
        MB="$MB --variant modernbert --batch 2"
        step modernbert-sdpa 300 $MB
        step modernbert-flex 360 $MB --set model.attention_backend=flex
        step modernbert-varlen 300 $MB --set model.attention_backend=varlen ;;
    attention)
        step attention 300 $PY benchmarks/attention.py --lengths 512,1024,2048,4096,8192 --dtype bf16 \
            --heads 12 --batch 2 ;;
    flex-tune)  # model.flex_kernel_options candidates (benchmarks/attention.py FLEX_CANDIDATES), head dim 64
        step flex-tune 540 $PY benchmarks/attention.py --lengths 2048,4096,8192 --dtype bf16 --heads 12 \
            --batch 2 --repeats 10 --flex-sweep ;;
    profile)
        step profile-base-baseline 240 $TP --model base --batch 8 --rounds 1 --profile ;;
    loop)
        train_run loop-2048 2048 8 "" 60
        train_run loop-2048-compiled 2048 8 "train.compile=true" 60
        train_run loop-2048-flex-dropout 2048 8 "model.attention_backend=flex train.compile=true" 60
        train_run loop-2048-large 2048 8 "--config configs/pile/large-zero-clap.yaml" 40
        train_run loop-8192 8192 2 "$FLEX train.compile=true" 40
        train_run loop-8192-documents 8192 2 "$FLEX train.compile=true model.document_mask=true" 40 ;;
    packed)
        train_run packed-2048-padded-sdpa 2048 8 "" 60
        train_run packed-2048-sdpa 2048 8 "data.packing=packed" 60
        train_run packed-2048-flex 2048 8 "$FLEX train.compile=true data.packing=packed" 60
        # varlen FlashAttention has no ALiBi score term: the learned-position baseline, padded and packed
        BASE="--config configs/variants/baseline.yaml model.attention_dropout=0"
        train_run packed-2048-baseline-padded-sdpa 2048 8 "$BASE" 60
        train_run packed-2048-baseline-varlen 2048 8 "$BASE model.attention_backend=varlen data.packing=packed" 60 ;;
    *) echo "unknown step $s (throughput compiled large attention flex-tune profile loop packed modernbert)"; exit 2 ;;
    esac
done
