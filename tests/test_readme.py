"""The README's Quick start has exactly two commands, and CI runs the test one verbatim; the README stays
short, and the relative links of the README and docs/ resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_quick_start_has_two_commands() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each Quick start command is one line"
    assert commands[0].startswith("pip install")
    assert "pytest" in commands[1] and "[test]" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _quick_start_commands()[1] in ci


def _relative_links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not link.startswith(("http://", "https://"))]


def test_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; internals belong in docs/"


def test_readme_and_docs_links_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for link in _relative_links(page):
            target = link.split("#", 1)[0]
            if target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, broken
