"""How tests/docs/test_doc_commands.py finds the blocks it runs: the marker on the line before a fence."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.marked_blocks import MARKER, marked_blocks


def _page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_a_marked_block_is_found_with_its_line_and_language(tmp_path: Path):
    page = _page(tmp_path, f"# Page\n\n{MARKER}\n```bash\necho one\necho two\n```\n\n```bash\nnot marked\n```\n")
    [block] = marked_blocks(page, tmp_path)
    assert (block.name, block.lang, block.code) == ("page.md:4", "bash", "echo one\necho two\n")


def test_a_longer_fence_holds_a_shorter_one(tmp_path: Path):
    page = _page(tmp_path, f"{MARKER}\n````python\nprint('''\n```\n''')\n````\n")
    [block] = marked_blocks(page, tmp_path)
    assert block.lang == "python" and "```" in block.code


def test_a_marker_away_from_its_fence_is_an_error(tmp_path: Path):
    with pytest.raises(ValueError, match="not followed by a fenced block"):
        marked_blocks(_page(tmp_path, f"{MARKER}\n\n```bash\necho\n```\n"), tmp_path)


def test_an_unclosed_marked_block_is_an_error(tmp_path: Path):
    with pytest.raises(ValueError, match="never closed"):
        marked_blocks(_page(tmp_path, f"{MARKER}\n```bash\necho\n"), tmp_path)
