"""A llama_serve preset's model written as a Hugging Face checkpoint folder, for serving it as text.

`write_checkpoint(preset, folder)` saves the preset's exact weights (`LlamaForCausalLM.save_pretrained`:
config.json, generation_config.json, model.safetensors) and, by default, a tokenizer trained here: a
byte-level BPE (GPT-2's pre-tokenizer) of exactly the model's vocabulary V, with Llama 3's special tokens
and a Llama-3-style chat template. Nothing is downloaded: the training text is seeded pseudo-English made in
code, so the same preset always gives the same folder. transformers (`AutoTokenizer`), vLLM and llama.cpp's
GGUF converter read it (llama.cpp: declare the tokenizer as its "gpt-2" pre-tokenizer). The folder reads
back as the preset `hf:<folder>`; engines read it themselves, as nobody in a jail with a private /tmp, so
it is made world-readable and belongs outside /tmp and /var/tmp.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from evo.workloads.base import DeviceInfo
from evo.workloads.llama.gguf_import import world_readable
from evo.workloads.llama.model import load_weights, read_checkpoint_spec
from evo.workloads.llama_serve.baselines import hf_model
from evo.workloads.llama_serve.presets import ServePreset

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER = ("<|start_header_id|>", "<|end_header_id|>")
SPECIAL_TOKENS = (BOS, EOS, EOT, *HEADER)  # ids 0..4, in this order

# Llama 3's layout: bos, then per message a header, the content trimmed and <|eot_id|>; then, to ask for a
# reply, an open assistant header. The template carries bos, so apply_chat_template encodes without adding it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5-0xFF): left out of the alphabet only when V is too
# small for all 256 bytes and the special tokens (cpu_small's V = 256); any str still encodes.
_NOT_UTF8 = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])
_SYLLABLES = [c + v for c in ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
                              "w", "th", "st", "ch", "sh", "tr") for v in ("a", "e", "i", "o", "u", "ea", "ou")]
_GLUE = ["the", "a", "of", "and", "to", "in", "is", "that", "it", "was", "for", "on", "with", "as", "I", "you"]
_EXTRA = ["café", "naïve", "über", "déjà", "Straße", "—", "…", "°C", "€", "日本", "😀", "λ", "π≈3.14"]


def write_checkpoint(preset: ServePreset, folder: Path, tokenizer: bool = True) -> Path:
    """Save `preset`'s model (its exact weights) into `folder` as a Hugging Face checkpoint, with a tokenizer of
    exactly V tokens and a chat template when `tokenizer`; return the folder (resolved). The weights and
    the architecture are read back and compared before returning (ValueError if they differ)."""
    folder = Path(folder).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    model = hf_model(preset, DeviceInfo("cpu", "cpu", 1))
    if tokenizer:
        _save_tokenizer(train_tokenizer(preset.model.vocab), folder)
        bos, eos, eot = (SPECIAL_TOKENS.index(t) for t in (BOS, EOS, EOT))
        model.config.bos_token_id, model.config.eos_token_id = bos, eos
        model.generation_config.bos_token_id = bos
        model.generation_config.eos_token_id = [eos, eot]  # end of text or of a turn (as Llama 3 Instruct's)
    else:
        for stale in ("tokenizer.json", "tokenizer_config.json"):
            (folder / stale).unlink(missing_ok=True)
    model.config.dtype = getattr(torch, preset.model.storage_dtype)
    rope = model.config.rope_parameters
    if "original_max_position_embeddings" in rope:  # a count: transformers and llama.cpp want an integer
        rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    model.save_pretrained(folder)
    world_readable(folder)
    _check_round_trip(preset, folder)
    return folder


def train_tokenizer(vocab: int):
    """A byte-level BPE (`tokenizers.Tokenizer`) of exactly `vocab` tokens: SPECIAL_TOKENS at ids 0-4, the byte
    alphabet, merges learnt from `training_text`, and, should the text offer too few merges, reserved
    special tokens at the end. Prepends bos to what it encodes (as Llama 3's does)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 bytes as GPT-2's printable characters
    if vocab < len(byte_chars) - len(_NOT_UTF8) + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least "
                         f"{len(byte_chars) - len(_NOT_UTF8) + len(SPECIAL_TOKENS)} tokens, the model has {vocab}")
    if vocab < 256 + len(SPECIAL_TOKENS):
        byte_chars = [_byte_char(b) for b in range(256) if b not in _NOT_UTF8]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=byte_chars,
                                  limit_alphabet=len(byte_chars), show_progress=False)
    tok.train_from_iterator(training_text(vocab), trainer=trainer)
    reserved = [AddedToken(f"<|reserved_special_token_{i}|>", special=True) for i in range(vocab - tok.get_vocab_size())]
    tok.add_special_tokens(reserved)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    assert tok.get_vocab_size() == vocab and tok.token_to_id(BOS) == 0, (tok.get_vocab_size(), vocab)
    return tok


def training_text(vocab: int, seed: int = 0) -> list[str]:
    """Seeded pseudo-English paragraphs: a Zipf-drawn lexicon of made-up words (at least one distinct word per merge
    the tokenizer needs, each used at least once), glue words, numbers, punctuation, newlines and a
    little non-ASCII."""
    rng = np.random.default_rng(seed)
    needed = vocab + 1000
    lexicon: list[str] = []
    seen: set[str] = set()
    while len(lexicon) < needed:
        word = "".join(rng.choice(_SYLLABLES, rng.integers(1, 5)))
        if word not in seen:
            seen.add(word)
            lexicon.append(word)
    zipf = 1.0 / np.arange(1, len(lexicon) + 1)
    zipf /= zipf.sum()
    order = [*lexicon, *rng.choice(lexicon, 2 * needed, p=zipf)]  # every word once, the common ones often
    paragraphs, sentences, i = [], [], 0
    while i < len(order):
        words = []
        for _ in range(int(rng.integers(6, 16))):
            if rng.random() < 0.3:
                words.append(str(rng.choice(_GLUE)))
            elif rng.random() < 0.04:
                words.append(str(rng.choice(_EXTRA)) if rng.random() < 0.5 else str(int(rng.integers(0, 10000))))
            elif i < len(order):
                words.append(str(order[i]))
                i += 1
        if words:
            sentences.append(" ".join(words).capitalize() + str(rng.choice([".", ".", ".", "?", "!", ":"])))
            sentences.append(str(rng.choice([" ", " ", "\n", "\n\n"])))
        if len(sentences) >= 12 or i >= len(order):  # a paragraph of up to 6 sentences, lines and blank lines
            paragraphs.append("".join(sentences[:-1]))
            sentences = []
    return paragraphs


def _byte_char(b: int) -> str:
    """GPT-2's printable character for byte b (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def _save_tokenizer(tok, folder: Path) -> None:
    """tokenizer.json, and a tokenizer_config.json that transformers 4 and 5 both load (PreTrainedTokenizerFast),
    with the chat template in it (where llama.cpp's converter and vLLM look)."""
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "additional_special_tokens": [EOT, *HEADER], "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _check_round_trip(preset: ServePreset, folder: Path) -> None:
    spec = read_checkpoint_spec(folder)
    if replace(spec, checkpoint=None, weight_seed=preset.model.weight_seed) != preset.model:
        raise ValueError(f"checkpoint {str(folder)!r} reads back as {spec}, not as the preset's model {preset.model}")
    ours, back = load_weights(preset.model), load_weights(spec)
    differ = [n for n in ours if not torch.equal(ours[n], back[n])]
    if differ:
        raise ValueError(f"checkpoint {str(folder)!r}: {differ[:3]} differ from the preset's weights")
