"""Benchmarks: weight-sync time, bytes and peak memory, ours side by side with TRL 1.16's built-in path."""
