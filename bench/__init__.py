"""visattn's benchmarks and result producers: each script writes one results file (bench/README.md) and runs from
the repository root as a module, ``python -m bench.NAME ARGS``; what they share is :mod:`bench.common`."""
