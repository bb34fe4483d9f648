"""Append-only JSONL files (the journal, the MLflow outbox): one reader, one torn-line policy.

Every writer appends one whole line (`json + "\\n"`) and fsyncs, so a crash can only leave the *last*
line cut short, without its newline. That torn line is skipped (its record was never acknowledged) and
`trim_torn_tail` drops it before appending again, so the next line never glues onto it. Any other line
that is not a JSON object is damage, and `read_jsonl` raises `JsonlError` naming the file and line.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonlError(ValueError):
    """A JSONL file damaged other than by a torn last line; the message names the file and the line."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The file's records, one dict per line ([] when the file does not exist).

    A last line without its newline that does not parse is torn by a crash and skipped; a blank line
    is skipped; any other unreadable line raises `JsonlError` ("PATH:LINE is corrupt (...)")."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")  # a complete file ends with "\n", so its last element is ""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # no newline after it: torn by a crash mid-append
                break
            raise JsonlError(f"{path}:{number} is corrupt (JSONDecodeError: {exc})") from exc
        if not isinstance(row, dict):
            raise JsonlError(f"{path}:{number} is corrupt (a JSON {type(row).__name__}, expected an object)")
        rows.append(row)
    return rows


def trim_torn_tail(path: Path) -> bool:
    """Cut a torn last line (bytes after the final newline) so appending starts on a fresh line.

    Returns whether anything was cut. A missing or empty file is left as it is."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    if not data or data.endswith(b"\n"):
        return False
    with open(path, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())
    return True


def append_line(f, row: dict[str, Any]) -> None:
    """Append one record to an open text file and fsync it: once this returns, the line survives a crash."""
    f.write(json.dumps(row, sort_keys=True) + "\n")
    f.flush()
    os.fsync(f.fileno())
