#!/bin/bash
# SLURM and munge from Debian's packages, for tests/e2e/test_slurm.py (a real slurmctld and three
# slurmd in network namespaces run examples/launch/slurm.sbatch). Needs root and apt; elsewhere it
# says why and exits 0, and those tests skip with the same reason.
set -euo pipefail
if command -v slurmctld > /dev/null && command -v slurmd > /dev/null && command -v munged > /dev/null \
        && command -v sbatch > /dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "install_slurm.sh: SLURM not installed (needs root and apt-get); tests/e2e/test_slurm.py will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq > /dev/null
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge > /dev/null
echo "install_slurm.sh: $(slurmd -V) installed"
