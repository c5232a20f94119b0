"""Sweep files: one base experiment config plus the overrides that make each trial.

```yaml
name: quality-losses                  # Tune experiment + MLflow parent run; relaunching it resumes
base: ../quickstart.yaml              # an experiment config, relative to this file
experiment: dmltrain-quality          # MLflow experiment of the parent and its child runs
overrides:                            # dotted keys applied to every trial
  train.steps: 300
variants:                             # named trials (optional) ...
  - name: fastap
    overrides: {loss: {name: fastap, num_bins: 10}}
grid:                                 # ... times every combination of these values (optional)
  optim.lr: [0.001, 0.0003]
baselines: [pixels]                   # raw-pixel retrieval, logged as a child run of its own
```

A trial is one variant combined with one grid point; its overrides apply on top of the sweep's ``overrides``,
and a value may be a whole section (``loss: {name: fastap}`` replaces the base's loss section, so switching
losses never leaves another loss's keys behind). Every trial is validated before Ray starts, with one line
naming the trial and the key.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dmltrain.service.config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    config_from_dict,
    parse_override,
    plain_folder_name,
    read_yaml_mapping,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Variant(_Strict):
    name: str = Field(min_length=1, description="Label of the trial in tables, plots and run names.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Dotted key -> value.")


class SweepSpec(_Strict):
    """A parsed sweep file (see the module docstring)."""

    name: str = Field(min_length=1, description="Tune experiment name and MLflow parent run name.")
    base: str = Field(description="Experiment YAML every trial starts from (relative to the sweep file).")
    description: str = ""
    experiment: str | None = Field(
        default=None, description="MLflow experiment for the parent and child runs; None = the base's."
    )
    overrides: dict[str, Any] = Field(default_factory=dict, description="Dotted overrides for every trial.")
    variants: list[Variant] = Field(default_factory=list)
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="Dotted key -> values (product).")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:  # Tune's experiment folder: a/b nested it
        return plain_folder_name(value)

    baselines: list[Literal["pixels"]] = Field(
        default_factory=list, description="pixels: retrieval on raw normalised pixels, no network."
    )
    trial_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.0},
        description="Ray resources of each Tune trial, which only drives its Ray Train run (the workers "
        "request their own through scaling.*); 0 CPUs so a trial never holds a core its workers need.",
    )
    max_concurrent_trials: int | None = Field(
        default=None, ge=1, description="None: as many trials as the cluster's CPUs/GPUs hold at once."
    )

    @model_validator(mode="after")
    def _check(self) -> SweepSpec:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names must be unique, got {names}")
        for key, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{key} has no values")
        return self


@dataclass(frozen=True)
class Trial:
    """One run of the sweep: its label, the overrides that make it, and its validated config."""

    label: str
    overrides: dict[str, Any]
    config: ExperimentConfig


@dataclass(frozen=True)
class Sweep:
    spec: SweepSpec
    source: Path  # the sweep file
    base_raw: dict[str, Any]  # the base config as read (before any override)
    trials: tuple[Trial, ...]
    extra_overrides: tuple[str, ...] = ()  # the command line's, applied to every trial after the file's


def _as_override(key: str, value: Any) -> str:
    """``key=value`` in the form `apply_overrides` parses (the value as YAML, so types survive)."""
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def _value_label(value: Any, full: bool = False) -> str:
    """A value as the trial label shows it: a section by its ``name`` (``full``: every key)."""
    if isinstance(value, Mapping):
        if not full and "name" in value:
            return str(value["name"])
        return "+".join(f"{k}={_value_label(v, full)}" for k, v in value.items())
    return str(value)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", text).strip("_") or "trial"


def _dropped_keys(overrides: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(dotted key, section) pairs where a whole section set later replaces a key set before it: the key
    was silently lost (the sweep's ``loss.temperature`` under a variant's ``loss: {name: smoothap}``)."""
    keys = list(overrides)
    return [
        (earlier, later)
        for i, earlier in enumerate(keys)
        for later in keys[i + 1 :]
        if isinstance(overrides[later], Mapping) and earlier.startswith(later + ".")
    ]


def expand(spec: SweepSpec) -> list[tuple[str, dict[str, Any]]]:
    """Every (label, overrides) of the sweep: variants x grid points, in file order."""
    variants: list[tuple[str, dict[str, Any]]] = [(v.name, v.overrides) for v in spec.variants] or [("", {})]
    keys = list(spec.grid)

    def label(name: str, point: Mapping[str, Any], full: bool) -> str:
        parts = ([name] if name else []) + [
            f"{k.split('.')[-1]}={_value_label(v, full)}" for k, v in point.items()
        ]
        return ",".join(parts) or "base"

    points = []
    for name, variant_overrides in variants:
        for values in itertools.product(*(spec.grid[k] for k in keys)):
            point = dict(zip(keys, values, strict=True))
            overrides = {**spec.overrides, **variant_overrides, **point}
            for key, section in _dropped_keys(overrides):
                where = (  # the last to set the section is the one that replaced it
                    f"grid.{section}"
                    if section in point
                    else f"variant {name!r}"
                    if section in variant_overrides
                    else f"overrides.{section}"
                )
                raise ConfigError(
                    f"sweep {spec.name}: {where} replaces the whole section {section}, which drops "
                    f"{key}={overrides[key]!r} set before it; put {key.removeprefix(section + '.')} inside "
                    f"that section's value, or set the section's keys one by one ({section}.<key>)"
                )
            points.append((name, point, overrides))
    labels = [label(name, point, False) for name, point, _ in points]
    if len(set(labels)) != len(labels):  # sections with the same name: label them by all their keys
        labels = [label(name, point, True) for name, point, _ in points]
    if len(set(labels)) != len(labels):
        raise ConfigError(
            f"sweep {spec.name}: trial labels repeat ({labels}); give variants distinct names and the grid "
            "distinct values"
        )
    return [(text, overrides) for text, (_, _, overrides) in zip(labels, points, strict=True)]


def trial_config(
    base_raw: Mapping[str, Any], overrides: Mapping[str, Any], extra: Sequence[str] = ()
) -> dict[str, Any]:
    """The raw config of a trial: the base, the trial's overrides, then command-line ``extra`` ones."""
    texts = [_as_override(k, v) for k, v in overrides.items()] + list(extra)
    return apply_overrides(dict(base_raw), texts)


def run_name(sweep_name: str, label: str) -> str:
    """The trial's ``run.name``: unique within the sweep, stable across relaunches (so a relaunch resumes)."""
    return _slug(f"{sweep_name}.{label}")


def load_sweep(
    path: str | os.PathLike[str], extra_overrides: Sequence[str] = (), name: str | None = None
) -> Sweep:
    """Read and validate a sweep file; ``extra_overrides`` (``key=value``) apply to every trial after the
    file's own, and ``name`` replaces the sweep's name (a different name is a different sweep)."""
    source = Path(path).resolve()
    raw = read_yaml_mapping(source, "sweep file")
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as error:  # every problem, one line each, as a config's are
        problems = []
        for e in error.errors():
            key = ".".join(str(p) for p in e["loc"]) or "(the file)"
            problems.append(f"  {key}: {e['msg'].removeprefix('Value error, ')}")
        raise ConfigError(f"invalid sweep file {source}:\n" + "\n".join(problems)) from None
    if name:
        try:
            spec = SweepSpec.model_validate({**raw, "name": name})
        except ValidationError as error:
            problem = next((e for e in error.errors() if e["loc"] == ("name",)), None)
            if problem is None:
                raise
            raise ConfigError(f"--name {name!r}: {problem['msg'].removeprefix('Value error, ')}") from None
    base_path = (source.parent / spec.base).resolve()
    base_raw = read_yaml_mapping(base_path, f"sweep file {source}: base config")
    trials = []
    command_line = [(".".join(path), value) for path, value in map(parse_override, extra_overrides)]
    for label, overrides in expand(spec):
        _check_command_line_keeps(spec, overrides, command_line)
        data = trial_config(base_raw, overrides, extra_overrides)
        _check_sweep_owned(spec, label, overrides, extra_overrides)
        data.setdefault("run", {})["name"] = run_name(spec.name, label)
        if spec.experiment:
            data.setdefault("mlflow", {})["experiment"] = spec.experiment
        config = config_from_dict(data, f"of sweep {spec.name}, trial {label!r} (base {base_path})")
        trials.append(Trial(label, overrides, config))
    names: dict[str, str] = {}
    for trial in trials:  # labels differ, but their run.name slugs may not ("B 64" and "B_64")
        other = names.setdefault(trial.config.run.name, trial.label)
        if other != trial.label:
            raise ConfigError(
                f"sweep {spec.name}: trials {other!r} and {trial.label!r} get the same run.name "
                f"{trial.config.run.name!r}; give their variants names that differ in letters or digits"
            )
    _check_shared_settings(spec, trials)
    return Sweep(spec, source, base_raw, tuple(trials), tuple(extra_overrides))


def _check_command_line_keeps(
    spec: SweepSpec, overrides: Mapping[str, Any], command_line: Sequence[tuple[str, Any]]
) -> None:
    """A whole section on the command line (``data={root: ...}``) replaced the sweep file's keys in it
    (``data.flip: false``) without a word, as one in the file's variants or grid would have (`expand`)."""
    for key, value in overrides.items():
        for section, given in command_line:
            if isinstance(given, Mapping) and (key == section or key.startswith(section + ".")):
                raise ConfigError(
                    f"sweep {spec.name}: the command line's {section}=... replaces the whole section "
                    f"{section}, which drops {key}={value!r} set by the sweep file; set the section's keys "
                    f"one by one ({section}.<key>=...)"
                )


_UNSET = object()


def _set_by(pairs: Sequence[tuple[str, Any]], dotted: str) -> Any:
    """The value the overrides ``pairs`` (in order) leave at ``dotted`` (``section.key``), or ``_UNSET``
    when none sets it (a whole section without the key unsets it)."""
    section, key = dotted.split(".", 1)
    value: Any = _UNSET
    for path, given in pairs:
        if path == dotted:
            value = given
        elif path == section:
            value = given.get(key, _UNSET) if isinstance(given, Mapping) else _UNSET
    return value


def _check_sweep_owned(
    spec: SweepSpec, label: str, overrides: Mapping[str, Any], extra: Sequence[str]
) -> None:
    """``run.name`` and (with ``experiment:``) ``mlflow.experiment`` are the sweep's: an override that set
    them to something else was silently replaced."""
    pairs = list(overrides.items()) + [(".".join(path), value) for path, value in map(parse_override, extra)]
    name = _set_by(pairs, "run.name")
    if name is not _UNSET and name != run_name(spec.name, label):
        raise ConfigError(
            f"sweep {spec.name}, trial {label!r}: run.name={name} is replaced by the sweep's "
            f"({run_name(spec.name, label)!r}, stable across relaunches); name the sweep with --name instead"
        )
    experiment = _set_by(pairs, "mlflow.experiment")
    if spec.experiment and experiment is not _UNSET and experiment != spec.experiment:
        raise ConfigError(
            f"sweep {spec.name}, trial {label!r}: mlflow.experiment={experiment} is replaced by the sweep "
            f"file's experiment: {spec.experiment}; change it there"
        )


# What the sweep decides once for all its trials: the parent run's store and experiment, Tune's storage and
# the cluster checks follow the first trial, so a trial that differs would be tracked or checked elsewhere.
_SHARED_SETTINGS = ("mlflow.tracking_uri", "mlflow.experiment", "run.storage_path", "scaling.topology")


def _check_shared_settings(spec: SweepSpec, trials: Sequence[Trial]) -> None:
    for key in _SHARED_SETTINGS:
        section, name = key.split(".")
        values = {t.label: getattr(getattr(t.config, section), name) for t in trials}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"{label!r}: {value}" for label, value in values.items())
            raise ConfigError(
                f"sweep {spec.name}: every trial must share {key} (one parent run, one Tune experiment); "
                f"the trials have {shown}"
            )
