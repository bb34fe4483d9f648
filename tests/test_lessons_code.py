"""Lessons carry the sources of their best genomes' code genes: written as readable literal blocks,
read back exactly, refused when damaged, and gathered from a run's code store or earlier lessons."""
from __future__ import annotations

import pytest
import yaml

from evo.core.code import CodeStore, code_hash
from evo.core.effects import GeneEffects
from evo.core.genome import Genome
from evo.core.lessons import Lessons, LessonsError, from_search, read, write

SOURCE = "import torch\n\n\ndef running_sum(x, initial_state):\n    return x.cumsum(1)  # a variant\n"
DIGEST = code_hash(SOURCE)
GENOME = {"workload": "tests.fake_workload", "fusion": {"impl": "cumsum", "code_sum": DIGEST}, "scheduling": {},
          "memory": {}}


def lessons(code: dict[str, str], best=((GENOME, 1.5),)) -> Lessons:
    return Lessons("tests.fake_workload", "cpu", "cpu:test", tuple(best), {}, {}, GeneEffects(),
                   ("run-a",), 3, code)


def test_code_round_trips_through_the_file_as_literal_blocks(tmp_path):
    path = write(tmp_path / "lessons.yaml", lessons({DIGEST: SOURCE}))
    text = path.read_text()
    assert f"  {DIGEST}: |\n    import torch\n" in text  # readable as code
    assert read(path).code == {DIGEST: SOURCE}


def test_a_damaged_source_is_refused_naming_its_hash(tmp_path):
    path = write(tmp_path / "lessons.yaml", lessons({DIGEST: SOURCE}))
    data = yaml.safe_load(path.read_text())
    data["code"][DIGEST] = SOURCE.replace("cumsum", "cumprod")
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(LessonsError, match=f"source under code hash '{DIGEST}' is damaged"):
        read(path)
    data["code"] = ["not", "a", "mapping"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(LessonsError, match="'code' must map code hashes to sources"):
        read(path)


class _Search:
    """What from_search reads of a search: earlier lessons, results, the team, yields, effects."""

    def __init__(self, earlier: Lessons | None, known: dict) -> None:
        self.lessons, self.known, self.yields, self.effects, self.evaluations = earlier, known, {}, GeneEffects(), 0
        self.team = type("Team", (), {"state": staticmethod(lambda: {})})()


def test_from_search_takes_sources_from_the_store_or_the_earlier_lessons(tmp_path):
    store = CodeStore(tmp_path / "code")
    other = SOURCE.replace("a variant", "another")
    store.put(other)
    mine = {**GENOME, "fusion": {"impl": "cumsum", "code_sum": code_hash(other)}}
    item = type("Item", (), {"fitness": 1.0, "proposal": type("P", (), {
        "hash": Genome.from_dict(mine).hash, "genome": Genome.from_dict(mine)})()})()
    learned = from_search(_Search(lessons({DIGEST: SOURCE}), {"x": item}), "tests.fake_workload", "cpu", "cpu:test",
                          "run-b", store)
    assert learned.code == {DIGEST: SOURCE, code_hash(other): other}
    assert [g for g, _ in learned.best] == [mine, GENOME]
    without = from_search(_Search(lessons({}), {"x": item}), "tests.fake_workload", "cpu", "cpu:test", "run-b")
    assert without.code == {}  # no store, no earlier source: nothing invented
