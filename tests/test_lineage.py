"""Lineage review: the family tree of a run, `python -m evo report`, each generation's candidates in MLflow,
and the lineage page as the MLflow UI shows it in a real headless Chromium."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from evo.cli import main as cli_main
from evo.evidence.journal import DiskEvidence, write_json
from evo.evidence.lineage import ancestry_lines, candidate_table, candidate_tags, gene_diff, load_lineage
from evo.evidence.lineage_view import write_lineage
from evo.core.records import EvalResult, Evaluated, Proposal
from tests.browser import Browser, find_chromium
from tests.toy_space import toy_space
from tests.waiting import wait_for

PNG = b"\x89PNG\r\n\x1a\n"


def _item(genome, parents, agent, move, generation, index, status="ok", latency=float("nan")) -> Evaluated:
    proposal = Proposal(genome, tuple(parents), agent, move, generation, index=index)
    result = EvalResult(genome.hash, status, message=f"{status} message", latency_ms=latency, evaluator=f"evaluator-{index % 2}",
                        error="Traceback: boom" if status != "ok" else "")
    return Evaluated(proposal, result)


@pytest.fixture
def family(tmp_path):
    """Two seeds, a mutation of each, a failed child, and an integration child of both lines (the best)."""
    space = toy_space()
    a = space.default()
    b = a.with_genes(chunk_size=32)
    a1 = a.with_genes(layout="time_major")
    b1 = b.with_genes(algorithm="b")
    broken = a1.with_genes(store=False)
    best = a1.with_genes(algorithm="b", chunk_size=32)
    items = [_item(a, [], "seed", "default genome", 0, 0, latency=10.0),
             _item(b, [], "seed", "random genome", 0, 1, latency=12.0),
             _item(a1, [a.hash], "memory", "layout: head_major -> time_major", 1, 0, latency=8.0),
             _item(b1, [b.hash], "scheduling", "algorithm: a -> b", 1, 1, latency=9.0),
             _item(broken, [a1.hash], "memory", "store: True -> False", 2, 0, status="incorrect"),
             _item(best, [a1.hash, b1.hash], "integration", "scheduling from b1", 2, 1, latency=5.0)]
    disk = DiskEvidence(tmp_path)
    for item in items:
        disk.on_result(item)
    disk.close()
    write_json(tmp_path / "baselines.json", {"eager": EvalResult("eager", "ok", latency_ms=20.0).to_dict()})
    return tmp_path, {name: item for name, item in zip(("a", "b", "a1", "b1", "broken", "best"), items)}


def test_lineage_follows_both_parents_and_prints_the_best_ancestry(family):
    run_dir, items = family
    h = {name: item.proposal.hash for name, item in items.items()}
    lineage = load_lineage(run_dir)
    assert lineage.best == h["best"] and lineage.baseline == ("eager", 20.0)
    assert lineage.ancestors(h["best"]) == {h["best"], h["a1"], h["a"], h["b1"], h["b"]}  # both parents' lines
    assert [s.node.hash for s in lineage.chain()] == [h["a"], h["a1"], h["best"]]  # first parents, oldest first
    assert [s.gain_ms for s in lineage.chain()][1:] == [2.0, 3.0]
    assert set(lineage.edges()) == {(h["a"], h["a1"]), (h["b"], h["b1"]), (h["a1"], h["broken"]),
                                    (h["a1"], h["best"]), (h["b1"], h["best"])}
    best, a1 = lineage.nodes[h["best"]], lineage.nodes[h["a1"]]
    assert gene_diff(best, a1) == [("scheduling.algorithm", "a", "b"), ("scheduling.chunk_size", 64, 32)]
    assert all(n.recorded_at is not None for n in lineage.nodes.values())  # the journal stamps arrival times

    lines = ancestry_lines(lineage)
    assert h["best"] in lines[0] and "4.00x vs eager" in lines[0]
    steps = lines[2:]
    assert [line.split()[1] for line in steps] == [h["a"], h["a1"], h["best"]]
    assert steps[2].split()[:3] == ["2", h["best"], "integration"] and "1.60x (-3.000 ms)" in steps[2]
    assert f"second parent {h['b1'][:8]}" in steps[2]


def test_lineage_page_is_self_contained_with_pngs(family):
    run_dir, items = family
    files = write_lineage(run_dir)
    page = files.html.read_text()
    # nothing is fetched when the page opens: no external script, style sheet or image
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=", page, re.I)
    best = items["best"].proposal.hash
    assert f'<code id="best-hash">{best}</code>' in page and 'id="lineage-tree"' in page and 'id="best-so-far"' in page
    data = json.loads(re.search(r"const LINEAGE = (.*?);</script>", page, re.S).group(1).replace("<\\/", "</"))
    node = data["nodes"][best]
    assert [d["parent"] for d in node["diffs"]] == list(items["best"].proposal.parents)
    assert node["evaluator"] == "evaluator-1" and node["message"] == "ok message"
    assert data["nodes"][items["broken"].proposal.hash]["error"] == "Traceback: boom"
    for png in (files.png, files.best_so_far_png):
        assert png.read_bytes().startswith(PNG) and png.stat().st_size > 10_000


def test_candidate_table_and_tags(family):
    _, items = family
    known = {item.proposal.hash: item for item in items.values()}
    generation = [items["best"], items["broken"]]
    rows = candidate_table(generation, known)
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[1]["parents"] == ",".join(items["best"].proposal.parents)
    assert rows[1]["latency_change_ms"] == -3.0 and rows[0]["latency_ms"] is None and rows[0]["status"] == "incorrect"
    tags = candidate_tags(rows)
    assert tags["candidate.01.hash"] == items["best"].proposal.hash and tags["candidate.01.latency_ms"] == "5.0000"
    assert tags["candidate.00.status"] == "incorrect" and tags["candidate.00.latency_ms"] == ""


def test_report_command(family, capsys, tmp_path_factory):
    run_dir, items = family
    assert cli_main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert items["best"].proposal.hash in out and (run_dir / "lineage" / "lineage.html").exists()
    empty = tmp_path_factory.mktemp("not-a-run")
    assert cli_main(["report", str(empty)]) == 2
    assert "not a run directory" in capsys.readouterr().err


# --- a real search through the driver, its MLflow runs, and the MLflow UI in Chromium -------------------

@pytest.fixture(scope="module")
def searched(smoke_on_server):
    """The session's small smoke run on a real `mlflow server` (tests/conftest.py)."""
    outcome, server, client, _ = smoke_on_server
    return outcome, server, client


def test_mlflow_runs_carry_the_lineage(searched, tmp_path):
    outcome, _, client = searched
    parent = client.get_run(outcome.mlflow_run_id)
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "lineage")} == {
        "lineage/lineage.html", "lineage/lineage.png", "lineage/best_so_far.png"}
    page = Path(client.download_artifacts(parent.info.run_id, "lineage/lineage.html", str(tmp_path))).read_text()
    assert f'<code id="best-hash">{outcome.summary.best_hash}</code>' in page  # the final version
    claim = re.search(r'<b id="claim">(.*?)</b>', page).group(1)  # the winner by its paired claim, first
    assert "(paired, 95% [" in claim and f'<code id="best-hash">{outcome.summary.best_hash}</code>' in claim
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    rows = [json.loads(line) for line in (outcome.run_dir / "evidence.jsonl").read_text().splitlines()]
    assert len(children) == outcome.summary.generations
    for child in children:
        generation = int(child.data.tags["generation"])
        mine = sorted((r for r in rows if r["generation"] == generation), key=lambda r: r["index"])
        for r in mine:
            tag = f"candidate.{r['index']:02d}"
            assert child.data.tags[f"{tag}.hash"] == r["genome_hash"]
            assert child.data.tags[f"{tag}.parents"] == ",".join(r["parents"])
            assert (child.data.tags[f"{tag}.agent"], child.data.tags[f"{tag}.status"]) == (r["agent"], r["status"])
            assert child.data.tags[f"{tag}.move"] == r["move"]
    tabled = []  # each child's candidates table, logged as `mlflow.log_table` logs one
    for child in children:
        assert json.loads(child.data.tags["mlflow.loggedArtifacts"]) == [{"path": "candidates.json", "type": "table"}]
        table = json.loads(Path(client.download_artifacts(child.info.run_id, "candidates.json", str(tmp_path))).read_text())
        tabled += [dict(zip(table["columns"], row))["hash"] for row in table["data"]]
    assert sorted(tabled) == sorted(r["genome_hash"] for r in rows)


def test_report_from_run_dir_and_from_mlflow_run_id(searched, capsys, tmp_path):
    outcome, server, _ = searched
    ancestry = [step["hash"] for step in reversed(outcome.summary.lineage)]
    assert cli_main(["report", str(outcome.run_dir)]) == 0
    local = capsys.readouterr().out
    lines = local.splitlines()  # the claim first (evo.evidence.claims), then the ancestry under its header
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["gen", "hash"])
    printed = [line.split()[1] for line in lines[head + 1:head + 1 + len(ancestry)]]
    assert printed == ancestry
    moved = outcome.run_dir.with_name("moved-away")  # only MLflow has the evidence now
    outcome.run_dir.rename(moved)
    try:
        assert cli_main(["report", outcome.mlflow_run_id, "--tracking-uri", server.uri, "--out", str(tmp_path)]) == 0
    finally:
        moved.rename(outcome.run_dir)
    remote = capsys.readouterr().out
    assert remote.splitlines()[:head + 1 + len(ancestry)] == lines[:head + 1 + len(ancestry)]
    assert (tmp_path / "lineage.html").exists()


def test_mlflow_ui_shows_the_lineage_page_in_chromium(searched, tmp_path):
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium: install Debian's `chromium` (scripts/setup.sh does where apt-get is available)")
    outcome, server, client = searched
    parent = client.get_run(outcome.mlflow_run_id)
    best = outcome.summary.best_hash
    ancestry = [step["hash"] for step in reversed(outcome.summary.lineage)]
    browser = Browser(executable)
    try:
        browser.navigate(f"{server.uri}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
                         "/artifacts/lineage/lineage.html")
        # The UI fetches the artifact and shows it in a sandboxed iframe (a blob: URL); read what it rendered.
        seen = wait_for(lambda: browser.frame_evaluate("blob:", _RENDERED), 120,
                        "the lineage page rendered inside the MLflow UI", tolerate=(RuntimeError,))
        browser.screenshot(tmp_path / "mlflow-lineage.png")
    finally:
        browser.close()
    assert seen["bestHash"] == best and seen["selected"] == best  # headline, and the details panel the page's JS filled
    assert seen["ancestryRows"] == ancestry
    labels = " ".join(seen["treeLabels"])  # text Plotly drew into the tree's SVG
    for genome_hash in ancestry:
        assert genome_hash[:8] in labels, f"ancestor {genome_hash} not labelled in the rendered tree"
        assert genome_hash in seen["text"]
    assert seen["treeNodes"] >= outcome.summary.evaluations


_RENDERED = """(() => {
  const svg = document.querySelector('#lineage-tree .main-svg');
  const selected = document.getElementById('selected-hash');
  if (!svg || !selected) return null;
  return {
    bestHash: document.getElementById('best-hash').textContent,
    selected: selected.textContent,
    ancestryRows: [...document.querySelectorAll('#ancestry tbody tr')].map(r => r.dataset.hash),
    treeLabels: [...document.querySelectorAll('#lineage-tree .textpoint text')].map(t => t.textContent),
    treeNodes: document.querySelectorAll('#lineage-tree .scatterlayer .point').length,
    text: document.body.innerText,
  };
})()"""


def test_the_lineage_sink_redraws_at_most_once_per_interval_and_always_at_the_end(tmp_path, monkeypatch):
    from evo.evidence.lineage_view import LineageSink

    drawn = []
    monkeypatch.setattr(LineageSink, "write", lambda self, final=False: drawn.append(self.min_interval_s))
    every, rarely = LineageSink(tmp_path, min_interval_s=0.0), LineageSink(tmp_path, min_interval_s=3600.0)
    for _ in range(3):
        every.on_generation(None, None)
        rarely.on_generation(None, None)
    assert drawn == [0.0, 0.0, 0.0]  # the rare one has not drawn during the search ...
    rarely.close()
    assert drawn[-1] == 3600.0  # ... but does at the end


def test_the_page_marks_re_timed_candidates_and_says_why_a_faster_looking_one_is_not_the_winner(family):
    """A winner confirmed by paired re-timing (a1, 8 ms) and a candidate that timed faster once (best, 5 ms)
    but was equal within noise to it: the page leads with the claim and says why the bigger node lost."""
    from evo.core.retiming import PairedTiming
    from evo.evidence.journal import append_retimings
    from evo.evidence.summary import Summary

    run_dir, items = family
    winner, looked = items["a1"].proposal.hash, items["best"].proposal.hash
    summary = Summary(workload="toy", preset="p", best_hash=winner, best_genome=items["a1"].proposal.genome.to_dict(),
                      best_latency_ms=8.0, best_baseline="eager", speedups={"eager": 2.5},
                      speedup_paired={"eager": 2.4}, speedup_ci={"eager": [2.2, 2.6]})
    write_json(run_dir / "summary.json", summary.to_dict())
    append_retimings(run_dir, [
        PairedTiming(looked, winner, "equal", 0.99, 0.95, 1.03, reason="incumbent", generation=2),
        PairedTiming(winner, "baseline:eager", "faster", 1 / 2.4, 1 / 2.6, 1 / 2.2, reason="baseline")])
    lineage = load_lineage(run_dir)
    assert lineage.best == winner and set(lineage.retimed()) == {winner, looked}
    assert lineage.not_the_winner() == {looked: f"re-timed: equal within noise to {winner} "
                                                "(latency ratio 0.990, 95% [0.950, 1.030])"}
    page = write_lineage(run_dir, lineage=lineage).html.read_text()
    assert f'<b id="claim"><code id="best-hash">{winner}</code> is 2.40x faster than eager (paired, 95% [2.20, 2.60]).</b>' \
        in page
    assert "Single timing (one evaluation's median, not a claim): 8.000 ms" in page
    assert 'id="not-the-winner"' in page and "re-timed: equal within noise to" in page
    data = json.loads(re.search(r"const LINEAGE = (.*?);</script>", page, re.S).group(1).replace("<\\/", "</"))
    assert data["nodes"][looked]["why_not_winner"].startswith("re-timed: equal within noise")
    assert data["nodes"][winner]["retimings"] and data["nodes"][items["b"].proposal.hash]["retimings"] == []

    # never re-timed: the summary's reason (evo.core.search.Unexamined), else the budget
    (run_dir / "retimings.jsonl").unlink()
    unexamined = [{"hash": looked, "latency_ms": 5.0, "reason": "the re-timing budget (4) was spent"}]
    write_json(run_dir / "summary.json", {**summary.to_dict(), "unexamined": unexamined})
    assert load_lineage(run_dir).not_the_winner() == {looked: "not re-timed: the re-timing budget (4) was spent"}


def test_the_lineage_page_goes_to_mlflow_once_at_the_end(tmp_path, family):
    """The pictures follow the search; the page (~5 MB) is queued once, when the run ends."""
    from evo.evidence.lineage_view import LineageSink

    run_dir, _ = family
    queued = []

    class Recorder:
        def log_lineage(self, paths):
            queued.append(sorted(Path(p).name for p in paths))

    sink = LineageSink(run_dir, Recorder(), min_interval_s=0.0)
    sink.on_generation(None, None)
    sink.on_generation(None, None)
    sink.close()
    assert queued == [["best_so_far.png", "lineage.png"]] * 2 + [["best_so_far.png", "lineage.html", "lineage.png"]]
