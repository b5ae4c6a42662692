"""Models and data for tests, examples and benchmarks, not library API for training: the reference models users'
models are compared with (`models`), a synthetic language (`corpus`), generated images (`shapes`) and synthetic
embedding gradients (`synthetic`). No files, no downloads: everything is generated from seeds."""
