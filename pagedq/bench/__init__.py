"""Benchmarks: peers run side by side in one process on the same model and workload."""
