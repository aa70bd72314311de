"""README.md's Python examples, run as written against the embedded model, so that they cannot rot.

The blocks run in order in one namespace, as a reader would paste them, in a temporary folder that
holds what they name: `a.png`, `b.png`, a `photos/` folder (two scenes), and the names `image`,
`img1`, `img2`, `images` (generated scenes). What a reader would fill in themselves is filled in:
lines that load placeholder paths (`/path/to/...`) are left out (`chat_model`, "a model with a chat
template", is a tiny random Qwen2.5-VL checkpoint: its answers are noise, its prompts real), the server address is a live
`foveal serve` of the embedded model, and the `data:image/png;base64,...` placeholder becomes a real
data URL. A block with a top-level `await` runs in an event loop. `missing.png` stays missing: the
example shows its error in the results.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import textwrap
from pathlib import Path

import pytest

import foveal
from foveal.server import create_app
from foveal.server.background import BackgroundServer
from foveal.testing import tiny
from foveal.vision import scenes

README = Path(__file__).resolve().parent.parent / "README.md"
pytestmark = pytest.mark.skipif(
    not (Path(foveal.__file__).parent / "embedded" / "model.safetensors").is_file(),
    reason="no embedded weights in sdk/embedded",
)


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _scene(seed: int):
    return scenes.render(scenes.generate_scene(seed, 160))


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _prepared(code: str, url: str, data_url: str) -> str:
    lines = [line for line in code.splitlines() if "/path/to/" not in line]
    code = (
        "\n".join(lines).replace("http://127.0.0.1:2020", url).replace("data:image/png;base64,...", data_url)
    )
    if re.search(r"^\s*\w+ = await |^\s*await ", code, re.M):
        code = "async def _block():\n" + textwrap.indent(code, "    ") + "\n    globals().update(locals())\n"
        code += "import asyncio as _asyncio\n_asyncio.run(_block())\n"
    return code


def test_every_readme_python_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    img1, img2 = _scene(1), _scene(2)
    img1.save("a.png")
    img2.save("b.png")
    Path("photos").mkdir()
    img1.save("photos/one.png")
    img2.save("photos/two.png")
    namespace = {"image": _scene(0), "img1": img1, "img2": img2, "images": [img1, img2], "asyncio": asyncio}
    assert len(blocks()) >= 5, "README.md lost its examples?"
    chat_model = foveal.load(tiny.build("qwen2_5_vl", tmp_path / "qwen"), device="cpu", max_model_len=1024)
    namespace["chat_model"] = chat_model
    with chat_model, foveal.load(device="cpu") as model, BackgroundServer(create_app(model)) as url:
        for i, code in enumerate(blocks()):
            source = _prepared(code, url, _data_url(img1))
            try:
                exec(compile(source, f"README.md python block {i}", "exec", dont_inherit=True), namespace)
            except Exception as error:
                pytest.fail(f"README.md python block {i} failed: {type(error).__name__}: {error}\n{code}")
