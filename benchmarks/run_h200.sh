#!/usr/bin/env bash
# The H200 batch of this session's GPU measurements, in one device call (device time is scarce).
# Run from the repo root on the GPU box after the gpu-wheels install line; every JSON lands in $OUT.
# Each step has its own time limit so one slow step cannot starve the others; logs go to $OUT/h200.log.
set -u
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-cache}
# Without an installed wheel, map the folders the way pyproject's package-dir does.
[ -e pagedweight/cuda ] || ln -s ../cuda pagedweight/cuda
[ -e pagedweight/actors ] || ln -s ../actors pagedweight/actors
log=$OUT/h200.log
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)" | tee -a "$log";
         local t0=$SECONDS; timeout "$limit" "$@" >>"$log" 2>&1; echo "rc=$? wall=$((SECONDS - t0))s" | tee -a "$log"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$log"
step 70  python3 -m benchmarks.budget_exchange
step 80  python3 -m benchmarks.page_mover_bench --trials 3
step 110 env PAGEDWEIGHT_TEST_DEVICE=cuda python3 -m pytest -x -q -p no:cacheprovider tests/test_engine.py -k "ap_ or pressure or preempts"
step 150 python3 -m benchmarks.engine_bench --bits 3,4,6 --gen 64
step 80  python3 -m benchmarks.kv_pressure --num-requests 16
grep -E "^(==|rc=)|passed|failed|Error|error" "$log" | tail -40
