"""A finished smoke run as the MLflow UI shows it, in headless Chromium: the parent run at the URL the run
printed (its description: best engine, speedups, lineage link; on the runs view, not the GenAI overview),
and the registered model version with its signature and tags, its alias, and `models:/NAME@champion`."""
from __future__ import annotations

import json
import re
import time

import pytest

from evo.evidence.claims import claim_sentence, short_claim
from evo.evidence.mlflow.links import EXPERIMENT_KIND, KIND_TAG, model_version_url
from evo.evidence.mlflow.registry import CHAMPION
from evo.workloads import get_workload
from tests.browser import Browser, find_chromium
from tests.conftest import SMOKE_MODEL
from tests.waiting import wait_for

MODEL = SMOKE_MODEL
PRESET = get_workload("kda").presets()["cpu_small"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(smoke_on_server):
    """The session's small smoke run on a real `mlflow server` (tests/conftest.py)."""
    return smoke_on_server


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium: install Debian's `chromium` (scripts/setup.sh does where apt-get is available)")
    browser = Browser(executable)
    yield browser
    browser.close()


def _page_text(browser: Browser, url: str, *needles: str, timeout: float = 120) -> str:
    """The page's visible text once every needle is in it (the UI fills in as its API calls return)."""
    browser.navigate(url)
    return wait_for(lambda: (lambda text: text if all(n in text for n in needles) else None)(
        browser.evaluate("document.body.innerText")), timeout, f"{url} to show {needles}", tolerate=(RuntimeError,))


def test_the_printed_url_opens_the_run_on_its_description(finished, browser, tmp_path):
    outcome, server, client, printed = finished
    summary = outcome.summary
    url = re.search(r"^MLflow run: (\S+)$", printed, re.M).group(1)
    parent = client.get_run(outcome.mlflow_run_id)
    experiment_id = parent.info.experiment_id
    assert url == f"{server.uri}/#/experiments/{experiment_id}/runs/{outcome.mlflow_run_id}?workflowType=machine_learning"
    baseline = summary.best_baseline
    claim = claim_sentence(summary).replace("`", "")  # the paired claim, as the description's first line states it
    assert f"(paired, 95% [" in claim, claim
    text = _page_text(browser, url, summary.best_hash, claim, "Description")
    browser.screenshot(tmp_path / "run.png")
    assert f"single timing {summary.speedups[baseline]:.2f}x" in text and "of the roofline floor" in text
    assert "Child runs" in text
    assert parent.info.run_name == f"run · {short_claim(summary)}" and "paired" in parent.info.run_name  # the title
    # without a click: in the first screen, and above the fold where the UI cuts a long description ("Show more")
    seen = _in_first_screen(browser, claim)
    assert seen is True, f"the claim {claim!r} on the run page: {seen}"
    lineage = browser.evaluate("[...document.querySelectorAll('a')].filter(a => a.textContent === 'the lineage page')"
                               ".map(a => a.href)")
    assert lineage == [f"{server.uri}/#/experiments/{experiment_id}/runs/{outcome.mlflow_run_id}"
                       "/artifacts/lineage/lineage.html?workflowType=machine_learning"]
    # the experiment opens on its runs, not on the GenAI overview; generation runs span their real time
    assert client.get_experiment(experiment_id).tags[KIND_TAG] == EXPERIMENT_KIND
    _page_text(browser, f"{server.uri}/#/experiments/{experiment_id}?workflowType=machine_learning", "matching runs")
    children = client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{outcome.mlflow_run_id}'")
    assert len(children) == summary.generations
    assert all(c.info.end_time - c.info.start_time > 500 for c in children), [
        (c.info.start_time, c.info.end_time) for c in children]


def test_the_model_version_shows_its_signature_and_tags_and_serves_as_champion(finished, browser, tmp_path):
    from evo.serving.source import resolve

    outcome, server, client, printed = finished
    summary = outcome.summary
    name, version = summary.registered_model.removeprefix("models:/").split("/")
    assert name == MODEL and f"registered {summary.registered_model}: alias @{CHAMPION}" in printed
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == version
    claim = claim_sentence(summary).replace("`", "")
    text = _page_text(browser, model_version_url(server.uri, name, version), summary.best_hash, "Inputs (6)", "Outputs (2)",
                      "speedup_ci.chunk_pairwise_c64", claim)
    seen = _in_first_screen(browser, claim)
    browser.screenshot(tmp_path / "model-version-first-screen.png")
    assert seen is True, f"the claim {claim!r} on the model version page: {seen}"
    tags = client.get_model_version(name, version).tags
    for key in ("latency", "device", "preset", "run_id", f"speedup.{summary.best_baseline}"):
        assert key in text and tags[key] in text, key
    # unfold the signature's inputs: click the innermost element that says so
    browser.evaluate("[...document.querySelectorAll('*')].filter(e => e.textContent.trim() === 'Inputs (6)').pop().click()")
    shape = ",".join(str(d) for d in (-1, -1, *(PRESET.shape[a] for a in "HK")))
    schema = wait_for(lambda: (lambda t: t if "initial_state (required)" in t else None)(
        browser.evaluate("document.body.innerText")), 60, "the signature's inputs", tolerate=(RuntimeError,))
    browser.screenshot(tmp_path / "model-version.png")
    assert "q (required)" in schema and f"Tensor (dtype: float32, shape: [{shape}])" in schema
    assert resolve(f"models:/{name}@{CHAMPION}", server.uri).genome.hash == summary.best_hash


# Whether the innermost element that says CLAIM is seen without scrolling or a click: inside the window, and
# inside every ancestor that clips its content (the description's fold); null while no element says it.
_SHOWN = """(() => {
  const claim = CLAIM;
  const holders = [...document.querySelectorAll('body *')].filter(e => e.textContent.includes(claim));
  const el = holders.find(e => ![...e.children].some(c => c.textContent.includes(claim)));
  if (!el) return null;
  const r = el.getBoundingClientRect();
  if (r.height === 0 || r.top < 0 || r.bottom > window.innerHeight) return `outside the first screen: ${r.top}..${r.bottom}`;
  for (let a = el.parentElement; a; a = a.parentElement) {
    const s = getComputedStyle(a), b = a.getBoundingClientRect();
    if (s.overflowY !== 'visible' && (r.top < b.top - 1 || r.bottom > b.bottom + 1)) return `folded: ${r.bottom} > ${b.bottom}`;
  }
  return true;
})()"""


def _in_first_screen(browser: Browser, text: str, timeout: float = 30) -> bool | str | None:
    """True once `text` is seen without scrolling or a click (`_SHOWN`), else what was seen last."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen = browser.evaluate(_SHOWN.replace("CLAIM", json.dumps(text)))
        except RuntimeError as exc:  # the page is still being replaced
            seen = str(exc)
        if seen is True or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)
