"""foveal.training: training and evaluation of the embedded default model; not used at runtime.

    python -m foveal.training.train_shapes --run runs/shapes --steps 20000 --export sdk/embedded
    python -m foveal.training.eval_shapes --n 500

`train_shapes` trains a tiny PaliGemma on the synthetic shape scenes (`foveal.vision.scenes`) and
exports the Hugging Face folder the SDK ships; `eval_shapes` measures a model on held-out scenes.
"""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.training")
