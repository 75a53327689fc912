"""The toolkit's benchmarks, a package so that each script runs as ``python -m benchmarks.NAME`` from the
repository root and imports the shared timing helper (:mod:`benchmarks.timing`) and its neighbours by name."""
