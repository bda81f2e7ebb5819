"""Issue-specific studies, A/B comparisons and format checks; not part of the suite (benchmarks/README.md)."""
