"""The embedded shapes model: a tiny PaliGemma trained by `foveal.training.train_shapes`, with its
prompts and answer format in the folder's `foveal.json` (`format.py`).

Detect and point answer in location tokens (`<locNNNN>`, N bins from foveal.json) followed by the
object phrase, the format the model was trained on; captions and answers are free text. A folder is
this family when it is a PaliGemma checkpoint with a foveal.json beside it.

`chat` and `generate` are rendered by the folder's chat template (format.CHAT_TEMPLATE, written by
the training script's export): conversations with a system prompt, several turns and images in
more than one turn, tools in the Hermes form; an answer whose output type is a JSON schema is asked
for with the system line the model was trained on (format.JSON_INSTRUCTION). A folder exported
before the template existed keeps one user message, as PaliGemma.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from foveal.engine.models.arch import ModelLoadError
from foveal.engine.models.loader import LoadedModel
from foveal.engine.models.processor import PromptInputs
from foveal.families.base import Capabilities, Family
from foveal.families.conversation import Conversation, Message, task_conversation, tools_of, with_tools
from foveal.families.paligemma import PaliGemmaFamily
from foveal.families.shapes.format import FORMAT_FILE, JSON_INSTRUCTION, ShapesFormat
from foveal.families.task import Task, is_loc, spatial_task
from foveal.families.template import ChatTemplate
from foveal.grammars import spatial
from foveal.grammars.specs import grammar_source

SKILLS = frozenset({"caption", "query", "detect", "point", "generate", "chat"})
MAX_IMAGES = 4  # images one conversation may show (64 tokens each, of the model's 512 positions)


class ShapesFamily(PaliGemmaFamily):
    name = "shapes"

    def __init__(self, loaded: LoadedModel, fmt: ShapesFormat) -> None:
        hf_processor = getattr(loaded.processor, "hf_processor", None)
        self.template = ChatTemplate(loaded.tokenizer, hf_processor, "<image>")
        talks = self.template.available
        capabilities = Capabilities(
            SKILLS, vision=True, image_required=True, max_images=MAX_IMAGES if talks else 1, conversations=talks
        )
        super().__init__(loaded, capabilities)
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

    def chat(self, conversation: Conversation, output_type: Any) -> Task:
        if not self.template.available:
            return super().chat(conversation, output_type)
        return Task("chat", self.plain_conversation(conversation), output_type, None, is_loc(output_type))

    def encode(self, task: Task, images: list[Image.Image], image_key: str | None) -> tuple[PromptInputs, Task]:
        if not self.template.available or task.skill not in ("generate", "chat"):
            return super().encode(task, images, image_key)
        conversation = task_conversation(task.prompt, len(images))
        if _asks_json(task.spec):
            conversation = _with_json_instruction(conversation)
        text, special = self.template.render(conversation)
        return self.processor(text, images or None, image_key=image_key, add_special_tokens=special), task

    def _label(self, phrase: str) -> str:
        return self.fmt.locations.check_label(self.plain("object", phrase))


def _asks_json(spec: Any) -> bool:
    """Whether the answer's output type is a JSON schema (a pydantic class, a dict, json_object)."""
    if spec is None or is_loc(spec):
        return False
    try:
        return grammar_source(spec).kind == "json_schema"
    except Exception:  # not a grammar spec the SDK knows: compiling it says why, not this
        return False


def _with_json_instruction(conversation: Conversation) -> Conversation:
    """The conversation with the system line that asks this model for JSON (its training's), after
    the caller's own system messages."""
    messages = list(conversation)
    at = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    messages.insert(at, Message("system", (JSON_INSTRUCTION,)))
    return with_tools(tuple(messages), tools_of(conversation))
