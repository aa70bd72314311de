"""foveal.vision: image input, geometry (boxes, points, drawing) and synthetic scenes."""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.vision")

# `draw` the function shadows the submodule of the same name on purpose: `foveal.vision.draw(img, result)`.
from .draw import draw  # noqa: E402
from .images import ImageError, image_key, load_image  # noqa: E402

__all__ = ["ImageError", "draw", "image_key", "load_image"]
