#!/bin/bash
# The GPU checks, and the benches that need a core per simulated node, on a lent device machine
# (no network there; torch, transformers, numba in its image; 16 CPU cores).
#
# Here, once per session (the wheels the image lacks, into the ignored .whl/; DeepSpeed has no wheel on
# the index, so it is built here, pure Python):
#   echo /.whl/ >> .git/info/exclude
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   for p in pyomo==6.10.1 highspy==1.16.0 grpcio==1.85.3 protobuf==7.36.2 pydantic==2.14.4 pydantic_core==2.50.5 \
#            annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0; do .venv/bin/python -m pip download $P $p; done
#   DS_BUILD_OPS=0 .venv/bin/python -m pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
# There (device tool: run, carry [".whl"]), each part on when its time limit is set (seconds):
#   GPU_T=200 GPU_ARGS=--no-bench STRAGGLER_T=320 bash scripts/device_run.sh     # first call, ~6 min (timeout_s 560)
#   JOIN_T=150 SOAK_T=300 SOAK_ARGS="--steps 1500" DEFERRAL_T=90 \
#     DEFERRAL_ARGS="--layout 4+3+2+1 --global-batch 48 --steps 12 --warmup 2" \
#     bash scripts/device_run.sh                                                  # second, on the warm machine
# Estimates from 2-core and earlier 16-core runs: gpu-check without its bench ~130 s, the straggler bench's three
# 400-step runs ~210 s, ten join runs ~130 s, the soak ~270 s; 15 device minutes hold both calls and a start,
# not a rerun. (The soak's churn is timed in seconds: on a core per node its 600 steps end before 60 events land.)
#   GPU_T       make gpu-check's script (GPU_ARGS: its options, e.g. --no-bench)         all CUDA tests, the job
#   PROFILE_T   scripts/gpu_profile.py (PROFILE_ARGS): engine vs plain loop, 1.1 B Llama, issue 52 item 4 (~3 min)
#   STRAGGLER_T scripts/bench_straggler.py --slow x2 (STRAGGLER_ARGS)                   issue 29: 6 nodes, 400 steps
#   JOIN_T      scripts/bench_join.py --runs 5, idle (JOIN_ARGS)                        issue 31 item 3
#   JOIN_LOAD_T the same beside two `yes > /dev/null`                                   issue 31 item 3
#   SOAK_T      scripts/soak_churn.py --size-control (SOAK_ARGS)                        issue 27: soak (a)
#   DEFERRAL_T  scripts/bench_deferral.py (DEFERRAL_ARGS)                               issue 32 item 3
# Every part writes NAME.json and NAME.log under $OUT (8 files come back at most: 4 parts a call).
# Why there: on this repository's 2-core machine every simulated node shares two cores with the others, so
# a frozen straggler's CPU speeds its peers, a joiner's start-up slows the survivors, and more nodes make
# every step slower; the device machine gives each simulated node a core of its own.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import deepspeed, pyomo, highspy" 2>/dev/null; then  # a warm machine keeps /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
fi
nvidia-smi -L; echo "cores: $(nproc)"; python3 -V; uptime
python3 -c "import torch, deepspeed, pyomo.environ, highspy, grpc, transformers, numba, oobleck_mm.cli, master, agent
print('imports ok', torch.__version__, deepspeed.__version__, transformers.__version__)" || exit 8
python3 -m oobleck_mm.balance.search >/dev/null 2>&1  # numba's cache, as `make setup` does
failed=0

part() {  # part NAME LIMIT_S COMMAND...: run one bench under its limit, its log and JSON under $OUT
  local name=$1 limit=$2 start rc
  shift 2
  [ -n "$limit" ] || return 0
  start=$(date +%s)
  echo "== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40
  rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc in $(($(date +%s) - start)) s"
  [ "$rc" = 0 ] || failed=1
}

# shellcheck disable=SC2086
{
  part gpu_check "$GPU_T" python3 scripts/gpu_check.py $GPU_ARGS --json "$OUT/gpu_check.json"
  [ -n "$GPU_T" ] && cp /tmp/gpu_check_*/job/agent-node0.log "$OUT/" 2>/dev/null  # a failed job's worker traceback
  part gpu_profile "$PROFILE_T" python3 scripts/gpu_profile.py $PROFILE_ARGS --json "$OUT/gpu_profile.json"
  part straggler "$STRAGGLER_T" python3 scripts/bench_straggler.py --slow x2 $STRAGGLER_ARGS --json "$OUT/straggler.json"
  part join "$JOIN_T" python3 scripts/bench_join.py --runs 5 $JOIN_ARGS --json "$OUT/join.json"
  part join_load "$JOIN_LOAD_T" python3 scripts/bench_join.py --runs 5 --load 2 $JOIN_ARGS --json "$OUT/join_load.json"
  part soak "$SOAK_T" python3 scripts/soak_churn.py --size-control $SOAK_ARGS --json "$OUT/soak.json"
  part deferral "$DEFERRAL_T" python3 scripts/bench_deferral.py $DEFERRAL_ARGS --json "$OUT/deferral.json"
}
pkill -f "oobleck_mm.cli|forkserver" 2>/dev/null  # a part stopped at its limit leaves no cluster behind
pkill -x yes 2>/dev/null
exit $failed
