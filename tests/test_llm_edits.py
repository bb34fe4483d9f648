"""operators.llm.edits: parsing a model's reply and applying its edits inside the marked blocks."""
from __future__ import annotations

import json

import pytest

from operators.llm.edits import Change, Edit, EditError, apply_change, parse_reply, unified_diff

SOURCE = """import torch

SCALE = 2.0


def helper(x):
    return x * SCALE


# EVOLVE-BLOCK-START
def kernel(x, y):
    z = x + y
    return z * SCALE
# EVOLVE-BLOCK-END


# EVOLVE-BLOCK-START
def other(x):
    return x + 1  # one
# EVOLVE-BLOCK-END
"""


def reply(**fields) -> str:
    return json.dumps({"rationale": "Fuse the add.", **fields})


def edits(*pairs: tuple[str, str]) -> Change:
    return Change("why", edits=tuple(Edit(s, r) for s, r in pairs))


def test_parse_plain_fenced_and_with_prose():
    plain = reply(edits=[{"search": "z = x + y", "replace": "z = torch.add(x, y)"}])
    expected = Change("Fuse the add.", edits=(Edit("z = x + y", "z = torch.add(x, y)"),))
    assert parse_reply(plain) == expected
    fenced = f"Here is my change {{as asked}}:\n```json\n{plain}\n```\nThis should help; {{x}} stays."
    assert parse_reply(fenced) == expected
    assert parse_reply(f"Sure. {{not json}} then {plain} and more {{}}") == expected
    rewrite = parse_reply("```\n" + reply(rewrite="def kernel(x, y):\n    return x + y\n") + "\n```")
    assert rewrite.rewrite.startswith("def kernel") and rewrite.edits == ()


def test_parse_tolerates_raw_newlines_in_strings_and_a_missing_rationale():
    raw = '{"edits": [{"search": "z = x + y\n    return z", "replace": "return x + y"}]}'
    change = parse_reply(raw)
    assert change.rationale == "" and change.edits[0].search == "z = x + y\n    return z"


def test_parse_malformed_json_says_where():
    bad = '```json\n{"rationale": "x", "edits": [{"search": "a\\d", "replace": "b"}]}\n```'
    with pytest.raises(EditError) as caught:
        parse_reply(bad)
    message = str(caught.value)
    assert "does not parse" in message and "Invalid \\escape" in message and "line 2 column" in message
    assert '"rewrite"' in message  # the format is restated for the repair
    with pytest.raises(EditError, match="no JSON object"):
        parse_reply("I could not find anything to improve.")
    with pytest.raises(EditError, match="does not parse"):
        parse_reply('{"rationale": "unterminated')


def test_parse_rejects_wrong_shapes():
    cases = {
        reply(): "neither",
        reply(edits=[]): "neither",
        reply(edits=[{"search": "a", "replace": "b"}], rewrite="x"): "both",
        json.dumps({"changes": []}): "keys \\['changes'\\]",
        reply(edits="z = x + y"): "must be a list",
        reply(edits=[{"search": "a"}]): "edits\\[0\\] must be an object",
        reply(edits=[{"search": "a", "replace": "b"}, {"search": 3, "replace": "b"}]): "edits\\[1\\].*strings",
        reply(edits=[{"search": "", "replace": "b"}]): "edits\\[0\\].*empty",
        reply(edits=[{"search": "a", "replace": "a"}]): "changes nothing",
        reply(rewrite="  \n"): "non-empty",
        reply(rewrite=5): "non-empty",
        json.dumps({"rationale": 3, "rewrite": "x"}): "rationale.*string",
    }
    for text, pattern in cases.items():
        with pytest.raises(EditError, match=pattern):
            parse_reply(text)


def test_apply_inside_a_block():
    new = apply_change(SOURCE, edits(("    z = x + y\n    return z * SCALE\n", "    return (x + y) * SCALE\n")))
    assert "return (x + y) * SCALE" in new and "z = x + y" not in new
    assert new.count("# EVOLVE-BLOCK-START") == 2 and new.count("# EVOLVE-BLOCK-END") == 2
    assert new.replace("    return (x + y) * SCALE\n", "    z = x + y\n    return z * SCALE\n") == SOURCE


def test_search_outside_the_blocks_is_refused_with_a_hint():
    with pytest.raises(EditError) as caught:
        apply_change(SOURCE, edits(("SCALE = 2.0", "SCALE = 3.0")))
    message = str(caught.value)
    assert "not found inside the marked blocks" in message and "outside the marked blocks" in message
    assert "line 3" in message and "'SCALE = 2.0'" in message


def test_ambiguous_search_asks_for_context():
    # "x + " is in both blocks; occurrences are counted over all blocks together
    with pytest.raises(EditError) as caught:
        apply_change(SOURCE, edits(("x + ", "x - ")))
    assert "2 times" in str(caught.value) and "[12, 19]" in str(caught.value) and "unique" in str(caught.value)
    with pytest.raises(EditError, match="3 times"):  # overlapping occurrences count too
        apply_change("# EVOLVE-BLOCK-START\naaaa\n# EVOLVE-BLOCK-END\n", edits(("aa", "b")))


def test_missing_search_and_a_whitespace_hint():
    with pytest.raises(EditError, match="not found inside the marked blocks.*copied exactly"):
        apply_change(SOURCE, edits(("w = x * y", "w = x")))
    with pytest.raises(EditError) as caught:  # indentation lost
        apply_change(SOURCE, edits(("z = x + y\nreturn z * SCALE", "return x")))
    assert "first line 'z = x + y' is at line 12" in str(caught.value)


def test_rewrite_replaces_the_whole_file():
    assert apply_change(SOURCE, Change("simpler", rewrite="def kernel(x, y):\n    return x\n")) == \
        "def kernel(x, y):\n    return x\n"


def test_markers_cannot_be_removed_added_or_merged():
    with pytest.raises(EditError, match="marker"):  # a marker line in the replace text
        apply_change(SOURCE, edits(("    return x + 1  # one\n", "    return x + 1\n# EVOLVE-BLOCK-END\n")))
    with pytest.raises(EditError, match="marker"):  # the newline before the end marker dropped
        apply_change(SOURCE, edits(("    return x + 1  # one\n", "    return x + 1")))
    with pytest.raises(EditError, match="not found inside"):  # the marker is not inside a block
        apply_change(SOURCE, edits(("# EVOLVE-BLOCK-END\n", "")))


def test_edits_apply_in_order_on_the_previous_result():
    change = edits(("z = x + y", "z = x * y"), ("z = x * y\n", "z = x * y  # product\n"),
                   ("return x + 1  # one", "return x + 2"))
    new = apply_change(SOURCE, change)
    assert "z = x * y  # product\n" in new and "return x + 2\n" in new
    with pytest.raises(EditError, match="edits\\[1\\] \\(applied after edits\\[0..0\\]\\)"):
        apply_change(SOURCE, edits(("z = x + y", "z = x * y"), ("z = x + y", "z = 0")))


def test_a_file_without_blocks_is_one_block():
    source = "def f(x):\n    return x\n"
    assert apply_change(source, edits(("return x", "return -x"))) == "def f(x):\n    return -x\n"
    with pytest.raises(EditError, match="not found in the file"):
        apply_change(source, edits(("return y", "return -y")))
    with pytest.raises(EditError, match="marker"):
        apply_change(source, edits(("    return x\n", "    return x\n# EVOLVE-BLOCK-START\n")))


def test_change_and_edit_validate_when_built_directly():
    with pytest.raises(EditError, match="neither"):
        Change("why")
    with pytest.raises(EditError, match="both"):
        Change("why", edits=(Edit("a", "b"),), rewrite="x")
    assert Change("why", edits=[Edit("a", "b")]).edits == (Edit("a", "b"),)


def test_unified_diff():
    new = apply_change(SOURCE, edits(("return x + 1  # one", "return x + 2")))
    diff = unified_diff(SOURCE, new, "a/kernel.py", "b/kernel.py")
    assert diff.startswith("--- a/kernel.py\n+++ b/kernel.py\n")
    assert "-    return x + 1  # one\n+    return x + 2\n" in diff
    assert unified_diff("a", "b", "old", "new").endswith("+b\n\\ No newline at end of file\n")
    assert unified_diff(SOURCE, SOURCE, "a", "b") == ""
