"""Every ```python block of README.md and docs/**/*.md runs, as written, against the embedded model.

A page's blocks run in order in one namespace, as a reader pastes them, in a temporary folder that
holds what they name; the first block that fails fails its page with the file and line it failed at.
A block fenced as ```python skip is not run (it needs a real checkpoint or a cluster); pages added
under docs/ later are picked up by the glob.

What a reader would fill in is filled in:
- images: `a.png`, `b.png`, `photo.png`, a `photos/` folder (two scenes), and the names `image`, `img1`,
  `img2`, `images` (generated scenes);
- models: `foveal.load()` with no path (and load's default options) returns one embedded model
  shared by every page (loading it takes seconds; its `close()` is deferred to the end of the module). Lines that name a placeholder
  path (`/path/to/...`) are left out; `chat_model`, "a model with a chat template", is a tiny random
  Qwen2.5-VL checkpoint (its answers are noise, its prompts real);
- the server address `http://127.0.0.1:2020` is a live `foveal serve` of the shared model, and the
  `data:image/png;base64,...` placeholder a real data URL.
A block with a top-level `await` runs in an event loop. `missing.png` stays missing: the examples show
its error in the results.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import inspect
import io
import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import foveal
from foveal.server import create_app
from foveal.server.background import BackgroundServer
from foveal.testing import tiny
from foveal.vision import scenes

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SERVER = "http://127.0.0.1:2020"
DATA_URL = "data:image/png;base64,..."
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python(?P<info>[^\n`]*)\n(?P<code>.*?)^(?P=indent)```", re.M | re.S
)
AWAIT = re.compile(r"^\s*(\w+ = )?await ", re.M)


@dataclass(frozen=True, slots=True)
class Block:
    """One ```python block: its page, the page line of its first code line, its code, and whether to run it."""

    page: Path
    line: int
    code: str
    skip: bool

    @property
    def where(self) -> str:
        return f"{_relative(self.page)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's ```python blocks in order (indented ones, in lists and admonitions, dedented)."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start("code")) + 1
        code = textwrap.dedent(match["code"])
        found.append(Block(page, line, code, skip="skip" in match["info"].split()))
    return found


def prepared(block: Block, url: str = SERVER, data_url: str = DATA_URL) -> str:
    """The block's code as it runs: placeholders filled in, line numbers kept those of the page."""
    lines = ["" if "/path/to/" in line else line for line in block.code.splitlines()]
    code = "\n".join(lines).replace(SERVER, url).replace(DATA_URL, data_url)
    pad = "\n" * (block.line - 1)
    if AWAIT.search(code):
        body = textwrap.indent(code, "    ")
        code = f"async def _block():\n{body}\n    globals().update(locals())\n"
        code += "import asyncio as _asyncio\n_asyncio.run(_block())\n"
        pad = pad[:-1]  # the wrapper's first line stands on the fence line
    return pad + code


# Clients a page may import that README's install does not bring, and how to get them: the moondream
# client's own dependencies are GPU kernels it never imports over HTTP, so .ci/run installs it --no-deps.
OPTIONAL_CLIENTS = {"moondream": "pip install --no-deps moondream==2.6.1 (as .ci/run does)"}
IMPORTS = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", re.M)


def missing_clients(page: Path) -> list[str]:
    """The optional clients the page's runnable blocks import that are not installed, with their hints."""
    named = {m for block in blocks(page) if not block.skip for m in IMPORTS.findall(block.code)}
    return [
        f"{name} ({hint})"
        for name, hint in OPTIONAL_CLIENTS.items()
        if name in named and importlib.util.find_spec(name) is None
    ]


def run_page(page: Path, namespace: dict, url: str = SERVER, data_url: str = DATA_URL) -> int:
    """Run the page's blocks in `namespace`; pytest.fail naming file:line at the first error. Returns the
    number of blocks run. A page that imports an optional client which is not installed is skipped,
    naming it and how to install it."""
    name = _relative(page)
    if absent := missing_clients(page):
        pytest.skip(f"{name} imports {', '.join(absent)}, which is not installed")
    ran = 0
    for block in blocks(page):
        if block.skip:
            continue
        try:
            exec(compile(prepared(block, url, data_url), name, "exec", dont_inherit=True), namespace)
        except Exception as error:
            line = _failing_line(error, name) or block.line
            pytest.fail(
                f"{name}:{line}: the python block at {block.where} failed: {type(error).__name__}: {error}\n"
                f"{block.code}",
                pytrace=False,
            )
        ran += 1
    return ran


def _failing_line(error: BaseException, name: str) -> int | None:
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == name]
    return lines[-1] if lines else None


def _relative(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


# ---- the harness itself -------------------------------------------------------------------------------------


def test_a_page_importing_an_absent_optional_client_skips_naming_it(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("```python\nimport moondream\nraise SystemExit('ran')\n```\n")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match=r"imports moondream \(pip install --no-deps"):
        run_page(page, {})
    monkeypatch.undo()
    page.write_text("```python skip\nimport moondream\n```\n")  # a skip block imports nothing
    assert missing_clients(page) == []


def test_a_failing_block_names_its_file_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```python\nx = 1\ny = x / 0\n```\n")
    with pytest.raises(pytest.fail.Exception, match=r"page\.md:5: .*ZeroDivisionError"):
        run_page(page, {})


def test_a_failing_await_block_names_its_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n- a list item:\n\n    ```python\n    await asyncio.sleep(0)\n    1 / 0\n    ```\n"
    )
    with pytest.raises(pytest.fail.Exception, match=r"page\.md:7: .*ZeroDivisionError"):
        run_page(page, {"asyncio": asyncio})


def test_blocks_share_a_namespace_and_skip_blocks_do_not_run(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 2\n```\n\n```python skip\nraise SystemExit('a skip block ran')\n```\n\n"
        "```python\nassert x == 2\nseen = True\n```\n\n```bash\nexit 1\n```\n"
    )
    namespace: dict = {}
    assert run_page(page, namespace) == 2
    assert namespace["seen"] is True


def test_placeholder_paths_are_left_out_and_lines_kept(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('```python\nm = load("/path/to/checkpoint")\nn = 1\n```\n')
    (block,) = blocks(page)
    assert prepared(block).splitlines() == ["", "", "n = 1"]


# ---- the site -----------------------------------------------------------------------------------------------


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_nav_page_exists_and_every_page_of_the_nav_has_examples_run():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    assert "architecture.md" in pages and "api/index.md" in pages
    missing = [page for page in pages if not (ROOT / "docs" / page).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    assert {ROOT / "docs" / page for page in pages} <= set(PAGES)


def test_the_api_reference_reads_the_sources_as_the_installed_package():
    spec = importlib.util.spec_from_file_location("source_tree", ROOT / "docs" / "_hooks" / "source_tree.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    package = hook.source_tree(ROOT) / "foveal"
    for module in (
        "model.py",
        "engine/pipeline.py",
        "grammars/compiler.py",
        "families/base.py",
        "batch/runner.py",
    ):
        assert (package / module).is_file(), f"the docs' source tree lacks foveal/{module}"


# ---- the pages ----------------------------------------------------------------------------------------------


def _scene(seed: int):
    return scenes.render(scenes.generate_scene(seed, 160))


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The embedded model (what `foveal.load()` returns on every page), a tiny chat model, a live server."""
    if not (Path(foveal.__file__).parent / "embedded" / "model.safetensors").is_file():
        pytest.skip("no embedded weights in sdk/embedded")
    folder = tmp_path_factory.mktemp("models")
    chat_model = foveal.load(tiny.build("qwen2_5_vl", folder / "qwen"), device="cpu", max_model_len=1024)
    model = foveal.load(device="cpu")
    model.close = lambda: None  # pages may close it (`with foveal.load() as model:`); the module does
    with chat_model, BackgroundServer(create_app(model)) as url:
        yield model, chat_model, url
    type(model).close(model)


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_every_python_example_runs(page, shared, tmp_path, monkeypatch):
    model, chat_model, url = shared
    real_load = foveal.load
    defaults = {name: p.default for name, p in inspect.signature(real_load).parameters.items()}

    def default(name, value):  # the shared model is on the CPU, which "auto" picks without CUDA
        return value in ("auto", "cpu") if name == "device" else value == defaults.get(name, ...)

    def load(path=None, **options):
        shared = path is None and all(default(name, value) for name, value in options.items())
        return model if shared else real_load(path, **options)

    monkeypatch.setattr(foveal, "load", load)
    monkeypatch.chdir(tmp_path)
    img1, img2 = _scene(1), _scene(2)
    img1.save("a.png")
    img2.save("b.png")
    _scene(3).save("photo.png")
    Path("photos").mkdir()
    img1.save("photos/one.png")
    img2.save("photos/two.png")
    namespace = {
        "image": _scene(0),
        "img1": img1,
        "img2": img2,
        "images": [img1, img2],
        "asyncio": asyncio,
        "chat_model": chat_model,
    }
    run_page(page, namespace, url, _data_url(img1))
