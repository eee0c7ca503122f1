#!/usr/bin/env bash
# The H200 measurements, in as few device calls as possible (device time is scarce): named steps, run in order.
#   bash benchmarks/run_h200.sh [STEP ...]      (no STEP: the default batch below)
# Run from the repo root on the GPU box after the gpu-wheels install line; every JSON lands in $OUT.
# Each step has its own time limit so one slow step cannot starve the others.
# A step past its limit gets SIGINT (cleanup runs: the page store leaves /dev/shm), SIGKILL 5 s later.
# Every benchmark rewrites its JSON after each row ("complete": false until it ends), so a cut step keeps
# what it measured; engine_bench and kv_pressure also stop starting configurations past --time-budget-s.
# Logs go to $OUT/h200.log.
# The kernels' compile (~110 s on a cold cache) can be skipped on a later call: SAVE_NUMBA_CACHE=1 returns the cache
# as $OUT/numba-cache.tgz (gzip: the plain tar outgrew the 16 MiB a returned file may have); unpack it into build/
# here and name build/numba-cache in the next call's carry (with NUMBA_CACHE_DIR=$PWD/build/numba-cache). Numba keys
# each cached kernel on its source file's mtime and size, which the copy to the device keeps: enginetest took 58 s
# instead of 168 s (h200-nvidia-h200-20261201-s22.log, calls 2-3).
set -u
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-cache}
# The device copy's git metadata is not the tree's (session 57's files read 30a48af-dirty for 8722133): write
# `git rev-parse --short HEAD > build/rev` here before the call (build carried) and results name that revision
export GIT_REV=${GIT_REV:-$(cat build/rev 2>/dev/null)}
# Without an installed wheel, map the folders the way pyproject's package-dir does.
[ -e pagedweight/cuda ] || ln -s ../cuda pagedweight/cuda
[ -e pagedweight/actors ] || ln -s ../actors pagedweight/actors
log=$OUT/${H200_LOG:-h200.log}  # two step lists on two GPUs (CUDA_VISIBLE_DEVICES) keep two logs
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)" | tee -a "$log";
         local t0=$SECONDS; timeout -k 5 -s INT "$limit" "$@" >>"$log" 2>&1
         echo "rc=$? wall=$((SECONDS - t0))s" | tee -a "$log"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$log"
NGPUS=${NGPUS:-1}; GPE=$(python3 -c "print(1 if $NGPUS >= 2 else 0.5)")  # GPU share of each of the two engines
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(exchange mover enginetest engine pressure)
for s in "${steps[@]}"; do case $s in
  exchange) step 60 python3 -m benchmarks.budget_exchange ;;
  mover) step 60 python3 -m benchmarks.page_mover_bench --trials 3 ;;
  # ncu's stall reasons and DRAM figures for the decode kernel (Mixtral 4-bit T=1: `_gemv_t1_narrow_kernel`; regex
  # `_gemv` matches every variant), first launches skipped;
  # NCU_KERNEL=_dequant_kernel NCU_PROBE="--shape qwen1.5-moe-a2.7b --T 512 --bits 4": the prefill's dequantize kernel
  ncu) step 150 ncu --clock-control none --kernel-name regex:${NCU_KERNEL:-_gemv} --launch-skip 4 --launch-count 2 \
         ${NCU_ARGS:---set full} -o "$OUT/ncu_gemv" python3 -m benchmarks.kernel_probe \
         ${NCU_PROBE:---shape mixtral-8x7b --T 1 --bits 4}
       ncu --import "$OUT/ncu_gemv.ncu-rep" --page details > "$OUT/ncu_gemv.txt" 2>&1
       ncu --import "$OUT/ncu_gemv.ncu-rep" --page raw --csv 2>&1 | python3 benchmarks/ncu_stalls.py > "$OUT/ncu_stalls.txt"
       rm -f "$OUT/ncu_gemv.ncu-rep" ;;
  # the bundled model (pagedweight/train.py, config tiny); the HF dir comes back as one tar (few files return)
  train) step "${TRAIN_LIMIT:-570}" python3 -m pagedweight.cli train --config tiny --work-dir /tmp/pwtrain \
           --out /tmp/pw-tiny-moe --results-dir "$OUT" && tar -C /tmp -cf "$OUT/pw-tiny-moe.tar" pw-tiny-moe ;;
  kernels) step "${KERNEL_LIMIT:-300}" python3 -m benchmarks.moe_kernel_bench ${KERNEL_ARGS:-} ;;
  quantize) step "${QUANTIZE_LIMIT:-600}" python3 -m benchmarks.quantize_speed ;;
  # the GPU tests (59 of this selection passed at f5bb1b8 in 40 s on a warm cache; on a cold one the run went past 300 s
  # in session 40, call 1), which also compile the kernels
  # into NUMBA_CACHE_DIR before the engine benchmarks load them
  # (tests/test_sampling_kernels.py: "on_gpu" selects the nucleus cut against its twin at 151,936 logits)
  enginetest) sel="ap_ or pressure or preempts or cuda_graph or graph or on_gpu or in_place or reload or narrow"
              sel+=" or widths_return or sampler or logprobs or adjust or penalties or prefix or min_tokens"
              step "${ENGINETEST_LIMIT:-360}" env PAGEDWEIGHT_TEST_DEVICE=cuda python3 -m pytest -q -rfE -p no:cacheprovider \
                tests/test_decode_graphs.py tests/test_engine.py tests/test_attention_kernel.py tests/test_layer_kernels.py \
                tests/test_kernels_sim.py tests/test_planner.py tests/test_sampling_kernels.py -k "$sel" ;;
  # the engine under random workloads (tests/test_engine_fuzz.py) with the fused kernels and whole-step graphs; the
  # GPU machine lacks hypothesis: `../shared/tools/gpu-wheels --numpy hypothesis==6.170.17 sortedcontainers==2.4.0`
  # (8 examples per test took 21 s with a warm Numba cache, h200-nvidia-h200-20261205-s40.log, call 2)
  fuzz) step "${FUZZ_LIMIT:-420}" env PAGEDWEIGHT_TEST_DEVICE=cuda PAGEDWEIGHT_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-40} \
          python3 -m pytest -q -rfE -p no:cacheprovider tests/test_engine_fuzz.py ;;
  # torch.profiler tables of the chunked prefill (host and device time per op: is a prefill step host-bound?); run
  # after enginetest, whose compile fills the Numba cache
  prefillprof) step "${PREFILLPROF_LIMIT:-240}" python3 -m benchmarks.engine_bench --bits 4 --batches 4 --skip-fp16 \
                 --torch-profile "$OUT/prefill_profile.txt" --torch-profile-phase prefill --label prefillprof ;;
  # the layer-level prefill A/B against an older moe_kernels.py's _prefill (PREFILLAB_OLD: a file carried as untracked,
  # e.g. `git show main:cuda/moe_kernels.py > scratch/old_moe_kernels.py`): layer-call time, output distance, buffers;
  # PREFILLAB_ARGS="--tokens 512" (no --skip-engine) adds the engine's time to the first tokens (give it ~300 s)
  prefillab) step "${PREFILLAB_LIMIT:-120}" python3 -m benchmarks.prefill_bench --old "${PREFILLAB_OLD:?}" \
               ${PREFILLAB_ARGS:---skip-engine --tokens 512,128,2048} --reps 6 --label "${PREFILLAB_LABEL:-prefillab}" ;;
  # layers.sdpa against an older layers.py's (SDPAAB_OLD, carried as an untracked file like PREFILLAB_OLD): time, peak
  # memory a call adds and output distance, on decode rows of grouped heads and prefill chunks after their context
  sdpaab) step "${SDPAAB_LIMIT:-150}" python3 -m benchmarks.sdpa_ab --old "${SDPAAB_OLD:?}" \
            --label "${SDPAAB_LABEL:-sdpaab}" ;;
  # ENGINE_PROFILE=1 adds a cProfile host-time breakdown (it slows the host: not for the committed figures)
  engine) step "${ENGINE_LIMIT:-200}" python3 -m benchmarks.engine_bench ${ENGINE_ARGS:---bits 4,3,6,5 --time-budget-s 150} \
            ${ENGINE_PROFILE:+--profile "$OUT/engine_profile.txt"} ;;
  # PagedWeight against uniform at equal memory, both engines resident and stepped in alternating 4-step chunks
  # (the table's configurations run minutes apart and drift by more than the 2 % under test)
  paired) step "${PAIRED_LIMIT:-200}" python3 -m benchmarks.engine_bench --rounds 0 --paired-chunk 4 --bits 4,3,6,5 \
            --batches 1,4 --gen 64 --paged-home match --time-budget-s 170 ${PAIRED_ARGS:-} ;;
  # issue 8(a) again on the tree: FP16 (dense, same engine) against uniform 4 bits at batch 1, three rounds (the
  # ratio a median); the README's figure is session 19's (engine_bench-nvidia-h200-20261130-s19.json)
  fp16ratio) step "${FP16RATIO_LIMIT:-240}" python3 -m benchmarks.engine_bench --bits 4 --batches 1 --rounds 3 --gen 64 \
               --time-budget-s 220 --label "${FP16RATIO_LABEL:-fp16ratio}" ;;
  # host time before each step's launch and the graph's GPU time, per engine and observation-cycle place
  marks) step "${MARKS_LIMIT:-150}" python3 -m benchmarks.launch_marks --rounds 0 --paired-chunk 4 --bits 3,4 \
           --batches 1,4 --gen 64 --paged-home match --time-budget-s 110 --label "${MARKS_LABEL:-marks}" ${MARKS_ARGS:-} ;;
  # MEMGAP_ARGS="--shape qwen3-moe": the grouped-query shape (its decode rows take the gather path)
  # where the memory above the budget goes (allocator segments by source and pool), then the same workload at budget
  # + that gap with activation_reserve = the gap, and with "auto": engine_bench's batch 1 and 4 at 4 bits, and
  # kv_pressure's arrivals
  # MEMGAP_WORKLOADS: which of the three (batch sizes and/or "pressure"), e.g. "4 pressure"
  memgap) for w in ${MEMGAP_WORKLOADS:-1 4 pressure}; do
            [ "$w" = pressure ] && a="--workload pressure" || a="--batch $w"
            step "${MEMGAP_LIMIT:-200}" python3 -m benchmarks.memory_gap $a --reserve "${MEMGAP_RESERVE:-measured,auto}" \
              --label "memgap-$w${MEMGAP_LABEL:-}" ${MEMGAP_ARGS:-}
          done ;;
  # `pagedweight run` (the README's main job) on the bundled model at BUDGETS, each run its own process: make run's
  # CUDA default
  budgets) step "${BUDGETS_LIMIT:-300}" python3 -m benchmarks.run_budgets --device cuda \
             --budgets "${BUDGETS:-118MiB,126MiB,134MiB}" --repeats "${BUDGETS_REPEATS:-2}" --label "${BUDGETS_LABEL:-budgets}" \
             ${BUDGETS_ARGS:-} ;;
  attention) step "${ATTENTION_LIMIT:-150}" python3 -m benchmarks.attention_bench ${ATTENTION_ARGS:-} ;;  # kernel vs SDPA
  # one sampler call per case and batch: top-p through the sort against the nucleus cut kernel (arms sort / kernel /
  # the policy), min-p, and top-k as a threshold before the cut in a mixed batch (session 41)
  sampler) step "${SAMPLER_LIMIT:-150}" python3 -m benchmarks.sampler_bench --nucleus-arms --batches 1,4,8,32,256 \
             --cases "${SAMPLER_CASES:-t1,t1-minp0.05,t0.8-p0.9,t0.7-k20-p0.8,mixed-k20p0.8-p0.9}" \
             --label "${SAMPLER_LABEL:-sampler}" ;;
  burst) step 120 python3 -m benchmarks.release_burst --device cuda --label cuda ;;  # host cost of a release burst
  # kept prefix blocks: closed-loop conversations (3 turns, each sent ~1 s after the previous one ended, its answer
  # included) with prefix caching on, then off; PagedWeight and static 4 bits at the same budget
  # (CONV_ARGS="--prefix-retention-s 5" CONV_LABEL=-ret5: kept blocks retained from reloads, session 41)
  conversations) for arm in on off; do
                   step "${CONV_LIMIT:-150}" python3 -m benchmarks.kv_pressure --turns 3 --think-s 1 --static-bits 4 \
                     --time-budget-s 130 $([ $arm = off ] && echo --no-prefix-caching) \
                     --label "conv-$arm${CONV_LABEL:-}" ${CONV_ARGS:-}
                 done ;;
  # A/B arms alternating in separate processes (arm order reversed every other round: a b b a ...), compared by each
  # result's host_loop_ms (the host's speed moves between processes on some machines; session 56's calls log).
  # ARMS="p n", ARM_FLAGS_n="--no-packed-layer-kernels" (an arm without ARM_FLAGS_<arm> runs the defaults), ROUNDS=2;
  # abhost: step_host (a fresh 453-token prompt per prefill step; eager decode, capture and replay);
  # abconv: the closed-loop conversations (3 turns, 1 s think time, no prefix retention, traced; static 4 bits beside)
  abhost|abconv) for ((r = 1; r <= ${ROUNDS:-2}; r++)); do
                   arms=(${ARMS:-p n}); ((r % 2)) || arms=($(printf '%s\n' "${arms[@]}" | tac))
                   for a in "${arms[@]}"; do flags=ARM_FLAGS_$a
                     if [ $s = abhost ]; then
                       step 60 python3 -m benchmarks.step_host --prompts 12 --launches 0 ${!flags:-} \
                         --label "${AB_LABEL:-ab}-$a-$r"
                     else
                       step 100 python3 -m benchmarks.kv_pressure --turns 3 --think-s 1 --static-bits 4 --paged-runs 1 \
                         --prefix-retention-s 0 --trace --time-budget-s 70 ${!flags:-} \
                         --label "${AB_LABEL:-ab}-conv3-ret0-trace-$a-$r"
                     fi
                   done
                 done ;;
  # A/B of source files: arm n = the tree, arm o = the files under OLD_DIR (same relative paths, made before the call,
  # e.g. `mkdir -p build/old/cuda && git show REV:cuda/layer_kernels.py > build/old/cuda/layer_kernels.py`, build
  # carried) put in place for its runs with a Numba cache of its own (one per OLD_DIR), then the tree's back (cp -p
  # both ways: each file keeps its mtime, which Numba's cache keys on). AB_CMD: the benchmark command, its label
  # AB_LABEL-<arm>-<round>; ROUNDS=2 (n o o n ...). The old arm's cache starts as a copy of the tree's (only the
  # files that differ compile); AB_WARM=1 first runs each arm once into /tmp/ab-warm (not returned), so no measured
  # process pays a compile
  abfiles) files=$(cd "${OLD_DIR:?}" && find . -type f -name '*.py'); old_nc=/tmp/nc-old-$(basename "$OLD_DIR")
           [ -d "$old_nc" ] || { [ -d "$NUMBA_CACHE_DIR" ] && cp -a "$NUMBA_CACHE_DIR" "$old_nc"; }
           r0=1; [ -n "${AB_WARM:-}" ] && r0=0
           for ((r = r0; r <= ${ROUNDS:-2}; r++)); do
             arms=(n o); ((r % 2)) || arms=(o n)
             for a in "${arms[@]}"; do
               if [ $a = o ]; then
                 for f in $files; do mkdir -p "/tmp/ab-keep/$(dirname "$f")"; cp -p "$f" "/tmp/ab-keep/$f"
                   cp -p "$OLD_DIR/$f" "$f"; done
               fi
               nc=$NUMBA_CACHE_DIR; [ $a = o ] && nc=$old_nc
               step "${AB_LIMIT:-120}" env NUMBA_CACHE_DIR="$nc" \
                 ${AB_CMD:?} --label "${AB_LABEL:-ab}-$a-$r" $( ((r)) || echo "--out-dir /tmp/ab-warm")
               if [ $a = o ]; then for f in $files; do cp -p "/tmp/ab-keep/$f" "$f"; done; fi
             done
           done ;;
  pressure) step "${PRESSURE_LIMIT:-150}" python3 -m benchmarks.kv_pressure --time-budget-s "${PRESSURE_BUDGET:-130}" ${PRESSURE_ARGS:-} ;;  # --trace, --profile $OUT/f, --paged-runs N
  # Ray steps (carry the --ray wheels and the Serve/dashboard deps listed in benchmarks/multi_engine.py).
  # NGPUS=1 (default): two half-GPU engines share one GPU; NGPUS=2 on a two-GPU box: one engine per GPU.
  # multi: store, reload, planner and eval sections over EngineActors; serve: Serve replicas under HTTP load;
  # evaljob: the evaluation as real `ray job submit` jobs over 1 and 2 engines
  # MULTI_ARGS go to both multi_engine steps (e.g. --expert-impl auto); give each a --label via *_LABEL
  multi) step 240 python3 -m benchmarks.multi_engine --engines 2 --gpus-per-engine "$GPE" \
           --sections store,reload,planner,eval --store-root /dev/shm --out-dir "$OUT" ${MULTI_ARGS:-} \
           --label "${MULTI_LABEL:-engines}" ;;
  # (with --expert-impl auto on a cold NUMBA_CACHE_DIR the kernel compile alone takes ~100 s)
  serve) step 240 python3 -m benchmarks.multi_engine --engines 2 --gpus-per-engine "$GPE" --sections serve \
           --serve-seconds 6 --out-dir "$OUT" ${MULTI_ARGS:-} ${SERVE_ARGS:-} --label "${SERVE_LABEL:-serve}" ;;
  evaljob) ray start --head --num-cpus $((8 * NGPUS)) --num-gpus "$NGPUS" --dashboard-host 127.0.0.1 \
             --disable-usage-stats >>"$log" 2>&1
           step 150 python3 -m benchmarks.eval_job_scaling /tmp/pagedweight-multi-engine/pw-tiny-moe-ap-s8 \
             --engines 1,2 --gpus-per-engine "$GPE" ${EVAL_LABEL:+--label "$EVAL_LABEL"} \
             --job-args "${EVAL_JOB_ARGS:---mode all --windows 64 --ctx 256 --num-prompts 16 --max-tokens 32 \
             --expert-impl reference}"
           ray stop --force >>"$log" 2>&1 ;;
  *) echo "unknown step $s" | tee -a "$log" ;;
esac; done
[ -n "${SAVE_NUMBA_CACHE:-}" ] && tar -C "$(dirname "$NUMBA_CACHE_DIR")" -czf "$OUT/numba-cache.tgz" "$(basename "$NUMBA_CACHE_DIR")"
grep -E "^(==|rc=)|passed|failed|Error|error" "$log" | tail -40
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    print(f"{f.name}: {len(d['rows'])} rows, complete={d.get('complete')}, skipped={d.get('skipped_configs') or d.get('skipped_modes') or []}")
PY
