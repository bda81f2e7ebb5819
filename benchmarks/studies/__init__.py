"""Accuracy and cost studies a user reruns on their machine or after a change; not part of the suite
(benchmarks/README.md)."""
