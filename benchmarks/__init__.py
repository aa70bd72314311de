"""foveal's benchmarks (not part of the package): `python -m benchmarks.<name>`; each prints a table and writes JSON."""
