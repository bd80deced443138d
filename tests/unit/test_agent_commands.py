"""The agent's side of its workers without processes: stale work folders, torchrun's variables, which
commands interrupt an iteration, and the command reader's hand-over of groups formed in the background.
(Real worker processes, stopped, killed and orphaned: ``tests/integration/test_agent_workers.py``.)"""

from __future__ import annotations

import os

from oobleck_mm.protocol import oobleck_pb2 as pb


def test_an_agent_removes_the_folders_of_agents_that_are_gone(tmp_path):
    from oobleck_mm.agent.workdir import remove_stale_work_dirs

    for name in (
        "oobleck-agent-node1-111-abc",
        "oobleck-agent-my-node-222-def",
        "oobleck-agent-node2-333-ghi",
        "oobleck-agent-odd",
        "other-111-xyz",
    ):
        (tmp_path / name).mkdir()
    removed = remove_stale_work_dirs(str(tmp_path), pid_alive=lambda pid: pid == 333)
    assert sorted(os.path.basename(p) for p in removed) == [
        "oobleck-agent-my-node-222-def",
        "oobleck-agent-node1-111-abc",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "oobleck-agent-node2-333-ghi",
        "oobleck-agent-odd",
        "other-111-xyz",
    ]


def test_torchrun_environment_names_the_generation_a_worker_runs_in():
    from oobleck_mm.runtime.group import TORCHRUN_VARIABLES, torchrun_environment

    env = torchrun_environment(5, 8, 1, "nodeB", ["nodeA"] * 4 + ["nodeB"] * 3 + ["nodeC"], "10.0.0.1", 29500)
    assert tuple(env) == TORCHRUN_VARIABLES
    assert env == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }


def test_only_commands_that_mean_a_peer_is_gone_interrupt_the_iteration_in_flight():
    """A checkpoint with every rank alive (a stop on request, nodes leaving on notice) and MasterLost wait for
    the boundary every rank reaches together; interrupting would leave ranks on either side of the update."""
    from oobleck_mm.runtime.worker_machine import drops_peers as _drops_peers

    assert _drops_peers(pb.WorkerCommand(checkpoint=pb.Checkpoint(dir="d", generation=2, surviving_ranks=[0])))
    assert not _drops_peers(pb.WorkerCommand(checkpoint=pb.Checkpoint(dir="d", generation=2, at_boundary=True)))
    assert not _drops_peers(pb.WorkerCommand(master_lost=pb.MasterLost(reason="gone")))
    assert _drops_peers(pb.WorkerCommand(shutdown=pb.Shutdown(reason="done")))


def test_a_lost_node_of_two_gpu_stages_interrupts_the_iteration_and_a_join_does_not():
    """Four pipelines of one 2-GPU stage each (8 ranks); a node lost leaves 6 of them: the survivors must give
    up their collectives at once (counting stages, 4, read 6 survivors as more than the old world)."""
    from oobleck_mm.planning.layout import ExecutionPlan
    from oobleck_mm.protocol.convert import plan_to_proto
    from oobleck_mm.runtime.worker_machine import drops_peers as _drops_peers

    for cp in (True, False):
        old = plan_to_proto(ExecutionPlan.even(6, [1] * 4, [2] * 4, 2, widths=[[2]] * 4, context_parallel=[cp] * 4))

        def assignment(previous_ranks, world):
            return pb.WorkerCommand(
                assignment=pb.Assignment(
                    generation=2,
                    previous_generation=1,
                    previous_plan=old,
                    previous_ranks=previous_ranks,
                    world_size=world,
                )
            )

        assert _drops_peers(assignment([0, 1, 2, 3, 4, 5, -1, -1], 6))  # a node lost
        assert not _drops_peers(assignment(list(range(8)), 10))  # a node joined: the iteration finishes


def test_a_plan_whose_groups_form_in_the_background_is_not_switched_to_before_they_are_ready():
    """The step's "I hold a command" waits for the next generation's groups (the old one trains on), unless
    another command came after it; what was prepared is handed over once; a failing preparation only costs
    the optimisation, never the command."""
    import multiprocessing as mp
    import threading
    import time

    from oobleck_mm.protocol.pipe import send_command
    from oobleck_mm.runtime.commands import CommandReader

    class Forming:  # stands for runtime.group.PreparedGroup, formed by peers in the real runs
        def __init__(self):
            self.done = threading.Event()

        def ready(self):
            return self.done.is_set()

    forming = Forming()

    def on_arrival(command):
        if command.assignment.generation == 3:
            raise RuntimeError("no plan to prepare")
        return forming if command.assignment.at_boundary else None

    ours, agents = mp.Pipe()
    reader = CommandReader(ours, on_arrival=on_arrival)

    def arrive(command, expect_queued: int):
        send_command(agents, command)
        deadline = time.monotonic() + 10
        while reader.queue.qsize() < expect_queued and time.monotonic() < deadline:
            time.sleep(0.005)

    join = pb.WorkerCommand(assignment=pb.Assignment(generation=2, previous_generation=1, at_boundary=True))
    arrive(join, 1)
    assert not reader.waiting()  # its groups are still forming: the old generation steps on
    forming.done.set()
    assert reader.waiting()
    taken = reader.get()
    assert reader.prepared_for(taken) is forming and reader.prepared_for(taken) is None
    forming.done.clear()
    arrive(pb.WorkerCommand(assignment=pb.Assignment(generation=4, previous_generation=3, at_boundary=True)), 1)
    assert not reader.waiting()
    arrive(pb.WorkerCommand(shutdown=pb.Shutdown(reason="done")), 2)
    assert reader.waiting()  # a later command is not held back by the forming groups
    reader.get(), reader.get()
    arrive(pb.WorkerCommand(assignment=pb.Assignment(generation=3, previous_generation=2, at_boundary=True)), 1)
    assert reader.waiting() and reader.prepared_for(reader.get()) is None  # on_arrival raised: a plain switch
    agents.close()
