"""`python -m foveal`: the same entry point as the `foveal` console script."""

from foveal.cli import main

raise SystemExit(main())
