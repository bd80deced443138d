"""Job configuration: every mistake names its field; units parse; defaults fill; round trips."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import yaml

from oobleck_mm.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    config_from_dict,
    config_text,
    dump_config,
    load_config,
    parse_config_text,
)
from oobleck_mm.config.devices import DEVICES
from oobleck_mm.planning.costs import ClusterSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(
    glob.glob(os.path.join(ROOT, "configs", "*.yaml")) + glob.glob(os.path.join(ROOT, "configs", "paper", "*.yaml"))
)
TINY = os.path.join(ROOT, "configs", "tiny_mm.yaml")
DELETE = object()


def tiny_dict() -> dict:
    with open(TINY, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def with_value(d: dict, dotted: str, value) -> dict:
    """A deep copy of ``d`` with ``dotted`` set to ``value`` (or removed for DELETE)."""
    d = copy.deepcopy(d)
    *parents, last = dotted.split(".")
    node = d
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return d


MINIMAL = {"model": {"name": "m", "llm": {"num_layers": 2, "hidden": 16, "num_heads": 2, "vocab_size": 32}}}


def test_every_shipped_config_loads_and_round_trips():
    assert len(CONFIGS) >= 10
    tiny_llava = os.path.join(ROOT, "runs", "models", "tiny_llava")  # configs/llava_tiny.yaml's model
    if not os.path.isdir(tiny_llava):  # what its header says to run first
        from oobleck_mm.model.tiny_hf import make_tiny_model

        make_tiny_model(tiny_llava)
    for path in CONFIGS:
        job = load_config(path)
        assert config_from_dict(job.to_dict()) == job, path
        # to_dict must be plain YAML (no timedelta or tuple objects).
        assert config_from_dict(yaml.safe_load(yaml.safe_dump(job.to_dict()))) == job, path
        # ... and what the master ships to agents, workers and its planner (JSON) reads back as the same job.
        text = config_text(job)
        assert text.startswith("{") and config_from_dict(parse_config_text(text)) == job, path


def test_the_job_shipped_as_json_reads_back_from_text_and_file_fast_and_yaml_still_reads(tmp_path):
    """A config with 600,000 excluded samples cost 4.5 s to dump and 5.1 s to read as YAML (libyaml), in the
    master, each agent, each worker and each plan; as JSON it reads back the same job in a fraction of that
    (100,000 here: the same ratio, a sixth of the test's CPU)."""
    import time

    raw = copy.deepcopy(MINIMAL)
    raw["data"] = {"kind": "synthetic", "num_samples": 200_000, "excluded_samples": list(range(0, 200_000, 2))}
    raw["training"] = {"optimizer": {"type": "AdamW", "params": {"lr": 1.0e-5}}}  # 1e-05: a string to YAML 1.1
    job = config_from_dict(raw)
    text = config_text(job)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    started = time.process_time()
    from_text, from_file = config_from_dict(parse_config_text(text)), load_config(path)
    json_s = time.process_time() - started
    assert from_text == job and from_file == job and job.training.optimizer.params.lr == 1.0e-5
    started = time.process_time()
    assert config_from_dict(parse_config_text(dump_config(job))) == job  # the run dir's YAML, read as before
    yaml_s = time.process_time() - started
    assert json_s < yaml_s / 4, (json_s, yaml_s)  # measured ~0.3 s against ~9 s
    # A YAML flow mapping is not JSON: read as YAML.
    assert parse_config_text("{model: {name: m}}") == {"model": {"name": "m"}}


def test_shipped_paper_configs_match_their_setups():
    gpt = load_config(os.path.join(ROOT, "configs", "gpt3_2.7b.yaml"))
    assert (gpt.training.global_batch, gpt.training.microbatch_size, gpt.data.max_seq_len) == (1024, 2, 2048)
    assert (gpt.cluster.nodes, gpt.cluster.gpus_per_node, gpt.cluster.device, gpt.cluster.accelerator) == (
        30,
        1,
        "cuda",
        "a40",
    )
    assert gpt.cluster.device_memory == 40 * 10**9 and gpt.fault_tolerance.f == 1
    orch = load_config(os.path.join(ROOT, "configs", "mllm_84b.yaml"))
    assert (orch.cluster.accelerator, orch.cluster.gpus_per_node, orch.model.llm.num_layers) == ("h100", 8, 80)
    corn = load_config(os.path.join(ROOT, "configs", "cornstarch_mllm_sss.yaml"))
    assert set(corn.model.frozen) == {"vision", "audio", "llm"}
    assert (corn.training.global_batch, corn.training.microbatch_size, corn.cluster.nodes) == (48, 4, 6)


@pytest.mark.parametrize(
    "name, layers, hidden, seq, batch, microbatch",
    [
        ("bert_large", 24, 1024, 512, 8192, 32),
        ("gpt2", 24, 1024, 1024, 8192, 32),
        ("gpt3_medium", 24, 1024, 2048, 8192, 16),
        ("gpt3_2.7b", 32, 2560, 2048, 1024, 2),
        ("gpt3_6.7b", 32, 4096, 2048, 1024, 2),
    ],
)
def test_the_simulators_paper_configs_are_table_2_1(name, layers, hidden, seq, batch, microbatch):
    job = load_config(os.path.join(ROOT, "configs", "paper", f"{name}.yaml"))
    assert (job.model.llm.num_layers, job.model.llm.hidden, job.data.max_seq_len) == (layers, hidden, seq)
    assert (job.training.global_batch, job.training.microbatch_size) == (batch, microbatch)
    assert job.training.dtype == "float32" and job.training.activation_checkpointing  # TF32, as §2.7.1 ran
    assert (job.cluster.nodes, job.cluster.accelerator, job.cluster.compute_efficiency) == (30, "a40", None)


def test_tiny_config_is_the_described_model():
    job = load_config(TINY)
    assert job.model.vision.num_layers == 2 and job.model.vision.hidden == 32
    assert job.model.llm.num_layers == 4 and job.model.llm.hidden == 64 and job.model.llm.vocab_size == 256
    assert (job.data.image_size, job.model.vision.patch_size) == (32, 8)
    assert (job.training.global_batch, job.training.microbatch_size, job.fault_tolerance.f) == (16, 2, 1)
    assert (job.cluster.nodes, job.cluster.gpus_per_node, job.cluster.device) == (4, 1, "cpu")
    audio = load_config(os.path.join(ROOT, "configs", "tiny_mm_audio.yaml"))
    assert audio.model.audio.num_layers == 2


def test_defaults_fill_a_minimal_config():
    job = config_from_dict(MINIMAL)
    assert job.model.llm.ffn_hidden == 64 and job.model.llm.num_kv_heads == 2
    assert job.model.vision is None and job.model.audio is None and job.model.frozen == ()
    assert job.data.kind == "synthetic" and job.training.optimizer.type == "AdamW"
    assert job.training.scheduler is None and job.training.optimizer.params.betas == (0.9, 0.999)
    assert job.training.flash_attention and job.training.activation_checkpointing == "auto"
    assert job.cluster.device_memory == DEVICES["cpu"].memory_bytes
    assert job.cluster.resolved_backend == "gloo"
    assert job.fault_tolerance.heartbeat_interval < job.fault_tolerance.heartbeat_timeout
    assert not job.planning.profile_cache_dir.startswith("~")
    # Empty sections (YAML `data:` with nothing under it) mean "all defaults".
    assert config_from_dict({**MINIMAL, "data": None, "cluster": {}}) == job


def test_device_memory_defaults_to_the_accelerator_kind():
    job = config_from_dict(with_value(MINIMAL, "cluster", {"device": "cuda", "accelerator": "h100", "nodes": 2}))
    assert job.cluster.device_memory == DEVICES["h100"].memory_bytes
    assert job.cluster.resolved_backend == "nccl"
    planned = config_from_dict(with_value(MINIMAL, "cluster", {"accelerator": "a40", "nodes": 2}))  # costs of an
    assert (planned.cluster.device, planned.cluster.resolved_backend) == ("cpu", "gloo")  # A40, run on the cpu


def test_an_old_device_kind_says_how_to_migrate():
    with pytest.raises(
        ConfigError,
        match=r"cluster.device: 'h100' is an accelerator kind.*`device: cuda` and "
        r"`accelerator: h100`",
    ):
        config_from_dict(with_value(MINIMAL, "cluster", {"device": "h100"}))
    with pytest.raises(ConfigError, match=r"cluster.accelerator: required with cluster.device 'cuda'.*'a40'"):
        config_from_dict(with_value(MINIMAL, "cluster", {"device": "cuda"}))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("3s", 3.0),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("250us", 250e-6),
        (2, 2.0),
        (0.25, 0.25),
        ("1.5s", 1.5),
        ("4", 4.0),
    ],
)
def test_durations_parse(text, seconds):
    d = with_value(MINIMAL, "fault_tolerance", {"heartbeat_interval": text, "heartbeat_timeout": 10_000})
    job = config_from_dict(d)
    assert job.fault_tolerance.heartbeat_interval.total_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("40GiB", 40 * 2**30),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 1.5e12),
        (123456, 123456),
        ("48 GB", 48 * 10**9),
        ("1024", 1024),
    ],
)
def test_sizes_parse(text, num_bytes):
    job = config_from_dict(with_value(MINIMAL, "cluster", {"device_memory": text}))
    assert job.cluster.device_memory == int(num_bytes)


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("100Gbps", 12.5e9),
        ("200Gb/s", 25e9),
        ("25GB/s", 25e9),
        ("25GBps", 25e9),
        ("1GiB/s", 2**30),
        (1e9, 1e9),
        ("400Mbps", 50e6),
    ],
)
def test_bandwidths_parse(text, rate):
    job = config_from_dict(with_value(MINIMAL, "cluster", {"inter_node_bandwidth": text}))
    assert job.cluster.inter_node_bandwidth == pytest.approx(rate)
    assert ClusterSpec.from_config(job.cluster).inter_node_bandwidth == pytest.approx(rate)


def test_cluster_spec_carries_the_cluster_section():
    job = load_config(os.path.join(ROOT, "configs", "mllm_10b.yaml"))
    spec = ClusterSpec.from_config(job.cluster)
    assert spec.gpus_per_node == 8 and spec.max_gpus_per_stage == 8
    assert spec.device_memory_bytes == 80 * 10**9
    assert spec.intra_node_bandwidth == 450e9 and spec.inter_node_bandwidth == 3200e9 / 8
    assert spec.stage_gpu_options == (1, 2, 4, 8)


def test_yaml_float_without_dot_is_accepted_for_float_fields():
    # YAML 1.1 reads 1e-4 as a string; a learning rate written that way must still work.
    job = config_from_dict(with_value(MINIMAL, "training", {"optimizer": {"params": {"lr": "1e-4"}}}))
    assert job.training.optimizer.params.lr == 1e-4


def test_scheduler_params_follow_deepspeed_and_total_defaults_to_steps():
    d = with_value(
        MINIMAL, "training", {"steps": 50, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}}
    )
    job = config_from_dict(d)
    assert job.training.scheduler.params == {"warmup_num_steps": 5}
    assert job.training.scheduler.total_steps(job.training.steps) == 50
    # --steps (and --set training.steps) come after the file: the schedule follows them (issue 30: a
    # 60-step run of a 30-step file kept its lr at the floor from step 31).
    longer = apply_overrides(job, steps=120)
    assert longer.training.scheduler.total_steps(longer.training.steps) == 120
    from oobleck_mm.runtime.optim import lr_at

    assert lr_at(longer.training, 100) > lr_at(longer.training, 119) > lr_at(longer.training, 120)
    cosine = with_value(
        d, "training.scheduler", {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "cos_min_ratio": 0.1}}
    )
    assert config_from_dict(cosine).training.scheduler.params["cos_min_ratio"] == 0.1


# Each bad config: (dotted field to set, value, what the message must start with, a fragment it must contain).
BAD = [
    ("cluster.gpu_per_node", 2, "unknown key 'cluster.gpu_per_node'", "did you mean 'gpus_per_node'"),
    ("model.vision.hiden", 2, "unknown key 'model.vision.hiden'", "valid keys: num_layers, hidden"),
    ("training.optimizer.params.momentum", 0.9, "unknown key 'training.optimizer.params.momentum'", "lr, betas"),
    ("training.global_batch", "abc", "training.global_batch:", "expected an integer, got 'abc' (str)"),
    ("training.global_batch", True, "training.global_batch:", "expected an integer, got True (bool)"),
    ("training.microbatch_size", 0, "training.microbatch_size:", "must be >= 1, got 0"),
    (
        "training.global_batch",
        15,
        "training.global_batch (15)",
        "microbatch_size (2); nearest valid global batches: 14 or 16",
    ),
    ("planning.replan_gain", -0.1, "planning.replan_gain:", "must be >= 0.0, got -0.1"),
    ("training.dtype", "fp8", "training.dtype:", "'float32', 'float64', 'bfloat16', 'float16'"),
    ("training.gradient_clipping", -1, "training.gradient_clipping:", "must be >= 0.0, got -1.0"),
    ("training.activation_checkpointing", 1, "training.activation_checkpointing:", "expected auto, true or false"),
    ("training.activation_checkpointing", "sometimes", "training.activation_checkpointing:", "got 'sometimes'"),
    ("training.optimizer.type", "SGD", "training.optimizer.type:", "'AdamW', 'Adam'"),
    ("training.optimizer.params.betas", [0.9], "training.optimizer.params.betas:", "two numbers"),
    ("training.optimizer.params.betas", [0.9, 1.0], "training.optimizer.params.betas[1]:", "must be < 1.0"),
    ("training.optimizer.params.lr", 0, "training.optimizer.params.lr:", "must be > 0"),
    ("training.scheduler", {"type": "Noam"}, "training.scheduler.type:", "'WarmupLR', 'WarmupDecayLR'"),
    ("training.scheduler", {"type": "OneCycle"}, "training.scheduler.params.cycle_min_lr:", "required by OneCycle"),
    (
        "training.scheduler",
        {"type": "WarmupLR", "params": {"total_num_steps": 5}},
        "unknown key 'training.scheduler.params.total_num_steps'",
        "valid keys for WarmupLR",
    ),
    (
        "training.scheduler",
        {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1000}},
        "training.scheduler.params.total_num_steps (20, training.steps: its default)",
        "warmup_num_steps (1000)",
    ),
    (
        "training.scheduler",
        {"type": "WarmupLR", "params": {"warmup_type": "cubic"}},
        "training.scheduler.params.warmup_type:",
        "'log', 'linear'",
    ),
    (
        "training.scheduler",
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1}},
        "training.scheduler.params.warmup_min_lr (0.1)",
        "warmup peak lr (0.001)",
    ),
    ("fault_tolerance.f", 4, "fault_tolerance.f (4)", "needs at least 5 nodes, cluster.nodes is 4"),
    ("fault_tolerance.f", -1, "fault_tolerance.f:", "must be >= 0"),
    (
        "fault_tolerance.heartbeat_interval",
        "5s",
        "fault_tolerance.heartbeat_interval (5.0s)",
        "shorter than fault_tolerance.heartbeat_timeout (2.0s)",
    ),
    ("fault_tolerance.heartbeat_timeout", "3 parsecs", "fault_tolerance.heartbeat_timeout:", "'500ms'"),
    ("fault_tolerance.heartbeat_timeout", "0s", "fault_tolerance.heartbeat_timeout:", "positive duration"),
    ("fault_tolerance.recovery", "pray", "fault_tolerance.recovery:", "'live', 'restart'"),
    ("cluster.nodes", 0, "cluster.nodes:", "must be >= 1, got 0"),
    ("cluster.device", "tpu", "cluster.device:", "'cpu', 'cuda'"),
    ("cluster.accelerator", "tpu", "cluster.accelerator:", "'cpu', 'a40'"),
    ("cluster.device_memory", "40 bananas", "cluster.device_memory:", "'40GiB'"),
    ("cluster.max_gpus_per_stage", 3, "cluster.max_gpus_per_stage:", "1, 2, 4 or 8, got 3"),
    ("cluster.max_nodes", 1, "cluster.max_nodes (1)", "must be >= cluster.nodes (4)"),
    ("cluster.compute_efficiency", 1.5, "cluster.compute_efficiency:", "(0, 1], got 1.5"),
    ("cluster.compute_efficiency", 0, "cluster.compute_efficiency:", "(0, 1], got 0"),
    ("cluster.max_gpus_per_stage", 2, "cluster.max_gpus_per_stage (2)", "exceeds cluster.gpus_per_node (1)"),
    ("cluster.inter_node_bandwidth", "fast", "cluster.inter_node_bandwidth:", "'100Gbps'"),
    ("cluster.backend", "nccl", "cluster.backend:", "needs a GPU device"),
    ("planning.solver", "cplex", "planning.solver:", "'highs', 'mindtpy'"),
    ("planning.profile", "guess", "planning.profile:", "'analytical', 'measured'"),
    ("planning.microbatches_hint", 9, "planning.microbatches_hint (9)", "(8)"),
    ("model.name", DELETE, "model.name:", "required"),
    ("model.llm.num_heads", 5, "model.llm.hidden (64)", "divisible by model.llm.num_heads (5)"),
    ("model.llm.num_kv_heads", 3, "model.llm.num_heads (4)", "divisible by model.llm.num_kv_heads (3)"),
    ("model.llm.gated_ffn", "yes", "model.llm.gated_ffn:", "expected true or false"),
    ("model.projector.num_layers", 3, "model.projector.num_layers:", "1 or 2, got 3"),
    ("model.frozen", ["audio"], "model.frozen:", "'audio' names no layer"),
    ("model.frozen", ["llm.block9"], "model.frozen:", "'llm.block9' names no layer"),
    ("model.frozen", "llm", "model.frozen:", "expected a list"),
    ("data.image_size", 30, "data.image_size (30)", "multiple of model.vision.patch_size (8)"),
    ("data.mean_images_per_sample", 0, "data.mean_images_per_sample (0.0)", "model.vision is set"),
    ("data.mean_audio_seconds", 2, "data.mean_audio_seconds (2.0)", "model.audio is not set"),
    ("data.max_seq_len", 20, "data.max_seq_len (20)", "(25 = 16 text + 9 image + 0 audio)"),
    ("data.kind", "llava_json", "data.path:", "required when data.kind is 'llava_json'"),
    ("data.path", "/nonexistent/llava.json", "data.path:", "does not exist"),
    ("data.mean_text_tokens", "many", "data.mean_text_tokens:", "expected a finite number, got 'many' (str)"),
    ("model", DELETE, "model:", "required"),
    ("training", [1, 2], "training:", "expected a mapping"),
]


@pytest.mark.parametrize(
    ("field", "value", "prefix", "fragment"),
    BAD,
    ids=[f"{b[0]}=<deleted>" if b[1] is DELETE else f"{b[0]}={b[1]!r}" for b in BAD],
)
def test_each_bad_field_gets_its_own_message(field, value, prefix, fragment):
    with pytest.raises(ConfigError) as info:
        config_from_dict(with_value(tiny_dict(), field, value))
    message = str(info.value)
    assert message.startswith(prefix), message
    assert fragment in message, message
    assert "\n" not in message


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_root_must_be_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        config_from_dict(["model"])


def test_missing_file_and_bad_yaml_give_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert "does not exist" in str(info.value) and "\n" not in str(info.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: [unclosed\n  llm: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert "not valid YAML at line" in str(info.value) and "\n" not in str(info.value)


def test_relative_data_path_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "llava.json").write_text("[]")
    d = with_value(tiny_dict(), "data.kind", "llava_json")
    d["data"]["path"] = "llava.json"
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(d))
    job = load_config(config_file)
    assert job.data.path == str(tmp_path / "llava.json")


def test_sections_validate_when_built_in_code():
    job = load_config(TINY)
    with pytest.raises(ConfigError, match=r"^training.global_batch \(15\)"):
        JobConfig(
            model=job.model,
            data=job.data,
            training=type(job.training)(global_batch=15, microbatch_size=4, steps=1),
            cluster=job.cluster,
        )


def test_every_timeout_derives_from_the_two_heartbeat_settings_by_its_documented_formula():
    ft = config_from_dict(
        with_value(MINIMAL, "fault_tolerance", {"heartbeat_interval": "250ms", "heartbeat_timeout": "4s"})
    ).fault_tolerance
    seconds = {
        name: getattr(ft, name).total_seconds()
        for name in (
            "collective_timeout",
            "stall_report_after",
            "master_stall_threshold",
            "detector_tick",
            "shutdown_grace",
            "checkpoint_round_timeout",
            "heartbeat_rpc_timeout",
            "report_rpc_timeout",
            "master_silence_limit",
            "worker_stop_timeout",
            "agent_exit_timeout",
            "rendezvous_timeout",
            "reform_after",
        )
    }
    assert seconds == {
        "collective_timeout": 9.0,
        "stall_report_after": 0.5,
        "master_stall_threshold": 2.0,
        "detector_tick": 0.1,
        "shutdown_grace": 4.0,
        "checkpoint_round_timeout": 68.0,
        "heartbeat_rpc_timeout": 2.0,
        "report_rpc_timeout": 4.0,
        "master_silence_limit": 8.0,
        "worker_stop_timeout": 4.0,
        "agent_exit_timeout": 6.0,
        "rendezvous_timeout": 300.0,
        "reform_after": 4.0,
    }
    short = config_from_dict(
        with_value(MINIMAL, "fault_tolerance", {"heartbeat_interval": "100ms", "heartbeat_timeout": "500ms"})
    ).fault_tolerance
    assert short.detector_tick.total_seconds() == pytest.approx(0.05) and short.shutdown_grace.total_seconds() == 2.0
    assert ft.confirmed_silence is None  # peer-confirmed detection is off unless set (a slow link looks the same)


@pytest.mark.parametrize("value", ["3s", "5s"])
def test_a_confirmed_silence_not_shorter_than_the_timeout_is_refused_naming_both(value):
    with pytest.raises(
        ConfigError,
        match=r"^fault_tolerance.confirmed_silence: must be > 0 and < heartbeat_timeout "
        r"\(3s\).*got " + value[:-1],
    ):
        config_from_dict(
            with_value(MINIMAL, "fault_tolerance", {"heartbeat_timeout": "3s", "confirmed_silence": value})
        )
    ft = config_from_dict(with_value(MINIMAL, "fault_tolerance", {"confirmed_silence": "1.5s"})).fault_tolerance
    assert ft.confirmed_silence.total_seconds() == 1.5


def test_the_rendezvous_timeout_is_a_setting_a_user_may_raise():
    job = config_from_dict(with_value(MINIMAL, "fault_tolerance", {"rendezvous_timeout": "15m"}))
    assert job.fault_tolerance.rendezvous_timeout.total_seconds() == 900.0
    with pytest.raises(ConfigError, match="fault_tolerance.rendezvous_timeout: must be a positive duration"):
        config_from_dict(with_value(MINIMAL, "fault_tolerance", {"rendezvous_timeout": "0s"}))


def test_inputs_that_were_internal_errors_are_config_errors_naming_the_file_or_field(tmp_path):
    """Issue 30: a UTF-16 file (the message dumped it), a step count past 64 bits, a 1 KB YAML alias bomb
    (the launcher hung expanding it into the message): each a one-line ConfigError."""
    from oobleck_mm.config import apply_overrides
    from oobleck_mm.config.loading import check_expansion
    from oobleck_mm.config.values import describe

    text = open(TINY, encoding="utf-8").read()
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_bytes(text.encode("utf-16"))
    with pytest.raises(ConfigError, match=r"utf16.yaml is not UTF-8 text \(byte 0xff at offset 0: it is UTF-16\)"):
        load_config(str(utf16))
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(text.encode("utf-8-sig"))
    assert load_config(str(bom)).model.name == load_config(TINY).model.name, "a UTF-8 BOM is fine"
    with pytest.raises(ConfigError, match=r"training.steps: must be <= 9007199254740992 .* got 10{23}"):
        apply_overrides(load_config(TINY), steps=10**23)
    levels = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"{x}: &{x} [{', '.join(['*' + p] * 9)}]" for p, x in zip("abcdefg", "bcdefgh")]  # 9**8 values
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(text + "\n" + "\n".join(levels) + "\n")
    with pytest.raises(ConfigError, match=r"bomb.yaml: its YAML aliases expand to more than 1,00[0-9],[0-9]{3} values"):
        load_config(str(bomb))
    with pytest.raises(ConfigError, match=r"--set training.steps: its YAML aliases expand"):
        load_config(TINY, overrides=["training.steps=" + "{" + ", ".join(levels).replace(": &", ": &") + "}"])
    expanded = yaml.safe_load("\n".join(levels))["h"]
    check_expansion(expanded[0][0][0][0], "small enough")  # 9**4 values pass
    assert len(describe(expanded)) < 1000, "a value refused with a bomb inside is described in a bounded message"
