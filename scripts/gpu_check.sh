#!/usr/bin/env bash
# One command for the GPU machine: build the extension, run the tests (GPU ones included) and the
# benchmarks, writing logs and results under $OUT. Steps: build test dequant adamw adamw-tune pin train
# adamw-quick train-quick train-mixed train-compile gap test-gpu train-1b train-default loss-curves precision-curves
# precision-curves-b1
# sanitize train-recipes train-b2 train-b2-ds timeline host-passes load dry-run scratch-8b train-qwen train-lora overhead train-kept train-b2-kept train-long fsdp train-fsdp train-fsdp-steps cuda-start bytecode train-nice
# accum-compile accum-sweep hog accum-probe accum-paired recipes-paired (default: build test
# adamw train).
# KEPT_MODES, KEPT_CAPPED_MODES: train-kept's two lists (uncapped; under the 24 GB cap); B2_KEPT_MODES: train-b2-kept's.
# RECIPE_MODES, RECIPE_EXTRA: train-recipes' modes instead of its own, more modes for it (e.g. deepspeed-bf16-clip);
# B2_MODES, B2_DS_MODES: train-b2's and train-b2-ds's modes (DS_STEPS, DS_WARMUP: its steps; train-b2 samples host memory into
# $OUT/host_memory_b2.log); TIMELINE_MODES: timeline's modes (resident ones too), TIMELINE_PRESET=b2: of the 8B shape under the 24 GB
# cap; TRACE_GPU=1: with the profiler's GPU streams merged in.
#   OUT=/tmp/out OFFLOAD_EXT_RESULTS_COMMIT=<local short hash> bash scripts/gpu_check.sh [step ...]
# (the device copy's own git names an older commit: the hash must come from the calling side.)
# Run every benchmark of a device call through its steps: the archive of $OUT is made at the end, and
# files written after it in the same call do not come back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/offload_ext_out}
mkdir -p "$OUT"
touch "$OUT/.start"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
# The GPU image keeps no bytecode for its site-packages and sets PYTHONDONTWRITEBYTECODE=1, so every process
# compiled transformers' and torch's sources again (6-8 s of each start, run 43's profile). Cached here, as an
# installed environment has it: the prefix alone did nothing while the image's flag stayed set (runs 39-41).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/offload_ext_pycache}
unset PYTHONDONTWRITEBYTECODE
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test adamw train)
status=0

run() {  # run NAME CMD...: log to $OUT/NAME.log, keep going on failure, remember it
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  last_rc=$rc
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}

timelines() {  # timelines MODES SHAPE: one traced step of each mode, drawn (plot_timeline) and counted (timeline_stats)
  local modes=$1 shape=$2 preset=() m
  [ "$shape" = b1 ] || preset=(--preset "$shape" --gpu-cap-gb 24)
  run "timeline_$shape" python3 benchmarks/bench_train.py --stem "train_${shape}_timeline" --steps 4 --warmup 2 \
    "${preset[@]}" --modes "$modes" --trace "$OUT/timelines_$shape" ${TRACE_GPU:+--trace-gpu}
  for m in ${modes//,/ }; do
    run "plot_${shape}_$m" python3 benchmarks/plot_timeline.py "$OUT/timelines_$shape/timeline_$m.json" \
      "$OUT/timeline_${shape}_$m.png" --title "${shape^^} $m, one step (commit ${OFFLOAD_EXT_RESULTS_COMMIT:-?})"
    run "timeline_stats_${shape}_$m" python3 benchmarks/timeline_stats.py "$OUT/timelines_$shape/timeline_$m.json"
  done
}

# Python packages the GPU image lacks travel as wheels in .whl/ (see docs/performance.md).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
    .whl/deepspeed-*.tar.gz > "$OUT/deepspeed_install.log" 2>&1 || echo "DeepSpeed install failed (see log)"
  export PYTHONPATH=/tmp/site
fi

# sanitize: scripts/sanitize_train.py (3 native steps of a tiny Llama: bf16 and mixed with clipping and grad_accum=2,
# and bf16 plain) under compute-sanitizer's memcheck, racecheck and synccheck, each capped at $SANITIZE_TIMEOUT s
# (SANITIZE_ARGS: the script's arguments, e.g. "bf16-plain --steps 1"). Logs: $OUT/sanitize_<tool>.log; one line per
# tool in $OUT/sanitize_summary.txt. CUDA API errors are not reported (--report-api-errors no): torch and cuBLASLt
# probe with calls that fail by design, and the extension checks the return codes of its own. memcheck runs with
# torch's caching allocator off, so that each tensor is its own allocation and a read past its end is out of bounds.
SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-150}
sanitize_summary() {  # sanitize_summary TOOL RC: "TOOL: N errors", "timed out" or "no summary"; fails unless clean
  local tool=$1 rc=$2 log="$OUT/sanitize_$1.log" pat='ERROR SUMMARY: [0-9]+ error' n
  # racecheck sums up as "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)": E counts
  grep -q 'RACECHECK SUMMARY:' "$log" && pat='RACECHECK SUMMARY: .*\([0-9]+ error'
  n=$(grep -E "$pat" "$log" | sed -E 's/.*[( ]([0-9]+) error.*/\1/' | awk '{ s += $1 } END { if (NR) print s }')
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "$tool: timed out after ${SANITIZE_TIMEOUT} s"; return 1; fi
  if [ -z "$n" ]; then echo "$tool: no summary (exit $rc)"; return 1; fi
  echo "$tool: $n errors (exit $rc)"
  [ "$n" -eq 0 ] && [ "$rc" -eq 0 ]
}
sanitize() {
  local tool pre
  : > "$OUT/sanitize_summary.txt"
  for tool in memcheck racecheck synccheck; do
    pre=(env)
    [ "$tool" = memcheck ] && pre+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    # shellcheck disable=SC2086  # SANITIZE_ARGS: words
    run "sanitize_$tool" "${pre[@]}" timeout -k 10 "$SANITIZE_TIMEOUT" compute-sanitizer --tool "$tool" \
      --error-exitcode 1 --print-limit 20 --target-processes all --report-api-errors no \
      python3 scripts/sanitize_train.py ${SANITIZE_ARGS:-}
    sanitize_summary "$tool" "$last_rc" | tee -a "$OUT/sanitize_summary.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
}

for step in "${steps[@]}"; do
  case "$step" in
    build) run build python3 -m pip install --no-build-isolation -v -e . && python3 -m offload_ext | tee "$OUT/build_info.json" ;;
    test) run test python3 -m pytest -q -rs tests ;;
    test-gpu) run test_gpu python3 -m pytest -q -rs -m gpu ${TEST_K:+-k "$TEST_K"} tests ;;  # TEST_K: a -k selection
    dequant) run dequant python3 benchmarks/bench_dequant.py ;;  # a 70 B base weight dequantized each way there is
    train-1b)  # issue 4: offload-train on the 1B shape, interrupted half way and resumed
      export OFFLOAD_TRAIN_NO_BAR=1
      run train_1b_a offload-train --model llama-1b --batch-size 4 --seq-len 2048 --steps 24 --stop-after 12 \
        --lr 1e-4 --warmup-steps 2 --out /tmp/run_1b --overwrite
      run train_1b_b offload-train --model llama-1b --batch-size 4 --seq-len 2048 --steps 24 --resume \
        --lr 1e-4 --warmup-steps 2 --out /tmp/run_1b
      cp /tmp/run_1b/metrics.jsonl "$OUT/metrics_1b.jsonl" ;;
    train-default)
      OFFLOAD_TRAIN_NO_BAR=1 run train_default offload-train --out /tmp/run_default --overwrite
      cp /tmp/run_default/metrics.jsonl "$OUT/metrics_default.jsonl" ;;
    loss-curves)  # the default run with each loss backend and chunk size: how far rounding alone moves the curve
      export OFFLOAD_TRAIN_NO_BAR=1
      for variant in torch-2048 torch-4096 native-2048 native-4096; do
        run "loss_${variant}" offload-train --out "/tmp/run_loss_${variant}" --overwrite --loss-kernel "${variant%-*}" \
          --loss-chunk-tokens "${variant#*-}"
        cp "/tmp/run_loss_${variant}/metrics.jsonl" "$OUT/metrics_loss_${variant}.jsonl"
      done
      run loss_curves python3 benchmarks/compare_curves.py --stem loss_curves_default \
        "$OUT"/metrics_loss_{torch-2048,torch-4096,native-2048,native-4096}.jsonl ;;
    precision-curves)  # the default run in each host precision: what bf16's rounding costs, and bf16-sr wins back
      export OFFLOAD_TRAIN_NO_BAR=1
      for precision in mixed bf16 bf16-sr; do
        run "precision_${precision}" offload-train --out "/tmp/run_precision_${precision}" --overwrite --precision "$precision"
        cp "/tmp/run_precision_${precision}/metrics.jsonl" "$OUT/metrics_precision_${precision}.jsonl"
      done
      title="offload-train's default run by host precision (commit ${OFFLOAD_EXT_RESULTS_COMMIT:-?})"
      run precision_curves python3 benchmarks/compare_curves.py --stem precision_curves_default \
        --png "$OUT/precision_curves_default.png" --title "$title" "$OUT"/metrics_precision_{mixed,bf16,bf16-sr}.jsonl ;;
    precision-curves-b1)  # issue 38: the B1 shape over $B1_CURVE_STEPS (1000) steps in each host precision, batches
      # of 2 x 1024 tokens of the embedded corpus; each run's directory (a 1.24 B checkpoint) removed once its
      # metrics are copied, so five runs fit the machine's disk. Every layer streamed (--resident-layers 0): the
      # default layout keeps 15 of 16 resident at this batch, stepped on the GPU, where the 8-bit precisions step
      # as bf16 / bf16-sr (run 94): their curves would show the device's rule, not the host's 8-bit moments
      export OFFLOAD_TRAIN_NO_BAR=1
      b1_precisions=${B1_CURVE_PRECISIONS:-mixed bf16 bf16-sr bf16-8bit bf16-8bit-sr}
      for precision in $b1_precisions; do
        run "precision_b1_${precision}" offload-train --model llama-1b --batch-size 2 --seq-len 1024 \
          --resident-layers 0 --steps "${B1_CURVE_STEPS:-1000}" --save-every 1000000 --precision "$precision" \
          --out "/tmp/run_precision_b1_${precision}" --overwrite
        cp "/tmp/run_precision_b1_${precision}/metrics.jsonl" "$OUT/metrics_precision_b1_${precision}.jsonl"
        rm -rf "/tmp/run_precision_b1_${precision}"
      done
      steps_b1=${B1_CURVE_STEPS:-1000}
      title="llama-1b, 2 x 1024 tokens, by host precision (commit ${OFFLOAD_EXT_RESULTS_COMMIT:-?})"
      # shellcheck disable=SC2086  # b1_precisions: words
      run precision_curves_b1 python3 benchmarks/compare_curves.py --stem precision_curves_b1 \
        --windows "0:$((steps_b1 / 10)),$((steps_b1 / 2)):$((steps_b1 * 3 / 4)),$((steps_b1 * 9 / 10)):$steps_b1" \
        --png "$OUT/precision_curves_b1.png" --title "$title" \
        $(for p in $b1_precisions; do echo "$OUT/metrics_precision_b1_$p.jsonl"; done) ;;
    adamw) run adamw python3 benchmarks/bench_adamw.py --threads "$(nproc)" ;;
    adamw-quick) run adamw_quick python3 benchmarks/bench_adamw.py --threads "$(nproc)" --no-deepspeed --stem adamw_16t_nods ;;
    train)  # TRAIN_MODES: a shorter list when device time is short
      run train python3 benchmarks/bench_train.py --modes "${TRAIN_MODES:-resident,python-bf16,native-bf16,native-mixed,native-mixed-d16}" ;;
    train-recipes)  # issue 11's recipes, each beside its GPU-resident peer (RECIPE_MODES: another list)
      recipes=resident,native-bf16,native-mixed,resident-clip,native-bf16-clip,resident-clipall,native-bf16-clipall
      recipes+=,native-mixed-clipall,resident-accum2,native-bf16-accum2,native-bf16-hostsum-accum2,native-bf16-d16-accum2
      recipes+=,resident-accum4,native-bf16-accum4,native-bf16-d16-accum4,native-bf16-r4,native-bf16-r4-clip
      recipes+=,native-bf16-r4-clipall,native-mixed-r4-clipall
      run train_recipes python3 benchmarks/bench_train.py --stem train_b1_recipes --modes \
        "${RECIPE_MODES:-$recipes}${RECIPE_EXTRA:+,$RECIPE_EXTRA}" ;;
    train-nice)  # issue 11: the host-step threads at niceness 19 against accumulation and clipping, twice interleaved
      nice_modes=resident-accum2,native-bf16-d16-r8-accum2,native-bf16-d16-r8-n19-accum2,native-bf16-clipall
      nice_modes+=,native-bf16-n19-clipall,resident-accum2,native-bf16-d16-r8-n19-accum2,native-bf16-d16-r8-accum2
      nice_modes+=,native-bf16-n19-clipall,native-bf16-clipall
      run train_nice python3 benchmarks/bench_train.py --stem train_b1_nice --modes "$nice_modes" ;;
    accum-compile)  # issue 11: accumulation with each layer compiled on both sides (fewer launches), twice interleaved
      run accum_compile python3 benchmarks/bench_train.py --compile --stem train_b1_accum_compile --modes \
        "${ACCUM_COMPILE_MODES:-resident-accum2,native-bf16-d16-r8-accum2,native-bf16-d16-r8-accum2,resident-accum2}" ;;
    accum-sweep)  # issue 11: how many of B1's 16 layers must stay on the GPU for accumulation to keep pace (each mode
      # twice, the second set in reverse order); ACCUM_SWEEP_COMPILE=0 leaves out the compiled set
      sweep=resident-accum2,native-bf16-d16-r8-accum2,native-bf16-d16-r10-accum2,native-bf16-d16-r12-accum2
      sweep+=,resident-accum4,native-bf16-d16-r8-accum4,native-bf16-d16-r10-accum4,native-bf16-d16-r12-accum4
      rev=$(tr , '\n' <<< "$sweep" | tac | paste -sd,)
      run accum_sweep python3 benchmarks/bench_train.py --stem train_b1_accum_sweep --modes "$sweep,$rev"
      [ "${ACCUM_SWEEP_COMPILE:-1}" = 0 ] || run accum_sweep_compile python3 benchmarks/bench_train.py --compile \
        --stem train_b1_accum_sweep_compile --modes \
        resident-accum2,native-bf16-d16-r10-accum2,native-bf16-d16-r12-accum2,native-bf16-d16-r12-accum2,native-bf16-d16-r10-accum2,resident-accum2 ;;
    accum-paired)  # issue 11's accumulation points, each set of modes side by side in one process (--interleave 3, a
      # batch per step, each turn an untimed lead-in and 3 timed steps): accum2 with resident twice (the pairing's own
      # spread), accum4; ACCUM2_PAIRED, ACCUM4_PAIRED replace the lists, ACCUM4_PAIRED=none leaves accum4 out
      run accum2_paired python3 benchmarks/bench_train.py --stem train_b1_accum2_paired --interleave 3 --steps 30 \
        --warmup 3 --batches 64 --modes \
        "${ACCUM2_PAIRED:-resident-accum2,native-bf16-d16-r8-accum2,native-bf16-d16-r12-accum2,resident-accum2}"
      [ "${ACCUM4_PAIRED:-}" = none ] || run accum4_paired python3 benchmarks/bench_train.py --stem train_b1_accum4_paired \
        --interleave 3 --steps 30 --warmup 3 --batches 64 --modes \
        "${ACCUM4_PAIRED:-resident-accum4,native-bf16-d16-r8-accum4,native-bf16-d16-r10-accum4}" ;;
    recipes-paired)  # issue 11's clipping points on B1, plain beside clipped in one process (--interleave 3, a batch
      # per step, so that clipall's norm stays above its 1e-3 throughout); RECIPES_PAIRED, MIXED_PAIRED replace the lists
      run bf16_paired python3 benchmarks/bench_train.py --stem train_b1_clip_paired --interleave 3 --steps 30 \
        --warmup 3 --batches 64 --modes "${RECIPES_PAIRED:-resident,native-bf16,native-bf16-clip,native-bf16-clipall}"
      run mixed_paired python3 benchmarks/bench_train.py --stem train_b1_mixed_clip_paired --interleave 3 --steps 30 \
        --warmup 3 --batches 64 --modes "${MIXED_PAIRED:-native-mixed,native-mixed-clipall}" ;;
    hog)  # issue 11: GPU-resident accumulation with and without a steady load on the host (HOG_THREADS, 12: copies, or
      # with HOG_KERNEL=adamw the engine's AdamW kernel in its pinned pool): what the host steps' load alone costs a
      # launch-bound backward
      run hog_before python3 benchmarks/bench_train.py --stem train_b1_hog_before --modes resident-accum2,resident
      python3 benchmarks/memory_hog.py --threads "${HOG_THREADS:-12}" --kernel "${HOG_KERNEL:-copy}" --seconds 120 \
        > "$OUT/memory_hog.log" 2>&1 &
      hog_pid=$!
      sleep 3
      run hog_during python3 benchmarks/bench_train.py --stem train_b1_hog_during --modes resident-accum2,resident
      kill "$hog_pid" 2>/dev/null; wait "$hog_pid" 2>/dev/null
      run hog_after python3 benchmarks/bench_train.py --stem train_b1_hog_after --modes resident-accum2,resident ;;
    train-kept)  # issue 13: B1 without recompute beside resident without checkpointing; auto and all under 24 GB
      # (train-kept and train-b2-kept: every mode with expandable segments unless PYTORCH_CUDA_ALLOC_CONF says
      # otherwise, as offload-train sets them for kept layers)
      export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
      run train_kept python3 benchmarks/bench_train.py --stem train_b1_kept --modes \
        "${KEPT_MODES:-resident,resident-ckptnone,native-bf16,native-bf16-ckptnone,native-bf16-g6-ckptnone,native-bf16-r4-ckptnone}"
      run train_kept_capped python3 benchmarks/bench_train.py --stem train_b1_kept_24gb --gpu-cap-gb 24 --modes \
        "${KEPT_CAPPED_MODES:-resident,native-bf16,native-bf16-ckptauto,native-bf16-ckpt8}" ;;
    train-b2-kept)  # issue 13: the 8B shape under the 24 GB cap with auto (and with activation offload too) beside
      # resident uncapped with full checkpointing
      export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
      run train_b2_kept python3 benchmarks/bench_train.py --preset b2 --gpu-cap-gb 24 --steps 4 --warmup 2 \
        --stem train_b2_kept_24gb --modes "${B2_KEPT_MODES:-resident,native-bf16,native-bf16-ckptauto,native-bf16-aoff-ckptauto}" ;;
    fsdp)  # issue 14: FSDP2 + CPUOffloadPolicy, torch AdamW after backward vs CPUAdamW(overlap=True), beside resident
      # FSDP2, the 8B shape at 2 x 4096 on one GPU (FSDP_MODES: another list; FSDP_GPUS: ranks; FSDP_ARGS: more flags,
      # e.g. "--steps 3 --warmup 1"). First the installed FSDP2's handling of a CPU-offloaded gradient with a hook.
      grep -n "post_accumulate\|non_blocking" "$(python3 -c 'import torch.distributed.fsdp._fully_shard._fsdp_collectives as m; print(m.__file__)')" \
        > "$OUT/fsdp_collectives_grep.txt" 2>&1
      # shellcheck disable=SC2086  # FSDP_ARGS: words
      run fsdp torchrun --nproc-per-node "${FSDP_GPUS:-1}" benchmarks/bench_fsdp.py ${FSDP_ARGS:-} \
        --modes "${FSDP_MODES:-offload-torch,offload-overlap,offload-torch-clip,offload-overlap-clip,resident}" ;;
    train-fsdp)  # issue 14: offload-train --fsdp under torchrun on FSDP_GPUS ranks, the 1B shape, stopped half way and resumed
      export OFFLOAD_TRAIN_NO_BAR=1
      fsdp_train=(torchrun --nproc-per-node "${FSDP_GPUS:-1}" --no-python offload-train --fsdp --model llama-1b
        --batch-size 4 --seq-len 2048 --steps 8 --lr 1e-4 --warmup-steps 2 --max-grad-norm 1.0 --out /tmp/run_fsdp)
      run train_fsdp_a "${fsdp_train[@]}" --stop-after 4
      run train_fsdp_b "${fsdp_train[@]}" --resume
      cp /tmp/run_fsdp/metrics.jsonl "$OUT/metrics_fsdp.jsonl" ;;
    train-fsdp-steps)  # offload-train --fsdp without clipping (stepping in backward) beside --max-grad-norm 1e9
      # (after backward, never clipping: the same steps), the 1B shape, in turns, each run twice
      export OFFLOAD_TRAIN_NO_BAR=1
      fsdp_steps=(torchrun --nproc-per-node "${FSDP_GPUS:-1}" --no-python offload-train --fsdp --model llama-1b
        --batch-size 4 --seq-len 2048 --steps 12 --lr 1e-4 --warmup-steps 2)
      for turn in 1 2; do
        run "train_fsdp_inside_$turn" "${fsdp_steps[@]}" --out "/tmp/fsdp_inside_$turn"
        run "train_fsdp_after_$turn" "${fsdp_steps[@]}" --max-grad-norm 1e9 --out "/tmp/fsdp_after_$turn"
      done ;;
    train-long)  # issue 13: the 8B shape at 1 x 32768 under 24 GB with activation offload (resident capped too, to
      # show it does not fit), then the same offloaded run uncapped without activation offload
      run train_long_capped python3 benchmarks/bench_train.py --preset b2 --batch 1 --seq 32768 --gpu-cap-gb 24 \
        --cap-resident --steps 3 --warmup 1 --stem train_b2_long_24gb --modes resident,native-bf16-aoff
      run train_long python3 benchmarks/bench_train.py --preset b2 --batch 1 --seq 32768 --steps 3 --warmup 1 \
        --stem train_b2_long --modes native-bf16 ;;
    train-b2)  # the 8B shape: resident uncapped, offload under a 24 GB cap, clipping never / always triggering
      run train_b2 python3 benchmarks/bench_train.py --preset b2 --gpu-cap-gb 24 --steps 6 --warmup 2 \
        --memory-log "$OUT/host_memory_b2.log" --modes "${B2_MODES:-resident-clip,native-bf16,native-bf16-clip,native-bf16-clipall}" ;;
    train-b2-ds)  # DeepSpeed's ZeRO-3 offload on the same B2 recipe, in a process of its own (its host peak is high);
      # DS_STEPS / DS_WARMUP: 2 and 1 fit it into a call beside the B1 and B2 recipes (run 63)
      run train_b2_ds python3 benchmarks/bench_train.py --preset b2 --gpu-cap-gb 24 --steps "${DS_STEPS:-4}" \
        --warmup "${DS_WARMUP:-2}" \
        --stem train_b2_deepspeed --modes "${B2_DS_MODES:-deepspeed-bf16-clip,deepspeed-bf16-clipall}" ;;
    timeline)  # issue 11's pictures: one traced step of B1 plain and with clipping triggering every step
      timelines "${TIMELINE_MODES:-native-bf16,native-bf16-clipall,native-bf16-accum2}" "${TIMELINE_PRESET:-b1}" ;;
    accum-probe)  # issue 11: accumulation with 15, 12 (and 4 step threads) and 8 resident layers beside resident, timed
      # in two interleaved sets (the second reversed), then each traced with the profiler's GPU lanes and CUDA API
      # calls (timeline_stats: who fed each pass, how fast); ACCUM_PROBE_MODES replaces the list
      probe=${ACCUM_PROBE_MODES:-resident-accum2,native-bf16-d16-r15-accum2,native-bf16-d16-r12-accum2,native-bf16-d16-r12-t4-accum2,native-bf16-d16-r8-accum2}
      rev=$(tr , '\n' <<< "$probe" | tac | paste -sd,)
      run accum_probe python3 benchmarks/bench_train.py --stem train_b1_accum_probe --modes "$probe,$rev"
      TRACE_GPU=1 timelines "$probe" b1 ;;
    overhead)  # the launching thread's cost per layer: a 16-layer shape so small that the GPU does next to nothing
      run overhead python3 benchmarks/bench_train.py --stem train_tiny_overhead --layers 16 --hidden 256 --intermediate 512 \
        --heads 4 --kv-heads 2 --vocab 1024 --batch 4 --seq 64 --steps 12 --warmup 3 \
        --modes resident,native-bf16,resident-accum4,native-bf16-accum4 ;;
    train-quick) run train python3 benchmarks/bench_train.py --modes resident,native-bf16 --stem train_b1_quick ;;
    train-mixed)  # mixed variants, each twice, interleaved: host steps whole vs sliced, 2 vs 16 device layers
      run train_mixed python3 benchmarks/bench_train.py --stem train_b1_mixed_variants --modes \
        resident,native-mixed-whole,native-mixed,native-mixed-d16,native-mixed-whole,native-mixed,native-mixed-d16,native-bf16-whole,native-bf16 ;;
    gap) run gap python3 benchmarks/bench_gap.py ;;
    load)  # issue 12: a checkpoint of LOAD_PRESET's shape (b2: 16 GB, written to /tmp once) streamed into the
      # engine against transformers' load, each followed by one step: times and host RSS
      run load python3 benchmarks/bench_load.py --preset "${LOAD_PRESET:-b2}" --device cuda --step "${LOAD_STEP:-1x4096}" \
        --vias "${LOAD_VIAS:-engine,transformers}" ;;
    dry-run)  # issue 12: offload-train --dry-run's plans for DRY_MODELS (default llama-8b,qwen-14b) at batch 1 x 4096
      models=${DRY_MODELS:-llama-8b,qwen-14b}
      for m in ${models//,/ }; do
        run "dry_run_$m" offload-train --model "$m" --device cuda --batch-size 1 --seq-len 4096 --dry-run ${DRY_ARGS:-}
      done ;;
    scratch-8b)  # issue 12: offload-train from scratch on the 8B shape (drawn into the engine): time to the first step.
      # SCRATCH_TIMEOUT (s) stops it before its final checkpoint (48 GB of params and moments) when only the start counts
      timed=(); [ -x /usr/bin/time ] && timed=(/usr/bin/time -v)  # its peak RSS, where the image has it
      [ -n "${SCRATCH_TIMEOUT:-}" ] && timed=(timeout -s INT "$SCRATCH_TIMEOUT" "${timed[@]}")
      OFFLOAD_TRAIN_NO_BAR=1 run scratch_8b "${timed[@]}" offload-train --model llama-8b --device cuda --steps 2 \
        --batch-size 1 --seq-len 4096 --out /tmp/run_8b --overwrite
      cp /tmp/run_8b/metrics.jsonl "$OUT/metrics_8b.jsonl"
      rm -rf /tmp/run_8b ;;  # its checkpoint (up to 48 GB, partial when cut) would leave no disk for `load`
    train-qwen)  # issue 12: the Qwen2.5-14B shape under the 24 GB cap, host memory logged
      run train_qwen python3 benchmarks/bench_train.py --preset qwen-14b --gpu-cap-gb 24 --steps 4 --warmup 2 \
        --memory-log "$OUT/host_memory_qwen.log" --modes "${QWEN_MODES:-native-bf16}" ;;
    train-lora)  # issue 12: LoRA r=16 on the 8B shape, offloaded under the 24 GB cap beside GPU-resident LoRA (uncapped)
      run train_lora python3 benchmarks/bench_train.py --preset b2 --gpu-cap-gb 24 --steps 6 --warmup 2 \
        --stem train_b2_lora --modes "${LORA_MODES:-resident-lora16,native-bf16-lora16}" ;;
    host-passes)  # each host pass alone per unit, as laid out in training (the engine's own buffer starts); the steps
      # after the norm as params and moments passes (the default), then whole; HOST_PASSES: a --passes list
      run host_passes python3 benchmarks/bench_host_passes.py --skew 0 ${HOST_PASSES:+--passes "$HOST_PASSES"}
      run host_passes_one_pass python3 benchmarks/bench_host_passes.py --skew 0 --one-pass --passes scale_step,redo \
        --stem host_passes_one_pass ;;
    train-compile) run train_compile python3 benchmarks/bench_train.py --compile --modes resident,native-bf16 ;;
    pin) run pin python3 benchmarks/bench_pin.py ;;
    bytecode)  # what `pip install` leaves and this image lacks: the bytecode of every package offload-train imports (run 70's
      # import log: transformers pulls in sklearn, pandas, scipy and torchvision where they are installed), compiled once on
      # every core (the models offload-train builds only, no test suites); a freshly booted machine's first import compiled it
      # one module at a time: the 8 B meta build took 51 s there (run 68), 10 s with torch's and transformers' alone (run 70)
      run bytecode python3 -m compileall -q -j 0 -x '/tests?/|transformers/models/(?!(auto|llama|qwen2)/|__init__)' $(python3 -c '
import importlib.util as u, os
names = "torch transformers sklearn scipy pandas pyarrow torchvision torchaudio triton sympy mpmath numpy narwhals accelerate joblib huggingface_hub PIL tokenizers safetensors rich psutil jinja2 peft tqdm".split()
print(" ".join(os.path.dirname(s.origin) for s in map(u.find_spec, names) if s and s.origin))') ;;
    cuda-start)  # issue 12: a process's one-time GPU costs, in turn (twice: the machine's first CUDA processes), then overlapped
      for k in 1 2; do run "cuda_start_$k" env PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/bench_cuda_start.py; done
      run cuda_start_overlap env PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/bench_cuda_start.py --overlap ;;
    suite)  # issue 36: the performance suite; SUITE_ARGS: its arguments (default the B1 preset)
      run suite python3 benchmarks/suite.py ${SUITE_ARGS:---preset b1} ;;
    sanitize) sanitize ;;  # compute-sanitizer over a few training steps (see sanitize() above)
    adamw-tune) run adamw_tune python3 benchmarks/bench_adamw.py --threads "$(nproc)" --tune --steps 5 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
# Only a few files come back from the device machine: everything under $OUT (and the result files the
# benchmarks wrote) also goes into one archive.
find benchmarks/results -type f -newer "$OUT/.start" -exec cp --parents {} "$OUT/" \;  # keeps <date>_<commit>/
tar -czf /tmp/offload_ext_results.tgz -C "$OUT" . && mv /tmp/offload_ext_results.tgz "$OUT/all_results.tgz"
exit $status
