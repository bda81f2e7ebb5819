"""What every system adapter provides, and the one result schema the suite reads back.

An adapter never runs a model in the suite's process: it names a command (interpreter + arguments) that runs one
case in its own subprocess and writes a JSON file. The suite times the subprocess (wall time), then
`normalize` maps the child's JSON onto RESULT_KEYS, with throughput from FlexGen's three definitions computed here
once for every system (`rates`), so no adapter can define "decode tok/s" its own way.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import largest_batch
from benchmarks.workloads import GIB, Workload

# the per-run JSON schema (tests/benchmarks check it); None where a system cannot report a field
RESULT_KEYS = ("system", "workload", "batch", "gbs", "num_batches", "prompt_len", "gen_len", "prefill_s",
               "decode_s", "prefill_tok_s", "decode_tok_s", "total_tok_s", "peak_rss_bytes", "peak_gpu_bytes",
               "kv_bytes_per_seq", "kv_grows", "wall_s", "step_times_s", "threads", "probe", "repeat")


@dataclass(frozen=True)
class Candidate:
    """One batch configuration of a search: `batch` sequences, computed `gbs` at a time in `num_batches` batches
    (only our engine splits; for every peer gbs == batch). predicted_bytes: the planner's RAM estimate, if any."""
    batch: int
    gbs: int
    num_batches: int = 1
    predicted_bytes: int | None = None

    @property
    def label(self) -> str:
        return f"{self.gbs}x{self.num_batches}" if self.num_batches > 1 else str(self.batch)


def parse_batches(specs: list[str]) -> dict[str, Candidate]:
    """--batch values: SYSTEM=B (one batch of B) or SYSTEM=GBSxN (N GPU batches of GBS)."""
    out = {}
    for spec in specs:
        name, _, b = spec.partition("=")
        gbs, _, nb = b.partition("x")
        if not (name and gbs.isdigit() and int(gbs) > 0 and (nb == "" or (nb.isdigit() and int(nb) > 0))):
            raise SystemExit(f"error: --batch {spec!r}: expected SYSTEM=B or SYSTEM=GBSxN, e.g. flexgen=32x8")
        n = int(nb or 1)
        out[name] = Candidate(int(gbs) * n, int(gbs), n)
    return out


def rates(batch: int, prompt_len: int, gen_len: int, prefill_s: float, decode_s: float) -> dict[str, float]:
    """FlexGen's definitions (its benchmark's log lines): prefill = B*P/t_prefill, decode = B*(G-1)/t_decode,
    total = B*G/(t_prefill + t_decode)."""
    return {"prefill_tok_s": batch * prompt_len / max(prefill_s, 1e-9),
            "decode_tok_s": batch * max(gen_len - 1, 0) / max(decode_s, 1e-9),
            "total_tok_s": batch * gen_len / max(prefill_s + decode_s, 1e-9)}


class System:
    """Base adapter. Subclasses set `name`, `kv_grows`, and implement `command` and `child_metrics`."""
    name = "?"
    kv_grows = True            # RSS grows by a KV row per generated token (False: allocated up front)
    kv_fixed_tokens = False    # the tokens attended per step stay constant (H2O) instead of growing
    kv_dtype_bytes = 4         # bytes per stored K/V element (HF caches hold the compute dtype: fp32 on CPU)
    runs_chat = False          # has a chat mode: the chat workload's job, answers to EOS (benchmarks/chat_job.py)

    @property
    def kv_precision(self) -> str:
        """What one stored K/V element is, for the report (OpenVINO's u8 cache is not our fp16 one)."""
        return {4: "fp32", 2: "fp16", 1: "u8"}.get(self.kv_dtype_bytes, f"{self.kv_dtype_bytes} B")

    def skip_reason(self, w: Workload) -> str | None:
        """Why this system cannot run this workload on this machine, or None when it can."""
        return None

    def python(self) -> str:
        return sys.executable

    def prepare(self, w: Workload, env: dict[str, str], out: Path) -> str | None:
        """One-off work outside any timed run (stores, offload folders, virtualenvs). Returns a skip reason
        when preparation failed, else None."""
        return None

    def candidates(self, w: Workload, max_batch: int) -> list[Candidate]:
        """Batch sizes to search, ascending: powers of two up to max_batch."""
        out, b = [], 1
        while b <= max_batch:
            out.append(Candidate(b, b))
            b *= 2
        return out

    def search_order(self) -> str:
        """"up": probe from the smallest candidate (peers: no memory model, stop at the first over budget);
        "down": from the largest the planner admits (ours)."""
        return "up"

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        raise NotImplementedError

    def cold_files(self, w: Workload) -> list[Path]:
        """Weight files whose page cache is dropped before each run of a cold-disk workload."""
        return []

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        """Map the child's JSON onto prefill_s, decode_s, peak_rss_bytes, kv_bytes_per_seq, step_times_s, ..."""
        raise NotImplementedError

    def chat_batch(self, w: Workload) -> tuple[Candidate | None, str]:
        """The chat workload's batch, chosen by a rule instead of probes (one run is the whole job), and the
        rule's words for the report; None when no batch fits."""
        raise NotImplementedError

    def chat_metrics(self, raw: dict[str, Any], json_path: Path) -> dict[str, Any]:
        """A chat run's lengths, finish reasons, gen_s and peak_rss_bytes (the rest is kept as extra); a peer's
        child reports them in its JSON."""
        return raw

    def resident_weight_bytes(self, cfg: Any, offloaded_bytes: float) -> float:
        """Weight bytes a decode step reads from RAM, for the roofline: the fp32 compute dtype's, of what is not
        homed on disk (fp16 there, hence / 2 params)."""
        return max(cfg.n_params() - offloaded_bytes / 2, 0) * 4

    def kv_growth_bytes(self, w: Workload, batch: int, tokens: int) -> int:
        """Bytes the cache gains over `tokens` more generated tokens (projects a short probe's peak to full
        length)."""
        return batch * tokens * w.model_config().kv_bytes_per_token(self.kv_dtype_bytes) if self.kv_grows else 0

    def normalize(self, raw: dict[str, Any], w: Workload, c: Candidate, gen_len: int, *, wall_s: float,
                  threads: int, probe: bool, repeat: int) -> dict[str, Any]:
        m = self.child_metrics(raw, c)
        row = {"system": self.name, "workload": w.name, "batch": c.batch, "gbs": c.gbs,
               "num_batches": c.num_batches, "prompt_len": w.prompt_len, "gen_len": gen_len,
               "prefill_s": float(m["prefill_s"]), "decode_s": float(m["decode_s"]),
               **rates(c.batch, w.prompt_len, gen_len, m["prefill_s"], m["decode_s"]),
               "peak_rss_bytes": int(m["peak_rss_bytes"]), "peak_gpu_bytes": m.get("peak_gpu_bytes"),
               "kv_bytes_per_seq": m.get("kv_bytes_per_seq"), "kv_grows": self.kv_grows, "wall_s": wall_s,
               "step_times_s": list(m.get("step_times_s") or []), "threads": threads, "probe": probe,
               "repeat": repeat}
        extra = {k: v for k, v in m.items() if k not in row}
        return {**row, "extra": extra}


def largest_fitting(predict: Any, w: Workload, rule: str) -> tuple[Candidate | None, str]:
    """The largest batch (one GPU batch) whose predict(batch) bytes fit the workload's budget, and the rule."""
    best, seen = largest_batch(predict, w.budget_bytes, w.max_batch)
    pred = dict(seen)
    if not best:
        return None, f"no batch fits: {rule}: batch 1 needs {pred[1] / GIB:.2f} GiB"
    return Candidate(best, best, 1, pred[best]), (f"{rule}, the largest batch <= {w.max_batch} under "
                                                  f"{w.budget_bytes / GIB:.2f} GiB")
