"""The README stays the short front door, and its links into docs/ resolve. The site itself is built by ``make test``
before the tests (``mkdocs build --strict``: mkdocs.yml's ``validation`` fails it on a broken link, an unknown anchor
or a page left out of the nav)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 160
TWO_COMMANDS = "```bash\nmake up "
# A Markdown link's target, without its anchor: [text](target#anchor)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    opening = "\n".join(lines[:8])
    assert lines[0] == "# Switchyard"
    assert opening.startswith("# Switchyard\n\n" + TWO_COMMANDS), "the README opens with the two commands"
    assert "\nmake test " in opening, "the README opens with the two commands"


def test_the_readme_links_into_docs_resolve():
    """MkDocs checks the links between pages; the README is outside the site, so its links are checked here."""
    targets = [t for t in LINK.findall((ROOT / "README.md").read_text()) if "://" not in t]
    assert any(t.startswith("docs/") for t in targets), "the README links into docs/"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
