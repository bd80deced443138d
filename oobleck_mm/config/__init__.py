"""Job configuration: YAML -> validated dataclasses, the one place user settings are checked.

The leaf of the import graph: nothing here imports another project module but
``oobleck_mm.errors`` (an import-linter contract in ``.importlinter`` keeps it so).

Three rooms. Declarations, one module per section, each field's docstring its
reference and each ``__post_init__`` checking its own fields: ``model``, ``data``,
``training``, ``fault_tolerance`` (with the named timeouts derived from it,
``FaultToleranceConfig``'s properties), ``cluster`` (with ``planning`` and
``balance``). Validation: ``validation``, the rules that relate fields of several
sections. Loading: ``job`` (the sections as one ``JobConfig``, built from plain
dicts) and ``loading`` (below). Beside them:

- ``loading``: the file, ``--deepspeed``, ``--set`` and the named flags, in that
  order (``load_config``, ``apply_overrides``), and the job's YAML text;
- ``values``: field checks and units (durations, sizes, bandwidths), ``ConfigError``;
- ``devices``: the accelerator catalogue ``cluster.accelerator`` names;
- ``shape``: the model the sections describe as ordered, pipeline-cuttable layers
  (``LayerSpec``), the workload's token counts and ``model.frozen``'s names.
"""

from oobleck_mm.config.cluster import BalanceConfig, ClusterConfig, PlanningConfig
from oobleck_mm.config.data import DataConfig
from oobleck_mm.config.job import JobConfig, config_from_dict, section_from_dict
from oobleck_mm.config.model import FROZEN_MODULES, AudioConfig, LLMConfig, ModelConfig, ProjectorConfig, VisionConfig
from oobleck_mm.config.training import (
    SCHEDULER_DEFAULT_WARMUP_STEPS,
    WARMUP_DECAY_DEFAULT_MAX_LR,
    OptimizerConfig,
    OptimizerParams,
    SchedulerConfig,
    TrainingConfig,
)
from oobleck_mm.config.validation import validate
from oobleck_mm.config.fault_tolerance import FaultToleranceConfig
from oobleck_mm.config.loading import apply_overrides, config_text, dump_config, load_config, parse_config_text
from oobleck_mm.config.values import ConfigError

__all__ = [
    "FROZEN_MODULES",
    "SCHEDULER_DEFAULT_WARMUP_STEPS",
    "WARMUP_DECAY_DEFAULT_MAX_LR",
    "AudioConfig",
    "BalanceConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "FaultToleranceConfig",
    "JobConfig",
    "LLMConfig",
    "ModelConfig",
    "OptimizerConfig",
    "OptimizerParams",
    "PlanningConfig",
    "ProjectorConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "VisionConfig",
    "apply_overrides",
    "config_from_dict",
    "config_text",
    "dump_config",
    "load_config",
    "parse_config_text",
    "section_from_dict",
    "validate",
]
