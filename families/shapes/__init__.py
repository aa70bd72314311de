"""The embedded shapes model: a tiny PaliGemma trained by `foveal.training.train_shapes`, with its
prompts and answer format in the folder's `foveal.json` (`format.py`).

Detect and point answer in location tokens (`<locNNNN>`, N bins from foveal.json) followed by the
object phrase, the format the model was trained on; captions and answers are free text. A folder is
this family when it is a PaliGemma checkpoint with a foveal.json beside it.
"""

from __future__ import annotations

from pathlib import Path

from foveal.engine.models.arch import ModelLoadError
from foveal.engine.models.loader import LoadedModel
from foveal.families.base import Capabilities, Family
from foveal.families.paligemma import PaliGemmaFamily
from foveal.families.shapes.format import FORMAT_FILE, ShapesFormat
from foveal.families.task import Task, spatial_task
from foveal.grammars import spatial

SKILLS = frozenset({"caption", "query", "detect", "point", "generate", "chat"})


class ShapesFamily(PaliGemmaFamily):
    name = "shapes"

    def __init__(self, loaded: LoadedModel, fmt: ShapesFormat) -> None:
        super().__init__(loaded, Capabilities(SKILLS, vision=True, image_required=True))
        self.fmt = fmt

    @classmethod
    def matches(cls, raw: dict, folder: Path) -> bool:
        return super().matches(raw, folder) and (folder / FORMAT_FILE).is_file()

    @classmethod
    def build(cls, loaded: LoadedModel, folder: Path) -> Family:
        fmt = ShapesFormat.load(folder)
        if fmt.family != "paligemma":
            raise ModelLoadError(
                f"{folder / FORMAT_FILE} describes a {fmt.family!r} model but the checkpoint is 'paligemma'; "
                "remove foveal.json or export the folder again with python -m foveal.training.train_shapes --export"
            )
        return cls(loaded, fmt)

    def caption(self, length: str) -> Task:
        return Task("caption", self.fmt.prompt("caption", length=length))

    def query(self, question: str) -> Task:
        return Task("query", self.fmt.prompt("query", question=self.plain("question", question)))

    def detect(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.boxes("loc", max_objects, self._label(phrase), self.fmt.n_bins, self.fmt.separator)
        return spatial_task("detect", self.fmt.prompt("detect", object=phrase), spec)

    def point(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.points("loc", max_objects, self._label(phrase), self.fmt.n_bins, self.fmt.separator)
        return spatial_task("point", self.fmt.prompt("point", object=phrase), spec)

    def _label(self, phrase: str) -> str:
        return self.fmt.locations.check_label(self.plain("object", phrase))
