"""Page selection's speed where the KV does not fit (issue 53): SmolLM2 s2048+512 in a 2 GiB memory cgroup, the full
cache at its best batch in RAM, H2O-20 at its best batch in RAM, and page selection at 20 % with the KV homed on
disk (so its pages really come from the disk: the cgroup's page cache cannot hold the KV), interleaved A B C ... C
B A; plus the full cache and page selection in RAM at one batch, for the decode step alone.

    python -m benchmarks.studies.page_speed --out benchmarks/results/pages-53 [--repeats 2] [--cut-gen-len 32]

Each run is the CLI's benchmark mode in its own process inside the cgroup (benchmarks/studies/choice_check's
MemoryCgroup; needs root), no warm-up; decode is projected from --cut-gen-len steps (FlexGen's formula, marked
projected in each run's metrics). Besides the engine's own counter of KV bytes read (metrics `kv_bytes_read`), each
run records the bytes its process tree read from storage (getrusage's ru_inblock of the finished child, 512-byte
blocks): the disk reads the OS saw.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.studies.choice_check import MemoryCgroup  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
SHAPE = ["--model", "smollm2-135m", "--prompt-len", "2048", "--gen-len", "512"]
RAM, KV_DISK = ["--percent", "100", "0", "100", "0", "100", "0"], ["--percent", "100", "0", "0", "0", "100", "0"]
PAGES = ["--kv-select", "pages", "--fetch-ratio", "0.2"]
# name: flags. Batches: about the largest the planner's estimate fits in 2 GiB beside the runtime (full: 12, H2O-20:
# 64, page selection with its KV on disk: 48; the preflight inside the cgroup has the last word), full at 8 and
# page selection at 16-32 too (`--only` picks: its best batch is below the largest that fits, where the page
# cache holds more of the KV)
SYSTEMS: dict[str, list[str]] = {
    "full-ram-b8": RAM + ["--gpu-batch-size", "8"],
    "full-ram-b12": RAM + ["--gpu-batch-size", "12"],
    "h2o-20-ram-b64": RAM + ["--hh-ratio", "0.1", "--gpu-batch-size", "64"],
    "pages-20-disk-b48": KV_DISK + PAGES + ["--gpu-batch-size", "48"],
    **{f"pages-20-disk-b{b}": KV_DISK + PAGES + ["--gpu-batch-size", str(b)] for b in (16, 24, 32)},
    "pages-20-ram-b12": RAM + PAGES + ["--gpu-batch-size", "12"],
    # reading a layer ahead (--page-ahead): where the KV lane has a thread (KV on disk), and in RAM, where it has none
    **{f"pages-20-ahead-disk-b{b}": KV_DISK + PAGES + ["--page-ahead", "--gpu-batch-size", str(b)] for b in (24, 48)},
    "pages-20-ahead-ram-b12": RAM + PAGES + ["--page-ahead", "--gpu-batch-size", "12"],
}


def run_one(name: str, group: MemoryCgroup, out: Path, cut: int, timeout: float) -> dict:
    folder = out / "runs" / f"{name}-{time.strftime('%H%M%S')}"
    folder.mkdir(parents=True)
    metrics = folder / "metrics.json"
    cmd = [sys.executable, "-m", "flexgen_h2o.run", *SHAPE, *SYSTEMS[name], "--cut-gen-len", str(cut),
           "--no-warmup", "--no-progress", "--metrics-json", str(metrics), "--offload-dir", str(out / "offload")]
    blocks0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    t0 = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              preexec_fn=group.join)
    row = {"system": name, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
           "os_read_bytes": (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - blocks0) * 512,
           "command": "python -m flexgen_h2o.run " + " ".join(cmd[3:-5])}
    if proc.returncode == 0:
        m = json.loads(metrics.read_text())
        row.update({k: m.get(k) for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s", "projected",
                                          "peak_rss_bytes", "kv_bytes_read", "kv_bytes_read_per_step",
                                          "measured_decode_s", "executed_gen_len")})
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cut-gen-len", type=int, default=32)
    p.add_argument("--only", nargs="+", choices=list(SYSTEMS),
                   default=[n for n in SYSTEMS if "ahead" not in n
                            and (not n.startswith("pages-20-disk-b") or n.endswith("b48"))])
    p.add_argument("--timeout", type=float, default=3600)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    group = MemoryCgroup(2 * GIB, "flexgen_h2o_pages")
    rows = []
    try:
        for r in range(a.repeats):              # A B C ... then C B A: drift hits every system alike
            for name in (a.only if r % 2 == 0 else list(reversed(a.only))):
                rows.append(run_one(name, group, out, a.cut_gen_len, a.timeout))
    finally:
        group.close()
        shutil.rmtree(out / "offload", ignore_errors=True)      # each run removed its files; the folder goes too
    summary = {}
    for name in a.only:
        mine = [r for r in rows if r["system"] == name and r["rc"] == 0]
        if mine:
            summary[name] = {k: statistics.median(r[k] for r in mine)
                             for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s", "kv_bytes_read_per_step")}
    (out / "results.json").write_text(json.dumps({"cpu": platform.processor() or platform.machine(),
                                                  "rows": rows, "median": summary}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
