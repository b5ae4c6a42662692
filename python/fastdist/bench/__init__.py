"""fastdist-bench: the benchmark suites and their command line (see fastdist.bench.cli)."""
