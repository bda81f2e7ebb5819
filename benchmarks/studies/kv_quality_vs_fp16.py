"""Compressed-KV quality against the fp16 accuracy grid: perplexity (full cache and H2O 20 %) from `python -m
flexgen_h2o.eval --kv-bits B` beside `eval-full-a`'s fp16 run on the same items, and summarization ROUGE on the
same articles (the compressed runs take the first n of the fp16 run's 100; ROUGE is recomputed for fp16 on those).

    python -m benchmarks.studies.kv_quality_vs_fp16 --out benchmarks/results/eval-kv-quality
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path("benchmarks/results")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.kv_quality_vs_fp16", description=__doc__)
    p.add_argument("--base", type=Path, default=RESULTS / "eval-full-a", help="the fp16 run's folder")
    p.add_argument("--runs", nargs="+", default=["4=eval-kv4", "8=eval-kv8"], help="BITS=folder under results")
    p.add_argument("--out", type=Path, default=RESULTS / "eval-kv-quality")
    a = p.parse_args(argv)
    from flexgen_h2o.eval import data
    from flexgen_h2o.eval.summarize import mean_rouge, rouge_scorer
    from flexgen_h2o.loader import load_model
    base_ppl = json.loads((a.base / "perplexity.json").read_text())["records"]
    base_sum = json.loads((a.base / "summarization.json").read_text())["records"]
    tok, scorer = load_model("smollm2-135m", progress=False).tokenizer, rouge_scorer()
    out: dict = {}
    ppl_rows = ["| KV | corpus | full cache: ppl vs fp16 | H2O 20 %: ppl vs fp16 |", "|---|---|---|---|"]
    sum_rows = ["| KV | cache | ROUGE-1 / 2 / L | fp16 on the same articles | ROUGE-L against fp16's own text |",
                "|---|---|---|---|---|"]
    for spec in a.runs:
        bits, folder = spec.split("=", 1)
        run = RESULTS / folder
        ppl = json.loads((run / "perplexity.json").read_text())["records"]
        for corpus in ("wiki", "lee"):
            cells = []
            for key in (f"{corpus}/full", f"{corpus}/h2o@20%"):
                q, b = ppl[key]["ppl"], base_ppl[key]["ppl"]
                out[f"int{bits}/{key}"] = {"ppl": q, "fp16_ppl": b, "ratio": q / b}
                cells.append(f"{q:.3f} vs {b:.3f} (**{q / b:.4f}x**)")
            ppl_rows.append(f"| int{bits} | {corpus} | {cells[0]} | {cells[1]} |")
        summaries = json.loads((run / "summarization.json").read_text())["records"]
        n = len(next(iter(summaries.values()))["articles"])
        reference = {item.article: item.reference for item in data.summary_items(tok, n, 2048)}
        for key in ("full", "h2o@20%"):
            r = summaries[key]
            fp16_text = dict(zip(base_sum[key]["articles"], base_sum[key]["summaries"]))
            fp16 = [fp16_text[art] for art in r["articles"]]
            fp16_rouge = mean_rouge(scorer, [reference[art] for art in r["articles"]], fp16)
            agree = mean_rouge(scorer, fp16, r["summaries"])
            q = r["vs_reference"]
            out[f"int{bits}/summarization/{key}"] = {"rouge": q, "fp16_rouge": fp16_rouge, "vs_fp16_text": agree,
                                                     "items": n}
            sum_rows.append(f"| int{bits} | {key} | {q['rouge1']:.4f} / {q['rouge2']:.4f} / {q['rougeL']:.4f} | "
                            f"{fp16_rouge['rouge1']:.4f} / {fp16_rouge['rouge2']:.4f} / {fp16_rouge['rougeL']:.4f}"
                            f" | {agree['rougeL']:.3f} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "quality.json").write_text(json.dumps(out, indent=1))
    table = "\n".join(ppl_rows) + "\n\n" + "\n".join(sum_rows) + "\n"
    (a.out / "tables.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
