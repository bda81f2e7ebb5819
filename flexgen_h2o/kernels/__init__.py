"""The compiled CPU kernels: their C++ sources (csrc/), their build (build.py) and the Kernels object that sends
each call of the model math to a kernel or to the plain torch ops (dispatch.py), resolved once per engine."""
from __future__ import annotations

from flexgen_h2o.kernels.dispatch import Kernels, onednn_may_run, resolve
from flexgen_h2o.models.ops import TORCH, TorchKernels

__all__ = ["Kernels", "TorchKernels", "TORCH", "resolve", "onednn_may_run"]
