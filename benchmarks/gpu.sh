#!/usr/bin/env bash
# The GPU checks and figures the issues ask for, on a machine with one NVIDIA GPU.
#
#   bash benchmarks/gpu.sh [STEP ...]        # default: smoke xl offload
#
# Steps (each runs on its own, under a time limit, and the script goes on if one fails):
#   smoke    tiny models through every GPU path of toolkit-train: fp16 (dynamic loss scaling),
#            bf16, memory-efficient fp16, fully_sharded with activation checkpointing and
#            offload, --cpu-offload with cpu_adam (consolidated and sharded checkpoints,
#            save, resume, toolkit-consolidate, toolkit-eval-lm)
#   xl       benchmarks.train on transformer_lm_gpt3_xl (tokens/s, MFU, peak GPU memory):
#            xl_bf16 and xl_fp16 without a wrapper, xl_fsdp bf16 under fully_sharded
#   offload  transformer_lm_gpt3_2_7 with --ddp-backend fully_sharded --cpu-offload
#            --optimizer cpu_adam --fp16 --checkpoint-activations, 20 updates (fairseq's
#            13B-on-one-GPU recipe: batch 8 x 2048 tokens), under benchmarks.peak_memory
#   (offload_6_7 and offload_13 are figures now: below)
#   offload_split   where an offloaded 2.7B update's time goes (benchmarks.train phases)
#   offload_overlap the offload runs of 2.7B and 6.7B without and with --overlap-offload-step (norm
#            during backward, CPU Adam block by block beside the next forward; issue 15's aims:
#            >= 12,000 / >= 5,000 words/s), and benchmarks.offload_overlap on 2.7B (steady-state
#            step time of both in one process, host time in the norm and the step, same bits)
#   profile  torch.profiler tables of one gpt3_xl step and one offloaded 2.7B step
#   generate benchmarks.generate on transformer_lm_gpt3_xl, bf16, batch 1 and 16: generation
#            tokens/s with the KV cache and with the whole prefix recomputed (256 + 256 tokens)
#   fp8      --fp8 (torchao float8): 500 updates of a small model, bf16 vs fp8, both compiled (losses within
#            1%, benchmarks.compare_losses), then gpt3_xl tokens/s with rowwise, tensorwise and tensorwise
#            + float8 all-gather under fully_sharded
#   llama    a tiny Llama through fully_sharded + activation checkpointing + --compile (train, resume, eval-lm),
#            then llama3_1b tokens/s and MFU (llama_bench: bf16 + --compile, unsharded, fully_sharded, --fp8)
#   compile  --compile (torch.compile per block, inductor): eager vs compiled losses of a tiny bf16
#            model (compile_parity), tiny models through its GPU compositions
#            (fp16 loss scaling, bf16 fully_sharded + activation checkpointing, --cpu-offload cpu_adam),
#            then xl_bf16 / xl_fsdp again with --compile (issue 15's aims: MFU >= 0.50 without
#            sharding, >= 0.48 fully_sharded; the log's "--compile: the first training pass took"
#            line gives the compile time) and a profile of one compiled xl step
#   llama    the Llama family (issue 21): a tiny Llama through bf16 fully_sharded + activation
#            checkpointing + --compile (save, resume, eval-lm), then benchmarks.train --preset
#            llama3_1b (Llama 3.2 1B, B 4 x T 2048, vocabulary 128256): bf16 without a wrapper,
#            fully_sharded, fully_sharded --compile, and fully_sharded --compile --checkpoint-activations
#            (tokens/s, MFU from the family's own FLOPs per token, peak GPU memory)
#   hybrid   the Qwen3-Next family (gated DeltaNet): qwen3_next_tiny bf16 on CUDA, plain and with
#            --document-attention-mask (flash-linear-attention's kernel when installed, else the PyTorch form
#            and one line naming pip install flash-linear-attention), save, resume, eval-lm
#
# Figures (issue 37: one entry per figure, each under its own limit of FIGURE_LIMIT s, default 470: < 8
# minutes; each appends one JSON line to $RESULTS/gpu_figures.jsonl, benchmarks.figure):
#   offload_13 / offload_13_bf16   transformer_lm_gpt3_13 on one GPU, B 8 x T 2048, fp16 (bf16), fully_sharded
#            + --cpu-offload + cpu_adam + --checkpoint-activations, 8-bit moments, bf16 host gradients,
#            --overlap-offload-step, 10 updates: words/s, peak GPU and host memory, host bytes per
#            parameter, and the planner's prediction (toolkit-train --plan) beside them
#   offload_2_7 / offload_6_7      the same offload recipe (fp32 moments and gradients) with
#            --overlap-offload-step at 2.7B and 6.7B, 10 updates
#   mfu_xl / mfu_xl_fsdp / mfu_llama3_1b / mfu_llama3_1b_fsdp   benchmarks.train, bf16 + --compile,
#            unsharded and fully_sharded: tokens/s, MFU, the step's time split
#   fp8_d4096_bf16 / fp8_d4096_tensorwise / fp8_d4096_rowwise   an 8-layer llama3_8b-shaped model (d 4096,
#            FFN 14336, V 32768), bf16 + --compile against --fp8 with each recipe
#   decode_xl   benchmarks.generate, gpt3_xl bf16, batch 1: cached decoding against the whole prefix
#            recomputed (tokens/s of each)
#   decode_llama3_1b_hf   benchmarks.generate --versus-transformers, llama3_1b bf16, batch 1, 256 + 256 tokens:
#            cached greedy decoding against transformers' generate() on the same weights, alternated rounds
#   moe_olmoe / moe_olmoe_compile   OLMoE-1B-7B's shape (8 of 16 layers), bf16, eager and --compile: tokens/s, MFU
#            counted on the active parameters (grouped GEMM on CUDA)
#   moe_olmoe_fp8   the same compiled, the experts' grouped GEMMs in float8 (benchmarks.train --fp8-experts:
#            torchao's MoE training recipe, Float8TrainingOpConfig, rowwise)
#   moe_olmoe_profile   a torch.profiler table of compiled OLMoE steps ($RESULTS/moe_olmoe_profile.txt): the
#            router, the token permute/unpermute and the grouped GEMMs apart
#   profile_13   one offloaded 13B-recipe update (offload_13's layout, synthetic tokens) under torch.profiler
#            (benchmarks.offload_profile): GPU compute, host-to-device and device-to-host bytes and their
#            overlap with compute, CPU Adam and its 8-bit state path; the table to $RESULTS/offload_profile_13.md
#   plan_calibration   benchmarks.plan_calibration over $RESULTS/gpu_figures.jsonl (this session's offload and
#            profile lines; the dry run reads benchmarks/results/gpu_figures_h200_*.jsonl): measured step time
#            and host bytes against toolkit-plan's terms, the fitted --host-link-gbps and --cpu-adam-gparams;
#            the table to $RESULTS/plan_calibration.md (run it last: it reads the lines before it)
#   moe_moonlight   Moonlight-16B-A3B's shape (4 of 27 layers: multi-head latent attention, 64 experts of 1408,
#            top 6, 2 shared, the first layer dense; its vocabulary 163840), bf16, B 4 x T 2048: tokens/s, MFU
#            counted on the active parameters, the step's time split (the DeepSeek-V3 family on the GPU)
#   moe_gpt_oss_20b_2l   gpt-oss-20b's shape at 2 of its 24 layers (a local layer of window 128, then a global
#            one: sinks, YaRN, 32 biased experts of 2880 with the clamped SwiGLU, top 4; its vocabulary 201088), bf16,
#            B 4 x T 2048: tokens/s, MFU counted on the active parameters, the step's time split (2.8B parameters:
#            AdamW's states of 4 layers would crowd an 80 GB GPU)
#   moe_30b_a3b_offload   Qwen3-30B-A3B's shape (12 of 48 layers) through the 13B recipe (FSDP2 + --cpu-offload,
#            8-bit moments, bf16 host gradients, overlap): words/s, host bytes per parameter, the plan beside
#   cp_llama3_1b_32k   llama3_1b on one 32k-token sequence, bf16 + --compile: tokens/s and peak memory (one GPU
#            cannot show context parallelism's scaling; toolkit-plan predicts CP over 8)
#   muon_offload_llama3_1b / adam_offload_llama3_1b   llama3_1b, FSDP2 + --cpu-offload, --optimizer muon against
#            cpu_adam, B 4 x T 2048: words/s (the offloaded Muon step against the offloaded Adam step)
#   pipeline_schedules   benchmarks.pipeline_schedules --larger on the machine's quiet CPU cores (one GPU cannot hold
#            two NCCL ranks): every schedule's step time, each stage's live-tensor peak against toolkit-plan's, the
#            measured bubble against the planned one; the table to $RESULTS/pipeline_schedules.json
#
#   bash benchmarks/gpu.sh --dry-run [ENTRY ...]   the same entries on CPU with tiny shapes (2 layers of 64,
#            T 32, 2 updates), GPU-only flags (--compile, --fp8, --fp8-experts) dropped (entries left with the same
#            command run it once), results in a temporary folder; tests/integration/test_gpu_sh.py runs it for every
#            entry
#   bash benchmarks/gpu.sh --print ENTRY ...   each entry's command as it runs on the GPU, one shell-quoted line
#            each, nothing run (benchmarks.plan_calibration plans the layouts of figure lines that predate
#            their "command" field from it)
#   bash benchmarks/gpu.sh prepare   (here, before the GPU session) the wheels a fresh GPU machine lacks in
#            .whl/ and the data-bin; benchmarks/README.md says what to carry
#   bash benchmarks/gpu.sh setup     (there, first) installs .whl/ into /tmp/site and builds the C++ optimizer
#            ops into .ops/ (and $OUT/toolkit_ops.tar.gz, to carry to the next call)
#
# Environment: DATA (a data-bin, default data-bin/wikitext-2-mini, made by `prepare`), OFFLOAD_UPDATES
# (updates per offload run of the older steps, default 20), FIGURE_LIMIT (seconds per figure, default 470),
# GPU_LOG_DIR (logs, default runs/gpu; one file per step plus summary.txt), GPU_RESULTS (where
# gpu_figures.jsonl goes: default $OUT when set, else benchmarks/results), TOOLKIT_PY (python, default python3).
set -u
cd "$(dirname "$0")/.."
DRY=0
PRINT=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
elif [ "${1:-}" = "--print" ]; then
  PRINT=1
  shift
fi
DATA=${DATA:-data-bin/wikitext-2-mini}
UPDATES=${OFFLOAD_UPDATES:-20}  # updates of each offload run (words/s: the median of updates 2..N)
FIGURE_LIMIT=${FIGURE_LIMIT:-470}
PY=${TOOLKIT_PY:-python3}
CK=$(mktemp -d /tmp/toolkit-gpu.XXXXXX)
if [ $PRINT = 1 ]; then
  trap 'rm -rf "$CK"' EXIT
fi
if [ $DRY = 1 ] || [ $PRINT = 1 ]; then  # never mixed with a GPU session's logs and results
  LOG=${GPU_LOG_DIR:-$CK/logs}
  RESULTS=${GPU_RESULTS:-$CK}
else
  LOG=${GPU_LOG_DIR:-runs/gpu}
  RESULTS=${GPU_RESULTS:-${OUT:-benchmarks/results}}
fi
mkdir -p "$LOG" "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The carried wheels (prepare), installed once per machine; the C++ ops built by `setup` (or carried back).
if [ $DRY = 0 ] && [ $PRINT = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  [ -f /tmp/site/.toolkit-wheels ] ||
    { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
      touch /tmp/site/.toolkit-wheels; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ $DRY = 0 ]; then
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.ops/torch_extensions}
  if [ -f .ops/toolkit_ops.tar.gz ] && [ ! -d "$TORCH_EXTENSIONS_DIR" ]; then
    mkdir -p "$TORCH_EXTENSIONS_DIR" && tar -xzf .ops/toolkit_ops.tar.gz -C "$TORCH_EXTENSIONS_DIR"
  fi
fi
TRAIN="$PY -m toolkit_cli.train"
EVAL="$PY -m toolkit_cli.eval_lm"
CONSOLIDATE="$PY -m toolkit_cli.consolidate"

case "${1:-}" in
  prepare|setup|--list) ;;
  *) if [ $PRINT = 0 ] && [ ! -f "$DATA/dict.txt" ]; then
       echo "benchmarks/gpu.sh: no data-bin at $DATA (run 'bash benchmarks/gpu.sh prepare' here and carry it, or set DATA)" >&2
       exit 1
     fi ;;
esac

# run NAME LIMIT_S CMD...: the command's output to $LOG/NAME.log (and the screen), status to summary.txt
run() {
  local name=$1 limit=$2; shift 2
  echo "=== $name: $(printf '%q ' "$@")" | tee -a "$LOG/$name.log"  # quoted: benchmarks.figure reads it back
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$LOG/summary.txt"
  return "$rc"
}

TINY=(--task language_modeling --arch transformer_lm --decoder-layers 2 --decoder-embed-dim 128
      --decoder-ffn-embed-dim 512 --decoder-attention-heads 4 --tokens-per-sample 128 --batch-size 16
      --decoder-input-dim 128 --decoder-output-dim 128 --decoder-normalize-before
      --optimizer adam --lr 0.001 --log-format json --log-interval 10 --num-workers 0 --no-epoch-checkpoints)
OFFLOAD=(--ddp-backend fully_sharded --cpu-offload --optimizer cpu_adam --fp16 --checkpoint-activations)

smoke() {
  run smoke_fp16 150 $TRAIN "$DATA" "${TINY[@]}" --fp16 --max-update 30 --save-dir "$CK/fp16" &&
    run smoke_fp16_eval 120 $EVAL "$DATA" --path "$CK/fp16/checkpoint_last.pt" --tokens-per-sample 128 --batch-size 16
  run smoke_bf16_fsdp_ac 150 $TRAIN "$DATA" "${TINY[@]}" --bf16 --ddp-backend fully_sharded \
    --checkpoint-activations --offload-activations --max-update 30 --save-dir "$CK/bf16"
  run smoke_mefp16 150 $TRAIN "$DATA" "${TINY[@]}" --memory-efficient-fp16 --max-update 30 --save-dir "$CK/mefp16"
  for kind in consolidated sharded; do
    local extra=() dir="$CK/offload_$kind"
    [ $kind = sharded ] && extra=(--use-sharded-state)
    run "smoke_offload_$kind" 180 $TRAIN "$DATA" "${TINY[@]}" "${OFFLOAD[@]}" "${extra[@]}" \
      --max-update 10 --save-interval-updates 10 --save-dir "$dir" &&
      run "smoke_offload_${kind}_resume" 150 $TRAIN "$DATA" "${TINY[@]}" "${OFFLOAD[@]}" "${extra[@]}" \
        --max-update 20 --save-dir "$dir"
  done
  run smoke_consolidate 120 $CONSOLIDATE "$CK/offload_sharded/checkpoint_last" -o "$CK/offload_sharded/last.pt" &&
    run smoke_offload_eval 120 $EVAL "$DATA" --path "$CK/offload_sharded/last.pt" --tokens-per-sample 128 --batch-size 16
}

xl_bf16() { run xl_bf16 200 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16; }
xl_fp16() { run xl_fp16 200 $PY -m benchmarks.train --preset gpt3_xl --device cuda --fp16 --fp16-init-scale 4; }
xl_fsdp() { run xl_bf16_fsdp 200 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16 --ddp-backend fully_sharded; }
xl() { xl_bf16; xl_fp16; xl_fsdp; }

offload_arch() {  # NAME ARCH LIMIT_S [extra flags]
  local name=$1 arch=$2 limit=$3; shift 3
  run "$name" "$limit" $PY -m benchmarks.peak_memory --json "$LOG/${name}_memory.json" -- \
    $TRAIN "$DATA" --task language_modeling --arch "transformer_lm_$arch" "${OFFLOAD[@]}" \
    --fp16-init-scale 4 --tokens-per-sample 2048 --batch-size 8 --adam-betas "(0.9, 0.98)" --lr 0.0001 \
    --lr-scheduler polynomial_decay --warmup-updates 5 --total-num-update "$UPDATES" --max-update "$UPDATES" \
    --no-save --disable-validation --log-format json --log-interval 1 --num-workers 0 "$@"
}

offload() { offload_arch offload_gpt3_2_7 gpt3_2_7 540; }
# Where an offloaded update's time goes (forward, backward, gradient norm, CPU Adam step), by benchmarks/train.py.
offload_split() {
  run offload_split_gpt3_2_7 300 $PY -m benchmarks.train --preset gpt3_xl --device cuda --arch transformer_lm_gpt3_2_7 \
    --batch-size 8 "${OFFLOAD[@]}" --fp16-init-scale 1 --warmup 2 --steps 3
}
# torch.profiler tables of one step each (files in the log folder).
profile() {
  run profile_xl 200 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16 --warmup 3 --steps 3 \
    --profile "$LOG/profile_xl.txt"
  run profile_offload_gpt3_2_7 300 $PY -m benchmarks.train --preset gpt3_xl --device cuda \
    --arch transformer_lm_gpt3_2_7 --batch-size 8 "${OFFLOAD[@]}" --fp16-init-scale 1 --warmup 2 --steps 2 \
    --profile "$LOG/profile_offload_gpt3_2_7.txt"
}
# Eager vs --compile on a tiny bf16 model (same seed, dropout 0): the logged losses must agree to bf16 rounding.
compile_parity() {
  for mode in eager compile; do
    local extra=()
    [ $mode = compile ] && extra=(--compile)
    run "compile_parity_$mode" 240 $TRAIN "$DATA" "${TINY[@]}" --bf16 --dropout 0 --max-update 30 --no-save \
      --disable-validation "${extra[@]}"
  done
  $PY -m benchmarks.compare_losses "$LOG/compile_parity_eager.log" "$LOG/compile_parity_compile.log" \
    --tolerance 0.01 2>&1 | tee -a "$LOG/summary.txt"
}
# --compile: the first steps compile (a minute or more for gpt3_xl), so more warm-up steps and a longer limit.
compile_smoke() {
  run smoke_compile_fp16 240 $TRAIN "$DATA" "${TINY[@]}" --fp16 --compile --max-update 30 --save-dir "$CK/compile_fp16" &&
    run smoke_compile_eval 120 $EVAL "$DATA" --path "$CK/compile_fp16/checkpoint_last.pt" --tokens-per-sample 128 \
      --batch-size 16
  run smoke_compile_bf16_fsdp_ac 240 $TRAIN "$DATA" "${TINY[@]}" --bf16 --ddp-backend fully_sharded \
    --checkpoint-activations --compile --max-update 30 --save-dir "$CK/compile_bf16"
  run smoke_compile_offload 300 $TRAIN "$DATA" "${TINY[@]}" "${OFFLOAD[@]}" --compile --max-update 20 \
    --save-dir "$CK/compile_offload"
}
xl_compile() {
  run xl_bf16_compile 500 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16 --compile --warmup 5
  run xl_bf16_fsdp_compile 500 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16 \
    --ddp-backend fully_sharded --compile --warmup 5
}
profile_compile() {
  run profile_xl_compile 500 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16 --compile --warmup 5 \
    --steps 3 --profile "$LOG/profile_xl_compile.txt"
}
attention_layout_xl() {
  run attention_layout_xl 120 $PY -m benchmarks.attention_layout --dim 2048 --heads 32 --batch 4 --tokens 2048 \
    --device cuda --dtype bf16
}
compile() { compile_parity; compile_smoke; xl_compile; profile_compile; attention_layout_xl; }
# --overlap-offload-step against the serial update, the same commands back to back (words/s: the logs' wps).
offload_pairs() {
  offload_arch offload_gpt3_2_7_serial gpt3_2_7 540
  offload_arch offload_gpt3_2_7_overlap gpt3_2_7 540 --overlap-offload-step
  offload_arch offload_gpt3_6_7_serial gpt3_6_7 330
  offload_arch offload_gpt3_6_7_overlap gpt3_6_7 330 --overlap-offload-step
}
offload_overlap() {
  offload_pairs
  # both trainers in one process: about 2 x 47 GiB of host memory for 2.7B
  run offload_overlap_bench_gpt3_2_7 540 $PY -m benchmarks.offload_overlap --device cuda --vocab 50264 \
    --arch transformer_lm_gpt3_2_7 --tokens-per-sample 2048 --batch-size 8 --fp16 --fp16-init-scale 4 \
    --checkpoint-activations --warmup 2 --steps 3 --rounds 2
}
# --fp8 (torchao float8, rowwise, the blocks' Linear layers): 500 updates of a small model against bf16 (both
# compiled; the mean loss of the last 50 updates must agree within 1%), then gpt3_xl tokens/s with both recipes
# (compare with xl_bf16_compile from the compile step).
SMALL=(--task language_modeling --arch transformer_lm --decoder-layers 6 --decoder-embed-dim 512
       --decoder-ffn-embed-dim 2048 --decoder-attention-heads 8 --decoder-input-dim 512 --decoder-output-dim 512
       --decoder-normalize-before --tokens-per-sample 512 --batch-size 16 --optimizer adam --lr 0.0005
       --lr-scheduler inverse_sqrt --warmup-updates 50 --clip-norm 1.0 --dropout 0 --bf16 --compile
       --log-format json --log-interval 10 --num-workers 0 --no-save --disable-validation --max-update 500)
fp8_parity() {
  run fp8_parity_bf16 300 $TRAIN "$DATA" "${SMALL[@]}"
  run fp8_parity_fp8 300 $TRAIN "$DATA" "${SMALL[@]}" --fp8
  $PY -m benchmarks.compare_losses "$LOG/fp8_parity_bf16.log" "$LOG/fp8_parity_fp8.log" --last 50 --tolerance 0.01 \
    2>&1 | tee -a "$LOG/summary.txt"
}
fp8_xl() {
  run xl_fp8_rowwise_compile 400 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16 --compile --fp8 \
    --warmup 5
  run xl_fp8_tensorwise_compile 400 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16 --compile --fp8 \
    --fp8-recipe tensorwise --warmup 5
  run xl_fp8_fsdp_allgather_compile 400 $PY -m benchmarks.train --preset gpt3_xl --device cuda --bf16 --compile \
    --fp8 --fp8-recipe tensorwise --fp8-all-gather --ddp-backend fully_sharded --warmup 5
}
fp8() { fp8_parity; fp8_xl; }
TINY_LLAMA=(--task language_modeling --arch llama_tiny --tokens-per-sample 128 --batch-size 16 --optimizer adam
            --lr 0.001 --log-format json --log-interval 10 --num-workers 0 --no-epoch-checkpoints --bf16
            --ddp-backend fully_sharded --checkpoint-activations --compile)
llama_smoke() {
  run smoke_llama 300 $TRAIN "$DATA" "${TINY_LLAMA[@]}" --max-update 20 --save-dir "$CK/llama" &&
    run smoke_llama_resume 300 $TRAIN "$DATA" "${TINY_LLAMA[@]}" --max-update 30 --save-dir "$CK/llama" &&
    run smoke_llama_eval 120 $EVAL "$DATA" --path "$CK/llama/checkpoint_last.pt" --tokens-per-sample 128 --batch-size 16
}
llama() { llama_smoke; llama_bench; }
TINY_HYBRID=(--task language_modeling --arch qwen3_next_tiny --tokens-per-sample 128 --batch-size 16 --bf16
      --optimizer adam --lr 0.001 --log-format json --log-interval 10 --num-workers 0 --no-epoch-checkpoints)
hybrid() {
  run smoke_hybrid 300 $TRAIN "$DATA" "${TINY_HYBRID[@]}" --max-update 20 --save-dir "$CK/hybrid" &&
    run smoke_hybrid_resume 300 $TRAIN "$DATA" "${TINY_HYBRID[@]}" --max-update 30 --save-dir "$CK/hybrid" &&
    run smoke_hybrid_eval 120 $EVAL "$DATA" --path "$CK/hybrid/checkpoint_last.pt" --tokens-per-sample 128 --batch-size 16
  run smoke_hybrid_documents 300 $TRAIN "$DATA" "${TINY_HYBRID[@]}" --document-attention-mask --max-update 20 \
    --save-dir "$CK/hybrid_documents"
}
# llama3_1b (Llama-3.2-1B's shape, V 128256): bf16 + --compile without sharding and under fully_sharded, and --fp8.
llama_bench() {
  run llama3_1b_bf16_compile 400 $PY -m benchmarks.train --preset llama3_1b --device cuda --bf16 --compile --warmup 5
  run llama3_1b_fsdp_compile 400 $PY -m benchmarks.train --preset llama3_1b --device cuda --bf16 \
    --ddp-backend fully_sharded --compile --warmup 5
  run llama3_1b_fp8_tensorwise_compile 400 $PY -m benchmarks.train --preset llama3_1b --device cuda --bf16 \
    --compile --fp8 --fp8-recipe tensorwise --warmup 5
}
generate() { run generate_gpt3_xl 300 $PY -m benchmarks.generate --preset gpt3_xl --device cuda --dtype bf16; }

# --- figures (issue 37): one entry per figure, each under FIGURE_LIMIT seconds, one JSON line each ---------

DRY_LIMIT=240  # seconds per entry in --dry-run (tiny shapes on CPU)
# --dry-run's shapes: appended last, so they win over the entry's own (argparse keeps a flag's last value)
DRY_GPT=(--decoder-layers 2 --decoder-embed-dim 64 --decoder-ffn-embed-dim 128 --decoder-attention-heads 2
         --decoder-input-dim 64 --decoder-output-dim 64 --tokens-per-sample 32 --batch-size 2)
DRY_LLAMA=(--decoder-layers 2 --decoder-embed-dim 64 --decoder-ffn-embed-dim 128 --decoder-attention-heads 4
           --decoder-kv-heads 2 --tokens-per-sample 32 --batch-size 2)
DRY_MOE=("${DRY_LLAMA[@]}" --decoder-head-dim 16 --moe-num-experts 4 --moe-ffn-embed-dim 32 --moe-top-k 2)
DRY_LATENT=("${DRY_MOE[@]}" --kv-lora-rank 16 --qk-nope-head-dim 16 --v-head-dim 16 --moe-shared-ffn-embed-dim 32)
DRY_BENCH=(--warmup 1 --steps 1 --vocab 512 --threads 2 --no-peak-after)

# adapt ARG...: the entry's command as it runs, in ARGS: unchanged on a GPU; in --dry-run on the CPU, without
# the flags that need a GPU (--compile: inductor's CPU build would take minutes; --fp8, --fp8-experts: float8
# matmuls)
adapt() {
  ARGS=()
  local skip=0 a
  for a in "$@"; do
    if [ $DRY = 0 ]; then ARGS+=("$a"); continue; fi
    if [ $skip = 1 ]; then skip=0; continue; fi
    case $a in
      --compile|--fp8|--fp8-all-gather|--fp8-experts) ;;
      --fp8-recipe) skip=1 ;;
      cuda) ARGS+=(cpu) ;;
      *) ARGS+=("$a") ;;
    esac
  done
}

declare -A DRY_DONE=()  # --dry-run: adapted command -> "ENTRY RC" of the entry that ran it

# figure NAME [--memory] CMD...: CMD (adapted) under the figure's limit, logged to $LOG/NAME.log, then its
# JSON line (benchmarks/figure.py) appended to $RESULTS/gpu_figures.jsonl; --memory runs CMD under
# benchmarks/peak_memory.py (peak host and GPU memory). Returns CMD's status.
figure() {
  local name=$1; shift
  local mem=() limit=$FIGURE_LIMIT dry=()
  if [ "$1" = --memory ]; then
    shift
    mem=(--memory "$LOG/$name.memory.json")
    set -- $PY -m benchmarks.peak_memory --json "$LOG/$name.memory.json" -- "$@"
  fi
  if [ $DRY = 1 ]; then limit=$DRY_LIMIT; dry=(--dry-run); fi
  adapt "$@"
  if [ $PRINT = 1 ]; then
    printf '%q ' "${ARGS[@]}"
    echo
    return 0
  fi
  : > "$LOG/$name.log"
  rm -f "$LOG/$name.memory.json"
  local t0=$SECONDS rc=0 key="${ARGS[*]}"
  if [ $DRY = 1 ] && [ ${#mem[@]} = 0 ] && [ -n "${DRY_DONE[$key]:-}" ]; then
    # the CPU runs exactly the command an earlier entry ran (they differ only in GPU-only flags, dropped):
    # its log and status stand for this one too
    local same=${DRY_DONE[$key]}
    echo "=== $name: the same command on the CPU as ${same% *} (GPU-only flags dropped); its log" | tee "$LOG/$name.log"
    cat "$LOG/${same% *}.log" >> "$LOG/$name.log"
    rc=${same##* }
  else
    run "$name" "$limit" "${ARGS[@]}" || rc=$?
    DRY_DONE[$key]="$name $rc"
  fi
  $PY -m benchmarks.figure "$name" --log "$LOG/$name.log" --rc "$rc" --seconds $((SECONDS - t0)) "${mem[@]}" \
    "${dry[@]}" --out "$RESULTS/gpu_figures.jsonl"
  return "$rc"
}

# offload_figure NAME ARCH PRECISION... [flags]: toolkit-train with FSDP2 + --cpu-offload + CPU Adam,
# B 8 x T 2048, 10 updates, the plan's line logged at start-up (--plan)
offload_figure() {
  local name=$1 arch=$2; shift 2
  family_offload_figure "$name" gpt "transformer_lm_$arch" "$@"
}

# family_offload_figure NAME FAMILY ARCH [flags]: offload_figure for any family (gpt, llama, moe: the dry run's
# shapes); a later --optimizer or --batch-size in the flags wins over cpu_adam and 8
family_offload_figure() {
  local name=$1 family=$2 arch=$3; shift 3
  local dry=()
  if [ $DRY = 1 ]; then
    case $family in gpt) dry=("${DRY_GPT[@]}") ;; llama) dry=("${DRY_LLAMA[@]}") ;; moe) dry=("${DRY_MOE[@]}") ;; esac
    dry+=(--max-update 2 --total-num-update 2 --warmup-updates 1)
  fi
  figure "$name" --memory $TRAIN "$DATA" --task language_modeling --arch "$arch" \
    --ddp-backend fully_sharded --cpu-offload --optimizer cpu_adam --checkpoint-activations \
    --tokens-per-sample 2048 --batch-size 8 --adam-betas "(0.9, 0.98)" --lr 0.0001 --lr-scheduler polynomial_decay \
    --warmup-updates 5 --total-num-update 10 --max-update 10 --no-save --disable-validation --log-format json \
    --log-interval 1 --num-workers 0 --plan "$@" "${dry[@]}"
}

# bench_figure NAME FAMILY [benchmarks/train.py flags]: tokens/s, MFU and the time split of one configuration
bench_figure() {
  local name=$1 family=$2; shift 2
  local dry=()
  if [ $DRY = 1 ] && [ "$family" = llama ]; then dry=("${DRY_LLAMA[@]}" "${DRY_BENCH[@]}"); fi
  if [ $DRY = 1 ] && [ "$family" = gpt ]; then dry=("${DRY_GPT[@]}" "${DRY_BENCH[@]}"); fi
  if [ $DRY = 1 ] && [ "$family" = moe ]; then dry=("${DRY_MOE[@]}" "${DRY_BENCH[@]}"); fi
  if [ $DRY = 1 ] && [ "$family" = windows ]; then  # a local layer and a global one, as the sizes' pattern
    dry=("${DRY_LLAMA[@]}" --sliding-window 8 --layer-types sliding_attention,full_attention "${DRY_BENCH[@]}")
  fi
  if [ $DRY = 1 ] && [ "$family" = latent ]; then dry=("${DRY_LATENT[@]}" "${DRY_BENCH[@]}"); fi
  if [ $DRY = 1 ] && [ "$family" = sinks ]; then  # gpt-oss: experts, a local layer and a global one
    dry=("${DRY_MOE[@]}" --sliding-window 8 --layer-types sliding_attention,full_attention "${DRY_BENCH[@]}")
  fi
  figure "$name" $PY -m benchmarks.train --device cuda --bf16 "$@" "${dry[@]}"
}

# The 8-layer llama3_8b shape of the float8 figures: d 4096 is where float8's saving outgrows its casts.
FP8_SHAPE=(--preset llama3_1b --arch llama3_8b --decoder-layers 8 --vocab 32768 --compile
           --warmup 5)
FIGURES="offload_13 offload_13_bf16 offload_2_7 offload_6_7 mfu_xl mfu_xl_fsdp mfu_llama3_1b mfu_llama3_1b_fsdp
fp8_d4096_bf16 fp8_d4096_tensorwise fp8_d4096_rowwise decode_xl moe_olmoe moe_olmoe_compile moe_30b_a3b_offload
cp_llama3_1b_32k muon_offload_llama3_1b adam_offload_llama3_1b profile_13 moe_olmoe_fp8 moe_olmoe_profile
decode_llama3_1b_hf moe_moonlight plan_calibration mfu_olmo3_7b_8l mfu_smollm3_3b moe_gpt_oss_20b_2l pipeline_schedules"
# OLMoE-1B-7B's shape at 8 of its 16 layers (3.6B parameters, 0.7B active: AdamW's fp32 states of all 16 would
# crowd an 80 GB GPU), its vocabulary (50304), B 4 x T 2048
OLMOE_SHAPE=(--preset llama3_1b --arch olmoe_1b_7b --decoder-layers 8 --vocab 50304 --warmup 5)
# OLMo 3 7B's shape at 8 of its 32 layers (6 local within 4096 positions, 2 global; YaRN on the global ones), its
# vocabulary (100278), one 8192-token sequence: the local layers' windowed attention at twice the window
OLMO3_LOCAL3=sliding_attention,sliding_attention,sliding_attention,full_attention
OLMO3_SHAPE=(--preset llama3_1b --arch olmo3_7b --decoder-layers 8 --vocab 100278 --tokens-per-sample 8192
             --batch-size 1 --layer-types "$OLMO3_LOCAL3,$OLMO3_LOCAL3" --compile --warmup 3 --steps 5)
# Qwen3-30B-A3B's shape at 12 of its 48 layers (7.9B parameters): the whole model needs ~230 GiB of host memory
# (toolkit-plan), more than a 128 GiB GPU machine has; words/s of the whole model are about a quarter of these
MOE_30B_SLICE=(--decoder-layers 12 --bf16 --adam-state-precision 8bit --bf16-host-grads --overlap-offload-step)
# Muon with --cpu-offload (momentum in host memory, Newton-Schulz on the GPU, transfers overlapped) against CPU
# Adam on the same model and batch: llama3_1b, bf16, B 4 x T 2048, 10 updates
MUON_OFFLOAD=(--bf16 --batch-size 4 --lr 0.001)
LOW_HOST_13=(--adam-state-precision 8bit --bf16-host-grads --overlap-offload-step)

is_figure() {
  case " $(echo $FIGURES) " in *" $1 "*) return 0 ;; esac
  return 1
}

run_figure() {
  case $1 in
    offload_13) offload_figure offload_13 gpt3_13 --fp16 --fp16-init-scale 4 "${LOW_HOST_13[@]}" ;;
    offload_13_bf16) offload_figure offload_13_bf16 gpt3_13 --bf16 "${LOW_HOST_13[@]}" ;;
    offload_2_7) offload_figure offload_2_7 gpt3_2_7 --fp16 --fp16-init-scale 4 --overlap-offload-step ;;
    offload_6_7) offload_figure offload_6_7 gpt3_6_7 --fp16 --fp16-init-scale 4 --overlap-offload-step ;;
    mfu_xl) bench_figure mfu_xl gpt --preset gpt3_xl --compile --warmup 5 ;;
    mfu_xl_fsdp) bench_figure mfu_xl_fsdp gpt --preset gpt3_xl --compile --warmup 5 --ddp-backend fully_sharded ;;
    mfu_llama3_1b) bench_figure mfu_llama3_1b llama --preset llama3_1b --compile --warmup 5 ;;
    mfu_llama3_1b_fsdp) bench_figure mfu_llama3_1b_fsdp llama --preset llama3_1b --compile --warmup 5 \
                          --ddp-backend fully_sharded ;;
    fp8_d4096_bf16) bench_figure fp8_d4096_bf16 llama "${FP8_SHAPE[@]}" ;;
    fp8_d4096_tensorwise) bench_figure fp8_d4096_tensorwise llama "${FP8_SHAPE[@]}" --fp8 --fp8-recipe tensorwise ;;
    fp8_d4096_rowwise) bench_figure fp8_d4096_rowwise llama "${FP8_SHAPE[@]}" --fp8 --fp8-recipe rowwise ;;
    decode_xl)
      local dry=()
      [ $DRY = 1 ] && dry=(--arch transformer_lm_gpt2_tiny --vocab 512 --prompt 8 --new 4)
      figure decode_xl $PY -m benchmarks.generate --preset gpt3_xl --device cuda --dtype bf16 --batch-size 1 \
        "${dry[@]}" ;;
    moe_olmoe) bench_figure moe_olmoe moe "${OLMOE_SHAPE[@]}" ;;
    moe_olmoe_compile) bench_figure moe_olmoe_compile moe "${OLMOE_SHAPE[@]}" --compile ;;
    moe_moonlight) bench_figure moe_moonlight latent --preset llama3_1b --arch moonlight_16b_a3b --decoder-layers 4 \
                     --vocab 163840 --warmup 5 ;;
    moe_gpt_oss_20b_2l) bench_figure moe_gpt_oss_20b_2l sinks --preset llama3_1b --arch gpt_oss_20b --decoder-layers 2 \
                          --layer-types sliding_attention,full_attention --vocab 201088 --warmup 5 ;;
    moe_30b_a3b_offload) family_offload_figure moe_30b_a3b_offload moe qwen3_30b_a3b "${MOE_30B_SLICE[@]}" ;;
    # one GPU cannot show context parallelism's scaling: one 32k-token sequence of llama3_1b (tokens/s, peak
    # memory); toolkit-plan predicts 8 GPUs at --context-parallel-size 8 (benchmarks/README.md)
    cp_llama3_1b_32k) bench_figure cp_llama3_1b_32k llama --preset llama3_1b --tokens-per-sample 32768 \
                        --batch-size 1 --compile --warmup 3 --steps 5 ;;
    muon_offload_llama3_1b) family_offload_figure muon_offload_llama3_1b llama llama3_1b "${MUON_OFFLOAD[@]}" \
                              --optimizer muon ;;
    adam_offload_llama3_1b) family_offload_figure adam_offload_llama3_1b llama llama3_1b "${MUON_OFFLOAD[@]}" ;;
    profile_13) profile_figure ;;
    moe_olmoe_fp8) bench_figure moe_olmoe_fp8 moe "${OLMOE_SHAPE[@]}" --compile --fp8-experts ;;
    moe_olmoe_profile) bench_figure moe_olmoe_profile moe "${OLMOE_SHAPE[@]}" --compile --steps 3 \
                         --profile "$RESULTS/moe_olmoe_profile.txt" ;;
    decode_llama3_1b_hf)
      local dry=()
      [ $DRY = 1 ] && dry=(--arch llama_tiny --vocab 512 --prompt 8 --new 4 --rounds 1)
      figure decode_llama3_1b_hf $PY -m benchmarks.generate --preset llama3_1b --device cuda --dtype bf16 \
        --versus-transformers --prompt 256 --new 256 --rounds 3 --warmup 1 "${dry[@]}" ;;
    plan_calibration) calibration_figure ;;
    pipeline_schedules)
      local size=(--larger)
      [ $DRY = 1 ] && size=(--schedules 1f1b)
      figure pipeline_schedules $PY -m benchmarks.pipeline_schedules "${size[@]}" \
        --json "$RESULTS/pipeline_schedules.json" ;;
    mfu_olmo3_7b_8l) bench_figure mfu_olmo3_7b_8l windows "${OLMO3_SHAPE[@]}" ;;
    # SmolLM3-3B whole (every fourth layer NoPE, tied), B 2 x T 4096
    mfu_smollm3_3b) bench_figure mfu_smollm3_3b llama --preset llama3_1b --arch smollm3_3b --vocab 128256 \
                      --tokens-per-sample 4096 --batch-size 2 --compile --warmup 3 --steps 5 ;;
  esac
}

# profile_13: offload_13's layout (the 13B recipe: 8-bit moments, bf16 host gradients, overlap) through
# benchmarks.offload_profile on synthetic tokens of its vocabulary: 2 updates to warm up, 2 profiled
profile_figure() {
  local dry=()
  [ $DRY = 1 ] && dry=("${DRY_GPT[@]}" --vocab 512 --warmup 1 --steps 1)
  figure profile_13 $PY -m benchmarks.offload_profile --device cuda --arch transformer_lm_gpt3_13 \
    --tokens-per-sample 2048 --batch-size 8 --vocab 12448 --fp16 --fp16-init-scale 4 --checkpoint-activations \
    "${LOW_HOST_13[@]}" --warmup 2 --steps 2 --out "$RESULTS/offload_profile_13.md" "${dry[@]}"
}

# plan_calibration: every offload figure recorded so far (benchmarks/results/gpu_figures_*.jsonl, carried with
# the checkout) and this session's ($RESULTS/gpu_figures.jsonl, when there is one; its dry-run lines are skipped)
calibration_figure() {
  local inputs=(benchmarks/results/gpu_figures_*.jsonl)
  [ -f "$RESULTS/gpu_figures.jsonl" ] && inputs+=("$RESULTS/gpu_figures.jsonl")
  figure plan_calibration $PY -m benchmarks.plan_calibration "${inputs[@]}" --out "$RESULTS/plan_calibration.md"
}

# --- host side, before the GPU session: what a fresh GPU machine lacks ----------------------------------

# The GPU image has torch 2.11 + CUDA 13 on Python 3.12 and most of the stack (device README, KINDS.md), but
# not DeepSpeed (CPU Adam), torchao (--fp8) or DeepSpeed's hjson and pydantic: their wheels go to .whl/.
WHEELS=(torchao==0.18.0 hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
        typing-inspection==0.4.2)
prepare() {
  if [ ! -f data-bin/wikitext-2-mini/dict.txt ]; then
    $PY -m toolkit_cli.preprocess --only-source --trainpref ../shared/data/wikitext-2-mini/wiki.train.tokens \
      --validpref ../shared/data/wikitext-2-mini/wiki.valid.tokens \
      --testpref ../shared/data/wikitext-2-mini/wiki.test.tokens --destdir data-bin/wikitext-2-mini --workers 2 ||
      return 1
  fi
  mkdir -p .whl
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}" || return 1
  # DeepSpeed is published as a source archive; its wheel is pure Python (its ops are built there, by setup)
  ls .whl/deepspeed-*.whl >/dev/null 2>&1 ||
    DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8 || return 1
  du -sh .whl data-bin/wikitext-2-mini
  echo "carry: .whl data-bin/wikitext-2-mini (and .ops once setup's toolkit_ops.tar.gz is copied there)"
}

# --- device side, first: the C++ optimizer ops (DeepSpeed's CPU Adam, the GIL-free binding, fused 8-bit Adam)
setup() {
  run setup_build_ops 470 $PY -m toolkit.optim.build_ops
  if [ -n "${OUT:-}" ] && [ -d "$TORCH_EXTENSIONS_DIR" ]; then
    tar -czf "$OUT/toolkit_ops.tar.gz" -C "$TORCH_EXTENSIONS_DIR" . && ls -la "$OUT/toolkit_ops.tar.gz"
  fi
}

# --- dispatch -------------------------------------------------------------------------------------------

if [ "${1:-}" = --list ]; then
  echo $FIGURES
  exit 0
fi
if [ $PRINT = 1 ]; then
  for name in "$@"; do
    if ! is_figure "$name"; then
      echo "benchmarks/gpu.sh --print: no figure named $name (bash benchmarks/gpu.sh --list)" >&2
      exit 1
    fi
    run_figure "$name"
  done
  exit 0
fi
if [ $DRY = 1 ]; then
  status=0
  for name in ${@:-$FIGURES}; do
    if ! is_figure "$name"; then
      echo "benchmarks/gpu.sh --dry-run: no figure named $name (bash benchmarks/gpu.sh --list)" >&2
      status=1
      continue
    fi
    run_figure "$name" || status=1
  done
  echo "dry run: results in $RESULTS/gpu_figures.jsonl, logs in $LOG"
  exit $status
fi

echo "toolkit GPU checks: $(date -u '+%F %T') UTC" | tee -a "$LOG/summary.txt"
$PY - <<'EOF' 2>&1 | tee -a "$LOG/summary.txt"
import os, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, {os.cpu_count()} CPUs, "
      f"host memory {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")
EOF
for step in "${@:-smoke xl offload}"; do
  for s in $step; do
    if is_figure "$s"; then run_figure "$s"; else "$s"; fi  # a figure, or one of the older steps above
  done
done
rm -rf "$CK"
