"""Hosts with their own addresses on one machine: a network namespace per node (issue 30 item 2).

``Network`` puts a Linux bridge in this (the test's) namespace, where the master listens on the
bridge's address, and gives every node a namespace of its own joined to the bridge by a veth pair:
``eth0`` inside with 10.X.Y.(i+1)/24, the other end on the bridge. Processes started with
``Network.command(node, argv)`` run inside the node's namespace (``ip netns exec``), so the node's
agent reaches the master, and its workers reach the other nodes' workers, only through that link.

``cut(node)`` takes the bridge's end of the link down: the node's processes keep running and
their sockets stay open, but nothing they send arrives and nothing reaches them (a partition, not a
kill: no FIN, no RST). ``heal(node)`` brings it back. ``throttle(node, kbit)`` makes the link slow.

Needs root and the ``ip`` tool (iproute2); ``unavailable()`` says why not, for a skip. Names carry
this process's pid, and ``close()`` deletes every namespace, veth and bridge it made even when a
test failed (deleting a namespace deletes the veth ends inside it).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import shutil
import subprocess
from dataclasses import dataclass, field

GLOO_INTERFACE = "eth0"
"""Inside a node's namespace. gloo binds the address the host name resolves to unless
``GLOO_SOCKET_IFNAME`` names an interface, and every namespace shares this host's name (here it
resolves to 127.0.0.1, each namespace's own loopback): a real multi-homed host needs the same
setting (``docs/launch.md``)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable() -> str | None:
    """Why this machine cannot make namespaces (a skip reason), or None when it can."""
    if shutil.which("ip") is None:
        return "no `ip` tool (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"oobprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        veth = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if veth.returncode != 0:
            return f"no veth pairs here: {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Network:
    nodes: list[str]
    tag: str = field(default_factory=lambda: str(os.getpid() % 100_000))
    subnet: str = ""
    made: list[tuple[str, str]] = field(default_factory=list)
    """What to delete at close: ("netns", name) or ("link", name)."""

    def __post_init__(self) -> None:
        pid = os.getpid()
        self.subnet = self.subnet or f"10.{200 + pid % 50}.{pid // 50 % 250}"  # private, unlikely to clash
        self.bridge = f"obr{self.tag}"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.master_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, node in enumerate(self.nodes):
                ns, host_end = self.namespace(node), self.host_end(node)
                _ip("netns", "add", ns)
                self.made.append(("netns", ns))
                _ip("link", "add", host_end, "type", "veth", "peer", "name", f"obp{self.tag}x{i}")
                self.made.append(("link", host_end))
                _ip("link", "set", f"obp{self.tag}x{i}", "netns", ns)
                _ip("-n", ns, "link", "set", f"obp{self.tag}x{i}", "name", GLOO_INTERFACE)
                _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", GLOO_INTERFACE)
                _ip("-n", ns, "link", "set", GLOO_INTERFACE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
        except BaseException:
            self.close()
            raise

    @property
    def master_address(self) -> str:
        return f"{self.subnet}.254"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{self.nodes.index(node) + 1}"

    def namespace(self, node: str) -> str:
        return f"oob{self.tag}n{self.nodes.index(node)}"

    def host_end(self, node: str) -> str:
        return f"obv{self.tag}x{self.nodes.index(node)}"

    def command(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``node``'s network namespace (``nsenter`` execs it: the pid is argv's). Not
        ``ip netns exec``, which also mounts a sysfs of its own, without the cgroup file system that
        slurmd and the slow-node freezer need."""
        return ["nsenter", f"--net=/run/netns/{self.namespace(node)}", *argv]

    def env(self) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": GLOO_INTERFACE}

    def cut(self, node: str) -> None:
        _ip("link", "set", self.host_end(node), "down")

    def heal(self, node: str) -> None:
        _ip("link", "set", self.host_end(node), "up")

    def _both_ends(self, node: str) -> list[tuple[list[str], str]]:
        """(command prefix, device) of each end of ``node``'s link: the bridge's, then the namespace's."""
        return [([], self.host_end(node)), (self.command(node, []), GLOO_INTERFACE)]

    def throttle(self, node: str, kbit: int) -> None:
        """A slow link: both directions of ``node``'s link through a token bucket of ``kbit`` kbit/s, so every
        packet queues behind the ones before it. (This kernel has no ``sch_netem``, so no fixed delay; a
        bucket's queueing is the slow link that a shared or congested uplink is.) The bucket holds 10 ms of the
        rate, 16 kB at least: refilled once a timer tick, a smaller one cannot carry a fast rate (16 kB at
        1 Gbit/s carried 0.29 Gbit/s)."""
        burst = max(16_000, kbit * 1000 // 8 // 100)  # bytes
        for where, device in self._both_ends(node):
            subprocess.run(
                [
                    *where,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    device,
                    "root",
                    "tbf",
                    "rate",
                    f"{kbit}kbit",
                    "burst",
                    str(burst),
                    "latency",
                    "2s",
                ],
                check=True,
                capture_output=True,
                timeout=20,
            )

    def throttled_packets(self, node: str) -> int:
        """Times the buckets of ``throttle`` held packets back (tc's ``overlimits``): > 0, the link was slow."""
        total = 0
        for where, device in self._both_ends(node):
            shown = subprocess.run(
                [*where, "tc", "-s", "qdisc", "show", "dev", device],
                check=True,
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            total += sum(int(n) for n in re.findall(r"overlimits (\d+)", shown))
        return total

    def unthrottle(self, node: str) -> None:
        for where, device in self._both_ends(node):
            subprocess.run([*where, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True, timeout=20)

    def close(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "netns":
                # Nothing outlives its host: whatever still runs there (a cut-off node's agent, a slurmstepd
                # its slurmd left behind) is killed before the namespace goes.
                for pid in _ip("netns", "pids", name, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)  # gone already when its peer's namespace went
        self.made.clear()
