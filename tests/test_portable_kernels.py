"""The compiled kernels built without the AVX2 flags (what a CPU without them compiles, an ARM host say): their
plain C++ loops give the torch paths' values too. One subprocess, since a process loads the extension once; in a
whole-suite run tests/conftest.py has started its build in the background (pytest_collection_finish)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexgen_h2o.kernels import build

CHECK = """
import json, torch
from flexgen_h2o.kernels import Kernels, build
from flexgen_h2o.models import ops
from tests.kernel_inputs import DECODE_SHAPES, decode_step
from tests.tolerances import EPS32, attention_bounds, decode_attention_bounds, linear_bound
ext = build.load()
assert build.isa_flags() == [] and ext is not None, build.unavailable_reason()
kernels = Kernels(ext)
worst = {}

def ratio(name, got, want, bound):
    # the worst |difference| / its derived bound (tests/tolerances.py): at most 1 on any CPU
    diff = (got.double() - want.double()).abs()
    r = torch.where(diff > 0, diff / torch.as_tensor(bound, dtype=torch.float64).clamp(min=1e-300), 0.0)
    worst[name] = max(worst.get(name, 0.0), float(r.max()) if r.numel() else 0.0)

for shape in DECODE_SHAPES:
    args = decode_step(*shape)
    got = kernels.narrow_decode_attention(*args, 0.3, want_scores=True)
    ref = ops.narrow_decode_attention(*args, 0.3, want_scores=True)
    for a, b, bound in zip(got, ref, decode_attention_bounds(*args, 0.3)):
        ratio("decode_attention", a, b, bound)
for m, k, n in [(120, 576, 40), (7, 13, 9), (1, 64, 5)]:
    x, w = torch.randn(m, k), (torch.randn(n, k) * 0.05).half()
    ratio("half_linear", ext.half_linear(x, w), x.double() @ w.double().T, linear_bound(x, w))
q, k, v = torch.randn(2, 6, 20, 16), torch.randn(2, 3, 20, 16), torch.randn(2, 3, 20, 16)
valid = torch.ones(2, 20, dtype=torch.bool)
valid[1, :4] = False
out, mass = kernels.scored_prompt_attention(q, k, v, valid, False, 0.25, "sum", 256)
ref_out, ref_mass = ops.grouped_attention(q, k, v, ops.causal_pad_mask(valid), 0.25, want_scores=True,
                                          query_valid=valid)
out_bound, mass_bound = attention_bounds(q, k, v, ops.causal_pad_mask(valid), 0.25, valid)
ratio("scored_prompt_attention", out, ref_out, out_bound)
ratio("scored_prompt_attention", mass, ref_mass, mass_bound)
from flexgen_h2o.kv import Budget
from tests.kernel_inputs import column_state, commit_cache, commit_step
pos, scores = column_state(seed=5)
for policy in ("h2o", "h2o-avg", "h2o-port"):
    compiled, plain = (commit_cache(policy, Budget(1, 5, 4, policy=policy), pos, scores, torch.float16, kernels)
                      for _ in "ab")
    plain._compiled_commit = lambda: False
    for step in range(4):
        commit_step(compiled, step, True)
        commit_step(plain, step, True)
    same = all(torch.equal(getattr(compiled, t), getattr(plain, t)) for t in ("k", "v", "pos", "score"))
    worst["commit_step"] = max(worst.get("commit_step", 0.0), 0.0 if same else 1.0)
from tests.kernel_inputs import rms_norm_bound, silu_mul_bound, torch_rms_norm, torch_rope
import torch.nn.functional as F
x, w, g, u = torch.randn(7, 1, 13), torch.randn(13).half(), torch.randn(5, 1, 30) * 4, torch.randn(5, 1, 30)
xr, angles = torch.randn(3, 1, 2 * 10).view(3, 1, 2, 10).transpose(1, 2), torch.rand(3, 1, 1, 10) * 50
xp, ap = torch.randn(2, 4, 3 * 10).view(2, 4, 3, 10).transpose(1, 2), torch.rand(2, 1, 4, 10) * 50   # a prompt
want = torch_rms_norm(x, w, 1e-5)
ratio("layer_math", kernels.rms_norm(x, w, 1e-5), want, rms_norm_bound(want, 13))
want = F.silu(g) * u
ratio("layer_math", ext.silu_mul_(g.clone(), u), want, silu_mul_bound(g, u, want))
for xx, aa in ((xr, angles), (xp, ap)):
    # x cos + rotate(x) sin: two products and a sum, rounded 2 or 3 times (a compiler may fuse one product into
    # an FMA where the ISA has it): 2 EPS32 of each term per path, twice for the two paths
    half = xx.shape[-1] // 2
    turned = torch.cat((xx[..., half:], xx[..., :half]), dim=-1)            # rotate_half, its sign aside
    bound = 4 * EPS32 * (xx.abs() * aa.cos().abs() + turned.abs() * aa.sin().abs()).double()
    ratio("layer_math", ext.rope_rows(xx, aa.cos(), aa.sin()), torch_rope(xx, aa.cos(), aa.sin()), bound)
print(json.dumps(worst))
"""


@pytest.mark.slow
def test_the_portable_build_gives_the_same_values(kernel):
    env = {**os.environ, build.ISA_SWITCH: "portable"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    worst = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(worst) == {"decode_attention", "half_linear", "scored_prompt_attention", "commit_step", "layer_math"}
    assert worst.pop("commit_step") == 0.0                   # the same cache, byte for byte
    # each: the worst |difference| over its derived bound (tests/tolerances.py, the bounds the AVX2 build's own
    # tests use), so it holds for a build on any CPU
    assert all(err <= 1.0 for err in worst.values()), worst


def test_every_kernel_file_ships_with_the_package():
    """An installed (non-editable) package builds the kernels from its own copy of csrc: a header left out of
    setup.py's package_data fails that build, and the engine falls back to the torch ops without a word."""
    import fnmatch
    import re
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    globs = re.findall(r'"(csrc/[^"]+)"', setup)
    files = sorted(p.name for p in build.CSRC.iterdir() if p.is_file())
    assert {"kernels.h", "simd.h"} <= set(files)
    assert [f for f in files if not any(fnmatch.fnmatch("csrc/" + f, g) for g in globs)] == []
