import os
import secrets
import tempfile

# Every Ray the tests start listens on 127.0.0.1 only (evo.driver.local_ray) and checks a token: one per test
# session, handed to the Ray processes and CLIs the tests start through the environment (no file).
os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"})
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".inductor_cache"))
# The machine's calibrated rates (evaluators.judge.calibration): one fresh cache per session, not the user's.
os.environ.setdefault("EVO_RATES_CACHE", tempfile.mkdtemp(prefix="evo-rates-"))
# The baselines' compile cache (evaluators.sandbox.view.baseline_cache): one fresh folder per session too.
os.environ.setdefault("EVO_BASELINE_CACHE", tempfile.mkdtemp(prefix="evo-baseline-cache-"))

import pytest

_CORES = os.sched_getaffinity(0)  # every core this session may use


@pytest.fixture(autouse=True)
def all_cores_back():
    """A test that builds an `Evaluator` in this process is pinned to its cores (`evaluators.machine.device.pin_cores`);
    every later test gets all of them back, and so does a Ray started later (its workers inherit this process's)."""
    yield
    if os.sched_getaffinity(0) != _CORES:
        os.sched_setaffinity(0, _CORES)


def start_local_ray():
    """The in-process local Ray most tests share (start ~6 s, stop ~1.4 s), on 127.0.0.1."""
    from evo.driver import local_ray

    local_ray.init_local(num_cpus=2, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": {"TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]}})


@pytest.fixture(scope="session")
def ray_local():
    """One in-process local Ray for the whole session. Tests that need another cluster (test_cluster)
    shut it down and start it again when they are done."""
    import ray

    started = not ray.is_initialized()
    if started:
        start_local_ray()
    yield ray
    if started:
        ray.shutdown()


SMOKE_MODEL = "ui-test-engine"  # the registered model of the shared smoke run on a server
SMOKE_EXPERIMENT = "smoke"


def smoke_config(tracking_uri: str):
    """The config of the session's smoke run (`smoke_on_server`)."""
    from pathlib import Path

    from evo.driver.config import load_config

    return load_config(Path(__file__).resolve().parents[1] / "configs" / "kda_smoke.yaml", [
        f"mlflow.tracking_uri={tracking_uri}", f"mlflow.experiment={SMOKE_EXPERIMENT}",
        f"mlflow.model_name={SMOKE_MODEL}"])


@pytest.fixture(scope="session")
def smoke_on_server(request, tmp_path_factory):
    """The configs/kda_smoke.yaml run through the driver, logging to a real `mlflow server` that stays up
    for the session: (outcome, server, client, printed output). The end-to-end, lineage and MLflow UI tests
    read the same run (three generations, both baselines, the final paired re-timings); its config is
    `smoke_config(server.uri)`."""
    import io
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from evo.driver.config import load_config
    from evo.driver.run import run
    from tests.test_mlflow_outage import MlflowServer

    root = tmp_path_factory.mktemp("smoke-on-server")
    server = MlflowServer(root)
    try:
        server.start()  # before the session's Ray, when this runs first: the two start-ups do not compete
        request.getfixturevalue("ray_local")
        config = smoke_config(server.uri)
        out = io.StringIO()
        outcome = run(config, root / "run", out=out)
        yield outcome, server, MlflowClient(server.uri), out.getvalue()
    finally:
        server.stop()


@pytest.fixture
def fake() -> str:
    """The fake workload (tests/fake_workload.py) as evaluators and configs name it: by its dotted
    module path, which `evo.workloads.get_workload` imports like any workload kept outside the project."""
    from tests import fake_workload

    return fake_workload.NAME


@pytest.fixture
def trusted_engine_code():
    """Let this test build engines from the project's own seed sources in its process
    (`evo.core.code.load_module` refuses anywhere but an engine's confined process otherwise)."""
    from evo.core.code import trusted_code

    with trusted_code():
        yield


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (engines' timings and reductions alike), restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
