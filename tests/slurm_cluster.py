"""A real SLURM cluster on this machine: slurmctld here, one slurmd per node in its own network namespace.

Debian's ``slurmctld``/``slurmd``/``munge`` (``scripts/install_slurm.sh``) with a private munge key and
socket, a private ``slurm.conf`` (``SLURM_CONF``) and ports picked free. Each slurmd runs inside a
``tests/network.Network`` namespace under its node's name (``slurmd -N``) at its own address, so a
node's jobs, steps and processes live behind that node's link: cutting it is a node that stops
answering SLURM too, and SLURM itself declares it DOWN (after ``SLURMD_TIMEOUT_S``).

No cgroups (``proctrack/linuxproc``, ``task/none``) and no accounting: what is tested is the launch
file's own behaviour against a real controller (allocation, ``srun`` steps, ``--no-kill``, signals,
exit codes), not SLURM's resource isolation.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness import wait_for
from network import Network
from oobleck_mm.runtime.worker import free_port

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "squeue")
SLURMD_TIMEOUT_S = 4
"""SlurmdTimeout: how long the controller waits for a node that stopped answering before it sets it DOWN
(and, without ``--no-kill``, ends the jobs on it). Short, so a test sees it; production uses 300 s."""


def unavailable() -> str | None:
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): run scripts/install_slurm.sh"
    return None


@dataclass
class SlurmCluster:
    root: Path
    network: Network
    cpus: int = 2
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.conf = self.root / "slurm.conf"
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start(self) -> None:
        r = self.root
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = r / "munge.sock"
        self.procs["munged"] = subprocess.Popen(
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={r / 'munged.pid'}",
                f"--log-file={r / 'munged.log'}",
                f"--seed-file={r / 'munge.seed'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: self.munge_socket.exists(), 10, "munged's socket")
        nodes = self.network.nodes
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr={self.network.address(n)} CPUs={self.cpus} State=UNKNOWN" for n in nodes
        )
        self.conf.write_text(f"""\
ClusterName=oobtest
SlurmctldHost={socket.gethostname()}({self.network.master_address})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / "ctld"}
SlurmdSpoolDir={r}/slurmd.%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r / "slurmctld.log"}
SlurmdLogFile={r}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT_S}
SlurmctldTimeout=10
MessageTimeout=5
KillWait=5
InactiveLimit=0
{node_lines}
PartitionName=test Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        for n in nodes:
            (r / f"slurmd.{n}").mkdir(exist_ok=True)
            self.procs[f"slurmd.{n}"] = subprocess.Popen(
                self.network.command(n, ["slurmd", "-D", "-N", n, "-f", str(self.conf)]),
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        self.wait_idle()

    def resume(self, node: str) -> None:
        """A node back from DOWN is idle again now, not at the controller's next look at it."""
        subprocess.run(
            ["scontrol", "update", f"nodename={node}", "state=resume"], env=self.env, capture_output=True, timeout=20
        )
        self.wait_idle()

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle (a node back from DOWN is, once its slurmd answers: ReturnToService=2)."""
        wait_for(lambda: self.idle_nodes() == set(self.network.nodes), timeout, "every node idle in sinfo")

    def sinfo(self) -> str:
        return subprocess.run(
            ["sinfo", "-N", "-h", "-o", "%N %t"], env=self.env, capture_output=True, text=True, timeout=20
        ).stdout

    def idle_nodes(self) -> set[str]:
        return {n for n, state in (line.split() for line in self.sinfo().splitlines()) if state == "idle"}

    def node_state(self, node: str) -> str:
        return dict(line.split() for line in self.sinfo().splitlines()).get(node, "")

    def close(self) -> None:
        subprocess.run(
            ["scancel", "--full", "--signal=KILL", "-u", "root"], env=self.env, capture_output=True, timeout=20
        )
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
