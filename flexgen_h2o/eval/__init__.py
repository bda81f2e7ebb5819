"""Accuracy harness: policies x KV budgets on real text, run on the engine itself (`python -m flexgen_h2o.eval`).

grid (policies x budgets -> EvictionConfig), runner (teacher forcing / generation on one Engine), data (items
from the offline corpora), one module per task, results (checkpoint JSON), report (tables, plots, targets).
"""
