"""The launch files users copy (examples/launch/) run a real job.

ssh is not on this machine: the script runs unchanged with ``ssh`` replaced by
a local stand-in (the fake part; the master, the agents, the token handling and
the exit codes are the script's own). The SLURM files run on a real SLURM in
``tests/e2e/test_slurm.py``. The Kubernetes manifest is checked against the CLI it
drives: every command parses, the ports and the token source agree.
"""

from __future__ import annotations

import os
import subprocess

import psutil
import pytest
import yaml
from harness import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LAUNCH = ROOT / "examples" / "launch"
TINY = str(ROOT / "configs" / "tiny_mm.yaml")

FAKE_SSH = """#!/usr/bin/env bash
# ssh HOST COMMAND: run COMMAND here (stdin passes through, as ssh's does)
shift
exec bash -c "$*"
"""


def _shims(tmp_path, **scripts: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:  # everything the script started, even on a timeout
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ssh_script_runs_a_job_on_its_hosts(tmp_path):
    env = _shims(tmp_path, ssh=FAKE_SSH)
    run = tmp_path / "run"
    env.update(RUN=str(run), PORT=str(_free_port()), MASTER_HOST="127.0.0.1", EXTRA="--steps 3")
    proc = _run([str(LAUNCH / "ssh.sh"), TINY, "hostA", "hostB"], env, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "done: 3 steps" in proc.stdout
    events = (run / "events.jsonl").read_text()
    for host in ("hostA", "hostB"):  # named after their hosts, each given the token over stdin
        assert f'"event":"registered","node":"{host}"' in events and (run / f"agent-{host}.log").exists()
    assert oct((run / "token").stat().st_mode & 0o777) == "0o600"


def test_a_script_given_a_bad_config_exits_2_without_waiting_for_agents(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "tiny_mm.yaml").read_text().replace("global_batch: 16", "global_batch: -1"))
    env = _shims(tmp_path, ssh=FAKE_SSH)
    env.update(RUN=str(tmp_path / "run"), PORT=str(_free_port()))
    proc = _run([str(LAUNCH / "ssh.sh"), str(bad), "hostA", "hostB"], env, timeout=120)
    assert proc.returncode == 2 and "training.global_batch" in proc.stdout


def test_kubernetes_manifest_is_valid_for_the_api_server_and_its_commands_volumes_and_failures_agree():
    import kubernetes_validate

    from oobleck_mm.cli import build_parser

    docs = list(yaml.safe_load_all((LAUNCH / "kubernetes.yaml").read_text()))
    # Each object against the Kubernetes API's own schema (strict: a misspelt field is an error).
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    by_kind = lambda kind: [d for d in docs if d["kind"] == kind]  # noqa: E731
    [service] = by_kind("Service")
    master_job, agents_job = (
        next(d for d in by_kind("Job") if d["metadata"]["name"] == n) for n in ("oobleck-master", "oobleck-agents")
    )
    master_pod, agent_pod = master_job["spec"]["template"]["spec"], agents_job["spec"]["template"]["spec"]
    [master], [agent] = master_pod["containers"], agent_pod["containers"]
    assert master["command"][0] == agent["command"][0] == "oobleck-launch"
    assert all(isinstance(c, str) for c in master["command"] + agent["command"])  # no YAML numbers
    m = build_parser().parse_args(master["command"][1:])
    a = build_parser().parse_args([c.replace("$(POD_NAME)", "pod-x") for c in agent["command"][1:]])
    # The Service selects the master pod and carries the one port the master listens on (gRPC: the
    # control plane and the workers' rendezvous store).
    assert service["spec"]["selector"].items() <= master_job["spec"]["template"]["metadata"]["labels"].items()
    assert {p["port"] for p in service["spec"]["ports"]} == {m.port}
    assert a.master == f"{service['metadata']['name']}:{m.port}" and a.node == "pod-x"
    # The master reads the token the agents get, from the same Secret.
    secret = next(v["secret"]["secretName"] for v in master_pod["volumes"] if "secret" in v)
    mount = next(v["mountPath"] for v in master["volumeMounts"] if v["name"] == "token")
    assert m.token_file.startswith(mount + "/")
    token_env = next(e for e in agent["env"] if e["name"] == "OOBLECK_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"] == {"name": secret, "key": os.path.basename(m.token_file)}
    # The run dir is on one ReadWriteMany claim that the master and every agent mount at the same path (the
    # workers write checkpoint layers under the master's run dir); the data claim is mounted by both too.
    claims = {d["metadata"]["name"]: d for d in by_kind("PersistentVolumeClaim")}

    def mounts(pod, container):
        volumes = {v["name"]: v for v in pod["volumes"]}
        return {
            m_["mountPath"]: volumes[m_["name"]].get("persistentVolumeClaim", {}).get("claimName")
            for m_ in container["volumeMounts"]
        }

    run_mount = next(path for path in mounts(master_pod, master) if m.run_dir.startswith(path + "/"))
    run_claim = mounts(master_pod, master)[run_mount]
    assert run_claim and claims[run_claim]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert mounts(agent_pod, agent)[run_mount] == run_claim
    data = {path: claim for path, claim in mounts(master_pod, master).items() if claim and claim != run_claim}
    assert data and all(mounts(agent_pod, agent).get(path) == claim for path, claim in data.items())
    # Agents: requests for what they use, spot tolerated, as many pods as the master waits for; a pod that
    # leaves on its notice exits with a code the failure policy ignores, so it is replaced and never
    # counted as a completion; disruptions are ignored too.
    assert {"cpu", "memory", "nvidia.com/gpu"} <= agent["resources"]["requests"].keys()
    assert any("spot" in t["key"] or t.get("value") == "spot" for t in agent_pod["tolerations"])
    assert agents_job["spec"]["parallelism"] == agents_job["spec"]["completions"] == m.nodes[0]
    assert agent_pod["restartPolicy"] == master_pod["restartPolicy"] == "Never"
    rules = agents_job["spec"]["podFailurePolicy"]["rules"]
    assert {
        "action": "Ignore",
        "onExitCodes": {"containerName": agent["name"], "operator": "In", "values": [a.left_exit_code]},
    } in rules and a.left_exit_code > 3
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    # The master: retried when killed (the same command re-adopts the workers from the run dir's journal),
    # never when it exited by itself.
    master_rules = master_job["spec"]["podFailurePolicy"]["rules"]
    assert master_job["spec"]["backoffLimit"] >= 1
    assert {
        "action": "FailJob",
        "onExitCodes": {"containerName": master["name"], "operator": "In", "values": [1, 2, 3]},
    } in master_rules
