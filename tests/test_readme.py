"""README.md is a short front page: the two commands first, a tour, links into the docs, no diary.

Its python examples are run with the docs pages' by tests/test_docs.py; here are the page's own
promises: the install-and-demo command, then CI's test command byte for byte (.ci/run runs that
line), at most 15,000 characters, links that resolve in a clone, and no measurement log or work
history (issue numbers, sessions, machine conditions belong nowhere in it; figures live in
docs/performance.md with their conditions).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_CHARS = 15_000
TEST_COMMAND = ". .venv/bin/activate && python -m pytest -q"
DIARY = re.compile(
    r"\bissues? #?\d+|#\d{2,}\b|\bsessions?\b|load average|this (shared )?(2-core )?machine|\b\d-core\b", re.I
)


def _text() -> str:
    return README.read_text()


def _code_blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S)


def test_readme_is_short():
    assert len(_text()) <= MAX_CHARS, f"README.md has {len(_text())} characters; move detail into docs/"


def test_the_two_commands_come_first():
    text = _text()
    first, second = _code_blocks(text)[:2]
    assert text.index("```") < text.index("\n## "), "the commands come before any section"
    assert first[0] == second[0] == "bash"
    install = first[1].strip()
    assert "python3 -m venv .venv" in install
    assert 'pip install -c constraints.txt -e ".[dev]"' in install
    assert install.endswith("&& foveal demo")
    assert second[1].strip() == TEST_COMMAND


def test_ci_runs_the_readme_test_command_verbatim():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[-1] == TEST_COMMAND, ".ci/run must end with README.md's test command, byte for byte"


def test_no_diary_in_the_readme():
    found = [match.group(0) for match in DIARY.finditer(_text())]
    assert not found, f"README.md holds work history or machine conditions: {found}"


def test_the_diary_pattern_finds_what_it_should():
    samples = [
        "as issue 19 measured",
        "this session changed",
        "load average 4-5",
        "on this shared 2-core machine",
    ]
    assert all(DIARY.search(sample) for sample in samples)
    assert not DIARY.search("a 2-slot pipeline runs the forward of step t+1")


def test_every_relative_link_resolves():
    text = re.sub(r"^```.*?^```", "", _text(), flags=re.M | re.S)
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "README.md links into the docs"
    missing = [t for t in targets if "://" not in t and not (README.parent / t).exists()]
    assert not missing, f"README.md links to paths that do not exist in a clone: {missing}"
    assert "../shared" not in _text()


def test_the_readme_links_the_main_docs_pages():
    text = _text()
    for page in (
        "getting-started",
        "models/index",
        "skills",
        "structured-output",
        "serving",
        "batch",
        "performance",
        "architecture",
    ):
        assert f"(docs/{page}.md)" in text, f"README.md does not link docs/{page}.md"
