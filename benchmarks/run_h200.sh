#!/usr/bin/env bash
# The H200 batch of this session's GPU measurements, in one device call (device time is scarce).
# Run from the repo root on the GPU box after the gpu-wheels install line; every JSON lands in $OUT.
# Each step has its own time limit so one slow step cannot starve the others; the limits add up to < 8 min.
# A step past its limit gets SIGINT (cleanup runs: the page store leaves /dev/shm), SIGKILL 5 s later.
# Every benchmark rewrites its JSON after each row ("complete": false until it ends), so a cut step keeps
# what it measured; engine_bench and kv_pressure also stop starting configurations past --time-budget-s.
# Logs go to $OUT/h200.log.
set -u
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-cache}
# Without an installed wheel, map the folders the way pyproject's package-dir does.
[ -e pagedweight/cuda ] || ln -s ../cuda pagedweight/cuda
[ -e pagedweight/actors ] || ln -s ../actors pagedweight/actors
log=$OUT/h200.log
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)" | tee -a "$log";
         local t0=$SECONDS; timeout -k 5 -s INT "$limit" "$@" >>"$log" 2>&1
         echo "rc=$? wall=$((SECONDS - t0))s" | tee -a "$log"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$log"
step 40  python3 -m benchmarks.budget_exchange
step 40  python3 -m benchmarks.page_mover_bench --trials 3
# compiles the kernels into NUMBA_CACHE_DIR before the engine benchmarks load them
step 120 env PAGEDWEIGHT_TEST_DEVICE=cuda python3 -m pytest -x -q -p no:cacheprovider tests/test_engine.py -k "ap_ or pressure or preempts"
step 155 python3 -m benchmarks.engine_bench --bits 4,3,6 --gen 32 --time-budget-s 110
step 95  python3 -m benchmarks.kv_pressure --time-budget-s 70
grep -E "^(==|rc=)|passed|failed|Error|error" "$log" | tail -40
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    print(f"{f.name}: {len(d['rows'])} rows, complete={d.get('complete')}, skipped={d.get('skipped_configs') or d.get('skipped_modes') or []}")
PY
