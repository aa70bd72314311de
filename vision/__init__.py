"""foveal.vision: image input, geometry (boxes, points, drawing) and synthetic scenes."""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.vision")
