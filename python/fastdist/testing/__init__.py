"""Data for tests and benchmarks, not for training: synthetic embedding gradients (`synthetic`)."""
