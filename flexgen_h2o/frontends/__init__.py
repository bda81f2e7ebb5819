"""Front ends: the CLI's flags (cli.py), batch JSONL (jsonl.py), the block loop shared with the API (batch.py),
benchmark mode (benchmark.py) and the bundled text corpus (corpus.py). Level 5: may import anything."""
