"""Benchmark scripts (not tests): each prints a table and the command that made it. See BENCHMARKS.md."""
