"""visattn's benchmarks and result producers: each script writes one results file (bench/README.md)."""
