"""Emulated accelerators (``cluster.emulate``): the compute copy, the truth, the device clock, the verdict.

Pure parts only (no process): the multi-process calibration is in
``tests/integration/test_emulated_cluster.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import yaml

from oobleck_mm.config import config_from_dict
from oobleck_mm.config.emulation import compute_job
from oobleck_mm.config.shape import layer_specs
from oobleck_mm.config.values import ConfigError
from oobleck_mm.data.sample import SampleMeta
from oobleck_mm.emulation.clock import GUARDED_S, DeviceClock, Lateness
from oobleck_mm.emulation.speed import SpeedFile, write_speed
from oobleck_mm.emulation.truth import DEFAULT_TRUTH, Truth, TruthProfile, TruthProfileError, load_truth, sample_noise
from oobleck_mm.emulation.validity import judge
from oobleck_mm.profiling.analytical import profile_from_config

EMULATED = {
    "cluster.device": "cpu",
    "cluster.backend": "gloo",
    "cluster.emulate": "a100-80gb",
    "cluster.gpus_per_node": 1,
    "cluster.max_gpus_per_stage": 1,
    "cluster.nodes": 16,
}


def load(path: str, **overrides):
    with open(path) as fh:
        raw = yaml.safe_load(fh)
    for key, value in {**EMULATED, **overrides}.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return config_from_dict(raw)


def mllm(**overrides):
    return load("configs/mllm_10b.yaml", **overrides)


# --------------------------------------------------------------------------- the compute copy


def test_the_compute_copy_has_the_real_layer_list_with_every_width_divided():
    job = mllm()
    copy = compute_job(job)
    real, shrunk = layer_specs(job.model, job.data), layer_specs(copy.model, copy.data)
    assert [s.name for s in shrunk] == [s.name for s in real]  # stage cuts mean the same layers
    assert copy.model.llm.hidden == 3584 // 112 and copy.model.vision.hidden == 2048 // 112
    for tower in (copy.model.llm, copy.model.vision, copy.model.audio):
        assert tower.hidden % tower.num_heads == 0
    assert copy.model.llm.num_heads % copy.model.llm.num_kv_heads == 0
    # CPU-friendly numerics; the planner's job keeps the real ones.
    assert copy.training.dtype == "float32" and not copy.training.activation_checkpointing
    assert job.training.dtype == "bfloat16" and job.training.activation_checkpointing
    assert compute_job(copy) == copy  # a compute copy is its own


def test_coarsening_tiles_the_images_and_bounds_every_attention_span():
    job = mllm()
    copy = compute_job(job)
    patch = copy.model.vision.patch_size
    assert job.data.image_size % patch == 0 and patch > job.model.vision.patch_size
    assert (job.data.image_size // patch) ** 2 <= 128
    assert copy.data.mean_text_tokens == pytest.approx(job.data.mean_text_tokens * 14 / patch)
    # The global batches are the real ones: the sampler does not depend on the compute copy's shape.
    from oobleck_mm.data.loader import TrainingData

    assert TrainingData(copy).global_batch(3) == TrainingData(job).global_batch(3)


def test_a_job_that_is_not_emulated_is_its_own_compute_copy():
    job = config_from_dict(yaml.safe_load(open("configs/tiny_mm.yaml")))
    assert compute_job(job) is job


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"cluster.emulate": "tpu-v9"}, "cluster.emulate: must be one of 'a40', 'a100-40gb', 'a100-80gb', 'h100'"),
        ({"cluster.emulate": "cpu"}, "cluster.emulate: must be one of"),
        (
            {"cluster.device": "cuda"},
            "cluster.emulate: emulated accelerators run on CPU workers, cluster.device is 'cuda'",
        ),
        (
            {"cluster.emulate_shrink": 5000},
            "cluster.emulate_shrink (5000) leaves model.llm.hidden (3584) with no width",
        ),
        ({"cluster.emulate_coarsen": 3}, "cluster.emulate_coarsen (3): a patch of 3 x 14 px does not tile"),
        ({"cluster.max_gpus_per_stage": 8, "cluster.gpus_per_node": 8}, "emulation runs stages of one GPU"),
    ],
)
def test_a_bad_emulation_setting_names_the_key_and_what_is_valid(overrides, named):
    with pytest.raises(ConfigError) as caught:
        mllm(**overrides)
    assert named in str(caught.value)


def test_the_emulated_accelerator_is_what_the_planner_sees():
    job = mllm(**{"cluster.accelerator": "h100"})
    assert job.cluster.accelerator == "a100-80gb" and job.cluster.device_memory == 80 * 10**9  # the file's 80GB


# --------------------------------------------------------------------------- the truth


def text_job(**overrides):
    return load("configs/gpt3_2.7b.yaml", **{"cluster.nodes": 6, **overrides})


def test_without_factors_or_noise_the_truth_of_a_mean_sample_is_the_planners_profile():
    job = text_job(**{"training.microbatch_size": 1})
    truth = Truth(job, TruthProfile())
    profile = profile_from_config(job)
    mean = SampleMeta(index=7, text_tokens=int(job.data.mean_text_tokens))
    groups = truth.groups(range(len(truth.specs)))
    forward, backward = truth.stage_seconds(groups, [mean])
    assert forward == pytest.approx(sum(layer.forward_s for layer in profile.layers), rel=1e-12)
    trainable_first = [layer.backward_input_s for layer in profile.layers[1:]]
    expected = sum(layer.backward_weight_s for layer in profile.layers) + sum(trainable_first)
    assert backward == pytest.approx(expected, rel=1e-12)


def test_a_kind_factor_changes_exactly_its_layers():
    job = text_job()
    plain, skewed = Truth(job, TruthProfile()), Truth(job, TruthProfile(factors={"lm_head": 2.0, "block": 1.5}))
    sample = [SampleMeta(index=1, text_tokens=1000)]
    for i, spec in enumerate(plain.specs):
        factor = {"lm_head": 2.0, "block": 1.5}.get(spec.kind, 1.0)
        assert skewed.stage_seconds(skewed.groups([i]), sample)[0] == pytest.approx(
            factor * plain.stage_seconds(plain.groups([i]), sample)[0], rel=1e-12
        )


def test_sample_noise_is_the_same_everywhere_and_has_mean_one():
    assert sample_noise(3, 41, 0.2) == sample_noise(3, 41, 0.2) != sample_noise(4, 41, 0.2)
    draws = np.array([sample_noise(0, i, 0.2) for i in range(20000)])
    assert draws.mean() == pytest.approx(1.0, abs=0.01)
    assert np.log(draws).std() == pytest.approx(0.2, rel=0.03)


def test_a_microbatch_costs_its_summed_tokens_weighted_by_each_samples_noise():
    job = text_job()
    truth = Truth(job, TruthProfile(noise=0.3, seed=5))
    quiet = Truth(job, TruthProfile())
    a, b = SampleMeta(index=1, text_tokens=300), SampleMeta(index=2, text_tokens=900)
    block = truth.groups([5])
    n1, n2 = sample_noise(5, 1, 0.3), sample_noise(5, 2, 0.3)
    # A block's time is not linear in tokens (attention), so the weight is applied to the pair's own roofline.
    assert truth.stage_seconds(block, [a, b])[0] == pytest.approx(
        quiet.stage_seconds(block, [a, b])[0] * (300 * n1 + 900 * n2) / 1200, rel=1e-12
    )


def test_transfers_and_copies_are_priced_from_the_real_models_bytes():
    job = text_job()
    truth = Truth(job, TruthProfile())
    sample = [SampleMeta(index=0, text_tokens=2048)]
    assert truth.output_bytes(10, sample) == 2048 * 2560 * 2  # bf16 activations of the real width
    block_state = truth.state_bytes(10)
    assert block_state == (12 * 2560**2 + 2 * 2560) * 12  # fp32 masters + two moments; the fp16 copy is derived
    assert truth.copy_s([10, 11]) == pytest.approx(20e-6 + 2 * block_state / job.cluster.inter_node_bandwidth)


@pytest.mark.parametrize(
    "content, named",
    [
        ("{not json", "not JSON"),
        ('{"factor": {}}', "unknown key 'factor'; valid: factors, noise, seed, efficiency, scale, odd_steps_scale"),
        ('{"noise": -1}', "noise must be a number in [0, 1)"),
        ('{"factors": {"block": 0}}', "factors must map a layer kind or modality to a number > 0"),
        ('{"scale": "x"}', "scale must be a number > 0"),
        ('{"odd_steps_scale": 0}', "odd_steps_scale must be a number > 0, got 0"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_a_truth_profile_that_does_not_parse_is_named(tmp_path, content, named):
    path = tmp_path / "truth.json"
    path.write_text(content)
    with pytest.raises(TruthProfileError) as caught:
        load_truth(str(path))
    assert str(path) in str(caught.value) and named in str(caught.value)


def test_a_truth_profile_file_is_read_and_stated(tmp_path):
    path = tmp_path / "truth.json"
    path.write_text(json.dumps({"factors": {"vision.block": 1.2}, "noise": 0.05, "seed": 2, "scale": 1.1}))
    profile = load_truth(str(path))
    assert profile == TruthProfile(factors={"vision.block": 1.2}, noise=0.05, seed=2, scale=1.1, source=str(path))
    assert "vision.block x1.2" in profile.describe() and "every duration x1.1" in profile.describe()
    assert load_truth(None) is DEFAULT_TRUTH


def test_odd_steps_scale_delays_every_duration_of_the_odd_steps_only():
    """The calibration's interleaved known delay (``scripts/bench_emulated.py calibrate`` (a)): compute,
    transfers, all-reduces and copies of an odd step x1.1 on top of ``scale``; an even step's untouched."""
    job = text_job()
    plain, delayed = Truth(job, TruthProfile(scale=2.0)), Truth(job, TruthProfile(scale=2.0, odd_steps_scale=1.1))
    sample, layers = [SampleMeta(index=3, text_tokens=700)], [4, 5, 6]

    def durations(truth):
        return (
            *truth.stage_seconds(truth.groups(layers), sample),
            truth.transfer_s(1e6),
            truth.allreduce_s(layers, 4),
            truth.copy_s(layers),
        )

    for step in range(4):
        expected = [d * (1.1 if step % 2 else 1.0) for d in durations(plain.at_step(step))]
        assert durations(delayed.at_step(step)) == pytest.approx(expected, rel=1e-12)
    assert "odd steps' x1.1" in delayed.profile.describe()


# --------------------------------------------------------------------------- the device clock


class FakeClock(DeviceClock):
    """A device clock on a hand-moved time: ``sleep`` moves it, plus ``oversleep``."""

    def __init__(self, oversleep: float = 0.0) -> None:
        super().__init__()
        self.t, self.oversleep, self.slept = 100.0, oversleep, []

    def now(self) -> float:  # type: ignore[override]
        return self.t

    def sleep(self, seconds: float) -> None:  # type: ignore[override]
        self.slept.append(seconds)
        self.t += seconds + self.oversleep


def test_ops_queue_on_the_device_and_the_host_waits_only_at_a_sync():
    clock = FakeClock()
    clock.begin_step()
    assert clock.run(100.0, 0.2) == (100.0, 100.2)
    assert clock.run(100.01, 0.3) == (100.2, 100.5)  # issued while the device was busy: queued behind
    clock.arrive(100.9)  # a message the next op needs arrives later
    assert clock.run(100.02, 0.1) == (100.9, 101.0)
    assert clock.slept == []
    assert clock.sync() == pytest.approx(101.0) and clock.slept == [pytest.approx(1.0)]
    assert clock.lateness.late_ops == 0 and clock.lateness.emulated_s == pytest.approx(0.6)


def test_the_host_falling_behind_the_device_is_lag_and_makes_the_run_invalid():
    clock = FakeClock()
    clock.begin_step()
    clock.run(100.0, 0.1)  # the step's first op: its set-up before it is the step's, not lag
    clock.run(100.2, 0.1)  # the device was free at 100.1: it idled 0.1 s for the host
    assert clock.lateness.late_ops == 1 and clock.lateness.worst == pytest.approx(1.0)
    assert not clock.take().valid and clock.lateness == Lateness()


def test_a_late_wake_up_is_judged_against_the_device_time_it_waited_out():
    clock = FakeClock(oversleep=0.004)
    clock.begin_step()
    clock.run(100.0, 0.1)
    clock.sync()  # woke 4 ms late after 0.1 s of device time: 4%, not late
    assert clock.lateness.late_ops == 0
    clock.run(clock.t, 0.05)
    clock.sync()  # 4 ms late after 50 ms: 8%
    assert clock.lateness.late_ops == 1


def test_a_host_that_reaches_a_sync_after_its_device_finished_is_late():
    """The host's own work after its last op (a real collective on shared cores) outlasted the device's time:
    the step is the host's from there, which the run must own up to (it once went unjudged, and a 'valid'
    calibration read 6% over its exact time)."""
    clock = FakeClock()
    clock.begin_step()
    clock.run(100.0, 0.1)  # the device is done at 100.1
    clock.t = 100.11  # the host comes 10 ms later: 10% of the 0.1 s it should have covered
    assert clock.sync() == pytest.approx(100.11) and clock.slept == []
    assert clock.lateness.late_ops == 1 and clock.lateness.late_s == pytest.approx(0.01)
    clock.run(clock.t, 0.1)
    clock.t += 0.102  # 2 ms after 0.1 s: within LATE_FRACTION
    clock.sync()
    assert clock.lateness.late_ops == 1


def test_the_hosts_set_up_of_a_step_is_counted_apart():
    clock = FakeClock()
    clock.begin_step()
    clock.t += 0.03  # the host assigns and packs the step's first microbatch
    clock.run(clock.t, 0.1)
    assert clock.lateness.setup_s == pytest.approx(0.03) and clock.lateness.late_ops == 0


def test_ops_below_the_judged_length_are_counted_apart():
    lateness = Lateness()
    lateness.record(GUARDED_S / 2, 1.0)
    assert lateness.ops == 0 and lateness.short_ops == 1 and lateness.valid


# --------------------------------------------------------------------------- the verdict, the speed file


def test_the_verdict_names_what_made_a_run_invalid():
    rows = [{"emulated_ops": 100, "emulated_late_ops": 1, "emulated_worst_lateness": 0.2}] * 3
    assert judge(rows, 0.5).valid
    late = judge([{"emulated_ops": 100, "emulated_late_ops": 2}], 0.5)
    assert not late.valid and "2 of 100 ops (2.0%)" in late.reason
    busy = judge(rows, 0.7)
    assert not busy.valid and "CPU was 70% busy (at most 60%)" in busy.reason
    assert not judge([], None).valid
    warm = [{"generation": 1, "emulated_ops": 10, "emulated_late_ops": 9}, *rows]
    assert judge(warm, None).valid  # a generation's first step warms its workers up: left out
    # the ranks whose ops were late, the most first (the event log's JSON keys are strings)
    ranked = judge(
        [
            {"emulated_ops": 100, "emulated_late_ops": 3, "emulated_late_ranks": {"4": 2, "0": 1}},
            {"emulated_ops": 100, "emulated_late_ops": 3, "emulated_late_ranks": {"4": 1, "0": 1, "7": 1}},
        ],
        0.5,
    )
    assert "most on ranks 4 (3), 0 (2), 7 (1)" in ranked.reason and ranked.late_ranks == {4: 3, 0: 2, 7: 1}
    assert ranked.to_dict()["late_ranks"] == {"4": 3, "0": 2, "7": 1}


def test_the_verdict_says_how_many_cores_the_workers_needed():
    """The workers' CPU seconds a step (``emulated_host_cpu_s``: every worker's process, summed) over the step's
    wall seconds are the cores they kept busy; at most ``CPU_LIMIT`` of a host may be: 16 emulated nodes that
    took 7.2 CPU-s in 4.5 s steps kept 1.6 cores busy and need 3 cores for themselves."""
    row = {"emulated_ops": 100, "emulated_late_ops": 0, "step_time_s": 4.5}
    rows = [
        {**row, "generation": 1, "emulated_host_cpu_s": 99.0, "emulated_busiest_rank_cpu_s": 9.0},  # warm-up
        {**row, "generation": 1, "emulated_host_cpu_s": 7.0, "emulated_busiest_rank_cpu_s": 0.9},
        {**row, "generation": 1, "emulated_host_cpu_s": 7.4, "emulated_busiest_rank_cpu_s": 1.1},
    ]
    verdict = judge(rows, 0.75)
    assert verdict.workers.cpu_s == pytest.approx(7.2) and verdict.workers.busiest_rank_cpu_s == 1.1
    assert verdict.workers.cores == pytest.approx(1.6) and verdict.workers.cores_needed == 3
    assert "7.20 CPU-s a step (busiest rank 1.10) in 4.50 s steps: 1.60 cores, 3 for them alone" in verdict.reason
    assert verdict.to_dict()["workers"]["cores_needed"] == 3
    exactly = judge([row, {**row, "emulated_host_cpu_s": 0.6 * 4.5}], 0.3).workers  # 0.6 cores: one at 60%
    assert exactly.cores_needed == 1
    assert judge([row, row], 0.3).workers is None  # runs that did not report it (an older worker) say nothing


def test_a_slowed_node_reads_its_speed_factor_when_it_changes(tmp_path):
    speed = SpeedFile("node3", str(tmp_path))
    assert speed.read() == 1.0
    write_speed(str(tmp_path), "node3", 2.0)
    assert speed.read() == 2.0
    write_speed(str(tmp_path), "node3", 1.0)
    assert speed.read() == 1.0
    assert SpeedFile("node3", None).read() == 1.0


def test_the_message_header_carries_the_emulated_arrival():
    import torch

    from oobleck_mm.runtime.p2p import HEADER_LEN, decode_header, encode_header

    header = encode_header([torch.zeros(3, 4), torch.zeros(0, dtype=torch.int64)], arrival_s=12345.678901)
    assert decode_header(header) == [(torch.float32, (3, 4)), (torch.int64, (0,))]
    assert int(header[HEADER_LEN - 1]) / 1e6 == pytest.approx(12345.678901, abs=1e-6)
    assert int(encode_header([torch.zeros(1)])[HEADER_LEN - 1]) == 0
    assert not math.isnan(dataclasses.asdict(TruthProfile())["noise"])


def test_a_local_run_that_this_machine_cannot_hold_is_refused_with_the_node_count_that_fits():
    from oobleck_mm.errors import UserError
    from oobleck_mm.runtime.limits import check_host_memory

    job = mllm(**{"cluster.nodes": 32})
    check_host_memory(job, available=32 * 2**30)
    with pytest.raises(UserError) as caught:
        check_host_memory(job, available=4 * 2**30)
    assert "cluster.nodes: 32 local nodes" in str(caught.value) and "run at most 9 nodes here" in str(caught.value)


def test_a_bad_truth_file_stops_the_job_before_anything_starts(tmp_path):
    from oobleck_mm.runtime.limits import check_runnable

    path = tmp_path / "truth.json"
    path.write_text('{"seed": -1}')
    with pytest.raises(TruthProfileError, match="seed must be an integer >= 0"):
        check_runnable(mllm(**{"cluster.emulate_profile": str(path)}), workers_here=False)


def test_a_re_plan_ends_a_hosts_wait_for_its_device():
    from oobleck_mm.emulation.clock import INTERRUPT_POLL_S, Interrupted

    clock = FakeClock()
    clock.begin_step()
    clock.run(100.0, 3.0)
    polls = []

    def replanned() -> bool:
        polls.append(clock.t)
        return clock.t >= 101.0  # the master re-plans a second into a 3 s wait

    with pytest.raises(Interrupted, match="gradients: abandoned, the master re-planned"):
        clock.sync("gradients", replanned)
    assert clock.t < 101.0 + 2 * INTERRUPT_POLL_S  # not the whole 3 s


def test_an_emulated_straggler_is_its_speed_file_and_ends_at_full_speed(tmp_path):
    from oobleck_mm.faults.slowdown import EmulatedSlowdown

    reader = SpeedFile("node2", str(tmp_path))
    slowdown = EmulatedSlowdown("node2", 2.0, str(tmp_path)).start()
    assert slowdown.running and reader.read() == 2.0
    slowdown.end()
    assert not slowdown.running and reader.read() == 1.0
    with pytest.raises(ValueError, match="slowdown factor must be > 1"):
        EmulatedSlowdown("node2", 1.0, str(tmp_path))
