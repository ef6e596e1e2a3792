"""The documentation site builds with ``mkdocs build --strict`` (mkdocs.yml's ``validation`` makes a broken link,
an unknown anchor or a page left out of the nav fail it), and the README stays the short front door."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 160
TWO_COMMANDS = "```bash\nmake up "
# A Markdown link's target, without its anchor: [text](target#anchor)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def test_the_site_builds_strictly(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert (tmp_path / "site" / "index.html").exists()


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
