"""A workload is one module: a toy one, written outside the project, is searched, served and load-tested.

The toy workload (o = relu(x) + y) is one file in a temporary folder, named by its dotted module path;
nothing of the project is edited or registered. The search, the evaluators (Ray actors and their
engine processes), the Serve replica and the load generator find everything they need through the
`Workload` base class's hooks.
"""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from evo.core.genome import Genome
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo, Preset, Workload

ROOT = Path(__file__).resolve().parents[1]
TOY = "toyload_xyz"  # a top-level module name the project does not have

TOY_SOURCE = textwrap.dedent('''
    """A toy workload kept outside the project: o[b, n] = relu(x[b, n]) + y[b, n]."""
    from __future__ import annotations

    import torch

    from evo.core.genome import Gene, GeneSpace
    from evo.workloads.base import NO_SOURCES, CheckCase, Preset, Roofline, Workload
    from evo.workloads.requests import TensorSpec

    SHAPE = {"B": 2, "N": 256}


    def _engine(impl: str, preallocate: bool, per_row: bool):
        def engine(x: torch.Tensor, y: torch.Tensor) -> dict:  # x, y: [B, N]
            rows = [slice(b, b + 1) for b in range(x.shape[0])] if per_row else [slice(None)]
            o = torch.empty_like(x) if preallocate else None
            parts = []
            for r in rows:
                if impl == "clamp":
                    part = x[r].clamp(min=0) + y[r]
                elif impl == "wrong":
                    part = x[r] + y[r]  # forgets the relu: the check must catch it
                else:
                    part = torch.relu(x[r]) + y[r]
                if o is not None:
                    o[r] = part
                parts.append(part)
            return {"o": o if o is not None else torch.cat(parts)}

        return engine


    class ToyWorkload(Workload):
        name = "toy"
        input_names = ("x", "y")
        output_names = ("o",)

        def presets(self):
            return {"cpu": Preset("cpu", dict(SHAPE), "float32", "cpu")}

        def gene_space(self, preset, device):
            return GeneSpace("toy", (
                Gene("impl", "fusion", ("relu", "clamp", "wrong"), "relu", "how relu(x) + y is computed"),
                Gene("per_row", "scheduling", (False, True), False, "one call per batch row"),
                Gene("preallocate", "memory", (False, True), False, "write into one preallocated output"),
            ))

        def free_axes(self, preset):
            return {"B": (1, preset.shape["B"]), "N": (preset.shape["N"],)}

        def check_cases(self, preset):
            return [[CheckCase("one_row", {**preset.shape, "B": 1}, "normal")],
                    [CheckCase("preset", dict(preset.shape), "normal")]]

        def make_inputs(self, case, dtype, device, seed):
            gen = torch.Generator().manual_seed(seed)
            B, N = case.shape["B"], case.shape["N"]
            return {name: torch.randn(B, N, generator=gen).to(device=device, dtype=getattr(torch, dtype))
                    for name in ("x", "y")}

        def reference(self, inputs):
            return {"o": torch.relu(inputs["x"].double()) + inputs["y"].double()}

        def build(self, genome, preset, device, sources=NO_SOURCES):
            return _engine(genome["impl"], genome["preallocate"], genome["per_row"])

        def baselines(self, preset):
            return {"eager": lambda device: _engine("relu", False, False)}

        def roofline(self, preset, rates):
            n = preset.shape["B"] * preset.shape["N"]
            return Roofline(flops=2.0 * n, bytes=3.0 * 4 * n, rates=rates)

        def request_specs(self, preset):
            dims = dict(shape=("B", preset.shape["N"]), dtypes=(preset.dtype,), dim_names=("B", "N"))
            return (TensorSpec("x", **dims), TensorSpec("y", **dims))


    WORKLOAD = ToyWorkload()
''')


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy workload's folder, importable here (sys.path) and by every process started from here
    (PYTHONPATH): Ray workers, the evaluators' engine processes, Serve replicas."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / f"{TOY}.py").write_text(TOY_SOURCE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    yield folder
    sys.modules.pop(TOY, None)


# ------------------------------------------------------------------------------ the base class, no Ray


class _Bare(Workload):
    name = "bare"
    output_names = ("o", "state")

    def presets(self) -> dict[str, Preset]:
        return {"p": Preset("p", {"B": 2, "T": 8}, "bfloat16", "cpu")}

    def check_cases(self, preset: Preset) -> list[list[CheckCase]]:
        return [[CheckCase("short", {"B": 2, "T": 4}, "wide")], [CheckCase("full", dict(preset.shape), "narrow")]]


def test_required_hooks_say_which_workload_must_override_what():
    bare = _Bare()
    for hook, args in (("gene_space", (None, None)), ("make_inputs", (None, "float32", "cpu", 0)),
                       ("reference", ({},)), ("build", (None, None, None)), ("baselines", (None,)),
                       ("roofline", (None, None)), ("request_specs", (None,))):
        with pytest.raises(NotImplementedError, match=f"'bare' .*_Bare.*{hook}"):
            getattr(bare, hook)(*args)


def test_optional_hooks_have_declared_defaults():
    bare = _Bare()
    preset = bare.presets()["p"]
    assert bare.free_axes(preset) == {"B": (2,), "T": (8,)}  # only the preset's own shape
    assert bare.open_stages(preset, DeviceInfo("cpu", "cpu")) == ()
    assert bare.output_dtypes(preset) == {"o": "bfloat16", "state": "bfloat16"}
    assert bare.forbidden_callables() == []
    assert bare.timing_case(preset).name == "full"  # the check case at the preset shape
    assert bare.reference_baseline is None
    genome = Genome("bare")
    assert bare.label(genome) == genome.hash[:8]
    with pytest.raises(ValueError, match=r"axes \['H'\] are not free axes of bare/p; free: \['B', 'T'\]"):
        bare.example_request(preset, 0, H=3)


def test_a_module_path_names_a_workload_and_anything_else_is_refused_with_the_reason(toy):
    assert type(get_workload(TOY)).__name__ == "ToyWorkload"
    with pytest.raises(ValueError, match="unknown workload 'no_such_toyload'; available: \\['kda', 'kimi_linear', 'llama', 'llama_serve'\\]"):
        get_workload("no_such_toyload")
    (toy / "not_a_workload_xyz.py").write_text("WORKLOAD = object()\n")
    try:
        with pytest.raises(ValueError, match="must define WORKLOAD, an instance of .*Workload subclass; found object"):
            get_workload("not_a_workload_xyz")
    finally:
        sys.modules.pop("not_a_workload_xyz", None)


def test_the_toy_workloads_example_requests_match_its_request_schema(toy):
    from evo.serving.codec import decode_request
    from evo.serving.loadgen import request_body

    workload = get_workload(TOY)
    preset = workload.presets()["cpu"]
    inputs = workload.example_request(preset, 3, B=1)
    decoded = decode_request(request_body(inputs, "b64"), workload.request_specs(preset), max_bytes=1 << 20,
                             extra_keys=("encoding",))
    assert set(decoded) == {"x", "y"} and all(torch.equal(decoded[k], inputs[k]) for k in decoded)


def test_serving_and_the_registry_name_no_workloads_tensors():
    """What a request holds comes from the workload (`request_specs`), never from a name in serving."""
    import ast

    from evo.workloads.kda import WORKLOAD as KDA

    names = set(KDA.input_names) | set(KDA.output_names)
    hits = []
    for path in [*sorted((ROOT / "evo" / "serving").glob("*.py")), ROOT / "evo" / "evidence" / "mlflow" / "registry.py"]:
        tree = ast.parse(path.read_text())
        specs = {id(c) for f in ast.walk(tree) if isinstance(f, ast.FormattedValue) and f.format_spec
                 for c in ast.walk(f.format_spec)}  # f"{x:g}" is a format, not a name
        hits += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and node.value in names and id(node) not in specs]
    assert not hits, hits


# ------------------------------------------------------------------------ search, serve, load: real Ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _project_state() -> str:
    """What git sees changed in the project (tracked and untracked files); '' outside a git checkout."""
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else ""


@pytest.mark.slow
def test_a_toy_workload_outside_the_project_is_searched_served_and_load_tested(toy, tmp_path):
    import ray
    from ray import serve

    from evo.driver import local_ray
    from evo.driver.config import config_from_dict
    from evo.driver.run import run
    from evo.serving.app import build_app
    from evo.serving.codec import decode_tensor
    from evo.serving.loadgen import load_run, request_body
    from tests.conftest import start_local_ray
    from tests.waiting import wait_for

    before = _project_state()
    was_local = ray.is_initialized()
    if was_local:  # the session's Ray predates the toy folder: its workers could not import the toy
        ray.shutdown()
    env = {"PYTHONPATH": os.environ["PYTHONPATH"], "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    local_ray.init_local(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        config = config_from_dict({
            "workload": TOY, "preset": "cpu", "name": "toy", "out_dir": str(tmp_path / "runs"),
            "search": {"seed": 3, "generations": 2, "offspring": 3, "max_evaluations": 6, "agents": ["fusion"],
                       "population": {"size": 3, "elite": 1, "tournament": 2}},
            "evaluators": {"count": 1},
            "evaluator": {"warmup": 1, "repeats": 3},
            "mlflow": {"enabled": False},
        })
        log = io.StringIO()
        outcome = run(config, tmp_path / "run", out=log)
        summary = json.loads((outcome.run_dir / "summary.json").read_text())
        assert summary["workload"] == TOY and summary["best_genome"], log.getvalue()[-3000:]
        assert summary["best_genome"]["fusion"]["impl"] != "wrong"  # wrong answers never win
        assert "eager" in summary["baselines"], log.getvalue()[-3000:]

        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"engine": str(outcome.run_dir), "max_batch_size": 2, "batch_wait_timeout_s": 0.01}),
                  name="toy", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{url}/healthz")["status"] == "ok", 120, "the toy engine to be verified",
                 (OSError, ValueError))
        info = _get(f"{url}/v1/engine")
        assert info["workload"] == TOY and info["hash"] == summary["best_hash"]

        workload = get_workload(TOY)
        preset = workload.presets()["cpu"]
        requests = [workload.example_request(preset, seed, B=1 + seed % 2) for seed in range(4)]
        expected = [workload.reference(inputs)["o"] for inputs in requests]

        def check(index: int, response: dict) -> str | None:
            got = decode_tensor(response["outputs"]["o"], "o").double()
            error = ((got - expected[index]).norm() / expected[index].norm()).item()
            return None if got.shape == expected[index].shape and error < 1e-6 else f"request {index}: error {error}"

        report = load_run(url, [request_body(inputs, "b64") for inputs in requests], clients=2, requests=12,
                          check=check)
        assert report.requests == 12 and report.errors == 0, report.first_error
        wrong = [dict(r, x=-r["x"]) for r in requests]  # answers to other inputs must fail the check
        assert load_run(url, [request_body(w, "b64") for w in wrong], 1, 2, check=check).errors == 2
    finally:
        serve.shutdown()
        ray.shutdown()
        if was_local:
            start_local_ray()
    assert _project_state() == before, "the toy run edited or created project files"


def _get(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())
