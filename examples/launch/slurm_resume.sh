#!/bin/bash
# Submits slurm.sbatch until the job is done: resubmits after exit 3 (stopped with a checkpoint: the
# allocation's time limit, a preemption, too few nodes left), resuming from the newest complete
# checkpoint of the earlier tries; stops on 0 (done), 1 (a failure) and 2 (a bad config or flag).
#
#   examples/launch/slurm_resume.sh [sbatch options...] -- CONFIG [master flags...]
#
# Env: BASE (default runs/slurm-<time>): one run dir per try below it, try1, try2, ...; it must be on
# a shared file system. TRIES (default 20): the most submissions. SBATCH_FILE: the batch file.
# POLL_S (default 10): how often it asks SLURM whether the job ended. A job SLURM itself ended at its
# time limit, on preemption or with its first node counts as exit 3 (resumable); one cancelled as 1.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SBATCH_FILE=${SBATCH_FILE:-$HERE/slurm.sbatch}
TRIES=${TRIES:-20}
sbatch_args=()
while [[ $# -gt 0 && $1 != -- ]]; do sbatch_args+=("$1"); shift; done
[[ ${1:-} == -- ]] || { echo "usage: slurm_resume.sh [sbatch options...] -- CONFIG [master flags...]" >&2; exit 2; }
shift
[[ $# -ge 1 ]] || { echo "slurm_resume.sh: no CONFIG after --" >&2; exit 2; }
BASE=${BASE:-$PWD/runs/slurm-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$BASE"

newest_with_a_checkpoint() {  # the latest try's run dir holding a complete checkpoint (a meta.json)
    local dir
    for dir in $(ls -d "$BASE"/try* 2>/dev/null | sort -V -r); do
        if compgen -G "$dir/*/meta.json" > /dev/null || compgen -G "$dir/*/*/meta.json" > /dev/null; then
            echo "$dir"
            return
        fi
    done
}

job_exit_code() {  # waits for job $1 to end; its batch script's exit code, 3 where SLURM ended it resumably
    local info state
    while :; do
        info=$(scontrol show job -o "$1" 2> /dev/null) || { echo 1; return; }  # gone past MinJobAge: unknown
        state=$(grep -o 'JobState=[A-Z_]*' <<< "$info")
        state=${state#JobState=}
        case $state in
            COMPLETED) echo 0; return ;;
            FAILED) code=$(grep -o ' ExitCode=[0-9]*' <<< "$info"); echo "${code#*=}"; return ;;
            # Ended by SLURM after the notice had its chance to checkpoint (or the node of the master failed):
            # the newest complete checkpoint is where to go on from.
            TIMEOUT | PREEMPTED | NODE_FAIL | BOOT_FAIL | DEADLINE) echo 3; return ;;
            CANCELLED | OUT_OF_MEMORY) echo 1; return ;;  # someone meant it to stop, or it cannot fit
        esac
        sleep "${POLL_S:-10}"  # not sbatch --wait: it backs off to 32 s between looks
    done
}

for ((try = 1; try <= TRIES; try++)); do
    resume=()
    from=$(newest_with_a_checkpoint)
    [[ -n $from ]] && resume=(--resume "$from")
    echo "slurm_resume.sh: try $try${from:+, resuming from the newest checkpoint in $from}" >&2
    jobid=$(sbatch --parsable --export=ALL,RUN="$BASE/try$try" "${sbatch_args[@]}" "$SBATCH_FILE" "$@" \
        "${resume[@]}") || { echo "slurm_resume.sh: sbatch refused the job" >&2; exit 2; }
    jobid=${jobid%%;*}
    echo "slurm_resume.sh: job $jobid" >&2
    code=$(job_exit_code "$jobid")
    case $code in
        0) echo "slurm_resume.sh: done" >&2; exit 0 ;;
        3) echo "slurm_resume.sh: try $try stopped with a checkpoint (exit 3): submitting again" >&2 ;;
        *) echo "slurm_resume.sh: try $try exited $code: not resubmitting (0 done, 3 resumable)" >&2
           exit "$code" ;;
    esac
done
echo "slurm_resume.sh: $TRIES tries, each stopped with a checkpoint; resume with: BASE=$BASE $0 ${sbatch_args[*]} -- $*" >&2
exit 3
