# Sourced by scripts/gpu_check.sh after it sets OUT: the Python to use, the thread and
# offline settings, the refusal on a machine without CUDA, and `step`, which runs one command with a time limit,
# logs it to OUT/NAME.log, prints its tail and counts it in `failed` when it fails (the next step still runs).
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "error: torch sees no CUDA GPU here; $(basename "$0") is for a GPU machine (CPU: make test)" >&2
    exit 2
fi
mkdir -p "$OUT"
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
failed=0
step() {   # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc, $((SECONDS - t0)) s"; tail -4 "$OUT/$name.log"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}
