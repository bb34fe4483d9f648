"""A fixed real text every machine has offline, for a checkpoint's quality on real text (the accuracy
contract's `real_text` figures, docs/evidence.md): the Zen of Python, read from the standard library's `this`
module (rot13 in its source since Python 2.2; read, not imported, which would print it)."""
from __future__ import annotations

import codecs
import importlib.util
import re
from pathlib import Path

NAME = "the Zen of Python"


def zen_of_python() -> str:
    """The text of `this.s`, decoded."""
    source = Path(importlib.util.find_spec("this").origin).read_text()
    encoded = re.search(r's = """(.*?)"""', source, re.S)
    if encoded is None:
        raise RuntimeError("the standard library's this.py no longer holds its text as s = \"\"\"...\"\"\"")
    return codecs.decode(encoded.group(1), "rot13")


def token_ids(folder: str | Path) -> list[int] | None:
    """The Zen of Python in the tokenizer saved in `folder` (bos first when it adds one), None without one."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(folder)).encode(zen_of_python()))
