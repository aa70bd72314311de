"""The family registry (`foveal.families`) is the one list of families; the pages that list them
must agree with it: the README's "Supported families" table, the models overview
(docs/models/index.md: each family's page and its config.json architectures), the architecture
page's family table (each family's folder) and the docs site's navigation (each family's page).

A family is known everywhere by its folder (`families/<folder>/`), whose page is
`docs/models/<folder>.md`; a failure names the families missing from a page, or extra on it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from foveal import families

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {family.__module__.split(".")[2] for family in families.FAMILIES}


def _section(path: str, heading: str) -> str:
    """The text of the section under `heading` (up to the next heading of its level or above)."""
    text = (ROOT / path).read_text()
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    following = re.search(rf"^#{{1,{len(level)}}} ", text[start + len(heading) :], re.M)
    return text[start : start + len(heading) + (following.start() if following else len(text))]


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]


def _agree(found: set[str], where: str) -> None:
    missing, extra = sorted(FOLDERS - found), sorted(found - FOLDERS)
    assert not missing and not extra, (
        f"{where} disagrees with the family registry (foveal.families._REGISTRY): "
        f"missing {missing or 'none'}, extra {extra or 'none'}"
    )


def test_the_readme_table_lists_every_registered_family():
    rows = _table_rows(_section("README.md", "## Supported families"))
    _agree({m for row in rows for m in re.findall(r"\(docs/models/(\w+)\.md\)", row)}, "README.md's Supported families")


def test_the_models_overview_lists_every_family_and_architecture():
    rows = _table_rows(_section("docs/models/index.md", "## Families"))
    _agree({m for row in rows for m in re.findall(r"\((\w+)\.md\)", row)}, "docs/models/index.md's Families table")
    named = {m for row in rows for m in re.findall(r"`(\w+)`", row) if m[0].isupper()}
    archs = set(families.supported_architectures())
    assert named == archs, f"docs/models/index.md: architectures missing {sorted(archs - named)}, extra {sorted(named - archs)}"


def test_the_architecture_page_lists_every_family_folder():
    rows = _table_rows(_section("docs/architecture.md", "## Families are plugins"))
    _agree({m for row in rows for m in re.findall(r"`families/(\w+)/`", row)}, "docs/architecture.md's family table")


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_every_family_has_its_page_in_the_docs_site(folder):
    assert (ROOT / "docs" / "models" / f"{folder}.md").exists(), f"families/{folder}/ has no docs/models/{folder}.md"
    assert f"models/{folder}.md" in (ROOT / "mkdocs.yml").read_text(), f"mkdocs.yml's nav lacks models/{folder}.md"
