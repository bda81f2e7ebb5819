"""planner/: predictions before a run. `memory.estimate` gives per-tier bytes; `preflight` checks them against
this machine and refuses, with numbers and fixes, a run that would not fit."""
from __future__ import annotations

from flexgen_h2o.planner.memory import PARTS, TIERS, Estimate, estimate
from flexgen_h2o.planner.preflight import (Check, Machine, PreflightError, checks, fmt, preflight, suggest,
                                          summary_line)

__all__ = ["PARTS", "TIERS", "Estimate", "estimate", "Check", "Machine", "PreflightError", "checks", "fmt",
           "preflight", "suggest", "summary_line"]
