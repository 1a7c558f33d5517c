"""The repository's text is for its users: no work-log references, and links that lead
somewhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".cfg", ".txt", ""}
# A numbered work entry or an issue number, as a diary would cite them.
WORK_LOG = re.compile(r"\b(sessions? \d+|session\d+|issues? #?\d+|round \d+ of)\b", re.I)


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True, timeout=60).stdout.split()
    return [ROOT / name for name in names
            if Path(name).suffix in TEXT_SUFFIXES and (ROOT / name).is_file()]


def test_no_file_cites_a_work_log() -> None:
    found = []
    for path in _tracked_text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if WORK_LOG.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert found == []


def test_every_relative_link_in_the_docs_leads_to_a_file() -> None:
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert missing == []


def test_the_readme_points_to_the_architecture_inside_the_repository() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/architecture.md" in readme
    assert "../" not in re.sub(r"`[^`]*`", "", readme)  # no link outside the repository
