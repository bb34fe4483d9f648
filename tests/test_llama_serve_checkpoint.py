"""llama_serve's cpu_small model written as a Hugging Face checkpoint with a tokenizer
(`evo.workloads.llama_serve.checkpoint`), read back as an `hf:` preset, and served as text
(`evo.serving.text`): the same weights, the same float64 reference and the same engine tokens; a
tokenizer of exactly V tokens that transformers loads, with a chat template; streamed text equal to
the full decode."""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluators.judge.replay import replay
from evo.core.trace import TraceSpec, draw
from evo.serving.text import TextCodec
from evo.workloads.base import DeviceInfo
from evo.workloads.llama_serve import WORKLOAD
from evo.workloads.llama_serve import engine as serve_engine
from evo.workloads.llama_serve.checkpoint import BOS, EOS, EOT, write_checkpoint
from evo.workloads.llama_serve.genes import gene_space
from evo.workloads.llama_serve.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
CPU = DeviceInfo("cpu", "cpu", 1)
PRESET = PRESETS["cpu_small"]
V = PRESET.model.vocab
TEXT = "Hello wörld, the café sells déjà-vu tea at 3.14 € 😀 — naïve?\n  Two spaces."


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder():
    """One cpu_small checkpoint, outside /tmp (the strict sandbox's engines, as nobody, read it themselves)."""
    out = write_checkpoint(PRESET, ROOT / "runs" / f".llama-serve-checkpoint-{uuid.uuid4().hex[:8]}")
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def codec(folder):
    return TextCodec.from_folder(folder)


def _hf(folder: Path, options: str = "") -> str:
    return f"hf:{folder}{options}"


def test_the_folder_reads_back_as_an_hf_preset_with_the_same_reference_logits(folder):
    assert folder.stat().st_mode & 0o005 == 0o005
    assert all(p.stat().st_mode & 0o004 for p in folder.iterdir())
    presets = WORKLOAD.presets()
    name = _hf(folder, ",R=3,N=10")
    assert name in presets and "hf:/nowhere,R=2" in presets  # named, not yet read
    preset = presets[name]
    assert preset is presets[name] and preset.model.checkpoint == str(folder)
    assert preset.shape == {"R": 3, "P": 24, "N": 10, "V": V} and (preset.dtype, preset.device) == ("float32", "cpu")
    assert preset.trace == TraceSpec("closed", count=12, concurrency=3, prompt_len=(1, 24), output_len=(1, 10))
    assert WORKLOAD.engine_files(preset) == (str(folder),)
    prompt, tokens = [0, 5, V - 1, 17, 17], [3, 200, 9]
    ours = WORKLOAD.reference_logits(PRESET, prompt, tokens)
    back = WORKLOAD.reference_logits(preset, prompt, tokens)
    assert back.shape == (3, V) and np.array_equal(ours, back)
    from transformers import AutoModelForCausalLM  # as transformers (and vLLM) load the folder

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        hf = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
    assert np.abs(hf - ours).max() < 1e-6 * np.abs(ours).max()  # its rotary angles are float32


@pytest.mark.parametrize("options, message", [
    (",X=1", "option 'X=1' must be key=value with key one of R, P, N, count, dtype, device"),
    (",R", "option 'R' must be key=value"),
    (",R=0", "R must be an integer >= 1, got '0'"),
    (",count=many", "count must be an integer >= 1, got 'many'"),
    (",dtype=float16", "dtype must be one of float32, bfloat16, got 'float16'"),
    (",device=tpu", "device must be one of cpu, cuda"),
])
def test_bad_hf_options_are_refused_naming_the_option(folder, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WORKLOAD.presets()[_hf(folder, options)]


def test_an_hf_preset_without_a_checkpoint_says_what_the_folder_lacks(tmp_path):
    with pytest.raises(ValueError, match="needs config.json and"):
        WORKLOAD.presets()[_hf(tmp_path)]
    assert TextCodec.from_folder(tmp_path) is None


def test_the_tokenizer_has_exactly_v_tokens_and_round_trips_text(folder, codec):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == V and max(tok.get_vocab().values()) == V - 1
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOS, EOS, EOT)}
    assert (tok.bos_token_id, tok.eos_token_id) == (ids[BOS], ids[EOS]) and all(0 <= i < V for i in ids.values())
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ids[BOS], ids[EOS])
    assert generation["bos_token_id"] == ids[BOS] and generation["eos_token_id"] == [ids[EOS], ids[EOT]]
    assert codec.eos_ids == (ids[EOS], ids[EOT]) and codec.has_chat_template
    encoded = codec.encode(TEXT)
    assert encoded[0] == ids[BOS] and encoded == tok.encode(TEXT) and max(encoded) < V
    assert codec.decode(encoded) == TEXT
    assert codec.encode("the tea") != [ids[BOS], *(b for b in b"the tea")]  # merges learnt, not bytes alone


def test_the_chat_template_writes_llama3_turns_and_refuses_malformed_messages(codec):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there! "}]
    ids = codec.chat(messages)
    rendered = codec.tokenizer.decode(ids)
    assert rendered == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids.count(codec.tokenizer.bos_token_id) == 1
    for bad, what in [("hi", "messages must be a non-empty list"), ([], "messages must be a non-empty list"),
                      ([{"role": "user"}], r"messages\[0\] must be an object with role and content"),
                      ([{"role": "tool", "content": "x"}], r"messages\[0\].role must be one of system, user"),
                      ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string")]:
        with pytest.raises(ValueError, match=what):
            codec.chat(bad)


def test_the_detokenizer_streams_the_full_decode(codec):
    ids = codec.encode(TEXT) + [1, 2]
    stream = codec.detokenizer()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == codec.decode(ids) == TEXT
    assert not any(p.endswith("\ufffd") for p in pieces) and "😀" in pieces[[i for i, p in enumerate(pieces)
                                                                              if "😀" in p][0]]
    assert "" in pieces  # the emoji's first bytes held back
    rng = np.random.default_rng(0)
    for _ in range(5):  # any ids, invalid UTF-8 included: the same text, held back U+FFFDs flushed at the end
        ids = rng.integers(0, V, 40).tolist()
        stream = codec.detokenizer()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == codec.decode(ids)


def test_the_engine_on_the_hf_preset_decodes_the_same_tokens(folder, trusted_engine_code):
    preset = WORKLOAD.presets()[_hf(folder)]
    trace = draw(TraceSpec("closed", count=6, concurrency=4, prompt_len=(1, 24), output_len=(1, 12)),
                 np.random.default_rng(3))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, V, t.prompt_len).tolist() for t in trace]
    tokens = []
    for p in (PRESET, preset):
        engine = serve_engine.build(gene_space(p, CPU).default(), p, CPU)
        tokens.append(replay(engine, trace, prompts, concurrency=4, deadline_s=120).tokens)
    assert tokens[0] == tokens[1] and sum(map(len, tokens[0])) == sum(t.max_tokens for t in trace)
