"""The Python entry points: the same jobs as ``oobleck-launch local`` and ``oobleck-launch master``, from Python.

    import oobleck_mm

    run = oobleck_mm.local("configs/tiny_mm.yaml", nodes=3, steps=20, dataset=my_hf_dataset,
                           inject=["kill:node2@step8"], save_final="runs/final")
    assert run.ok, run.exit_code

``config`` is a YAML path, a plain dict (its relative paths taken from the current folder) or a
``JobConfig``. Python objects go where the config would name a file:

- ``model=``: a builder function (``model.builder``'s contract, ``examples/custom_model.py``), defined at
  the top level of an importable module or of a ``.py`` file (the workers are other processes: they
  import it by name, so a script that calls ``local`` must do so under ``if __name__ == "__main__":``,
  as with multiprocessing's spawn); or a HuggingFace model directory (``model.huggingface``);
- ``dataset=``: a HuggingFace ``datasets.Dataset`` or ``DatasetDict`` (written once with
  ``save_to_disk`` into the run folder and read by every rank as ``data.kind: hf_datasets``), or a path:
  a ``.json`` file (``llava_json``), else a ``datasets`` folder or Parquet (``hf_datasets``);
  ``columns=`` is ``data.columns``.

Everything then runs exactly as the command line does (the job is written to ``<run_dir>/job.yaml`` and
handed to ``oobleck_mm.cli``): the same checks and exit codes (a ``UserError`` here is exit 2 there), the
same console, events and checkpoints. Nothing heavy is imported until a job starts.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oobleck_mm.errors import UserError


@dataclass(frozen=True, slots=True)
class Run:
    """What a job left: its exit code (``oobleck_mm.errors.ExitCode``) and where its files are."""

    exit_code: int
    run_dir: str
    config: str
    """The job file it ran (``<run_dir>/job.yaml``): ``oobleck-launch verify --config`` reads it."""
    final: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def event_log(self) -> str:
        return os.path.join(self.run_dir, "events.jsonl")

    def events(self, kind: str | None = None) -> list[dict]:
        """The job's structured events (all, or those of ``kind``: ``step``, ``lost``, ``plan_decided``...)."""
        if not os.path.exists(self.event_log):
            return []
        with open(self.event_log, encoding="utf-8") as fh:
            out = [json.loads(line) for line in fh if line.strip()]
        return [e for e in out if kind is None or e.get("event") == kind]


def local(
    config: Any,
    *,
    nodes: int | str | None = None,
    steps: int | None = None,
    model: Callable | str | os.PathLike | None = None,
    dataset: Any = None,
    columns: Mapping[str, str] | None = None,
    inject: Sequence[str] = (),
    save_final: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    run_dir: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    tensorboard: bool = True,
) -> Run:
    """The job on the embedded local cluster (``oobleck-launch local``): a master, ``nodes`` agents and their
    workers as processes of this machine. ``nodes``: a count or ``"MIN:MAX"``; ``inject``: ``--inject``
    items (``kill:node2@step8``, ``join@step12`` ...); ``overrides``: ``--set KEY=VALUE`` items."""
    args = ["--no-tensorboard"] if not tensorboard else []
    args += [x for item in inject for x in ("--inject", item)]
    return _run("local", config, nodes, steps, model, dataset, columns, save_final, resume, run_dir, overrides, args)


def launch(
    config: Any,
    *,
    host: str = "0.0.0.0",
    port: int = 29400,
    nodes: int | str | None = None,
    steps: int | None = None,
    model: Callable | str | os.PathLike | None = None,
    dataset: Any = None,
    columns: Mapping[str, str] | None = None,
    save_final: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    run_dir: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
) -> Run:
    """The master of a real cluster (``oobleck-launch master``): it listens on ``host:port`` and each node
    joins it with ``oobleck-launch agent --master HOST:PORT`` (``docs/deployment.md``). The model builder
    and the dataset must be at the same path on every node (a shared file system), as a config's are."""
    args = ["--host", host, "--port", str(port)]
    return _run("master", config, nodes, steps, model, dataset, columns, save_final, resume, run_dir, overrides, args)


def _run(command, config, nodes, steps, model, dataset, columns, save_final, resume, run_dir, overrides, extra) -> Run:
    raw, was_built = _raw(config)
    if run_dir is None:
        from oobleck_mm.master.run_dir import default_run_dir

        run_dir = base = default_run_dir(str((raw.get("model") or {}).get("name") or "job"))
        for k in range(2, 1000):  # two calls in one second of one process: the folder name is second and pid
            if not os.path.exists(run_dir):
                break
            run_dir = f"{base}-{k}"
    run_dir = os.path.abspath(os.fspath(run_dir))
    os.makedirs(run_dir, exist_ok=True)
    if model is not None:
        _put_model(raw, model)
    if dataset is not None or columns is not None:
        _put_dataset(raw, dataset, columns, run_dir, was_built)
    from oobleck_mm.config import config_from_dict, dump_config

    job_file = os.path.join(run_dir, "job.yaml")
    with open(job_file, "w", encoding="utf-8") as fh:
        dump_config(config_from_dict(raw, source="oobleck_mm.api"), fh)  # checked here: a bad value raises now
    args = [command, "--config", job_file, "--run-dir", run_dir, *extra]
    for flag, value in (("--nodes", nodes), ("--steps", steps), ("--save-final", save_final), ("--resume", resume)):
        if value is not None:
            args += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    args += [x for item in overrides for x in ("--set", item)]
    from oobleck_mm.cli import main

    final = os.path.abspath(os.fspath(save_final)) if save_final is not None else None
    return Run(main(args), run_dir, job_file, final)


def _raw(config) -> tuple[dict, bool]:
    """The job as a plain dict with absolute paths, and whether it came from a built ``JobConfig``."""
    from oobleck_mm.config import JobConfig
    from oobleck_mm.config.loading import read_config_dict

    if isinstance(config, JobConfig):
        return config.to_dict(), True
    if isinstance(config, (str, os.PathLike)):
        raw = read_config_dict(config)
        if not isinstance(raw, dict):
            raise UserError(f"config: {os.fspath(config)} must hold a mapping of sections")
        return raw, False
    if isinstance(config, Mapping):
        raw = copy.deepcopy(dict(config))
        model, data = raw.get("model"), raw.get("data")
        for section, key in ((model, "huggingface"), (data, "path"), (data, "cache_dir")):
            if isinstance(section, dict) and isinstance(section.get(key), str):
                section[key] = os.path.abspath(os.path.expanduser(section[key]))
        if isinstance(model, dict) and isinstance(model.get("builder"), str):
            module, sep, function = model["builder"].rpartition(":")
            if sep and module.endswith(".py"):
                model["builder"] = os.path.abspath(os.path.expanduser(module)) + ":" + function
        return raw, False
    raise UserError(f"config: expected a YAML path, a dict or a JobConfig, got {type(config).__name__}")


def _put_model(raw: dict, model) -> None:
    section = raw.setdefault("model", {})
    if isinstance(model, (str, os.PathLike)):
        section.pop("builder", None)
        section["huggingface"] = os.path.abspath(os.fspath(model))
        return
    if not callable(model):
        raise UserError(f"model=: expected a builder function or a HuggingFace directory, got {type(model).__name__}")
    section.pop("huggingface", None)
    section["builder"] = builder_name(model)


def builder_name(function: Callable) -> str:
    """How a worker finds ``function``: ``package.module:name``, or ``/path/file.py:name`` for a script's."""
    name = getattr(function, "__qualname__", "")
    if not name or "<" in name or "." in name:
        raise UserError(
            f"model=: {function!r} is not a top-level function; the workers import it by name, so define it "
            "at the top level of a module or a .py file"
        )
    module = inspect.getmodule(function)
    if module is None or module.__name__ == "__main__":
        path = getattr(module, "__file__", None)
        if not path:
            raise UserError(
                f"model=: {name} was defined in an interactive session, which the workers cannot import; "
                "put it in a .py file or a module"
            )
        return f"{os.path.abspath(path)}:{name}"
    return f"{module.__name__}:{name}"


def _put_dataset(raw: dict, dataset, columns, run_dir: str, was_built: bool) -> None:
    data = raw.setdefault("data", {})
    if was_built:  # the synthetic data's derived shape: the new data is measured instead
        for key in ("mean_text_tokens", "mean_images_per_sample", "image_size", "min_image_size"):
            data.pop(key, None)
    if dataset is not None:
        if isinstance(dataset, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(dataset))
            data["kind"] = "llava_json" if path.endswith(".json") else "hf_datasets"
        else:
            path = _save_dataset(dataset, os.path.join(run_dir, "dataset"))
            data["kind"] = "hf_datasets"
            if _is_dataset_dict(dataset):
                data.setdefault("split", next(iter(dataset)))
        data["path"] = path
    if columns is not None:
        data["columns"] = dict(columns)


def _is_dataset_dict(dataset) -> bool:
    import datasets

    return isinstance(dataset, datasets.DatasetDict)


def _save_dataset(dataset, folder: str) -> str:
    import datasets

    if not isinstance(dataset, (datasets.Dataset, datasets.DatasetDict)):
        raise UserError(
            f"dataset=: expected a datasets.Dataset, a DatasetDict or a path, got {type(dataset).__name__}; "
            "datasets.Dataset.from_list / from_dict / from_generator make one from Python records"
        )
    if os.path.exists(folder):  # a resumed run in the same folder: the rows it trained on, as written
        return folder
    dataset.save_to_disk(folder)
    return folder
