"""The code agent through the real openai client against a scripted loopback server: good edits,
repairs of replies that do not apply, compile or parse, 429s, timeouts, over-long replies, budgets,
critiques into the lessons file, saved state, and redaction. Proposals are judged by the real
evaluator (fake workload, whose running sum is an open stage)."""
from __future__ import annotations

import json
import math

import pytest

from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.code import code_hash
from evo.core.records import OK, Evaluated
from evo.workloads.base import DeviceInfo
from operators.base import Parent
from operators.code_agent import CodeAgent
from operators.code_settings import CodeAgentSettings
from operators.llm.client import Budget, LlmSettings, Price
from tests import fake_workload as fw
from tests.llm_server import ScriptedLlmServer, Step

WORKLOAD = "tests.fake_workload"
SPACE = fw.WORKLOAD.gene_space(fw.WORKLOAD.presets()["cpu"], DeviceInfo("cpu", "cpu"))
PARENT = Parent(SPACE.default(), 1.0)
KEY = "sk-test-secret-0123456789abcdef"


def edit(search: str = "    o = x.cumsum(1)\n", replace: str = "    o = torch.cumsum(x, dim=1)\n",
         rationale: str = "call the op directly") -> str:
    return json.dumps({"rationale": rationale, "edits": [{"search": search, "replace": replace}]})


GOOD = Step(edit())


def make_agent(server: ScriptedLlmServer, tmp_path, **overrides) -> CodeAgent:
    llm = LlmSettings(base_url=server.url, model="scripted", api_key_env="TEST_LLM_KEY", timeout_s=5.0,
                      max_retries=overrides.pop("max_retries", 0), max_tokens=overrides.pop("max_tokens", 2000),
                      prices={"scripted": Price(1.0, 2.0)})
    settings = CodeAgentSettings(llm=llm, **{"queue": 1, "critique": False, **overrides})
    return CodeAgent(SPACE, seed=5, settings=settings, workload=WORKLOAD, preset="cpu",
                     device=DeviceInfo("cpu", "cpu"), run_dir=str(tmp_path / "run"),
                     lessons_path=str(tmp_path / "lessons" / "fake-cpu.md"), environ={"TEST_LLM_KEY": KEY})


def one_round(agent: CodeAgent, parents=(PARENT,)) -> list:
    """Queue work, wait for it, collect what it made (the agent never blocks the caller)."""
    first = agent.propose(list(parents), 4, generation=1)
    assert first == [] or all(p.agent == "code" for p in first)
    assert agent.wait_idle(60), "the agent's work did not finish"
    return first + agent.propose(list(parents), 4, generation=2)


def log_lines(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "agent" / "log.jsonl").read_text().splitlines()]


def test_a_good_edit_becomes_a_proposal_with_its_source_costs_and_prompt(tmp_path):
    with ScriptedLlmServer([GOOD]) as server:
        agent = make_agent(server, tmp_path)
        proposals = one_round(agent)
        agent.close()
    assert len(proposals) >= 1
    p = proposals[0]
    (digest, source), = p.sources
    assert p.genome["code_sum"] == digest == code_hash(source) and "torch.cumsum(x, dim=1)" in source
    assert p.parents == (PARENT.genome.hash,) and p.move_kind == "edit:code_sum"
    used = p.metrics
    assert used["calls"] == 1 and used["tokens_in"] > 0 and used["tokens_out"] > 0 and used["repairs"] == 0
    assert math.isclose(used["cost_usd"], (used["tokens_in"] * 1.0 + used["tokens_out"] * 2.0) / 1e6)
    assert p.artifacts["code_hash"] == digest and p.artifacts["stage"] == "code_sum"
    record = json.loads((tmp_path / "run" / p.artifacts["prompt"]).read_text())
    assert record["outcome"] == f"proposed {p.hash}" and "running_sum" in record["exchanges"][0]["messages"][1]["content"]
    prompt = server.requests[0]["messages"][1]["content"]
    assert "x.cumsum(1)" in prompt and "EVOLVE-BLOCK-START" in prompt  # the parent's code, with its marked blocks


@pytest.mark.parametrize("bad, words", [
    (Step(edit(search="    o = x.cumsum(2)\n")), "must be copied exactly"),  # an edit that does not apply
    (Step(edit(replace="    o = x.cumsum(1\n")), "does not compile"),  # code that fails to compile
    (Step('{"rationale": "x", "edits": [{"search": '), "JSON"),  # malformed JSON in the reply
    (Step(edit(replace="    import os\n    o = x.cumsum(1)\n")), "import of 'os' is not allowed"),
    (Step(edit(), completion_tokens=50_000), "keep the reply short"),  # far over the token limit
])
def test_a_bad_reply_is_sent_back_and_repaired(tmp_path, bad, words):
    with ScriptedLlmServer([bad, GOOD]) as server:
        agent = make_agent(server, tmp_path)
        proposals = one_round(agent)
        agent.close()
    assert len(server.requests) == 2 and len(proposals) == 1
    repair = server.requests[1]["messages"][-1]["content"]
    assert "could not be used" in repair and words in repair, repair
    assert proposals[0].metrics["repairs"] == 1 and proposals[0].metrics["calls"] == 2


def test_repairs_are_bounded_and_the_failure_is_recorded(tmp_path):
    with ScriptedLlmServer([Step(edit(search="nowhere"))]) as server:
        agent = make_agent(server, tmp_path, max_repairs=2)
        assert one_round(agent) == []
        agent.close()
    assert len(server.requests) == 3  # one proposal and two repairs, then it gives up
    (line,) = log_lines(tmp_path)
    assert line["kind"] == "proposal" and line["outcome"].startswith("EditError") and line["usage"]["calls"] == 3
    assert agent.failures == {"EditError": 1} and agent.spent.calls == 3


def test_a_429_with_retry_after_is_retried(tmp_path):
    with ScriptedLlmServer([Step(status=429, headers={"retry-after": "0.1"}), GOOD]) as server:
        agent = make_agent(server, tmp_path, max_retries=2)
        proposals = one_round(agent)
        agent.close()
    assert len(server.requests) == 2 and len(proposals) == 1


def test_a_timeout_is_a_recorded_failure_and_the_agent_goes_on(tmp_path):
    with ScriptedLlmServer([Step(GOOD.content, delay_s=30), GOOD]) as server:
        agent = make_agent(server, tmp_path)
        assert one_round(agent) == []
        assert log_lines(tmp_path)[0]["outcome"].startswith("llm timeout")
        assert len(one_round(agent)) == 1  # the next job works
        agent.close()


def test_the_budget_stops_new_work(tmp_path):
    with ScriptedLlmServer([GOOD]) as server:
        agent = make_agent(server, tmp_path, budget=Budget(max_calls=1), queue=3)
        one_round(agent)
        one_round(agent)
        agent.close()
    assert len(server.requests) == 1 and agent.spent.calls == 1


def test_a_result_is_critiqued_into_the_lessons_file_which_the_next_agent_reads(tmp_path, fake):
    critique = "Calling torch.cumsum directly changed nothing measurable; look for fewer passes instead."
    with ScriptedLlmServer([GOOD, Step(critique)]) as server:
        agent = make_agent(server, tmp_path, critique=True)
        (proposal,) = one_round(agent)
        result = Evaluator(fake, "cpu", EvaluatorSettings(warmup=1, repeats=3), seed=1).evaluate(
            proposal.genome.to_json(), dict(proposal.sources))
        assert result.status == OK, result.message
        agent.observe((Evaluated(proposal, result),))
        assert agent.wait_idle(60)
        agent.close()
    text = (tmp_path / "lessons" / "fake-cpu.md").read_text()
    assert critique in text and proposal.hash in text and "call the op directly" in text
    assert f"code {proposal.genome['code_sum']}" in text
    # a second run's agent reads the lessons into its prompt
    with ScriptedLlmServer([GOOD]) as server:
        later = make_agent(server, tmp_path / "second")
        later.lessons = agent.lessons
        one_round(later)
        later.close()
    assert critique in server.requests[0]["messages"][1]["content"]


def test_a_correct_edit_not_found_faster_gets_no_lesson_and_a_confirmed_one_does(tmp_path, fake):
    """The search tells the agent which children improved (with intensification: confirmed by a paired
    re-timing); a correct edit outside that set (a comment-only change timed lucky once) is not a lesson."""
    from evo.core.proposer import Feedback

    other = Step(edit(replace="    o = torch.cumsum(x, 1)\n", rationale="positional dim"))
    with ScriptedLlmServer([GOOD, other, Step("Direct calls pay.")]) as server:
        agent = make_agent(server, tmp_path, critique=True, queue=2)
        proposals = one_round(agent)
        assert len(proposals) == 2 and proposals[0].hash != proposals[1].hash
        evaluator = Evaluator(fake, "cpu", EvaluatorSettings(warmup=1, repeats=3), seed=1)
        items = tuple(Evaluated(p, evaluator.evaluate(p.genome.to_json(), dict(p.sources))) for p in proposals)
        assert all(item.result.status == OK for item in items), [i.result.message for i in items]
        agent.tell(Feedback(1, items[:1], frozenset()))  # equal within noise: not improved
        assert agent.wait_idle(60)
        path = tmp_path / "lessons" / "fake-cpu.md"
        assert not path.exists() or items[0].proposal.hash not in path.read_text()
        assert any(line["outcome"].startswith("no lesson") and line["genome"] == items[0].proposal.hash
                   for line in log_lines(tmp_path))
        agent.tell(Feedback(2, items[1:2], frozenset({items[1].proposal.hash})))  # confirmed faster: a lesson
        assert agent.wait_idle(60)
        assert items[1].proposal.hash in path.read_text() and "Direct calls pay." in path.read_text()
        agent.close()


def test_state_survives_a_restart(tmp_path):
    with ScriptedLlmServer([GOOD]) as server:
        agent = make_agent(server, tmp_path)
        agent.propose([PARENT], 0, generation=1)  # queue work, take nothing
        assert agent.wait_idle(60)
        state = json.loads(json.dumps(agent.state()))  # as state.json holds it
        agent.close()
        restarted = make_agent(server, tmp_path)
        restarted.load_state(state)
        assert restarted.spent == agent.spent and restarted.jobs == agent.jobs
        handed = restarted.propose([PARENT], 4, generation=3)
        restarted.close()
    assert [p.hash for p in handed][:1] == [agent.ready[0].hash]
    assert handed[0].sources == agent.ready[0].sources


def test_secrets_never_reach_the_artifacts(tmp_path):
    leak = json.dumps({"rationale": f"the key is {KEY}", "edits": [{"search": "    o = x.cumsum(1)\n",
                                                                     "replace": "    o = torch.cumsum(x, 1)\n"}]})
    with ScriptedLlmServer([Step(leak)]) as server:
        agent = make_agent(server, tmp_path)
        one_round(agent)
        agent.close()
    assert server.requests[0]["_headers"].get("Authorization", server.requests[0]["_headers"].get("authorization")) \
        == f"Bearer {KEY}"
    for path in (tmp_path / "run" / "agent").iterdir():
        assert KEY not in path.read_text(), path


def test_an_agent_without_open_stages_says_so(tmp_path):
    from evo.core.genome import GeneSpace

    with ScriptedLlmServer([GOOD]) as server, pytest.raises(ValueError, match="nothing to edit"):
        CodeAgent(GeneSpace("fake", SPACE.genes), seed=1, settings=CodeAgentSettings(), workload=WORKLOAD,
                  preset="cpu", device=DeviceInfo("cpu", "cpu"), run_dir=str(tmp_path), lessons_path=str(tmp_path / "l.md"))


def test_wrong_code_is_judged_incorrect_and_its_message_reaches_the_lesson_and_the_next_prompt(tmp_path, fake):
    wrong = Step(edit(replace="    o = x.cumsum(1) * 1.01\n", rationale="scale it"))

    def model(body: dict) -> Step:
        if "review one experiment" in body["messages"][0]["content"]:
            return Step("Scaling breaks correctness.")
        return wrong if sum("review" not in r["messages"][0]["content"] for r in server.requests) <= 1 else GOOD

    with ScriptedLlmServer(model) as server:
        agent = make_agent(server, tmp_path, critique=True)
        (proposal,) = one_round(agent)
        result = Evaluator(fake, "cpu", EvaluatorSettings(warmup=1, repeats=3), seed=1).evaluate(
            proposal.genome.to_json(), dict(proposal.sources))
        assert result.status == "incorrect", result.message
        agent.observe((Evaluated(proposal, result),))
        assert agent.wait_idle(60)
        one_round(agent)
        agent.close()
    lessons = (tmp_path / "lessons" / "fake-cpu.md").read_text()
    assert "· running_sum · incorrect" in lessons and "Scaling breaks correctness." in lessons
    last_prompt = server.requests[-1]["messages"][1]["content"]
    assert f"sibling {proposal.hash}" in last_prompt and result.message[:60] in last_prompt


def test_the_config_section_is_checked_and_round_trips(tmp_path):
    from evo.driver.config import ConfigError, config_from_dict, load_config

    config = load_config(ROOT_CONFIG, ["code_agent.budget.max_calls=7", "code_agent.llm.model=m"])
    assert config.code_agent.budget.max_calls == 7 and config.code_agent.llm.model == "m"
    assert config_from_dict(config.to_dict()).code_agent == config.code_agent  # what config.yaml of a run holds
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['bogus'\].*allowed"):
        load_config(ROOT_CONFIG, ["code_agent.bogus=1"])
    with pytest.raises(ConfigError, match="api_key_env"):
        load_config(ROOT_CONFIG, ["code_agent.llm.api_key_env=sk-live-123"])


ROOT_CONFIG = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "configs" / "kda_code_agent.yaml")
