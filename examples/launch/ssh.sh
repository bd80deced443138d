#!/usr/bin/env bash
# One oobleck_mm job on hosts you can ssh to: the master here, one agent per host.
#
#   examples/launch/ssh.sh job.yaml gpu01 gpu02 gpu03 gpu04
#
# Every host needs this repository (with its .venv) at the same path as here, and the
# dataset at the config's data.path. The token travels over ssh's stdin, never on a
# command line (where `ps` on the host would show it). Env: PORT (default 29400),
# RUN (default runs/<config>-<time>), SSH (default ssh), MASTER_HOST (default: this
# host's name as the agents should dial it), and EXTRA: flags for the master
# (e.g. "--steps 1000 --save-final runs/final").
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 CONFIG HOST [HOST...]" >&2; exit 2; }
CONFIG=$1; shift
HOSTS=("$@")
PORT=${PORT:-29400}
RUN=${RUN:-runs/$(basename "$CONFIG" .yaml)-$(date +%Y%m%d-%H%M%S)}
SSH=${SSH:-ssh}
MASTER_HOST=${MASTER_HOST:-$(hostname -f)}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
LAUNCH="$HERE/.venv/bin/oobleck-launch"

mkdir -p "$RUN"
# The master listens on every interface; --nodes: plan once this many agents are in.
# shellcheck disable=SC2086  # EXTRA is a list of flags
"$LAUNCH" master --config "$CONFIG" --host 0.0.0.0 --port "$PORT" --nodes "${#HOSTS[@]}" \
    --run-dir "$RUN" ${EXTRA:-} &
MASTER=$!
trap 'kill $MASTER 2>/dev/null || true' INT TERM
until [ -s "$RUN/token" ]; do
    kill -0 "$MASTER" 2>/dev/null || { wait "$MASTER"; exit $?; }  # the master refused the config
    sleep 0.2
done
for h in "${HOSTS[@]}"; do
    # An agent that loses its master (the job ended or failed) exits by itself.
    $SSH "$h" "read -r OOBLECK_TOKEN; export OOBLECK_TOKEN; cd '$HERE' && exec '$LAUNCH' agent \
        --master $MASTER_HOST:$PORT --node $h" < "$RUN/token" > "$RUN/agent-$h.log" 2>&1 &
done
set +e
wait "$MASTER"   # the master's exit code is the job's (0 done, 2 bad input, 3 stopped with a checkpoint)
code=$?
wait             # the agents end with the job
exit $code
