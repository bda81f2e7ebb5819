"""`accelerate`: HF Accelerate disk offload (`device_map` with the decoder layers on "disk", an offload folder of
fp16 tensors, fp32 compute), as FlexGen's `hf_opt.py` baseline. The case itself is
`benchmarks/systems/accelerate_child.py` (its docstring lists the fairness choices); this adapter only schedules it.

Timing there is from outside `generate`: prefill = a cold `generate(max_new_tokens=1)`, decode = a cold full
`generate` minus that, so it reports no per-step times. Its device map is explicit (embeddings resident, every
decoder layer on disk), so `max_memory` plays no part; the budget is enforced on the measured peak RSS.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT
from benchmarks.systems.base import Candidate, System
from benchmarks.workloads import Workload


class Accelerate(System):
    name = "accelerate"
    kv_grows = True
    kv_dtype_bytes = 4

    def skip_reason(self, w: Workload) -> str | None:
        if w.model_config().family != "opt" or not w.cold_disk:
            return "Accelerate's row is the disk-offload baseline (an OPT shape with weights on disk)"
        if w.uncached:
            return "Accelerate memory-maps its offload files, so it cannot keep them out of the page cache"
        return None

    def _folder(self, w: Workload) -> Path:
        from benchmarks.systems.accelerate_child import default_offload_folder
        return default_offload_folder(w.model)

    def prepare(self, w: Workload, env: dict[str, str], out: Path) -> str | None:
        """Write the dummy store and Accelerate's offload folder once (outside any timed run)."""
        proc = subprocess.run([sys.executable, "-m", "benchmarks.systems.accelerate_child", "--model", w.model,
                               "--prepare-only"], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            return f"accelerate prepare failed: {lines[-1] if lines else proc.returncode}"
        return None

    def cold_files(self, w: Workload) -> list[Path]:
        from benchmarks.systems.accelerate_child import offload_files
        return offload_files(self._folder(w))

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        from flexgen_h2o.weights import default_store_path
        return ["-m", "benchmarks.systems.accelerate_child", "--model", w.model, "--store",
                str(default_store_path(w.model + "-dummy")), "--offload-folder", str(self._folder(w)),
                "--batch", str(c.batch), "--prompt-len", str(w.prompt_len), "--gen-len", str(gen_len),
                "--metrics-json", str(json_path)]

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        block = raw["block_size"]
        tokens = raw["prompt_len"] + raw["gen_len"] - 1
        return {"prefill_s": raw["prefill_s"], "decode_s": raw["decode_s"], "peak_rss_bytes": raw["peak_rss_bytes"],
                "kv_bytes_per_seq": raw["kv_cache_bytes"] / block, "kv_tokens_per_seq": tokens, "step_times_s": [],
                "offloaded_weight_bytes": raw["offload_folder_bytes"], "io_read_bytes": raw.get("io_read_bytes"),
                "weights_bytes_read": raw.get("weights_bytes_read"),
                "rss_parts_peak_bytes": raw.get("rss_parts_peak_bytes"),
                "rss_file_growth_bytes": raw.get("rss_file_growth_bytes")}
