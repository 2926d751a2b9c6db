"""Benchmarks that report ratios against a peer measured in the same run."""
