"""Task formats of the embedded shapes model: prompt per skill, target text per skill, parsing back.

The embedded model is a tiny PaliGemma. Its prompt is PaliGemma's prefix ("<image>" x n, <bos>,
prompt, "\\n"), its answer the suffix, then <eos>. The spatial answers follow the spatial grammar
shared with the grammar package:

- N location bins; tokens `<loc0000>`..`<loc{N-1:04d}>`; a coordinate v in [0, 1] encodes as
  k = round(v * (N - 1)) and decodes as k / (N - 1).
- detect: items `<locYMIN><locXMIN><locYMAX><locXMAX> LABEL` joined by " ; " (LABEL: the object
  phrase asked for, verbatim); boxes have strictly positive extent in bins.
- point: items `<locY><locX> LABEL` joined by " ; " (centre points).
- no items when nothing matches.

What the SDK needs to drive the model (N, prompt templates) lives in the shipped folder's
`foveal.json`, read by `ShapesFormat.load`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from foveal.vision import scenes

FORMAT_FILE = "foveal.json"
SKILLS = ("caption", "query", "detect", "point")
_LOC = re.compile(r"<loc(\d{4})>")


def _default_prompts() -> dict[str, str]:
    return {
        "caption": "caption {length}",
        "query": "answer {question}",
        "detect": "detect {object}",
        "point": "point {object}",
    }


@dataclass(slots=True)
class ShapesFormat:
    """The model's task formats: location bins and prompt templates per skill."""

    n_bins: int = 32
    prompts: dict[str, str] = field(default_factory=_default_prompts)
    separator: str = " ; "
    family: str = "paligemma"

    # ---- files ----

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / FORMAT_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, folder: str | Path) -> ShapesFormat:
        path = Path(folder) / FORMAT_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing; the folder is not a foveal shapes model (train one with python -m foveal.train_shapes)"
            )
        return cls(**json.loads(path.read_text()))

    # ---- prompts ----

    def prompt(self, skill: str, **slots: str) -> str:
        if skill not in self.prompts:
            raise ValueError(f"skill {skill!r} is unknown; use one of {sorted(self.prompts)}")
        return self.prompts[skill].format(**slots)

    # ---- locations ----

    def loc_tokens(self) -> list[str]:
        return [f"<loc{k:04d}>" for k in range(self.n_bins)]

    def encode(self, v: float) -> int:
        return min(max(round(v * (self.n_bins - 1)), 0), self.n_bins - 1)

    def decode(self, k: int) -> float:
        return k / (self.n_bins - 1)

    def box_bins(self, box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
        """(ymin, xmin, ymax, xmax) bins with strictly positive extent, as the grammar requires."""
        x0, y0, x1, y1 = box
        ky0, ky1 = _widen(self.encode(y0), self.encode(y1), self.n_bins)
        kx0, kx1 = _widen(self.encode(x0), self.encode(x1), self.n_bins)
        return ky0, kx0, ky1, kx1

    # ---- targets ----

    def detect_target(self, scene: scenes.Scene, phrase: str) -> str:
        items = []
        for o in scenes.objects_matching(scene, phrase):
            ky0, kx0, ky1, kx1 = self.box_bins(o.box(scene.width, scene.height))
            items.append(f"<loc{ky0:04d}><loc{kx0:04d}><loc{ky1:04d}><loc{kx1:04d}> {phrase}")
        return self.separator.join(items)

    def point_target(self, scene: scenes.Scene, phrase: str) -> str:
        items = []
        for o in scenes.objects_matching(scene, phrase):
            x, y = o.centre(scene.width, scene.height)
            items.append(f"<loc{self.encode(y):04d}><loc{self.encode(x):04d}> {phrase}")
        return self.separator.join(items)

    # ---- parsing ----

    def parse_detect(self, text: str) -> list[dict[str, float]]:
        """Boxes from model text; malformed items are skipped (unconstrained decoding can make them)."""
        out = []
        for item in _items(text, self.separator):
            ks = [int(k) for k in _LOC.findall(item)]
            if len(ks) == 4:
                y0, x0, y1, x1 = (self.decode(k) for k in ks)
                out.append({"x_min": x0, "y_min": y0, "x_max": x1, "y_max": y1})
        return out

    def parse_point(self, text: str) -> list[dict[str, float]]:
        out = []
        for item in _items(text, self.separator):
            ks = [int(k) for k in _LOC.findall(item)]
            if len(ks) == 2:
                out.append({"x": self.decode(ks[1]), "y": self.decode(ks[0])})
        return out


def _widen(lo: int, hi: int, n: int) -> tuple[int, int]:
    """Give a span at least one bin of extent, staying inside [0, n - 1]."""
    if hi > lo:
        return lo, hi
    return (lo, lo + 1) if lo + 1 <= n - 1 else (lo - 1, lo)


def _items(text: str, separator: str) -> list[str]:
    return [s for s in text.split(separator.strip()) if s.strip()]
