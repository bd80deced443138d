"""Reading a job: the YAML file, then a DeepSpeed file, then ``--set``, then the named flags, in that order.

One precedence for every setting (file < ``--deepspeed`` < ``--set`` < named flags such as ``--steps``),
and no default derived from another setting is filled in before all of them were applied: a section
derives what it needs when it is built (``config.validation``), and is built again after each step. Also the
job's text as the master ships it to agents and workers (``config_text``, JSON, ``parse_config_text``) and as
the run dir keeps it for people (``dump_config``, YAML).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import reprlib
from collections.abc import Sequence
from typing import Any

import yaml

from oobleck_mm.config.deepspeed import apply_deepspeed
from oobleck_mm.config.cluster import ClusterConfig
from oobleck_mm.config.job import JobConfig, config_from_dict
from oobleck_mm.config.values import ConfigError

log = logging.getLogger(__name__)

# libyaml's loader and dumper when built in: same results, many times faster (a config with a million
# excluded samples: 2.7 s to dump instead of 6.9 s).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def parse_config_text(text: str) -> Any:
    """The raw dict of a config's text: ``config_text``'s JSON, or YAML (``dump_config``'s, a file's), read with
    libyaml when built in."""
    raw = _json_or_none(text)
    return raw if raw is not None else yaml.load(text, Loader=_YAML_LOADER)


def _json_or_none(text: str) -> Any:
    """``text`` read as JSON if it is a JSON object, else None (then it is YAML's to read). JSON is YAML 1.2, and
    where PyYAML's YAML 1.1 reads a JSON text differently (``1e-05`` is a string to it) JSON's reading is the
    one its writer meant."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # a YAML flow mapping, "{a: 1}"
        return None


def dump_config(job: JobConfig, stream=None):
    """The job as YAML that ``config_from_dict(yaml.safe_load(...))`` reads back: the text, or written to ``stream``."""
    return yaml.dump(job.to_dict(), stream, Dumper=_YAML_DUMPER, sort_keys=False)


def config_text(job: JobConfig) -> str:
    """The job as the text the master hands other processes (agents and their workers, the planning helper,
    the journal), which ``parse_config_text`` and ``load_config`` read back: JSON. Even libyaml's YAML is ~50x
    slower: a config with 600,000 ``data.excluded_samples`` (what ``--skip-bad-samples`` fills) took 4.5 s of
    CPU to dump and 5.1 s to read on a 2-core machine, paid again by each agent, worker and plan; as JSON, 0.1 s
    each. YAML where JSON would not give back the same values (keys that are not strings)."""
    raw = job.to_dict()
    text = json.dumps(raw)
    return text if json.loads(text) == raw else dump_config(job)


_SHORT_TEXT = reprlib.Repr()
_SHORT_TEXT.maxstring = 200  # a --set value in a message: its start is enough

MAX_CONFIG_VALUES = 1_000_000
"""Values a config may hold once its YAML aliases are expanded, beyond one per byte of its text: a 1 KB
alias bomb expands to billions (every later copy, message or ``safe_dump`` of the job would hang on it),
while a written-out list, even of a million excluded samples, holds fewer values than bytes."""


def check_expansion(raw: Any, where: str, text_bytes: int = 0) -> None:
    """``ConfigError`` when ``raw`` expands past ``MAX_CONFIG_VALUES`` plus ``text_bytes`` values. Counted on
    the loaded graph, each shared node counted once per reference but computed once (a bomb is a small DAG)."""
    limit = MAX_CONFIG_VALUES + text_bytes
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        key = id(node)
        if key not in sizes:
            sizes[key] = 0  # a cycle (YAML allows one) counts once
            values = list(node.values()) if isinstance(node, dict) else node
            sizes[key] = min(1 + len(node) + sum(size(v) for v in values), limit + 1)
        return sizes[key]

    if size(raw) > limit:
        raise ConfigError(
            f"{where}: its YAML aliases expand to more than {limit:,} values (an alias bomb?); "
            "write the values out, or use fewer nested aliases"
        )


def load_config(path: str | os.PathLike, deepspeed: str | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Reads a YAML job file; a relative ``data.path`` is taken relative to the file.

    ``deepspeed`` (or a top-level ``deepspeed: FILE`` in the YAML, relative to it): a DeepSpeed
    JSON config mapped onto the training section (``oobleck_mm.config.deepspeed``); its notes
    (keys accepted without effect) are logged as warnings. ``overrides``: ``--set KEY=VALUE``
    items (``apply_set``), applied last, checked like the file."""
    raw = read_config_dict(path, deepspeed)
    if overrides and isinstance(raw, dict):
        apply_set(raw, overrides)
    return config_from_dict(raw, source=os.fspath(path))


def read_config_dict(path: str | os.PathLike, deepspeed: str | None = None) -> Any:
    """``load_config``'s plain dict before it is built: the file's paths made absolute (relative to the file),
    ``deepspeed`` mapped in; nothing derived or checked yet (``oobleck_mm.api`` edits it first)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        text = data.decode("utf-8-sig")
        raw = _json_or_none(text)  # an agent's copy of the job (``config_text``)
        if raw is None:
            raw = yaml.load(text, Loader=_YAML_LOADER)
            check_expansion(raw, path, len(data))  # JSON has no aliases to expand
    except UnicodeDecodeError as exc:
        utf16 = data[:2] in (b"\xff\xfe", b"\xfe\xff")
        raise ConfigError(
            f"<file>: {path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}"
            f"{': it is UTF-16' if utf16 else ''}); save it as UTF-8"
        ) from None
    except FileNotFoundError:
        raise ConfigError(f"<file>: config file {path!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"<file>: cannot read config file {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"<file>: {path} is not valid YAML{where}: {problem}") from None
    if isinstance(raw, dict) and isinstance(raw.get("data"), dict) and isinstance(raw["data"].get("path"), str):
        data_path = os.path.expanduser(raw["data"]["path"])
        raw["data"]["path"] = os.path.join(os.path.dirname(os.path.abspath(path)), data_path)
    model = raw.get("model") if isinstance(raw, dict) else None
    here = os.path.dirname(os.path.abspath(path))
    if isinstance(raw, dict) and ("deepspeed" in raw or deepspeed is not None):
        in_file = raw.pop("deepspeed", None)
        if in_file is not None and deepspeed is not None:
            raise ConfigError(f"deepspeed: given twice, {in_file!r} in {path} and {deepspeed!r} on the command line")
        ds_path = deepspeed if deepspeed is not None else os.path.join(here, os.path.expanduser(str(in_file)))
        cluster = raw.get("cluster") if isinstance(raw.get("cluster"), dict) else {}
        defaults = {f.name: f.default for f in dataclasses.fields(ClusterConfig)}
        sizes = [cluster.get(k, defaults[k]) for k in ("nodes", "gpus_per_node")]
        world = sizes[0] * sizes[1] if all(isinstance(x, int) for x in sizes) else 1
        for note in apply_deepspeed(raw, ds_path, world):
            log.warning("note: %s", note)
    if isinstance(model, dict) and isinstance(model.get("huggingface"), str):
        model["huggingface"] = os.path.join(here, os.path.expanduser(model["huggingface"]))
    elif isinstance(model, dict) and isinstance(model.get("huggingface"), dict):  # a composition of parts
        model["huggingface"] = {
            part: os.path.join(here, os.path.expanduser(d)) if isinstance(d, str) else d
            for part, d in model["huggingface"].items()
        }
    if isinstance(model, dict) and isinstance(model.get("builder"), str):
        module, sep, function = model["builder"].rpartition(":")
        if sep and module.endswith(".py"):  # a file path: absolute, so every worker finds it
            model["builder"] = os.path.join(here, os.path.expanduser(module)) + ":" + function
    return raw


# Paths given on the command line are relative to where the command runs, not to the YAML file.
_PATH_KEYS = ("data.path", "model.huggingface")


def apply_set(raw: dict, overrides: Sequence[str]) -> None:
    """``--set training.global_batch=64``: each dotted key set in the raw config before it is
    checked, so a bad key or value gets the YAML's own message naming it. Values are read as
    YAML (``64``, ``true``, ``null``, ``[0.9, 0.95]``, ``{type: AdamW}``). A dotted key may create
    a section the file lacks (``balance.enabled=true``)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set: expected KEY=VALUE with a dotted key (training.global_batch=64), got {item!r}")
        try:
            value = yaml.load(text, Loader=_YAML_LOADER)
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: {_SHORT_TEXT.repr(text)} is not a YAML value") from None
        check_expansion(value, f"--set {key}", len(text))
        if (key in _PATH_KEYS or key.startswith("model.huggingface.")) and isinstance(value, str):
            value = os.path.abspath(os.path.expanduser(value))
        node = raw
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"--set {key}: {where} is {child!r}, not a section with fields")
            node = child
        node[parts[-1]] = value


# --------------------------------------------------------------------------- command-line overrides


def apply_overrides(
    job: JobConfig,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    steps: int | None = None,
    recovery: str | None = None,
    checkpoint_interval: int | None = None,
    max_nodes: int | None = None,
) -> JobConfig:
    """The job with command-line values in place, validated again (ConfigError names the field)."""
    ft = job.fault_tolerance
    if recovery is not None or checkpoint_interval is not None:
        ft = dataclasses.replace(
            ft,
            recovery=ft.recovery if recovery is None else recovery,
            checkpoint_interval=ft.checkpoint_interval if checkpoint_interval is None else checkpoint_interval,
        )
        job = dataclasses.replace(job, fault_tolerance=ft)
    if nodes is not None or max_nodes is not None:
        cluster = job.cluster
        job = dataclasses.replace(
            job,
            cluster=dataclasses.replace(
                cluster,
                nodes=cluster.nodes if nodes is None else nodes,
                max_nodes=cluster.max_nodes if max_nodes is None else max_nodes,
            ),
        )
    if gpus_per_node is not None:
        job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpus_per_node=gpus_per_node))
    if steps is not None:
        job = dataclasses.replace(job, training=dataclasses.replace(job.training, steps=steps))
    return job
