#!/bin/bash
# The GPU checks on a lent device machine (no network there; torch, transformers, numba in its image).
#
# Here, once per session (the wheels the image lacks, into the ignored .whl/; DeepSpeed has no wheel on
# the index, so it is built here, pure Python):
#   echo /.whl/ >> .git/info/exclude
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   for p in pyomo==6.10.1 highspy==1.16.0 grpcio==1.85.3 protobuf==7.36.2 pydantic==2.14.4 pydantic_core==2.50.5 \
#            annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0; do .venv/bin/python -m pip download $P $p; done
#   DS_BUILD_OPS=0 .venv/bin/python -m pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
# There (device tool: run, carry [".whl"]):
#   GPU_T=300 STRAGGLER_T=200 bash scripts/device_run.sh
# GPU_T bounds `make gpu-check`'s script; STRAGGLER_T, when set, runs scripts/bench_straggler.py after it
# (STRAGGLER_ARGS: its options; six simulated nodes want the machine's 16 cores).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L; nproc; python3 -V
python3 -c "import torch, deepspeed, pyomo.environ, highspy, grpc, transformers, numba, oobleck_mm.cli, master, agent
print('imports ok', torch.__version__, deepspeed.__version__, transformers.__version__)" || exit 8
python3 -m oobleck_mm.balance.search >/dev/null 2>&1  # numba's cache, as `make setup` does
start=$(date +%s)
timeout "${GPU_T:-330}" python3 scripts/gpu_check.py --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" | tail -80
echo "gpu_check rc=${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
cp /tmp/gpu_check_*/job/agent-node0.log "$OUT/" 2>/dev/null  # a failed job's worker traceback
if [ -n "$STRAGGLER_T" ]; then
  # shellcheck disable=SC2086
  timeout "$STRAGGLER_T" python3 scripts/bench_straggler.py --slow x2 $STRAGGLER_ARGS --json "$OUT/straggler.json" 2>&1 \
    | tee "$OUT/straggler.log" | tail -40
  echo "straggler rc=${PIPESTATUS[0]}"
fi
