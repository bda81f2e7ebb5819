"""Dummy-weight generation speed: the pool generator vs the per-value normal draw it replaced (one process)."""
import time, zlib
import numpy as np
from flexgen_h2o.models import PRESETS, build_layers, all_specs
from flexgen_h2o.weights.dummy import dummy_tensor
cfg = PRESETS["opt-6.7b"]
specs = all_specs(build_layers(cfg))
dummy_tensor(specs[1])
t = time.perf_counter(); n = 0
for s in specs:
    n += dummy_tensor(s).nbytes
new = time.perf_counter() - t
layer = [s for s in specs if ".5." in s.name]
t = time.perf_counter(); m = 0
for s in layer:
    rng = np.random.default_rng([0, zlib.crc32(s.name.encode())])
    m += (rng.standard_normal(s.numel, dtype=np.float32) * 0.02).astype(np.float16).nbytes
old = time.perf_counter() - t
print(f"pool generator: {n / 1e9:.1f} GB (all of OPT-6.7B) in {new:.1f} s = {n / 1e9 / new:.2f} GB/s")
print(f"per-value normals (the old generator): {m / 1e9:.2f} GB (one OPT-6.7B layer) in {old:.1f} s = {m / 1e9 / old:.2f} GB/s")
opt30 = 2 * PRESETS["opt-30b"].n_params() / 1e9
print(f"OPT-30B ({opt30:.0f} GB) projected on this VM: pool {opt30 / (n / 1e9 / new):.0f} s, old {opt30 / (m / 1e9 / old):.0f} s")
