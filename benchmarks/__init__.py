"""Benchmarks of the engine against the MinT quickstart's sequential loop.

``python -m benchmarks.throughput`` (steps/s, samples/s, pipeline efficiency per
configuration) and ``python -m benchmarks.scaling`` (the client's CPU and memory per
sample as the batch grows); see ``benchmarks/README.md``.
"""
