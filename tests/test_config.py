from pathlib import Path

import pytest

from evo.driver.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["kda_cpu.yaml", "kda_smoke.yaml", "kda_h200.yaml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.workload == "kda"
    assert config.search.max_evaluations >= config.search.offspring


def test_overrides_are_typed(tmp_path):
    config = load_config(CONFIGS / "kda_smoke.yaml", ["search.generations=5", "search.agents=[fusion, memory]",
                                                      "evaluator.repeats=3", "mlflow.enabled=false"])
    assert config.search.generations == 5
    assert config.search.agents == ("fusion", "memory")
    assert config.evaluator.repeats == 3 and config.mlflow.enabled is False


def test_unknown_key_lists_allowed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("search:\n  generatoins: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['generatoins'\] in search; allowed: \[.*'generations'"):
        load_config(path)
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["color=blue"])


def test_wrong_types_and_values_are_named():
    with pytest.raises(ConfigError, match="search.generations must be int"):
        load_config(None, ["search.generations=many"])
    with pytest.raises(ConfigError, match="generations must be >= 1"):
        load_config(None, ["search.generations=0"])
    with pytest.raises(ConfigError, match="unknown evaluator settings"):
        load_config(None, ["evaluator.speed=9"])
    with pytest.raises(ConfigError, match="agents"):
        load_config(None, ["search.agents=[fusion, magic]"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["search.generations"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("nope.yaml")


def test_an_empty_config_file_is_an_error_pointing_at_the_sample(tmp_path):
    for text in ("", "\n# nothing but comments\n"):
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"empty\.yaml.*empty \(or only comments\).*configs/kda_smoke\.yaml"):
            load_config(path)
    assert load_config(CONFIGS / "kda_smoke.yaml").preset == "cpu_small"  # the sample it names loads
