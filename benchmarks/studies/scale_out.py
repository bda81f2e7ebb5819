"""One batch job three ways on this machine: one process, data-parallel ranks, and a pipeline of stages.

    python -m benchmarks.studies.scale_out --out benchmarks/results/scale-38 [--prompts 32 --gen-len 64]

The job: `--prompts` Lee news articles, each cut to its first --prompt-words words, as a batch file, on the
embedded SmolLM2-135M with an H2O cache (--hh-ratio 0.2). Every run is the real command (torchrun for the
ranks), rounds interleaved so the VM's drift falls on every mode alike. Each row: the command's wall time
(start-up and weight loading included), the generation's own time and tok/s (the slowest data-parallel rank,
the pipeline's last stage), and whether the output equals the one-process output. On this 2-core VM, two
ranks each get one core of the two one process uses: the ratio measures the overheads of splitting (start-up
per rank, the pipeline's bubble and hand-offs), not the speed-up on machines with a core, GPU or node per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from flexgen_h2o.frontends.corpus import lee_articles

# mode -> (ranks, extra flags); one rank is a plain process
MODES = {"one process": (1, []), "data-parallel x2": (2, []), "pipeline x2": (2, ["--pipeline-stages", "2"]),
         # the same block of 8 as 4 GPU batches of 2: in one process, and in each stage order (batches: a stage
         # hands batch k on while it computes batch k+1)
         "one process, 4 batches": (1, ["--gpu-batch-size", "2", "--num-gpu-batches", "4"]),
         "pipeline x2, 4 batches": (2, ["--pipeline-stages", "2", "--gpu-batch-size", "2", "--num-gpu-batches", "4",
                                        "--stage-order", "batches"]),
         "pipeline x2, 4 batches, zigzag": (2, ["--pipeline-stages", "2", "--gpu-batch-size", "2",
                                                "--num-gpu-batches", "4", "--stage-order", "zigzag"])}


def command(ranks: int, extra: list[str], common: list[str]) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "flexgen_h2o.run", *common, *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
            "flexgen_h2o.run", *common, *extra]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    inp = a.out / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": " ".join(t.split()[:a.prompt_words])}) + "\n"
                           for i, t in enumerate(lee_articles()[:a.prompts])))
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")          # one node: the ranks talk over loopback
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(a.repeats):
        for name, (ranks, extra) in MODES.items():
            tag = name.replace(",", "").replace(" ", "-")
            out, mj = a.out / f"{tag}.jsonl", a.out / f"{tag}-{r}.json"
            common = ["--model", "smollm2-135m", "--input", str(inp), "--output", str(out), "--overwrite",
                      "--gen-len", str(a.gen_len), "--hh-ratio", "0.2", "--gpu-batch-size", "8", "--no-refill",
                      "--no-progress", "--metrics-json", str(mj)]
            t0 = time.perf_counter()
            proc = subprocess.run(command(ranks, extra, common), env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            (a.out / f"{tag}-{r}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                print(f"{name}: failed ({proc.returncode}); see {tag}-{r}.log")
                continue
            m = json.loads(mj.read_text())
            ranks = m.get("ranks") or [m]
            gen_s = max(x["total_s"] for x in ranks)
            tokens = sum(x["generated_tokens"] for x in ranks)
            rows[name].append({"wall_s": wall, "generate_s": gen_s, "tokens": tokens, "tok_s": tokens / gen_s})
            print(f"round {r} {name}: wall {wall:.1f} s, generation {gen_s:.1f} s, {tokens / gen_s:.1f} tok/s")
    want = [json.loads(x)["token_ids"] for x in (a.out / "one-process.jsonl").read_text().splitlines()]
    summary = {}
    for name, runs in rows.items():
        if not runs:
            continue
        out = a.out / f"{name.replace(',', '').replace(' ', '-')}.jsonl"
        same = [json.loads(x)["token_ids"] for x in out.read_text().splitlines()] == want
        med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "generate_s", "tok_s")}
        summary[name] = {**med, "runs": runs, "same_tokens_as_one_process": same}
    base = summary["one process"]
    lines = ["| mode | wall s | generation s | tok/s | vs one process | same tokens |", "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['wall_s']:.1f} | {s['generate_s']:.1f} | {s['tok_s']:.1f} | "
                     f"{s['tok_s'] / base['tok_s']:.2f} | {s['same_tokens_as_one_process']} |")
    print("\n".join(lines))
    (a.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                    "modes": summary, "table": lines}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
