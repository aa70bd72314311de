"""Task formats of the embedded shapes model: prompt per skill, target text per skill, parsing back.

The embedded model is a tiny PaliGemma. Its prompt is PaliGemma's prefix ("<image>" x n, <bos>,
prompt, "\\n"), its answer the suffix, then <eos>. The spatial answers are in the location-token
format of `foveal.grammars.locations` (its one owner: bins, item layout, separator), the format the
detect and point grammars constrain:

- detect: items `<locYMIN><locXMIN><locYMAX><locXMAX> LABEL` (LABEL: the object phrase asked for,
  verbatim); boxes have strictly positive extent in bins.
- point: items `<locY><locX> LABEL` (centre points).
- items joined by `separator` (" ; "); no items when nothing matches.

What the SDK needs to drive the model (N, prompt templates) lives in the shipped folder's
`foveal.json`, read by `ShapesFormat.load`.

Conversations (`model.chat`, and `generate`) are rendered by the model's own chat template,
`CHAT_TEMPLATE`, which the training script writes into the exported folder (chat_template.jinja):
every image placeholder first (PaliGemma's processor puts BOS after the last one), then, one line
each, the tools as signatures, `role: text` turns where an image's place is written `(image N)`, an
assistant's tool calls in the Hermes form the tool grammar constrains
(`<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>`), and `assistant:` to answer. A JSON
answer is asked for by the system line `JSON_INSTRUCTION` (the family adds it for JSON output types).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from foveal.grammars.locations import DEFAULT_SEPARATOR, LocationFormat
from foveal.vision import scenes

FORMAT_FILE = "foveal.json"
JSON_INSTRUCTION = "answer in json"  # the system line a JSON answer is trained and asked with
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{%- if message.content is not string -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}<image>{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}tools:{%- for tool in tools %} {{ tool.function.name }}("
    "{%- for name in (tool.function.parameters or {}).get('properties', {}) -%}"
    "{{ ', ' if not loop.first }}{{ name }}{%- endfor -%}){%- endfor %}{{ '\\n' }}{% endif -%}"
    "{%- set seen = namespace(images=0) -%}"
    "{%- for message in messages -%}{{ message.role }}:"
    "{%- if message.content is string -%}{{ ' ' + message.content if message.content }}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}{%- set seen.images = seen.images + 1 %} (image {{ seen.images }})"
    "{%- elif part.type == 'text' and part.text %} {{ part.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- for call in message.tool_calls or [] %} <tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{{ '\\n' }}{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)
SKILLS = ("caption", "query", "detect", "point")


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
    separator: str = DEFAULT_SEPARATOR
    family: str = "paligemma"

    def __post_init__(self) -> None:
        # Refuse bins or a separator the location format cannot use here, when foveal.json is read.
        LocationFormat(self.n_bins, self.separator)

    @property
    def locations(self) -> LocationFormat:
        """The location-token format of this model's answers (the grammar and the parsers use it)."""
        return LocationFormat(self.n_bins, self.separator)

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
                f"{path} is missing; the folder is not a foveal shapes model (train one with python -m foveal.training.train_shapes)"
            )
        try:
            return cls(**json.loads(path.read_text()))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path} is not a valid foveal format file: {error}") from None

    # ---- prompts ----

    def prompt(self, skill: str, **slots: str) -> str:
        if skill not in self.prompts:
            raise ValueError(f"skill {skill!r} is unknown; use one of {sorted(self.prompts)}")
        return self.prompts[skill].format(**slots)

    # ---- targets (bins, items, separator: self.locations, their one owner) ----

    def detect_target(self, scene: scenes.Scene, phrase: str) -> str:
        locations = self.locations
        boxes = [o.box(scene.width, scene.height) for o in scenes.objects_matching(scene, phrase)]
        return locations.join([locations.box_item(box, phrase) for box in boxes])

    def point_target(self, scene: scenes.Scene, phrase: str) -> str:
        locations = self.locations
        centres = [o.centre(scene.width, scene.height) for o in scenes.objects_matching(scene, phrase)]
        return locations.join([locations.point_item(x, y, phrase) for x, y in centres])

    # ---- parsing ----

    def parse_detect(self, text: str) -> list[dict[str, float]]:
        """Boxes from model text; malformed items are skipped (unconstrained decoding can make them)."""
        return self.locations.parse_lenient("boxes", text)

    def parse_point(self, text: str) -> list[dict[str, float]]:
        return self.locations.parse_lenient("points", text)
