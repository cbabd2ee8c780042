#!/usr/bin/env bash
# The GPU benchmark set behind BENCHMARKS.md's GPU tables, in one run on one GPU:
#   bash benchmarks/gpu.sh [LOG_DIR] [STEP ...]      # default: every step, logs in benchmarks/results/gpu
# Steps: throughput (roberta.base at 2048: baseline vs Hugging Face, zero-clap = ALiBi-offset + CLAP
# with SDPA + bias and with FlexAttention, without and with attention dropout), compiled (the same with
# torch.compile per layer), large (roberta.large at 2048), attention (ALiBi kernels 512..8192; Flex
# dropout's hash on int64 vs int32 lanes), head
# (CLAP's table normalization; the MLM head + loss unfused vs fused at base/2048),
# flex-tune (FlexAttention kernel_options candidates at 2048..8192), profile (megamlm base's top
# kernels; the host time of a launch-bound step vs transformers), loop (the real training loop, base zero-clap at 2048 with the reference's attention dropout
# on SDPA, eager and compiled, and on compiled FlexAttention, large zero-clap on SDPA; at 8192 on FlexAttention, also with
# attention kept within each packed document (the BlockMask skips the other documents' blocks), bf16,
# WikiText-103), packed (the same loop at 2048 with data.packing=packed on SDPA and on compiled
# FlexAttention (also on the flat engine, without and with attention dropout), next to the padded SDPA row, and the
# learned-position baseline padded on SDPA vs packed
# on varlen FlashAttention; real tokens/s and the fill are in each log's update lines), modernbert
# (modernbert-base at 8192, 14 of 22 layers through a 128-token window, vs transformers'
# ModernBertForMaskedLM: SDPA with the window in the bias, Flex whose BlockMask skips the blocks outside
# it, varlen with the kernel's window), triton (model.attention_backend=triton, our Triton kernels: compiled on
# the GPU against the fp64 reference, timed beside cuDNN and Flex at the loop's batch, and the loop on them;
# model.bias_activation=triton's FFN kernels beside eager and Inductor, and the loop with them too).
# Each step has its own time limit and log file; a failed step is
# reported and the next one runs.
#   GPU_SH_SMOKE=1 bash benchmarks/gpu.sh LOG_DIR [STEP ...]
# runs every command at toy size (tiny model, 16-token benchmarks, 128-token training runs, a few updates; a command
# that is another row's at toy size runs once) on whatever device there is:
# the check, on a CPU, that a lease will not be spent on a broken command (tests/test_gpu_script.py). Its shards
# go to LOG_DIR/cache (GPU_SH_SHARDS=FOLDER: there, for runs to share them), its runs to LOG_DIR/runs.
#   GPU_SH_ONLY="loop-2048 base-baseline" bash benchmarks/gpu.sh LOG_DIR loop throughput
# runs only the named rows of those steps; GPU_SH_DEADLINE=EPOCH_SECONDS cuts each command's limit to
# what is left before then and skips a command with under 45 s left (benchmarks/gpu_lease.sh: one lease).
# shellcheck disable=SC2086  # the command variables are meant to split into words
set -u
LOG_DIR=${1:-benchmarks/results/gpu}
shift || true
STEPS=${*:-triton throughput compiled large attention head flex-tune profile loop packed modernbert}
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python3}
TP="$PY benchmarks/train_throughput.py --dtype bf16 --seq-length 2048"
if [ -n "${GPU_SH_SMOKE:-}" ]; then  # appended to each command: later options and overrides win
    SMOKE_BENCH="--model tiny --seq-length 16 --batch 1 --rounds 1 --steps 1"
    SMOKE_ATTENTION="--lengths 128,256 --batch 1 --heads 2 --repeats 1"
    SMOKE_HOST="--device cpu --rounds 1 --steps 2"
    SMOKE_ROWS="--device cpu --rows 1000 --rounds 1"
    SMOKE_HASH="--device cpu --shape 1,2,64,64 --rounds 1"
    SMOKE_TRITON="--device cpu --lengths 40 --batch 2 --heads 2 --head-dim 16 --dtype fp32"
    SMOKE_CANDIDATES="--device cpu --length 96 --batch 2 --heads 2 --head-dim 16 --dtype fp32 --repeats 1"
    SMOKE_BIAS="--device cpu --rows 300 --ffn 40 --dtype fp32 --rounds 1 --no-compile"
    SMOKE_HEAD="--model tiny --seq-length 128 --batch 2 --rounds 1 --steps 1 --chunks 65536"
    SMOKE_LOADER="--seq-length 128 --micro-batch 2 --workers 1 --updates 2 --rounds 1 --busy-ms 1"
    SMOKE_CE="--device cpu --rows 30 --vocab 1000 --rounds 1"
    # (train.global_batch_size: the recipe rows' 16 micro-batches per update are 2 here, still accumulated;
    # 32 took two of the loop step's toy minutes. One head and one sequence per micro-batch: Triton's
    # interpreter runs a program per head, sequence and block of queries, one after another, and the Triton
    # rows took 40% longer with two of each)
    SMOKE_TRAIN="model.num_layers=2 model.hidden_size=64 model.num_attention_heads=1 model.ffn_hidden_size=256 \
        train.eval_batches=1 train.global_batch_size=2"
    # the toy rows' shards and runs stay out of the checkout (its cache/ is the demo's, runs/ the user's)
    SMOKE_LENGTH=128 RUNS=$LOG_DIR/runs SHARDS=${GPU_SH_SHARDS:-$LOG_DIR/cache}
    SMOKE_LIMIT=900  # each command's limit is the GPU run's; a toy run on a slow CPU may need more
else
    SMOKE_BENCH="" SMOKE_ATTENTION="" SMOKE_HOST="" SMOKE_ROWS="" SMOKE_HASH="" SMOKE_TRITON="" SMOKE_CANDIDATES="" SMOKE_BIAS="" SMOKE_HEAD="" SMOKE_LOADER="" SMOKE_CE=""
    SMOKE_TRAIN="" SMOKE_LENGTH="" RUNS=runs SHARDS=cache SMOKE_LIMIT=""
fi
FLEX="model.attention_backend=flex model.attention_dropout=0"
PROFILE="train.profile_updates=3"

FAILED="" SKIPPED=""
declare -A TOY_COMMANDS  # at toy size, command (less its run dir) -> the row that ran it
step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=${SMOKE_LIMIT:-$2}
    shift 2
    if [ -n "${GPU_SH_ONLY:-}" ] && [[ " $GPU_SH_ONLY " != *" $name "* ]]; then return; fi
    if [ -n "$SMOKE_LENGTH" ]; then  # rows that differ only in micro-batch and updates are one toy command
        local toy="${*//"$RUNS/$name"/}"
        if [ -n "${TOY_COMMANDS[$toy]:-}" ]; then echo "=== $name: same toy command as ${TOY_COMMANDS[$toy]}"; return; fi
        TOY_COMMANDS[$toy]=$name
    fi
    if [ -n "${GPU_SH_DEADLINE:-}" ]; then  # a lease's end: the command gets what is left of it, or is skipped
        local left=$((GPU_SH_DEADLINE - $(date +%s)))
        if [ "$left" -lt 45 ]; then echo "=== $name: skipped, ${left} s left before GPU_SH_DEADLINE"; SKIPPED="$SKIPPED $name"; return; fi
        [ "$left" -ge "$limit" ] || limit=$left
    fi
    echo "=== $name: $*"
    local start=$SECONDS
    # SIGTERM first (a training row saves and exits at its next update's end: train/signals.py), SIGKILL 15 s
    # later: a row still compiling would otherwise run past the lease's deadline
    timeout --kill-after=15 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$?
    grep -v "^\[\|Warning\|warn(" "$LOG_DIR/$name.log" | tail -n 8
    if [ $rc -ne 0 ] && [ -n "$SMOKE_LENGTH" ] && grep -q "needs a CUDA GPU" "$LOG_DIR/$name.log"; then
        echo "=== $name: needs a GPU (checked up to building the model) after $((SECONDS - start)) s"
        return
    fi
    [ $rc -eq 0 ] || FAILED="$FAILED $name"
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

bench() {  # bench NAME LIMIT_SECONDS ARGUMENTS...: benchmarks/train_throughput.py at bf16
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" $TP "$@" $SMOKE_BENCH
}

train_run() {  # train_run NAME LENGTH MICRO_BATCH OVERRIDES UPDATES [CONFIGS]: 2 micro-batches per update
    # (the row's OVERRIDES come after the common ones, so they win: the last value of a key is the one;
    # CONFIGS: one file, or a recipe and the overlays after it, space-separated)
    local name=$1 length=${SMOKE_LENGTH:-$2} micro=$3 extra=$4 updates=$5 config configs=()
    for config in ${6:-configs/pile/base-zero-clap.yaml}; do configs+=(--config "$config"); done
    [ -z "$SMOKE_LENGTH" ] || { micro=1 updates=3; }
    step "$name" 420 $PY -m megamlm train --overwrite "${configs[@]}" \
        "data.build_from=[data/wikitext-103/valid.txt,data/wikitext-103/test.txt]" \
        data.shards=$SHARDS/gpu-wikitext-103-s$length data.seq_length=$length model.max_positions=$length \
        data.long_docs=split data.valid_fraction=0.02 train.precision=bf16 \
        train.micro_batch_size=$micro train.global_batch_size=$((2 * micro)) train.steps=$updates \
        optim.warmup_steps=10 optim.period_steps=$updates train.log_interval=10 train.eval_interval=$updates \
        train.eval_batches=4 train.save_interval=100000 train.run_dir=$RUNS/$name $extra $SMOKE_TRAIN
}

for s in $STEPS; do
    case $s in
    triton)
        # the compiled kernels against the fp64 reference first (tests run them in Triton's interpreter);
        # 6 feature variants x 2 lengths x 19 autotuner candidates to compile, each variant's at once
        # (triton_autotune `compile_at_once`; one by one if that fails: the limit allows for it); Triton's
        # cache keeps them for the rows below. -2048: the loop's length only (half the compiling)
        step triton-check 420 $PY benchmarks/triton_check.py $SMOKE_TRITON
        step triton-check-2048 300 $PY benchmarks/triton_check.py --lengths 2048 $SMOKE_TRITON
        # model.triton_dq=atomic's backward (dQ added by the dK/dV kernel with the GPU's atomics), the same cases
        step triton-check-atomic 300 $PY benchmarks/triton_check.py --lengths 2048 --dq atomic $SMOKE_TRITON
        # every autotuner candidate timed alone at the loop's shape (base, packed, micro-batch 16, dropout
        # 0.1), each one's results against the first's: dK/dV's two orientations side by side
        step triton-candidates 240 $PY benchmarks/triton_candidates.py $SMOKE_CANDIDATES
        # beside cuDNN (bias, with and without dropout) and Flex at the loop's micro-batch of 8
        step triton-attention 240 $PY benchmarks/attention.py --lengths 2048 --dtype bf16 --heads 12 --batch 8 \
            --kernels "sdpa,flex score_mod,triton" $SMOKE_ATTENTION
        # model.bias_activation=triton: the FFN's bias + GELU beside eager and Inductor at micro-batch 16's
        # [32,768, 3,072] (exits 1 where the kernels' error exceeds twice eager's)
        step bias-activation 150 $PY benchmarks/bias_activation.py --device cuda --rows 32768 $SMOKE_BIAS
        # the best measured loop (flat, compiled, zero-clap with the recipe's attention dropout 0.1) on the kernels
        TRITON_FLAT="train.engine=flat train.compile=true model.attention_backend=triton $PROFILE"
        train_run loop-2048-triton-flat 2048 8 "$TRITON_FLAT" 60
        train_run loop-2048-triton-flat-micro16 2048 16 "$TRITON_FLAT" 30
        # the same with the FFN's bias + GELU in our kernels (Inductor's backward: two passes, libdevice's erf)
        train_run loop-2048-triton-flat-micro16-ffn 2048 16 "$TRITON_FLAT model.bias_activation=triton" 30
        train_run loop-2048-large-triton-flat 2048 8 "$TRITON_FLAT" 40 configs/pile/large-zero-clap.yaml
        train_run packed-2048-triton-flat 2048 8 "$TRITON_FLAT data.packing=packed" 60
        # configs/gpu/fastest.yaml, the overlay `megamlm plan` assumes 29.9% for (session 60: TRITON_FLAT with
        # the FFN kernels, packed, micro-batch 16; its settings, measured as that file): with the recipe's attention
        # dropout, without it, and with the head and its loss compiled; large at micro-batch 8 (30-34%) and 16
        BASE_FASTEST="configs/pile/base-zero-clap.yaml configs/gpu/fastest.yaml"
        LARGE_FASTEST="configs/pile/large-zero-clap.yaml configs/gpu/fastest.yaml"
        train_run packed-2048-triton-flat-micro16-ffn 2048 16 "$PROFILE" 30 "$BASE_FASTEST"
        train_run packed-2048-triton-flat-micro16-ffn-nodropout 2048 16 "$PROFILE model.attention_dropout=0" 30 \
            "$BASE_FASTEST"
        train_run packed-2048-triton-flat-micro16-ffn-head 2048 16 "$PROFILE train.compile_head=true" 30 "$BASE_FASTEST"
        # the recipe's own update, 32 micro-batches of 16 (the rows above take 2): what the optimizer, the engine's
        # per-update work and the GPU's idle time between updates (4-6% at micro-batch 16, lease 8) cost the Pile run
        # (one update profiled: its 32 micro-batches are 16 of the other rows' updates)
        train_run packed-2048-triton-flat-micro16-ffn-accum32 2048 16 \
            "train.profile_updates=1 train.global_batch_size=512" 20 "$BASE_FASTEST"
        # micro-batch 32: in lease 8's profile of the micro-batch-16 row the host was the slower side (its forward
        # and backward took the host 74 and 99 ms of a 190 ms update, the GPU's kernels 152; its loss read
        # 0.1 ms: it never waited for the GPU); the host's work per micro-batch is about fixed, the kernels' doubles
        train_run packed-2048-triton-flat-micro32-ffn 2048 32 "$PROFILE" 30 "$BASE_FASTEST"
        train_run packed-2048-triton-flat-micro32-ffn-head 2048 32 "$PROFILE train.compile_head=true" 30 "$BASE_FASTEST"
        # the host's launches another way: each compiled layer one CUDA graph
        train_run packed-2048-triton-flat-micro16-ffn-cudagraphs 2048 16 \
            "$PROFILE train.compile_mode=reduce-overhead" 30 "$BASE_FASTEST"
        train_run packed-2048-large-triton-flat-ffn 2048 8 "$PROFILE" 30 "$LARGE_FASTEST"
        train_run packed-2048-large-triton-flat-ffn-micro16 2048 16 "$PROFILE" 30 "$LARGE_FASTEST"
        train_run packed-2048-large-triton-flat-ffn-micro32 2048 32 "$PROFILE" 20 "$LARGE_FASTEST"
        # model.triton_dq=atomic (session 74): 5 matmuls per score in one backward kernel where the dK/dV and dQ
        # kernels do 7, 0.74x the instructions per score (benchmarks/triton_static.py); base and large
        train_run packed-2048-triton-flat-micro16-ffn-atomic 2048 16 "$PROFILE model.triton_dq=atomic" 30 "$BASE_FASTEST"
        train_run packed-2048-large-triton-flat-ffn-atomic 2048 8 "$PROFILE model.triton_dq=atomic" 30 "$LARGE_FASTEST"
        train_run packed-2048-large-triton-flat-ffn-micro16-atomic 2048 16 "$PROFILE model.triton_dq=atomic" 30 \
            "$LARGE_FASTEST"
        # the bound without the recipe's attention dropout (ModernBERT's choice): packed, nothing padded
        train_run packed-2048-triton-flat-nodropout 2048 16 "$TRITON_FLAT data.packing=packed model.attention_dropout=0" 30 ;;
    throughput)
        bench base-baseline 240 --model base --batch 8
        bench base-zero-clap-sdpa 240 --model base --batch 8 --variant zero-clap
        bench base-zero-clap-flex 300 --model base --batch 8 --variant zero-clap --set $FLEX
        # the reference recipe's attention dropout 0.1 on Flex (two passes, flex.py) vs the sdpa row above
        bench base-zero-clap-flex-dropout 300 --model base --batch 8 --variant zero-clap \
            --set model.attention_backend=flex ;;
    compiled)
        bench base-baseline-compiled 360 --model base --batch 8 --compile
        bench base-zero-clap-flex-compiled 360 --model base --batch 8 --variant zero-clap --set $FLEX --compile
        # train.compile_mode=reduce-overhead: each layer also a CUDA graph
        bench base-baseline-cudagraphs 420 --model base --batch 8 --compile --compile-mode reduce-overhead ;;
    large)
        bench large-baseline 300 --model large --batch 8
        bench large-zero-clap-flex 300 --model large --batch 8 --variant zero-clap --set $FLEX ;;
    modernbert)
        MB="--seq-length 8192 --model modernbert-base --variant modernbert --batch 2"
        bench modernbert-sdpa 300 $MB
        bench modernbert-flex 360 $MB --set model.attention_backend=flex
        bench modernbert-varlen 300 $MB --set model.attention_backend=varlen
        # our kernels: the window and the packed samples' block skipping in the one pass
        bench modernbert-triton 300 $MB --set model.attention_backend=triton ;;
    attention)
        step attention 300 $PY benchmarks/attention.py --lengths "${ATTENTION_LENGTHS:-512,1024,2048,4096,8192}" --dtype bf16 \
            --heads 12 --batch 2 $SMOKE_ATTENTION
        # Flex attention dropout's keep mask over the loop's [b, np, s, s] grid: int64 lanes vs int32 lanes
        step dropout-hash 120 $PY benchmarks/dropout_hash.py --device cuda --shape 8,12,2048,2048 $SMOKE_HASH ;;
    head)
        # CLAP's table normalization, forward + backward: autograd's chain vs the closed-form backward
        step row-normalize 60 $PY benchmarks/row_normalize.py --device cuda $SMOKE_ROWS
        # the head + loss unfused vs fused (one chunk: 134M elements hold base/2048's ~2,100 x 50,304 logits)
        step head-memory 240 $PY benchmarks/head_memory.py --model base --variant zero-clap --seq-length 2048 --batch 8 \
            --dtype bf16 --chunks 2097152 16777216 134217728 --compiled $SMOKE_HEAD
        # the unfused head's loss: megatron-core's cross-entropy on its fp32 copy vs megamlm's (session 64), at the
        # best base row's ~4,915 masked positions per micro-batch of 16 x 2,048
        step cross-entropy 60 $PY benchmarks/cross_entropy.py --device cuda --rows 4915 --dtype bf16 $SMOKE_CE ;;
    flex-tune)  # model.flex_kernel_options candidates (benchmarks/attention.py FLEX_CANDIDATES), head dim 64, at the
        # loop's micro-batch of 8 (the attention step keeps batch 2, comparable across leases)
        step flex-tune 540 $PY benchmarks/attention.py --lengths "${FLEX_TUNE_LENGTHS:-2048,4096,8192}" --dtype bf16 --heads 12 \
            --batch 8 --repeats 10 --flex-sweep --kernels sdpa,flex $SMOKE_ATTENTION ;;
    profile)
        bench profile-base-baseline 240 --model base --batch 8 --rounds 1 --profile
        # launch-bound steps: megamlm (one-rank plain linears, megatron's) vs transformers, host time per step
        step host-overhead 120 $PY benchmarks/host_overhead.py --device cuda $SMOKE_HOST
        # the trainer's next() per update with the loader's workers handing it their batches, and through torch's
        # pin-memory thread (the loop's way on a GPU since session 63); the loop rows' shards where they are built
        handover_shards=$SHARDS/gpu-wikitext-103-s2048
        [ -d "$handover_shards" ] || handover_shards=""
        step loader-handover 120 $PY benchmarks/loader_handover.py ${handover_shards:+--shards "$handover_shards"} \
            $SMOKE_LOADER ;;
    loop)
        # train.profile_updates: the loop's own top kernels and the GPU's busy share (train/profiling.py),
        # recorded on updates 3-5, inside the first 10 that BENCHMARKS.md's ranges leave out
        train_run loop-2048 2048 8 "$PROFILE" 60
        train_run loop-2048-compiled 2048 8 "train.compile=true $PROFILE" 60
        # without DeepSpeed's per-gradient inf/NaN scan: ~1,900 fewer host operations and two fewer
        # waits for the device per update (benchmarks/loop_ops.py)
        train_run loop-2048-noscan 2048 8 "train.skip_nonfinite_updates=false $PROFILE" 60
        # each compiled layer also a CUDA graph: one launch per layer instead of its kernels' (the loop waits for the host)
        train_run loop-2048-cudagraphs 2048 8 "train.compile=true train.compile_mode=reduce-overhead $PROFILE" 60
        # micro-batches of 16: the host's per-micro-batch work (launches, engine hooks) spread over twice the tokens
        train_run loop-2048-micro16 2048 16 "$PROFILE" 30
        # megamlm's flat engine: ~2,800 host operations per update against ZeRO-1's ~6,600 (loop_ops.py)
        train_run loop-2048-flat 2048 8 "train.engine=flat $PROFILE" 60
        train_run loop-2048-flat-compiled 2048 8 "train.engine=flat train.compile=true $PROFILE" 60
        # session 24's H200: the flat, compiled loop kept the GPU 89% busy; twice the tokens per launch
        train_run loop-2048-flat-compiled-micro16 2048 16 "train.engine=flat train.compile=true $PROFILE" 30
        # the same with the head and its loss compiled (train.compile_head): the ~8 eager passes over [n, V]
        train_run loop-2048-flat-compiled-micro16-head 2048 16 \
            "train.engine=flat train.compile=true train.compile_head=true $PROFILE" 30
        # the same loop with learned positions (no bias: cuDNN's bias-free kernel): what ALiBi's bias costs in it
        train_run loop-2048-baseline-flat-compiled 2048 8 "train.engine=flat train.compile=true $PROFILE" 60 \
            configs/pile/base-baseline.yaml
        # ALiBi on Flex with the reference's attention dropout 0.1, on the flat engine
        # the Pile recipe's own update (configs/pile/base.yaml: micro-batch 4 x 16 accumulation, fp16) on one GPU:
        # DeepSpeed's step is amortized over 16 micro-batches there, so whether flat should be its default is open
        train_run loop-2048-recipe 2048 4 "train.global_batch_size=64 train.precision=fp16 $PROFILE" 30
        train_run loop-2048-recipe-flat 2048 4 \
            "train.global_batch_size=64 train.precision=fp16 train.engine=flat train.compile=true $PROFILE" 30
        # the same, the 16 micro-batches' gradients summed in fp32 (an add and a zero of 12 bytes per parameter each)
        train_run loop-2048-recipe-flat-fp32sums 2048 4 "train.global_batch_size=64 train.precision=fp16 \
            train.engine=flat train.compile=true train.fp32_grad_accumulation=true $PROFILE" 30
        # the fused head + loss in one chunk: no fp32 copy of the [n, V] logits, no separate softmax passes
        train_run loop-2048-flat-compiled-fused-head 2048 8 \
            "train.engine=flat train.compile=true model.head_loss=fused model.head_loss_chunk=134217728 $PROFILE" 60
        train_run loop-2048-flex-flat 2048 8 "train.engine=flat model.attention_backend=flex train.compile=true $PROFILE" 60
        # the same without attention dropout (ModernBERT's choice): lease 5's Flex at batch 8 took 1.42 ms per layer
        # forward + backward without, 3.97 with; what the loop reaches when attention costs ~34 ms per update
        train_run loop-2048-flex-flat-nodropout 2048 8 "train.engine=flat $FLEX train.compile=true $PROFILE" 60
        train_run loop-2048-flex-flat-nodropout-micro16 2048 16 "train.engine=flat $FLEX train.compile=true $PROFILE" 30
        # the same with Inductor timing its own matmul and FlexAttention configurations (minutes of compilation)
        train_run loop-2048-flex-flat-autotune 2048 8 \
            "train.engine=flat model.attention_backend=flex train.compile=true train.compile_mode=max-autotune-no-cudagraphs $PROFILE" 60
        train_run loop-2048-flat-cudagraphs 2048 8 \
            "train.engine=flat train.compile=true train.compile_mode=reduce-overhead $PROFILE" 60
        # the Pile configs' own precision (fp16, dynamic loss scale on the device): train_run sets bf16, this overrides it
        train_run loop-2048-flat-fp16 2048 8 "train.engine=flat train.precision=fp16 $PROFILE" 60
        train_run loop-2048-large-flat 2048 8 "train.engine=flat train.compile=true $PROFILE" 40 \
            configs/pile/large-zero-clap.yaml
        train_run loop-2048-large-flex-flat-nodropout 2048 8 "train.engine=flat $FLEX train.compile=true $PROFILE" 40 \
            configs/pile/large-zero-clap.yaml
        # ALiBi on two causal flash passes without a bias (model/alibi_flash.py), attention dropout 0.1 kept
        train_run loop-2048-alibi-flash 2048 8 "train.engine=flat model.attention_backend=alibi-flash $PROFILE" 60
        train_run loop-2048-alibi-flash-compiled 2048 8 \
            "train.engine=flat train.compile=true model.attention_backend=alibi-flash $PROFILE" 60
        train_run loop-2048-flex-dropout 2048 8 "model.attention_backend=flex train.compile=true" 60
        train_run loop-2048-large 2048 8 "$PROFILE" 40 configs/pile/large-zero-clap.yaml
        train_run loop-8192 8192 2 "$FLEX train.compile=true" 40
        train_run loop-8192-documents 8192 2 "$FLEX train.compile=true model.document_mask=true" 40 ;;
    packed)
        train_run packed-2048-padded-sdpa 2048 8 "" 60
        train_run packed-2048-sdpa 2048 8 "data.packing=packed" 60
        train_run packed-2048-flex 2048 8 "$FLEX train.compile=true data.packing=packed" 60
        # no compute on padding at all: packed rows (fill 95-98%), the BlockMask skips other samples' blocks,
        # on the flat engine (the host limit gone); without and with the recipe's attention dropout 0.1
        train_run packed-2048-flex-flat 2048 8 "train.engine=flat $FLEX train.compile=true data.packing=packed $PROFILE" 60
        train_run packed-2048-flex-flat-dropout 2048 8 \
            "train.engine=flat model.attention_backend=flex train.compile=true data.packing=packed $PROFILE" 60
        # varlen FlashAttention has no ALiBi score term: the learned-position baseline, padded and packed
        BASE=configs/pile/base-baseline.yaml
        train_run packed-2048-baseline-padded-sdpa 2048 8 "model.attention_dropout=0" 60 $BASE
        train_run packed-2048-baseline-varlen 2048 8 "model.attention_dropout=0 model.attention_backend=varlen \
            data.packing=packed" 60 $BASE ;;
    *) echo "unknown step $s (triton throughput compiled large attention head flex-tune profile loop packed modernbert)"; exit 2 ;;
    esac
done
[ -z "$SKIPPED" ] || echo "skipped:$SKIPPED (GPU_SH_DEADLINE)"
if [ -n "$FAILED" ]; then
    echo "failed:$FAILED (logs in $LOG_DIR)"
    exit 1
fi
