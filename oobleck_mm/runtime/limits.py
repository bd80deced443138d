"""What the runtime can run, checked before any process starts (``oobleck-launch master`` and ``local``).

``plan`` plans what the dissertation's setups describe (stages of up to 8 GPUs);
the engine trains stages of several GPUs with FSDP2 (docs/runtime.md) but not yet
with every feature. A job the workers would refuse after minutes of start-up is
refused here instead, naming the field and what to set.
"""

from __future__ import annotations

from oobleck_mm.errors import UserError

# torch is imported where a check needs it, not here: the master runs ``check_runnable`` before it
# listens, and importing torch (~1 s, more on a busy host) delayed every start and every restart of
# a master that never needs it (its workers' GPUs are counted on their own machines).


LOCAL_WORKER_BYTES = 300 * 2**20
"""Resident memory of one local worker process beyond what it shares with its template (torch, its stage of a
tiny or shrunk model, gloo's buffers): 250-420 MB peak RSS measured, most of it shared pages."""
LOCAL_AGENT_BYTES = 120 * 2**20
"""One local agent process (gRPC, psutil; no torch)."""


def check_runnable(job, workers_here: bool) -> None:
    """``workers_here``: the workers run on this machine (``local``), so its GPUs can be counted."""
    c = job.cluster
    if c.emulate is not None:  # the truth file is read by every worker: a bad one stops the job before it starts
        from oobleck_mm.emulation.truth import load_truth

        load_truth(c.emulate_profile)
    if workers_here and c.device == "cpu":
        check_host_memory(job)
    check_templates(job)
    if min(c.max_gpus_per_stage, c.gpus_per_node) > 1:
        check_wide_stages(job)
    if workers_here and c.device == "cuda":
        import torch

        needed = c.gpus_per_node
        if torch.cuda.device_count() < needed:
            raise UserError(
                f"cluster.device: 'cuda' with cluster.gpus_per_node {needed}, but this machine's torch sees "
                f"{torch.cuda.device_count()} GPU(s); set cluster.device: cpu to run the job on the cpu"
            )


def check_templates(job) -> None:
    """The pipeline templates for ``cluster.nodes`` exist (enough nodes for f + 1 replicas, enough consecutive
    node counts to cover every size), said before anything starts: the master would find out only once every
    agent registered and its workers built their layers (``llava_tiny`` on 4 nodes: 17 s of start-up, then
    exit 2). Only with the analytical profile: a measured one times the job's layers, which is the master's
    work at start (seconds of it), and only once the data's shape is known (a ``llava_json`` file's is
    measured by the master, which then checks its data first, naming a bad sample before any plan)."""
    from oobleck_mm.config.validation import shape_measured

    if job.planning.profile != "analytical" or not shape_measured(job.data):
        return  # a data file's token counts are measured by the master before it plans (data.check)
    from oobleck_mm.planning.stage_mapping import build_templates, planning_cluster
    from oobleck_mm.profiling.load import load_profile

    try:
        profile = load_profile(job)
        build_templates(profile, planning_cluster(job, profile), job.cluster.nodes, job.fault_tolerance.f)
    except UserError as exc:
        raise UserError(f"no pipeline templates for {job.cluster.nodes} nodes (cluster.nodes): {exc}") from None


def check_wide_stages(job) -> None:
    """What a stage of several GPUs (``cluster.max_gpus_per_stage`` above 1) cannot run with."""
    c, t = job.cluster, job.training
    keep = f"or set cluster.max_gpus_per_stage: 1 (now {c.max_gpus_per_stage})"
    widest = max(d for d in (1, 2, 4, 8) if d <= min(c.max_gpus_per_stage, c.gpus_per_node))  # the planner's options
    if widest > t.microbatch_size:
        raise UserError(
            f"cluster.max_gpus_per_stage: {c.max_gpus_per_stage} (stages of up to {widest} GPUs on nodes of "
            f"{c.gpus_per_node}), but training.microbatch_size is {t.microbatch_size}: a stage of several GPUs splits "
            f"every microbatch's samples over them (FSDP2), so a microbatch needs at least as many samples; raise "
            f"training.microbatch_size to {widest} {keep}"
        )
    scalars = scalar_parameters(job)
    if scalars:
        layer, name = scalars[0]
        raise UserError(
            f"layer {layer!r} has a scalar parameter {name!r}: a stage of several GPUs shards every parameter's rows "
            f"(FSDP2's fully_shard refuses 0-dimensional ones), so this model cannot be split over GPUs as it is; "
            f"make it a 1-D tensor of one element in the layer's code {keep}"
        )


def scalar_parameters(job) -> list[tuple[str, str]]:
    """(layer, parameter) of every 0-dimensional parameter of the job's model, read on the ``meta`` device."""
    import torch

    from oobleck_mm.model.layers import build_layer, model_layer_specs

    specs = model_layer_specs(job)
    out = []
    for index, spec in enumerate(specs):
        with torch.device("meta"):
            layer = build_layer(job, index, specs, initialize=False, weights=False)
        out += [(spec.name, name) for name, p in layer.named_parameters() if p.dim() == 0]
    return out


def check_host_memory(job, available: int | None = None) -> None:
    """A local run's processes must fit this machine's memory (``available`` bytes, default: what the kernel
    says is available): said before any starts, with the node count that fits."""
    import psutil

    c = job.cluster
    available = psutil.virtual_memory().available if available is None else available
    per_node = LOCAL_AGENT_BYTES + c.gpus_per_node * LOCAL_WORKER_BYTES
    nodes = c.max_nodes or c.nodes
    if nodes * per_node > available:
        fits = max(0, available // per_node)
        raise UserError(
            f"cluster.nodes: {nodes} local nodes of {c.gpus_per_node} CPU worker(s) need about "
            f"{nodes * per_node / 2**30:.1f} GiB ({per_node / 2**20:.0f} MiB a node), and this machine has "
            f"{available / 2**30:.1f} GiB available; run at most {fits} nodes here (--nodes {fits})"
        )
