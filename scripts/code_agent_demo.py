"""The code agent's whole path without a language model: a scripted OpenAI-compatible server on 127.0.0.1
(tests/llm_server.py, a model that only adds comment lines) stands in for the endpoint, and a short
KDA search (small CPU preset) runs with the code agent in its team. Prints the agent's candidates (code
hash, tokens, cost, prompt record) and where the diffs and lessons are.

The scripted model's edits change nothing but comments: with intensification (on by default) such an
edit is re-timed against its parent when its single timing looks faster, comes back equal within
noise, and is neither credited as a win nor written as a lesson. The demo's lessons go to its own run
directory (`<run dir>/lessons/`), never to the lessons file that real runs on this device read.

    .venv/bin/python scripts/code_agent_demo.py [--out runs/code-demo] [--budget 12]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evo.driver.config import load_config  # noqa: E402
from evo.driver.run import run  # noqa: E402
from tests.llm_server import CommentingModel, ScriptedLlmServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="run directory (default runs/code-demo-<timestamp>)")
    parser.add_argument("--budget", type=int, default=12, help="genome evaluations")
    args = parser.parse_args()
    os.environ.setdefault("DEMO_LLM_KEY", "not-a-real-key")
    run_dir = Path(args.out or ROOT / "runs" / f"code-demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    with ScriptedLlmServer(CommentingModel()) as server:
        config = load_config(ROOT / "configs" / "kda_code_agent.yaml", [
            "preset=cpu_small", "name=code-demo", f"search.max_evaluations={args.budget}", "search.generations=4",
            "search.offspring=4", "search.agents=[scheduling,code]", "evaluator.repeats=5",
            f"code_agent.llm.base_url={server.url}", "code_agent.llm.model=scripted",
            "code_agent.llm.api_key_env=DEMO_LLM_KEY", "code_agent.llm.timeout_s=30",
            "code_agent.llm.prices={scripted: {input_per_mtok: 3.0, output_per_mtok: 15.0}}",
            f"code_agent.lessons_dir={run_dir / 'lessons'}",  # its own: the scripted model's lessons are no one's
            "mlflow.experiment=code-demo", "mlflow.register_model=false"])
        outcome = run(config, run_dir)
        print(f"\nthe scripted model answered {len(server.requests)} requests")
    rows = [json.loads(line) for line in (outcome.run_dir / "evidence.jsonl").read_text().splitlines()]
    for row in rows:
        if row["agent"] == "code":
            notes = json.loads(row["notes"])
            print(f"  {row['genome_hash']} {row['status']:9s} {notes['stage']}={notes['code_hash']} "
                  f"calls {notes['calls']} tokens {notes['tokens_in']}+{notes['tokens_out']} "
                  f"${notes['cost_usd']:.4f} prompt {notes['prompt']}")
    retimed = [json.loads(line) for line in (outcome.run_dir / "retimings.jsonl").read_text().splitlines()] \
        if (outcome.run_dir / "retimings.jsonl").exists() else []
    for row in retimed:
        print(f"  re-timed {row['a']} vs {row['b']} ({row['reason']}): {row['verdict']}, ratio {row['ratio']}")
    print(f"best from {outcome.summary.lineage[0]['agent'] if outcome.summary.lineage else '-'}")
    print(f"diffs: {outcome.run_dir}/lineage/gen_*/diffs/, lessons: {outcome.run_dir}/code_lessons.md"
          f" (the agent's file: {outcome.run_dir}/lessons/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
