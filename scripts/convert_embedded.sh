#!/usr/bin/env bash
# Convert the bundled SmolLM2-135M-Instruct GGUF into the fp16 weight store once (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" -m flexgen_h2o.convert smollm2-135m "$@"
