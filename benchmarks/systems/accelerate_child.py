"""The `accelerate` system's case: HF Accelerate disk offload of an OPT shape, as FlexGen's `hf_opt.py` baseline
(benchmarks/systems/accelerate.py schedules it).

One process = one measured case: `python -m benchmarks.systems.accelerate_child --model opt-1.3b --batch 4
--prompt-len 64 --gen-len 16 --metrics-json out.json`; `--prepare-only` writes the offload folder and exits.

Fairness choices (said again in the report):
- Same weights: `OPTForCausalLM` gets the engine's dummy store tensor by tensor (`WeightSpec.hf_name`), so both
  systems compute with identical numbers.
- Same storage and compute dtypes as the engine on CPU: the decoder layers and the final LayerNorm live on "disk" as
  **fp16** `.dat` files in Accelerate's own offload format, while the module itself is built in **fp32**. Accelerate's
  `AlignDevicesHook` loads each layer's weights just before its forward through `set_module_tensor_to_device`, which
  casts to the parameter's dtype, so every forward reads fp16 from disk and computes in fp32, exactly what the engine
  does (fp16 matmul is far slower than fp32 on a CPU; an fp32 offload folder would double the bytes read).
- Device map as FlexGen's `hf_opt.py`: embeddings (and the tied lm_head) stay resident ("cpu" here, GPU 0 there);
  `decoder.layers.*` and the final LayerNorm go to "disk". The map is explicit, so `max_memory` plays no part in the
  placement; the suite enforces the memory budget on the measured peak RSS instead.
- Timing from outside, as modern transformers has no `timers` hook: prefill = wall time of
  `generate(max_new_tokens=1)`, decode = wall time of `generate(max_new_tokens=G)` minus prefill. The page cache of
  the offload files is dropped before each of the two calls, so both start cold and the subtraction cancels the cold
  first pass.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")        # spin-waiting OpenMP threads starve a shared 2-core VM
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):                   # `python benchmarks/systems/accelerate_child.py` also works
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import RssSampler, drop_page_cache  # noqa: E402

RESIDENT_PREFIXES = ("embed_tokens.", "embed_positions.", "project_in.", "project_out.", "lm_head.")


def proc_read_bytes() -> int:
    """Bytes this process really fetched from the storage layer (/proc/self/io read_bytes; page-cache hits and
    memory-mapped pages already resident do not count), or -1 where the kernel does not expose it."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return -1


def default_offload_folder(model: str) -> Path:
    from flexgen_h2o.weights.store import store_root
    return store_root() / "accelerate-offload" / f"{model}-dummy"


def disk_specs(cfg: Any) -> list[Any]:
    """The engine's weight specs that Accelerate puts on "disk": every decoder layer and the final LayerNorm."""
    from flexgen_h2o.models import all_specs, build_layers
    return [s for s in all_specs(build_layers(cfg)) if not s.name.startswith(RESIDENT_PREFIXES)]


def offload_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.dat"))


def prepare_offload_folder(cfg: Any, store: Path, folder: Path) -> Path:
    """Write the disk modules' fp16 tensors from the engine's store in Accelerate's offload format (one `.dat`
    memmap per tensor + `index.json`, via `accelerate.utils.offload_weight`). Once per model: `dispatch_model`
    reuses a folder that has an `index.json`. Built in a temp folder and renamed, so a half-written folder is
    never taken for a complete one."""
    import numpy as np
    import torch
    from accelerate.utils import offload_weight, save_offload_index

    specs = disk_specs(cfg)
    index_file = folder / "index.json"
    if index_file.is_file() and set(json.loads(index_file.read_text())) == {s.hf_name for s in specs}:
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index: dict[str, Any] = {}
    for spec in specs:                                          # one tensor at a time: bounded RAM
        arr = np.load(store / f"{spec.name}.npy", mmap_mode="r")
        offload_weight(torch.from_numpy(np.array(arr, dtype=np.float16)), spec.hf_name, str(tmp), index=index)
    save_offload_index(index, str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def hf_config(cfg: Any) -> Any:
    from transformers import OPTConfig
    if cfg.family != "opt":
        raise SystemExit(f"error: the Accelerate peer builds OPT models only, not {cfg.family}")
    return OPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                     ffn_dim=cfg.ffn_size, num_attention_heads=cfg.n_heads, max_position_embeddings=cfg.max_seq_len,
                     do_layer_norm_before=cfg.pre_norm, word_embed_proj_dim=cfg.embed_dim, dropout=0.0,
                     enable_bias=cfg.attn_bias, tie_word_embeddings=cfg.tie_word_embeddings,
                     pad_token_id=cfg.pad_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id)


def build_model(cfg: Any, store: Path, folder: Path) -> tuple[Any, dict[str, str]]:
    """An fp32 `OPTForCausalLM` on meta, resident modules filled from the store, then dispatched with the decoder
    layers on disk. Returns (model, device_map)."""
    import numpy as np
    import torch
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import OPTForCausalLM
    from flexgen_h2o.models import all_specs, build_layers

    with init_empty_weights():
        model = OPTForCausalLM(hf_config(cfg)).to(torch.float32)
    model.eval()
    for spec in all_specs(build_layers(cfg)):
        if spec.name.startswith(RESIDENT_PREFIXES) and spec.hf_name != "lm_head.weight":
            arr = np.load(store / f"{spec.name}.npy", mmap_mode="r")
            set_module_tensor_to_device(model, spec.hf_name, "cpu", value=torch.from_numpy(np.array(arr)).float())
    if cfg.tie_word_embeddings:             # setting embed_tokens replaced the Parameter object: tie again
        model.lm_head.weight = model.model.decoder.embed_tokens.weight
    else:
        arr = np.load(store / "lm_head.weight.npy", mmap_mode="r")
        set_module_tensor_to_device(model, "lm_head.weight", "cpu", value=torch.from_numpy(np.array(arr)).float())
    dec = "model.decoder."
    device_map = {dec + "embed_tokens": "cpu", dec + "embed_positions": "cpu", "lm_head": "cpu"}
    if cfg.embed_dim != cfg.hidden_size:
        device_map.update({dec + "project_in": "cpu", dec + "project_out": "cpu"})
    if cfg.final_norm:
        device_map[dec + "final_layer_norm"] = "disk"
    device_map.update({f"{dec}layers.{i}": "disk" for i in range(cfg.n_layers)})
    model = dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(folder))
    return model, device_map


class LoadCounter:
    """Counts the bytes Accelerate's offload loader reads from the `.dat` files (patched at module level, which is
    where `OffloadedWeightsLoader.__getitem__` looks the function up)."""

    def __init__(self) -> None:
        import accelerate.utils.offload as off
        self.bytes = 0
        self._orig = off.load_offloaded_weight

        def counted(weight_file: str, weight_info: dict) -> Any:
            t = self._orig(weight_file, weight_info)
            self.bytes += t.nbytes
            return t
        off.load_offloaded_weight = counted


def run_case(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from flexgen_h2o.frontends.corpus import benchmark_prompts
    from flexgen_h2o.loader import fallback_tokenizer
    from flexgen_h2o.metrics import peak_rss_bytes, throughput
    from flexgen_h2o.models import resolve_model

    cfg = resolve_model(a.model)
    folder = Path(a.offload_folder)
    tok = fallback_tokenizer()
    if tok is None:
        raise SystemExit("error: needs the embedded SmolLM2 tokenizer: run `make run` once")
    # the engine's benchmark prompts: Lee news windows, ids mod the vocab; the first `batch` windows
    ids = torch.tensor(benchmark_prompts(tok, a.batch, a.prompt_len, cfg.vocab_size), dtype=torch.long)
    model, device_map = build_model(cfg, Path(a.store), folder)
    counter = LoadCounter()
    files = offload_files(folder)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=cfg.pad_id, use_cache=True)

    def timed(n_new: int) -> tuple[float, int, int, int]:
        drop_page_cache(files)                      # each call starts with the offloaded layers cold
        io0, loaded0, t0 = proc_read_bytes(), counter.bytes, time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        return (time.perf_counter() - t0, proc_read_bytes() - io0, counter.bytes - loaded0,
                out.shape[1] - ids.shape[1])

    with RssSampler() as rss:
        prefill_s, _, prefill_loaded, _ = timed(1)
        full_s, io_full, loaded_full, n_gen = timed(a.gen_len)
    decode_s = max(full_s - prefill_s, 1e-9)
    rates = throughput(a.batch, a.prompt_len, n_gen, prefill_s, decode_s)
    disk_bytes = sum(f.stat().st_size for f in files)
    kv_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4      # HF's cache is fp32 here
    return {**rates, "system": "accelerate", "model": cfg.name, "block_size": a.batch, "prompt_len": a.prompt_len,
            "gen_len": n_gen, "prefill_s": prefill_s, "decode_s": decode_s, "full_generate_s": full_s,
            "decode_steps": n_gen - 1, "weights_bytes_read": {"disk": loaded_full},
            "weights_bytes_per_forward": loaded_full / max(n_gen, 1), "prefill_bytes_loaded": prefill_loaded,
            "offload_folder_bytes": disk_bytes, "io_read_bytes": io_full, "io_window_s": full_s,
            "kv_cache_bytes": kv_per_token * a.batch * (a.prompt_len + n_gen - 1),
            "kv_bytes_per_token": kv_per_token, "peak_rss_bytes": peak_rss_bytes(),
            # sampled during generate; mapped offload pages would be "file" pages, grown above the libraries' start
            "rss_parts_peak_bytes": rss.peaks, "rss_file_growth_bytes": rss.growth("file"),
            "torch_threads": torch.get_num_threads(), "attn_implementation": model.config._attn_implementation,
            "device_map": device_map}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.systems.accelerate_child",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-1.3b", help="an OPT preset of flexgen_h2o")
    p.add_argument("--store", help="the engine's dummy store (default: materialise ~/.cache/flexgen_h2o/<model>-dummy)")
    p.add_argument("--offload-folder", help="Accelerate's offload folder (default: next to the store)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--prepare-only", action="store_true", help="write the offload folder and exit")
    p.add_argument("--metrics-json", help="write the case's metrics here")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from flexgen_h2o.loader import load_model
    loaded = load_model(a.model, path=a.store, dummy_weights=True, dummy_on_disk=True, progress=False)
    a.store = str(loaded.store_path)
    folder = Path(a.offload_folder) if a.offload_folder else default_offload_folder(a.model)
    a.offload_folder = str(prepare_offload_folder(loaded.config, loaded.store_path, folder))
    if a.prepare_only:
        return 0
    del loaded                                      # the engine's reader is not used by the peer
    metrics = run_case(a)
    print(f"accelerate batch {a.batch}: prefill {metrics['prefill_tok_s']:.2f} tok/s | decode "
          f"{metrics['decode_tok_s']:.2f} tok/s | total {metrics['total_tok_s']:.2f} tok/s | peak RSS "
          f"{metrics['peak_rss_bytes'] / 2**30:.2f} GiB")
    if a.metrics_json:
        Path(a.metrics_json).write_text(json.dumps(metrics, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
