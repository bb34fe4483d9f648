"""Text in, text out for a served generation engine: the replica's side of OpenAI's /v1/completions (text
prompts) and /v1/chat/completions (messages), over the tokenizer in the model's checkpoint folder
(transformers' `AutoTokenizer`; trusted code, never run inside an engine's sandbox).

Decoding skips special tokens (bos, eos, a turn's end), as vLLM's default `skip_special_tokens` does; a
`Detokenizer` streams the same text token by token, holding back an incomplete UTF-8 character.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

ROLES = ("system", "user", "assistant")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
_END_OF_TURN = "<|eot_id|>"  # Llama 3's; eos ids also come from the tokenizer and generation_config.json
_INCOMPLETE = "\ufffd"  # what a decode of a cut UTF-8 sequence ends with


@dataclass(frozen=True)
class TextCodec:
    """A checkpoint's tokenizer: text and chat messages to token ids and back."""

    folder: str
    tokenizer: Any  # transformers' PreTrainedTokenizerBase
    eos_ids: tuple[int, ...]  # ids that end a reply: eos, end of turn, generation_config.json's eos_token_id
    has_chat_template: bool

    @classmethod
    def from_folder(cls, folder: str | Path) -> TextCodec | None:
        """The codec of the tokenizer saved in `folder`; None when the folder has no tokenizer files."""
        folder = Path(folder).expanduser().resolve()
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(_END_OF_TURN)}
        eos.update(_generation_eos(folder))
        eos_ids = tuple(sorted(i for i in eos if isinstance(i, int) and i != tokenizer.unk_token_id))
        return cls(str(folder), tokenizer, eos_ids, bool(tokenizer.chat_template))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with bos first when the tokenizer adds it."""
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: list) -> list[int]:
        """Token ids of `messages` in the chat template, ending where the assistant's reply starts. ValueError
        naming `messages` when they are malformed or the model has no chat template."""
        _check_messages(messages)
        if not self.has_chat_template:
            raise ValueError(f"messages: the tokenizer in {self.folder!r} has no chat template; send a text prompt "
                             f"to /v1/completions instead")
        try:  # a template may raise on what it does not take (e.g. a system message, roles out of turn)
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError and what a template raises
            raise ValueError(f"messages: the chat template refused them: {type(exc).__name__}: {exc}"[:500]) from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))  # the template writes bos itself

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)


class Detokenizer:
    """One reply's text, streamed: `push(token_id)` returns the new text, `flush()` what was held back.
    The pieces joined equal `codec.decode(all ids)`.

    Each push decodes a window of ids: from the start of the last text handed out (`prefix`) to the end,
    compared with the window's decode up to where the new ids begin (`read`), so tokenizers whose pieces
    depend on their neighbours (a leading space) decode as they do in full."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.codec.decode(self.ids[self.prefix:self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or a character cut short: wait for its next bytes
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD, as in a full decode)."""
        before = self.codec.decode(self.ids[self.prefix:self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


def _generation_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def _check_messages(messages: object) -> None:
    allowed = f'a list of {{"role": {"|".join(ROLES)}, "content": str, optional "name": str}}'
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list, got {type(messages).__name__}; allowed: {allowed}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not {"role", "content"} <= set(m) <= {"role", "content", "name"}:
            keys = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise ValueError(f"messages[{i}] must be an object with role and content, got {keys}; allowed: {allowed}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(m.get('content')).__name__}")
