"""The job: its seven sections as one validated dataclass, and building it from plain dicts.

A job file has seven sections (``model``, ``data``, ``training``,
``fault_tolerance``, ``cluster``, ``planning``, ``balance``); only ``model`` is
required. The config lives in three rooms: the declarations, one module per
section (``model``, ``data``, ``training``, ``fault_tolerance``, ``cluster``),
each a ``@dataclass(kw_only=True, slots=True)`` whose field docstrings are the
reference and whose ``__post_init__`` checks (and normalises) its own fields;
the rules that relate fields to each other (``validation.validate``, which
``JobConfig`` runs on construction); and loading (this module's dict building,
``loading``'s file, ``--deepspeed``, ``--set`` and flags, in that order). Every
mistake raises ``ConfigError`` whose message starts with the dotted path of the
field and carries the bad value and what would be valid, so the CLI can print it
as one line.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from datetime import timedelta
from typing import Any, Union, get_args, get_origin, get_type_hints

from oobleck_mm.config.fault_tolerance import FaultToleranceConfig
from oobleck_mm.config.values import (
    ConfigError,
    describe,
    reject_unknown,
)
from oobleck_mm.config.cluster import BalanceConfig, ClusterConfig, PlanningConfig
from oobleck_mm.config.data import DataConfig
from oobleck_mm.config.model import ModelConfig
from oobleck_mm.config.training import TrainingConfig
from oobleck_mm.config.validation import validate


@dataclass(kw_only=True, slots=True)
class JobConfig:
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able dict; ``config_from_dict(job.to_dict())`` gives an equal job."""
        return _to_plain(self)


def _section_class(hint: Any) -> tuple[type | None, bool]:
    """(section dataclass, optional?) for a field annotation, or (None, False) for a plain value."""
    if dataclasses.is_dataclass(hint):
        return hint, False
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0], True
    return None, False


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path or '<root>'}: expected a mapping of settings, got {describe(raw)}")
    fields = dataclasses.fields(cls)
    reject_unknown(raw, tuple(f.name for f in fields), path)
    hints = get_type_hints(cls)
    kwargs = {}
    for f in fields:
        key_path = f"{path}.{f.name}" if path else f.name
        if f.name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{key_path}: required but missing")
            continue
        value = raw[f.name]
        section, optional = _section_class(hints[f.name])
        if section is not None and not (optional and value is None):
            value = _build(section, value, key_path)
        kwargs[f.name] = value
    return cls(**kwargs)


def _to_plain(value: Any) -> Any:
    if isinstance(value, ModelConfig) and value.huggingface is not None:
        # The shape sections are derived from the directory; writing them back would conflict.
        return {
            f.name: _to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.name not in ("llm", "vision", "audio", "projector")
        }
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def config_from_dict(d: Any, source: str = "<dict>") -> JobConfig:
    """Builds and validates a job from a plain dict (e.g. parsed YAML)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"<root>: {source} must hold a mapping of sections, got {describe(d)}")
    return _build(JobConfig, d, "")


def section_from_dict(cls: type, raw: Any, path: str) -> Any:
    """One section (e.g. ``FaultToleranceConfig``) from its plain dict, checked like in a whole job."""
    return _build(cls, raw, path)
