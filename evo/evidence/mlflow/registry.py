"""Register a search's best engine in MLflow as a model that describes itself, linked to the search's run.

A version is logged under the search's parent run as a pyfunc model whose loader module is
`evo.evidence.mlflow.pyfunc_engine` (nothing pickled): its `engine/` folder holds `engine.json`
(workload, preset, genome, and what the search measured) and `genome.json`. It carries
  - a signature: the workload's request schema as MLflow tensor specs (-1 for a free axis such as B
    or T), and the outputs read off the workload's output shapes, with a small input example;
  - tags: genome hash, latency and its spread, speedup over each baseline with its paired 95%
    interval, device, workload, preset, the run (`evo.evidence.mlflow.describe.version_tags`);
  - a description in Markdown.
The alias `champion` moves to a new version only on a paired win (`promote`): the new engine and the
current champion, both built from their registered records (`engine.json`), are timed interleaved in one
evaluator (the `race`, with the run's `search.intensify` settings), and the alias moves only when the
verdict is `faster` (the whole 95% interval of the latency ratio below 1 - min_effect). Two single medians
from separate runs never move it: they differ by more than the engines do (the same genome measured
18.75 ms in one run and 6.98 ms in another). The first version takes the alias; a version with the
champion's genome never does (no race needed); a champion that cannot be raced (another workload or
preset, or a version registered before `engine.json`) keeps it, and the text says how to move it by hand.
The race's verdict, ratio and interval are tags on the new version (`champion_race_*`).

The alias records the accuracy mode (every version is tagged `accuracy_mode`: exact, budget, or tolerance for a
call engine). A lossy engine (budget mode: bfloat16 or int8 weights accepted within a measured budget) never
takes `@champion` from an exact-mode champion by itself, however fast: `@champion` stays, the new version
contests `@champion-budget` instead (by the same rule: the first takes it, then a paired win), and its tag
`champion_kept` says why. Exact over budget, or the same mode: the paired race decides `@champion` as above.

`mlflow.pyfunc.load_model("models:/NAME@champion")` rebuilds the engine on CPU; the Serve app reads
`engine.json` from the model and builds and verifies the engine itself.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from evo.core.retiming import FAILED, FASTER, SLOWER, PairedTiming
from evo.evidence.claims import BUDGET, EXACT, loss_mode, loss_words
from evo.evidence.engine_record import ENGINE_FILE, EngineRecord, SourceError, record_from_summary
from evo.evidence.mlflow.describe import MODE_TAG, version_description, version_tags
from evo.evidence.summary import Summary
from evo.workloads.base import CheckCase, Preset, Workload

CHAMPION = "champion"
BUDGET_CHAMPION = "champion-budget"  # a lossy engine's alias under an exact champion (MLflow allows [\w-] in aliases)
KEPT_TAG = "champion_kept"  # on a lossy version: why it did not contest @champion
LATENCY_TAG = "latency_ms"
log = logging.getLogger("evo.mlflow")


Race = Callable[[EngineRecord, EngineRecord], PairedTiming | None]  # (new, champion) -> their paired timing
RACE_TAG = "champion_race"  # prefix of the race's tags on the new version: _verdict, _ratio, _low, _high, _against
NOT_RACED = "not raced"  # the verdict tag when no race decided (same genome, a champion that cannot be raced)


@dataclass(frozen=True)
class Registration:
    """A registered version and what became of the alias it contested (`alias`: `champion`, or `champion-budget`
    for a lossy engine under an exact champion): `reason` says why it moved or stayed, `race` is the paired
    timing of this version (a) against that alias's version before (b), when one ran; `kept` says why a lossy
    engine left `@champion` where it was ("" when it contested `@champion`)."""

    uri: str  # models:/NAME/VERSION
    name: str
    version: str
    champion: bool  # whether `alias` now points at this version
    previous: str | None  # the version `alias` pointed at before, if any
    reason: str
    race: PairedTiming | None = None
    alias: str = CHAMPION
    kept: str = ""

    def describe(self) -> str:
        at = f"alias @{self.alias}"
        if self.champion and self.previous:
            text = f"{at} moved to version {self.version}: {self.reason}"
        elif self.champion:
            text = f"{at} set to version {self.version} ({self.reason})"
        elif self.previous is None:
            text = f"{at} not set: {self.reason}"
        else:
            text = f"{at} stays on version {self.previous}: {self.reason}"
        return f"{self.kept}; {text}" if self.kept else text


def _numpy_dtype(name: str) -> np.dtype:
    """What a numpy caller sends for a tensor of dtype `name` (numpy has no bfloat16: float32, cast by the engine)."""
    return np.dtype("float32" if name == "bfloat16" else name)


def engine_signature(workload: Workload, preset: Preset):
    """The model signature: every input of the workload's request schema (optional ones too: MLflow's
    tensor specs cannot be optional), free axes as -1; outputs from `output_shapes` when declared."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    specs = workload.request_specs(preset)
    inputs = Schema([TensorSpec(_numpy_dtype(s.dtypes[0]), tuple(-1 if isinstance(d, str) else int(d) for d in s.shape),
                                s.name) for s in specs])
    free = {d for s in specs for d in s.shape if isinstance(d, str)}
    like = workload.timing_case(preset)
    at = workload.output_shapes(CheckCase("signature", dict(preset.shape), like.distribution, like.with_initial_state))
    moved = workload.output_shapes(CheckCase("signature", {k: v + (k in free) for k, v in preset.shape.items()},
                                             like.distribution, like.with_initial_state))
    if not at or not moved:
        return ModelSignature(inputs=inputs)
    outputs = Schema([TensorSpec(np.dtype("float32"), tuple(-1 if a != b else a for a, b in zip(at[name], moved[name])), name)
                      for name in at])  # predict returns float32
    return ModelSignature(inputs=inputs, outputs=outputs)


MAX_EXAMPLE_VALUES = 1_000_000  # an example is stored as JSON with the model: a large preset's is left out


def input_example(workload: Workload, preset: Preset, seed: int = 0) -> dict[str, np.ndarray] | None:
    """One request at the smallest verified size of each free axis, every input present (as the signature asks);
    None when even that is over MAX_EXAMPLE_VALUES values (MLflow then notes that the example is missing)."""
    specs = workload.request_specs(preset)
    free = {d for s in specs for d in s.shape if isinstance(d, str)}
    axes = {axis: lo for axis, (lo, _) in workload.domain(preset).axis_bounds().items() if axis in free}
    example = workload.example_request(preset, seed, **axes)
    missing = [s.name for s in specs if s.name not in example]
    if missing:  # an optional input the example leaves out: zeros of its shape
        sizes = {**preset.shape, **axes}
        for spec in (s for s in specs if s.name in missing):
            example[spec.name] = np.zeros([sizes[d] if isinstance(d, str) else d for d in spec.shape],
                                          _numpy_dtype(spec.dtypes[0]))
    example = {name: _as_numpy(value) for name, value in example.items() if name in {s.name for s in specs}}
    return example if sum(a.size for a in example.values()) <= MAX_EXAMPLE_VALUES else None


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    return value.float().numpy() if str(value.dtype) == "torch.bfloat16" else value.numpy()


def _save_pyfunc(validate_serving_input: bool = False, **kwargs: Any) -> Any:
    import mlflow.pyfunc

    return mlflow.pyfunc.save_model(**kwargs)


# mlflow.pyfunc as `Model.log` sees it, but for `validate_serving_input=False`, which `pyfunc.log_model` cannot pass
# (`pyfunc.save_model` refuses the keyword): MLflow would load the logged model to predict its input example, so
# build and verify the engine in the sandbox once more (~8 s on 2 cores) after the judge verified it.
_PYFUNC_UNLOADED = SimpleNamespace(__name__="mlflow.pyfunc", save_model=_save_pyfunc)


def register_engine(record: EngineRecord, run_id: str, model_name: str, tracking_uri: str,
                    tags: dict[str, str] | None = None, description: str | None = None) -> str:
    """Log the engine as a model of run `run_id` and register it as `model_name`; returns its version.
    `tags` and `description` go on the model version."""
    import mlflow
    from mlflow.models import Model
    from mlflow.tracking import MlflowClient

    from evo.workloads import get_workload

    workload = get_workload(record.workload)
    preset = workload.presets()[record.preset]
    try:
        signature, example = engine_signature(workload, preset), input_example(workload, preset)
    except NotImplementedError:  # a workload without a request schema: it cannot be served, and has no signature
        signature, example = None, None
    mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "engine"
        folder.mkdir()
        (folder / ENGINE_FILE).write_text(json.dumps(record.to_dict(), indent=2, sort_keys=True))
        (folder / "genome.json").write_text(json.dumps(record.genome.to_dict(), indent=2, sort_keys=True))
        with mlflow.start_run(run_id=run_id):
            info = Model.log(
                None, _PYFUNC_UNLOADED, name="engine", loader_module="evo.evidence.mlflow.pyfunc_engine",
                data_path=str(folder), signature=signature, input_example=example,
                pip_requirements=["engine-factory", "torch"], registered_model_name=model_name,
                validate_serving_input=False,
            )
    version = str(info.registered_model_version)
    client = MlflowClient(tracking_uri=tracking_uri)
    for key, value in (tags or {}).items():
        client.set_model_version_tag(model_name, version, key, value)
    if description:
        client.update_model_version(model_name, version, description=description)
    return version


def registered_record(tracking_uri: str, name: str, version: str) -> EngineRecord:
    """The record a registered version holds (`engine.json` among its model artifacts); SourceError when the
    store cannot give it or the version has none (registered before the file existed, or by something else).
    `evo.serving.source` reads `models:/...` sources the same way."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    source = f"models:/{name}/{version}"
    quiet = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"  # no progress bar on the run's output
    saved, os.environ[quiet] = os.environ.get(quiet), "false"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
            local = Path(mlflow.artifacts.download_artifacts(
                artifact_uri=client.get_model_version_download_uri(name, str(version)), dst_path=tmp,
                tracking_uri=tracking_uri, registry_uri=tracking_uri))
            found = sorted(local.rglob(ENGINE_FILE)) if local.is_dir() else [local]
            if not found:
                raise SourceError(f"{source} has no {ENGINE_FILE}: registered before it existed, or not by this "
                                  f"project")
            return EngineRecord.from_dict(json.loads(found[0].read_text()), source)
    except SourceError:
        raise
    except (MlflowException, OSError, KeyError, ValueError) as exc:  # a store that fails, a malformed engine.json
        said = " ".join(str(exc).split())[:300]  # one line: it ends up in Registration.describe()
        raise SourceError(f"could not load {source} from MLflow at {tracking_uri}: "
                          f"{type(exc).__name__}: {said}") from exc
    finally:
        if saved is None:
            os.environ.pop(quiet, None)
        else:
            os.environ[quiet] = saved


def promote(client, name: str, version: str, record: EngineRecord, race: Race | None,
            tracking_uri: str) -> Registration:
    """Point `champion` at `version` (whose engine is `record`) when there is no champion yet, or when `race`
    (the new engine against the champion's, paired) says it is faster by the minimum effect; tag the version
    with the race. Conservative everywhere else: the same genome, a champion that cannot be raced (no
    loadable record, another workload or preset), no race (`race` None or it returned None), or a verdict of
    slower, equal or failed leave the alias where it is. A single timing never moves it (see the module).
    A lossy engine (budget mode) under a champion that is not (exact; one registered before the mode was
    tagged was exact) contests `champion-budget` by the same rule instead, and says why (`KEPT_TAG`)."""
    from mlflow.exceptions import MlflowException

    version = str(version)
    try:
        current = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:  # no champion yet: the first measured version takes it, whatever its mode
        current = None
    held = (current.tags.get(MODE_TAG) or EXACT) if current is not None else None
    if loss_mode(record.accuracy) != BUDGET or held in (None, BUDGET):
        return _promote(client, name, version, record, race, tracking_uri, CHAMPION)
    kept = (f"alias @{CHAMPION} stays on version {current.version} ({held} mode): this engine is lossy ("
            f"{loss_words(record.accuracy)}) and a budget-mode engine never takes @{CHAMPION} from the {held}-mode "
            f"champion by itself (to choose it anyway, set it by hand: MlflowClient().set_registered_model_alias(NAME, "
            f"{CHAMPION!r}, VERSION)); it contests @{BUDGET_CHAMPION}")
    client.set_model_version_tag(name, version, KEPT_TAG, kept[:5000])
    contested = _promote(client, name, version, record, race, tracking_uri, BUDGET_CHAMPION)
    return dataclasses.replace(contested, kept=kept)


def _promote(client, name: str, version: str, record: EngineRecord, race: Race | None, tracking_uri: str,
             alias: str) -> Registration:
    """`promote` for one alias: the first measured version takes it, then only a paired win moves it."""
    from mlflow.exceptions import MlflowException

    uri = f"models:/{name}/{version}"
    try:
        current = client.get_model_version_by_alias(name, alias)
    except MlflowException:  # nobody holds the alias yet: the first measured version takes it
        if record.latency_ms is None:
            return Registration(uri, name, version, False, None, "this version has no measured latency", alias=alias)
        client.set_registered_model_alias(name, alias, version)
        first = "the first champion" if alias == CHAMPION else f"the first @{alias}"
        return Registration(uri, name, version, True, None, first, alias=alias)
    against = str(current.version)
    moved, reason, timing = _contest(record, against, current.tags.get("genome_hash"), race,
                                     lambda: registered_record(tracking_uri, name, against), alias)
    tags = {f"{RACE_TAG}_against": against, f"{RACE_TAG}_verdict": timing.verdict if timing else NOT_RACED,
            f"{RACE_TAG}_note": reason[:5000], f"{RACE_TAG}_alias": alias}
    if timing and timing.verdict != FAILED:
        tags.update({f"{RACE_TAG}_{key}": f"{getattr(timing, key):.4f}" for key in ("ratio", "low", "high")})
        tags[f"{RACE_TAG}_pairs"] = str(timing.pairs)
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    if moved:
        client.set_registered_model_alias(name, alias, version)
    return Registration(uri, name, version, moved, against, reason, timing, alias=alias)


def _contest(record: EngineRecord, against: str, champion_hash: str | None, race: Race | None,
             load_champion: Callable[[], EngineRecord], alias: str = CHAMPION) -> tuple[bool, str, PairedTiming | None]:
    """(whether `alias` moves, why, the race's timing) for `record` against the alias's version `against`."""
    if champion_hash == record.genome.hash:
        return False, f"same genome ({record.genome.hash}), no race needed", None
    keep = (f"a single timing does not move the alias; to replace the champion anyway, set it by hand "
            f"(MlflowClient().set_registered_model_alias(NAME, {alias!r}, VERSION))")
    try:
        champion = load_champion()
    except SourceError as exc:
        return False, f"the champion cannot be raced, its record does not load ({exc}); {keep}", None
    if champion.genome.hash == record.genome.hash:
        return False, f"same genome ({record.genome.hash}), no race needed", None
    if (champion.workload, champion.preset) != (record.workload, record.preset):
        return False, (f"the champion is an engine for {champion.workload}/{champion.preset}, this one for "
                       f"{record.workload}/{record.preset}: they cannot be raced (register under another model "
                       f"name); {keep}"), None
    timing = race(record, champion) if race else None
    if timing is None:
        return False, f"no paired race was run (paired re-timing is off); {keep}", None
    if timing.verdict == FAILED:
        return False, f"the paired race failed ({timing.message}); the alias moves only on a paired win", timing
    interval = (f"paired {timing.ratio:.2f}x the latency of version {against} [95% {timing.low:.2f}, "
                f"{timing.high:.2f}] over {timing.pairs} calls")
    if timing.verdict == FASTER:
        return True, interval, timing
    if timing.verdict == SLOWER:
        return False, f"slower, {interval}", timing
    need = f"a win needs the whole interval below {1 - timing.min_effect:g}"
    return False, f"equal within noise, {interval} ({need})", timing


def register_best(summary: Summary, run_dir: Path, run_id: str, model_name: str, tracking_uri: str,
                  experiment_id: str | None = None, race: Race | None = None) -> Registration:
    """Register the best engine of `summary` (a version with signature, tags and description, under run
    `run_id`) and move the alias when it wins a paired race against the champion: `race(new, champion)` times
    the two engines paired (the driver's runs them in the run's evaluator pool) and returns their PairedTiming,
    or None when it cannot; without `race` the alias moves only to a first champion (see `promote`)."""
    from mlflow.tracking import MlflowClient

    tags = version_tags(summary, run_id, run_dir)
    description = version_description(summary, Path(run_dir).name, experiment_id, run_id)
    record = record_from_summary(summary, str(run_dir))
    version = register_engine(record, run_id, model_name, tracking_uri, tags, description)
    client = MlflowClient(tracking_uri=tracking_uri)
    client.update_registered_model(model_name, description=(
        f"Engines for {summary.workload} at preset `{summary.preset}`, one version per search that registered its best. "
        f"`@{CHAMPION}` moves to a new version only when it wins a paired race against the current champion "
        f"(both timed interleaved in one evaluator; the whole 95% interval of the latency ratio below 1 minus the "
        f"minimum effect): the version's `{RACE_TAG}_*` tags hold the verdict, ratio and interval. A lossy engine "
        f"(`{MODE_TAG}` budget) never takes `@{CHAMPION}` from an exact one: it contests `@{BUDGET_CHAMPION}` by the "
        f"same rule. Serve it with `python -m evo serve models:/{model_name}@{CHAMPION}`."))
    return promote(client, model_name, version, record, race, tracking_uri)


def __getattr__(name: str):
    """`EnginePyfunc`, the pickled class of versions registered before the loader module, loads on demand."""
    if name == "EnginePyfunc":
        from evo.evidence.mlflow.legacy_pyfunc import EnginePyfunc

        return EnginePyfunc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
