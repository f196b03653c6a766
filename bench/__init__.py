"""Benchmarks: each module prints medians and ratios against a baseline measured in the same run (see RESULTS.md)."""
