"""Benchmarks (not tests): each prints a table and returns its results as plain dicts."""
