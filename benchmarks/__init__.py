"""Benchmarks: figures and ratios against baselines in the same run (`make bench`)."""
