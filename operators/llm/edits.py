"""What a model proposes for a source file, and applying it: search/replace edits or a whole rewrite.

The model replies with one JSON object (in ```json fences or with prose around it, both tolerated):

    {"rationale": "...", "edits": [{"search": "<exact text>", "replace": "<new text>"}, ...]}
    {"rationale": "...", "rewrite": "<the whole new file>"}

`parse_reply` turns the reply into a `Change`; `apply_change` applies it to a source. Edits may touch only
the text inside the marked blocks (`# EVOLVE-BLOCK-START` ... `# EVOLVE-BLOCK-END`, or the whole file when
it has none), each `search` must occur there exactly once, and the marker lines stay as they are. Every
`EditError` message says what was wrong and what the reply must look like, so it can be sent back to the
model as is for a repair.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from typing import Any

from evo.core.code import END_MARK, START_MARK, marked_blocks

REPLY_FORMAT = (
    'Reply with ONE JSON object, either {"rationale": "<one or two sentences>", "edits": [{"search": '
    '"<text copied exactly from inside a marked block>", "replace": "<new text>"}, ...]} or, to replace the '
    'whole file, {"rationale": "<one or two sentences>", "rewrite": "<the whole new file>"}.')
_KEYS = ("rationale", "edits", "rewrite")
_OPENS_REPLY = re.compile(r'\{\s*"(?:rationale|edits|rewrite)"')
_MAX_CANDIDATES = 200  # '{' positions tried as the start of the reply's object
_QUOTE = 200  # characters of a search text quoted back


class EditError(ValueError):
    """A reply or an edit that cannot be applied; the message is fit to be sent back to the model."""


@dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of `search` inside the marked blocks with `replace`."""

    search: str
    replace: str

    def __post_init__(self) -> None:
        if not isinstance(self.search, str) or not isinstance(self.replace, str):
            raise EditError(f'"search" and "replace" must be strings, got {type(self.search).__name__} and '
                            f'{type(self.replace).__name__}')
        if not self.search:
            raise EditError('"search" is empty; it must be text copied exactly from inside a marked block')
        if self.search == self.replace:
            raise EditError(f'"replace" equals "search", so the edit changes nothing; drop it or change the '
                            f'text. Search text begins: {self.search[:_QUOTE]!r}')


@dataclass(frozen=True)
class Change:
    """A proposed change of a file: ordered `edits`, or a whole-file `rewrite` (exactly one of them)."""

    rationale: str
    edits: tuple[Edit, ...] = ()
    rewrite: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rationale, str):
            raise EditError(f'"rationale" must be a string, got {type(self.rationale).__name__}. {REPLY_FORMAT}')
        object.__setattr__(self, "edits", tuple(self.edits))
        if not all(isinstance(e, Edit) for e in self.edits):
            raise EditError(f"Change.edits must hold Edit values, got {[type(e).__name__ for e in self.edits]}")
        if self.edits and self.rewrite is not None:
            raise EditError(f'the reply has both "edits" and "rewrite"; give exactly one of them. {REPLY_FORMAT}')
        if not self.edits and self.rewrite is None:
            raise EditError(f'the reply has neither "edits" (a non-empty list) nor "rewrite"; give exactly one. '
                            f'{REPLY_FORMAT}')
        if self.rewrite is not None and (not isinstance(self.rewrite, str) or not self.rewrite.strip()):
            raise EditError(f'"rewrite" must be the whole new file as a non-empty string, got {self.rewrite!r:.80}. '
                            f'{REPLY_FORMAT}')


def parse_reply(text: str) -> Change:
    """The Change in a model's reply: the first top-level JSON object in it, fences and prose allowed."""
    if not isinstance(text, str):
        raise EditError(f"the reply must be text, got {type(text).__name__}")
    data = _find_object(text)
    rationale = data.get("rationale", "")
    edits, rewrite = data.get("edits"), data.get("rewrite")
    has_edits = edits is not None and edits != []
    if has_edits == (rewrite is not None):
        which = "both" if has_edits else "neither"
        raise EditError(f'the reply\'s JSON object has keys {sorted(data)}: {which} of "edits" (a non-empty list) '
                        f'and "rewrite"; give exactly one. {REPLY_FORMAT}')
    if not has_edits:
        return Change(rationale=rationale, rewrite=rewrite)
    if not isinstance(edits, list):
        raise EditError(f'"edits" must be a list of {{"search": ..., "replace": ...}} objects, got '
                        f'{type(edits).__name__}. {REPLY_FORMAT}')
    return Change(rationale=rationale, edits=tuple(_edit(i, e) for i, e in enumerate(edits)))


def _edit(index: int, item: Any) -> Edit:
    if not isinstance(item, dict) or "search" not in item or "replace" not in item:
        got = f"keys {sorted(item)}" if isinstance(item, dict) else type(item).__name__
        raise EditError(f'edits[{index}] must be an object {{"search": "<exact text>", "replace": "<new text>"}}, '
                        f'got {got}. {REPLY_FORMAT}')
    try:
        return Edit(item["search"], item["replace"])
    except EditError as exc:
        raise EditError(f"edits[{index}]: {exc}") from None


def _find_object(text: str) -> dict:
    """The reply's JSON object: tried from a ```json fence first, then from every '{' in order; the first
    object with a key of the reply format wins. Non-strict decoding allows raw newlines inside strings."""
    decoder = json.JSONDecoder(strict=False)
    starts = [i for i, ch in enumerate(text) if ch == "{"]
    fence = text.find("```json")
    if fence >= 0 and text.find("{", fence) >= 0:
        first = text.find("{", fence)
        starts = [first] + [i for i in starts if i != first]
    furthest: json.JSONDecodeError | None = None
    furthest_rank = (False, -1)
    other: dict | None = None
    other_end = -1
    for start in starts[:_MAX_CANDIDATES]:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:  # the one the model meant: it opens with a key of the format,
            # else the one that got furthest
            rank = (bool(_OPENS_REPLY.match(text, start)), exc.pos)
            if furthest is None or rank > furthest_rank:
                furthest, furthest_rank = exc, rank
            continue
        if isinstance(value, dict) and any(k in value for k in _KEYS):
            return value
        if other is None and isinstance(value, dict):
            other, other_end = value, end
    if other is not None and (furthest is None or not furthest_rank[0] and furthest.pos <= other_end):
        return other  # no key of the format: the caller names the keys it found
    if furthest is not None:
        near = text[max(0, furthest.pos - 40):furthest.pos + 40]
        raise EditError(f"the reply's JSON does not parse: {furthest.msg} at line {furthest.lineno} column "
                        f"{furthest.colno} (char {furthest.pos}), near {near!r}. Escape backslashes as \\\\ and "
                        f'double quotes as \\" inside strings. {REPLY_FORMAT}')
    raise EditError(f"the reply contains no JSON object (no '{{' in {len(text)} characters). {REPLY_FORMAT}")


def apply_change(source: str, change: Change) -> str:
    """`source` with `change` applied: the rewrite, or the edits in order, each on the previous result."""
    if change.rewrite is not None:
        return change.rewrite
    for index, edit in enumerate(change.edits):
        source = _apply_edit(source, edit, index)
    return source


def _apply_edit(source: str, edit: Edit, index: int) -> str:
    label = f"edits[{index}]" + (f" (applied after edits[0..{index - 1}])" if index else "")
    marked = marked_blocks(source)
    blocks = marked or [(0, len(source))]
    hits = [pos for start, end in blocks for pos in _occurrences(source, edit.search, start, end)]
    quote = f"Search text begins: {edit.search[:_QUOTE]!r}"
    if not hits:
        raise EditError(_not_found(source, edit.search, blocks, bool(marked), label) + " " + quote)
    if len(hits) > 1:
        lines = [_line(source, pos) for pos in hits]
        raise EditError(f"{label}: the search text occurs {len(hits)} times (at lines {lines}); it must occur exactly "
                        f"once, so add neighbouring lines to the search (and the same to the replace) to make it "
                        f"unique. {quote}")
    pos = hits[0]
    new = source[:pos] + edit.replace + source[pos + len(edit.search):]
    if _marker_lines(new) != _marker_lines(source):
        raise EditError(f"{label}: the edit would add, remove or merge a marker line ({START_MARK!r} / {END_MARK!r}); "
                        f"the markers must stay exactly as they are, each on its own line, so keep the newline "
                        f"before a marker and put no marker in the replace text. {quote}")
    return new


def _not_found(source: str, search: str, blocks: list[tuple[int, int]], marked: bool, label: str) -> str:
    where = f"inside the marked blocks (between {START_MARK!r} and {END_MARK!r})" if marked else "in the file"
    message = (f"{label}: the search text was not found {where}; it must be copied exactly, character for character "
               f"with its indentation, from inside a marked block.")
    outside = source.find(search)
    if outside >= 0:
        message += (f" It does occur at line {_line(source, outside)}, outside the marked blocks: that code may "
                    f"not be changed; edit only between the markers.")
        return message
    first = next((line.strip() for line in search.splitlines() if line.strip()), "")
    for start, end in blocks:
        offset = start
        for line in source[start:end].splitlines(keepends=True):
            if first and line.strip() == first:
                return message + (f" Its first line {first[:80]!r} is at line {_line(source, offset)}, but the "
                                  f"lines that follow or the whitespace differ; copy them exactly from there.")
            offset += len(line)
    return message


def _occurrences(source: str, search: str, start: int, end: int) -> list[int]:
    """Start offsets of `search` lying wholly within source[start:end], overlapping ones included."""
    found, pos = [], source.find(search, start, end)
    while pos >= 0:
        found.append(pos)
        pos = source.find(search, pos + 1, end)
    return found


def _line(source: str, pos: int) -> int:
    return source.count("\n", 0, pos) + 1


def _marker_lines(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if line.strip() in (START_MARK, END_MARK)]


def unified_diff(old: str, new: str, old_name: str, new_name: str) -> str:
    """A unified diff of two sources (git's "\\ No newline at end of file" where a last line lacks one)."""
    lines = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                 fromfile=old_name, tofile=new_name)
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
