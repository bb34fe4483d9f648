"""Experiment configuration: YAML in, frozen dataclasses out, every key checked.

Each option is declared once, as a dataclass field with its default and a comment; unknown keys
anywhere are an error that names the key and lists the allowed ones. `--set a.b=value` overrides
parse `value` as YAML (so `8`, `true`, `[a, b]` work).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from evaluators.settings import EvaluatorSettings, PoolSettings
from evo.core.population import PopulationSettings
from evo.core.search import SearchSettings
from evo.workloads import DEFAULT_WORKLOAD, SAMPLE_CONFIG
from operators.code_settings import CodeAgentSettings


class ConfigError(ValueError):
    """A config file or override is wrong; the message says where and what is allowed."""


@dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db
    experiment: str = "engine-factory"
    enabled: bool = True
    register_model: bool = True  # register the best engine as a pyfunc model, linked to the parent run
    model_name: str | None = None  # default: <workload>-<preset>-engine


@dataclass(frozen=True)
class RaySettings:
    address: str | None = None  # default: $RAY_ADDRESS, else an in-process local Ray
    num_cpus: int | None = None  # for a local Ray only; default: all cores


@dataclass(frozen=True)
class RunConfig:
    workload: str = DEFAULT_WORKLOAD  # a registered name or the dotted path of a workload module
    preset: str = "cpu"
    name: str = "run"  # run directories are <out_dir>/<name>-<timestamp>
    out_dir: str = "runs"
    baselines: tuple[str, ...] | None = None  # None: every baseline available here
    genes: dict[str, list] | None = None  # restrict genes to these values, e.g. {backend_intra: [eager]}
    search: SearchSettings = field(default_factory=SearchSettings)
    evaluators: PoolSettings = field(default_factory=PoolSettings)
    evaluator: EvaluatorSettings = field(default_factory=EvaluatorSettings)
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)
    ray: RaySettings = field(default_factory=RaySettings)
    code_agent: CodeAgentSettings = field(default_factory=CodeAgentSettings)  # used when search.agents has "code"

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config (or defaults when `path` is None) and apply `key=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found; the sample config {SAMPLE_CONFIG} of this "
                              f"repository is a small, complete one")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {str(path)!r} is not valid YAML: {exc}") from exc
        if data is None:  # an empty file would silently run the full default search
            raise ConfigError(f"config {str(path)!r} is empty (or only comments); give the sections to change, "
                              f"e.g. copy the sample config {SAMPLE_CONFIG} of this repository")
        if not isinstance(data, dict):
            raise ConfigError(f"config {str(path)!r} must be a mapping of sections, got {type(data).__name__}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. search.generations=3")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ConfigError(f"override {item!r}: {raw!r} is not a YAML value ({problem}); quote strings and "
                              f"close brackets, e.g. search.agents=[fusion,memory]") from None
    return config_from_dict(data)


def config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    config = _build(RunConfig, data, "")
    _check_agents(config.search.agents)
    return config


def _check_agents(names: tuple[str, ...]) -> None:
    """Every `search.agents` entry names a registered agent or a dotted path to a Proposer class."""
    from operators.registry import proposer_class  # importing it registers the built-in agents

    for name in names:
        try:
            proposer_class(name)
        except ValueError as exc:
            raise ConfigError(f"search.agents: {exc}") from None


def _build(cls: type, data: Any, where: str) -> Any:
    if cls in (EvaluatorSettings, CodeAgentSettings):
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where or 'config'}; allowed: {names}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], data[name], f"{where}.{name}".lstrip(".")) for name in names if name in data}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from exc


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        return _convert(hint, value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (type(value) is hint):
        raise ConfigError(f"{where} must be {hint.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, CodeAgentSettings):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


__all__ = ["ConfigError", "MlflowSettings", "PoolSettings", "PopulationSettings", "RaySettings", "RunConfig",
           "load_config", "config_from_dict"]
