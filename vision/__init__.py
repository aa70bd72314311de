"""foveal.vision: image input (decoding, reduced decodes, a decoded-pixel budget), geometry (boxes,
points, drawing) and synthetic scenes."""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.vision")

from .budget import PixelBudget, PixelBudgetTimeout, PixelLease  # noqa: E402

# `draw` the function shadows the submodule of the same name on purpose: `foveal.vision.draw(img, result)`.
from .draw import draw  # noqa: E402
from .images import ImageError, OpenedImage, image_key, load_image, open_image  # noqa: E402

__all__ = [
    "ImageError",
    "OpenedImage",
    "PixelBudget",
    "PixelBudgetTimeout",
    "PixelLease",
    "draw",
    "image_key",
    "load_image",
    "open_image",
]
