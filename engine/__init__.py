"""foveal.engine: requests, scheduler, the two-slot pipeline, KV cache, sampler and model runners."""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.engine")
