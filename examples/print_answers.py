"""Print a batch job's answers, then what the H2O cache held against the full cache.

Used by `make run`: python examples/print_answers.py ANSWERS.jsonl METRICS.json
(the files of `python -m flexgen_h2o.run --input ... --output ANSWERS.jsonl --metrics-json METRICS.json`;
the fields are described in docs/cli.md, "Batch mode" and "Benchmark mode").
"""
import json
import sys


def main(answers_path: str, metrics_path: str) -> None:
    with open(answers_path) as f:
        for line in f:
            row = json.loads(line)
            asked = row["prompt"] if "prompt" in row else row["messages"][-1]["content"]
            print(f">>> {asked}")
            print(f"{row['text'].strip()}  [{row['completion_tokens']} tokens, {row['finish_reason']}]\n")
    with open(metrics_path) as f:
        metrics = json.load(f)
    kept, full = metrics["kv_cache_bytes"], metrics["full_cache_bytes"]
    print(f"KV cache ({metrics['eviction_request']}): {kept / 2**20:.1f} MiB held instead of "
          f"{full / 2**20:.1f} MiB for the full cache ({full / kept:.1f}x less), "
          f"{metrics['prompts']} prompts, {metrics['generated_tokens']} tokens generated")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("error: usage: python examples/print_answers.py ANSWERS.jsonl METRICS.json", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1], sys.argv[2])
