"""Synthetic scenes of coloured shapes, with ground truth: the world of foveal's embedded model.

PROBLEM: the embedded default model is trained and evaluated on a world we generate ourselves
(no hub, no data set download), so the world must be fully determined by a seed and its ground
truth (boxes, centre points, captions, question/answer pairs) must be exact and unambiguous
enough that exact-match scoring means something.

SOLUTION: a scene is a small record (size, background grey, objects); `generate_scene(seed)`
draws it from `numpy.random.default_rng(seed)`; `render(scene)` paints it with PIL; the text
ground truth is a pure function of the record.

The world:
- shapes: circle, square, triangle (isosceles, apex up); colours (RGB): red (230, 25, 75),
  green (60, 180, 75), blue (0, 130, 200), yellow (255, 225, 25), orange (245, 130, 48),
  purple (145, 30, 180); filled, no outline.
- background: one grey level in [200, 255], light per-pixel noise (std <= 3).
- 1 to 4 objects, each with a bounding square of side 10% to 40% of the image's shorter side,
  anywhere inside the image, bounding boxes pairwise disjoint (a gap of at least 1 pixel).
- any image size (width, height >= 32); the model's image processor resizes.
- object phrases: "circle" (every circle), "red circle" (only the red circles), "shape" (every
  object), "red shape" (every red object).

INVARIANTS (each tested in tests/vision/test_scenes.py):
1. Same seed and size, same scene and same pixels.
2. Object sizes within [0.10, 0.40] of the shorter side; boxes inside the image and disjoint.
3. Every object pixel has its object's exact colour; background pixels are within [200, 255].
4. `objects_matching(scene, phrase)` follows the phrase semantics above.
5. Captions and answers are functions of the record alone (no randomness after generation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 75),
    "green": (60, 180, 75),
    "blue": (0, 130, 200),
    "yellow": (255, 225, 25),
    "orange": (245, 130, 48),
    "purple": (145, 30, 180),
}
MIN_SIZE, MAX_SIZE = 0.10, 0.40
MAX_OBJECTS = 4
_NUMBER_WORDS = ("no", "a", "two", "three", "four")


@dataclass(slots=True, frozen=True)
class SceneObject:
    """One filled shape. Pixel box [x0, x1) x [y0, y1) in image pixels (x1 - x0 == y1 - y0)."""

    shape: str
    colour: str
    x0: int
    y0: int
    x1: int
    y1: int

    def box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """Normalized (x_min, y_min, x_max, y_max), origin top-left."""
        return (self.x0 / width, self.y0 / height, self.x1 / width, self.y1 / height)

    def centre(self, width: int, height: int) -> tuple[float, float]:
        """Normalized (x, y) centre of the bounding box; inside the shape for all three shapes."""
        return ((self.x0 + self.x1) / 2 / width, (self.y0 + self.y1) / 2 / height)

    def contains(self, x: float, y: float, width: int, height: int) -> bool:
        """Whether the normalized point (x, y) falls inside the shape itself (not just its box)."""
        px, py = x * width, y * height
        if not (self.x0 <= px <= self.x1 and self.y0 <= py <= self.y1):
            return False
        side = self.x1 - self.x0
        if self.shape == "square":
            return True
        if self.shape == "circle":
            cx, cy = (self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2
            return (px - cx) ** 2 + (py - cy) ** 2 <= (side / 2) ** 2
        # Triangle with apex at top centre: half-width grows linearly from 0 at y0 to side/2 at y1.
        half = (py - self.y0) / side * side / 2
        return abs(px - (self.x0 + self.x1) / 2) <= half

    def phrase(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass(slots=True, frozen=True)
class Scene:
    seed: int
    width: int
    height: int
    background: int
    objects: tuple[SceneObject, ...]

    def boxes(self) -> list[tuple[float, float, float, float]]:
        return [o.box(self.width, self.height) for o in self.objects]


def generate_scene(seed: int, width: int = 64, height: int | None = None) -> Scene:
    """The scene for `seed` at the given size (height defaults to width)."""
    height = width if height is None else height
    if width < 32 or height < 32:
        raise ValueError(f"scene size {width}x{height} is too small; use width and height >= 32")
    rng = np.random.default_rng(seed)
    background = int(rng.integers(200, 256))
    wanted = int(rng.integers(1, MAX_OBJECTS + 1))
    side_px = min(width, height)
    lo, hi = int(np.ceil(MIN_SIZE * side_px)), int(np.floor(MAX_SIZE * side_px))
    objects: list[SceneObject] = []
    for _ in range(wanted):
        obj = _place(rng, objects, width, height, lo, hi)
        if obj is not None:
            objects.append(obj)
    return Scene(seed, width, height, background, tuple(objects))


def _place(rng, placed, width, height, lo, hi, tries: int = 50) -> SceneObject | None:
    """Rejection-sample one object whose box keeps a 1-pixel gap to every placed box."""
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    for _ in range(tries):
        side = int(rng.integers(lo, hi + 1))
        x0 = int(rng.integers(0, width - side + 1))
        y0 = int(rng.integers(0, height - side + 1))
        cand = SceneObject(shape, colour, x0, y0, x0 + side, y0 + side)
        if all(_apart(cand, other) for other in placed):
            return cand
    return None


def _apart(a: SceneObject, b: SceneObject) -> bool:
    return a.x1 < b.x0 or b.x1 < a.x0 or a.y1 < b.y0 or b.y1 < a.y0


def render(scene: Scene) -> Image.Image:
    """Paint the scene: grey background with light noise, then each filled shape."""
    rng = np.random.default_rng([scene.seed, 1])
    noise_std = float(rng.uniform(0.0, 3.0))
    pixels: np.ndarray = scene.background + rng.normal(0.0, noise_std, (scene.height, scene.width, 1))
    pixels = np.clip(np.rint(pixels), 200, 255).astype(np.uint8).repeat(3, axis=2)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    for o in scene.objects:
        fill = COLOURS[o.colour]
        # PIL's right/bottom coordinates are inclusive, our boxes are half-open.
        if o.shape == "square":
            draw.rectangle((o.x0, o.y0, o.x1 - 1, o.y1 - 1), fill=fill)
        elif o.shape == "circle":
            draw.ellipse((o.x0, o.y0, o.x1 - 1, o.y1 - 1), fill=fill)
        else:
            draw.polygon(((o.x0, o.y1 - 1), (o.x1 - 1, o.y1 - 1), ((o.x0 + o.x1 - 1) / 2, o.y0)), fill=fill)
    return image


# ---- phrases ------------------------------------------------------------------------------


def phrase_matches(obj: SceneObject, phrase: str) -> bool:
    """Semantics of an object phrase: "[colour] shape-word", shape-word in SHAPES or "shape"."""
    words = phrase.split()
    if not words or len(words) > 2:
        return False
    if len(words) == 2 and words[0] != obj.colour:
        return False
    return words[-1] in ("shape", obj.shape)


def objects_matching(scene: Scene, phrase: str) -> list[SceneObject]:
    """Matching objects, ordered left to right by centre (ties: top to bottom)."""
    found = [o for o in scene.objects if phrase_matches(o, phrase)]
    return sorted(found, key=lambda o: (o.x0 + o.x1, o.y0 + o.y1))


def all_phrases() -> list[str]:
    """Every phrase of the world, in a fixed order."""
    words = [*SHAPES, "shape"]
    return words + [f"{c} {w}" for c in COLOURS for w in words]


# ---- captions -----------------------------------------------------------------------------


def _count(n: int, noun: str) -> str:
    if n == 1:
        return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"
    return f"{_NUMBER_WORDS[n]} {noun}s"


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def caption(scene: Scene, length: str = "normal") -> str:
    """Deterministic caption. short: shapes by kind; normal: by colour and kind; long: each object
    left to right with its size and position."""
    if length == "short":
        counts = [(s, sum(o.shape == s for o in scene.objects)) for s in SHAPES]
        return _join([_count(n, s) for s, n in counts if n])
    if length == "normal":
        keys = [(c, s) for c in COLOURS for s in SHAPES]
        pairs = [(k, sum((o.colour, o.shape) == k for o in scene.objects)) for k in keys]
        return _join([_count(n, f"{c} {s}") for (c, s), n in pairs if n])
    if length == "long":
        ordered = sorted(scene.objects, key=lambda o: (o.x0 + o.x1, o.y0 + o.y1))
        return _join([_describe(scene, o) for o in ordered])
    raise ValueError(f"caption length {length!r} is unknown; use 'short', 'normal' or 'long'")


def _describe(scene: Scene, o: SceneObject) -> str:
    size = "small" if (o.x1 - o.x0) < 0.25 * min(scene.width, scene.height) else "large"
    x, y = o.centre(scene.width, scene.height)
    row = ("top", "middle", "bottom")[min(int(y * 3), 2)]
    col = ("left", "center", "right")[min(int(x * 3), 2)]
    where = "the center" if (row, col) == ("middle", "center") else f"the {row} {col}"
    return f"a {size} {o.colour} {o.shape} at {where}"


# ---- questions ----------------------------------------------------------------------------

RELATIONS = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}
RELATION_MARGIN = 0.1  # centres closer than this along the axis make the relation ambiguous: not asked


def questions(scene: Scene) -> dict[str, list[tuple[str, str]]]:
    """Every well-posed (question, answer) pair of the scene, grouped by kind:
    count, color, shape, relation. Answers are one word."""
    objs = scene.objects
    out: dict[str, list[tuple[str, str]]] = {"count": [], "color": [], "shape": [], "relation": []}
    for phrase in all_phrases():
        words = phrase.split()
        plural = " ".join(words[:-1] + [words[-1] + "s"])
        n = sum(phrase_matches(o, phrase) for o in objs)
        out["count"].append((f"how many {plural}?", str(n)))
    for s in SHAPES:
        same = [o for o in objs if o.shape == s]
        if len(same) == 1:
            out["color"].append((f"what color is the {s}?", same[0].colour))
    for c in COLOURS:
        same = [o for o in objs if o.colour == c]
        if len(same) == 1:
            out["shape"].append((f"what shape is the {c} one?", same[0].shape))
    unique = [o for o in objs if sum(p.phrase() == o.phrase() for p in objs) == 1]
    for a in unique:
        for b in unique:
            if a is not b:
                out["relation"].extend(_relation_questions(scene, a, b))
    return out


def _relation_questions(scene: Scene, a: SceneObject, b: SceneObject) -> list[tuple[str, str]]:
    ca, cb = a.centre(scene.width, scene.height), b.centre(scene.width, scene.height)
    pairs = []
    for name, (axis, sign) in RELATIONS.items():
        delta = ca[axis] - cb[axis]
        if abs(delta) >= RELATION_MARGIN:
            answer = "yes" if delta * sign > 0 else "no"
            pairs.append((f"is the {a.phrase()} {name} the {b.phrase()}?", answer))
    return pairs
