"""Are a refactor's tokens and cache states bit-identical to another commit's? Runs a fixed set of generations
(OPT-125M with dummy weights and SmolLM2 with its real weights; full cache, H2O, the port's H2O, the baselines;
KV, activations and weights on RAM and disk; position rolling) here and in a git worktree of `--base`, and
compares every generated token and a SHA-256 of every layer's final cache (K, V, score, position).

    python scripts/same_outputs.py --base HEAD~1            # exit 0: identical; 1: the first differences
    python scripts/same_outputs.py --dump here.json         # this tree's outputs only

The same file drives both trees (`--repo` puts the other tree's package first on the path), so it may only use
what both commits have: Engine, OffloadPolicy, EvictionConfig, GenerationConfig, load_model.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent

# (name, model, percent, eviction kwargs, block size, gpu batch size, prompt lengths, new tokens)
CASES = [
    ("opt-full-ram", "opt-125m", (100, 0, 100, 0, 100, 0), dict(policy="full"), 4, 2, (37, 20, 29, 11), 12),
    ("opt-h2o-ram", "opt-125m", (100, 0, 100, 0, 100, 0), dict(policy="h2o", hh_ratio=0.2), 4, 2,
     (37, 20, 29, 11), 12),
    ("opt-h2o-kv-host", "opt-125m", (100, 0, 0, 100, 100, 0), dict(policy="h2o", hh_size=5, recent_size=4), 4, 4,
     (40, 33, 40, 25), 10),
    ("opt-h2o-port-disk", "opt-125m", (100, 0, 50, 0, 50, 0), dict(policy="h2o-port", hh_ratio=0.2), 4, 4,
     (40, 33, 40, 25), 10),
    ("opt-h2o-weights-disk", "opt-125m", (0, 50, 100, 0, 100, 0), dict(policy="h2o", hh_ratio=0.25), 2, 2,
     (30, 18), 8),
    ("smol-h2o", "smollm2-135m", (100, 0, 100, 0, 100, 0), dict(policy="h2o", hh_ratio=0.2), 3, 3,
     (64, 41, 50), 16),
    ("smol-full", "smollm2-135m", (100, 0, 100, 0, 100, 0), dict(policy="full"), 3, 3, (64, 41, 50), 16),
    ("smol-avg-kv-disk", "smollm2-135m", (100, 0, 0, 0, 100, 0), dict(policy="h2o-avg", kv_budget=24), 2, 2,
     (48, 30), 12),
    ("smol-sink-rolling", "smollm2-135m", (100, 0, 100, 0, 100, 0),
     dict(policy="sink", kv_budget=16, position_rolling=True), 2, 2, (40, 25), 24),
    ("smol-random", "smollm2-135m", (100, 0, 100, 0, 100, 0), dict(policy="random", kv_budget=20, seed=3),
     2, 2, (40, 25), 12),
]


def digest(t) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def dump(only: list[str] | None = None) -> dict:
    import torch

    from flexgen_h2o.config import GenerationConfig, OffloadPolicy
    from flexgen_h2o.engine import Engine
    from flexgen_h2o.kv import EvictionConfig
    from flexgen_h2o.loader import load_model

    torch.manual_seed(0)
    out, loaded = {}, {}
    for name, model, pct, ev, block, gbs, lens, n_new in CASES:
        if only and name not in only:
            continue
        if model not in loaded:
            loaded[model] = load_model(model, dummy_weights=model == "opt-125m", progress=False)
        m = loaded[model]
        vocab = m.config.vocab_size
        g = torch.Generator().manual_seed(sum(lens))
        prompts = [torch.randint(10, vocab - 10, (n,), generator=g).tolist() for n in lens]
        offload = OffloadPolicy.from_percent(pct, gpu_batch_size=gbs, num_gpu_batches=block // gbs)
        with tempfile.TemporaryDirectory() as off_dir, Engine(m.config, m.read, offload=offload,
                                                              eviction=EvictionConfig(**ev), offload_dir=off_dir,
                                                              locate=m.locate) as engine:
            res = engine.generate(prompts, GenerationConfig(max_new_tokens=n_new, stop_at_eos=False))
            caches = {f"{b}:{layer}": [digest(t) for t in split.snapshot()]
                      for b, batch in enumerate(engine.last_caches) for layer, split in batch.items()}
        out[name] = {"tokens": res.token_ids, "caches": caches}
        print(f"  {name}: {sum(len(t) for t in res.token_ids)} tokens, {len(caches)} caches", flush=True)
    return out


def compare(here: dict, there: dict) -> list[str]:
    diffs = []
    for name in sorted(set(here) | set(there)):
        a, b = here.get(name), there.get(name)
        if a is None or b is None:
            diffs.append(f"{name}: only in {'base' if a is None else 'this tree'}")
        elif a["tokens"] != b["tokens"]:
            diffs.append(f"{name}: tokens differ")
        elif a["caches"] != b["caches"]:
            bad = [k for k in a["caches"] if a["caches"][k] != b["caches"].get(k)]
            diffs.append(f"{name}: cache states differ in {len(bad)} of {len(a['caches'])} (first {bad[0]})")
    return diffs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="commit to compare with (a temporary git worktree)")
    p.add_argument("--dump", type=Path, help="write this tree's outputs here and stop")
    p.add_argument("--repo", type=Path, help=argparse.SUPPRESS)      # the tree whose package is imported
    p.add_argument("--cases", nargs="*", help="only these cases (default: all)")
    a = p.parse_args()
    sys.path.insert(0, str(a.repo or REPO))
    if a.dump or not a.base:
        result = dump(a.cases)
        if a.dump:
            a.dump.write_text(json.dumps(result))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base_tree, base_json = Path(tmp) / "base", Path(tmp) / "base.json"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base_tree), a.base],
                       check=True)
        try:
            # where the kernels' sources are the same bytes, both trees run this tree's build (the folder moved
            # from models/ to kernels/ once; the build goes where the base tree looks for it); where they differ,
            # the base tree compiles its own (torch's extension cache, once per source tree: minutes)
            from benchmarks.studies.ab import CSRC_FOLDERS     # this tree's, as is the hash
            from flexgen_h2o.kernels.build import source_hash
            here, there = (next(t / c for c in CSRC_FOLDERS if (t / c).is_dir()) for t in (REPO, base_tree))
            if source_hash(here) == source_hash(there):
                for so in here.parent.glob("_kernels*.so"):                  # the compiled kernels, as built
                    shutil.copy(so, there.parent)
            else:
                print(f"the kernels' sources differ from {a.base}: its tree builds its own", flush=True)
            print(f"base {a.base}:", flush=True)
            subprocess.run([sys.executable, __file__, "--dump", str(base_json), "--repo", str(base_tree),
                            *(["--cases", *a.cases] if a.cases else [])], check=True, cwd=tmp)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False)
        print("this tree:", flush=True)
        diffs = compare(dump(a.cases), json.loads(base_json.read_text()))
    print("\n".join(diffs) if diffs else f"identical: {len(CASES if not a.cases else a.cases)} cases, tokens and "
          "cache states")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
