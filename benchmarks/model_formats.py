"""One model for every system: the peers that cannot read our store get it as an HF folder (transformers, vLLM,
OpenVINO's exporter), written once from the store the engine itself runs.

The store holds the GGUF's weights converted once to fp16 (`flexgen_h2o.weights.convert`); the HF folder holds
those very fp16 values widened to fp32 safetensors, so every system computes with identical numbers. The folder is
cached under `<store_root>/formats/<model>-hf` with a `.ready` marker naming the store's manifest hash, so a
re-converted store rebuilds it. The OpenVINO IR is exported from this folder (benchmarks/systems/openvino.py).

    python -m benchmarks.model_formats             # builds (or finds) the folder and prints its path
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch


def formats_root() -> Path:
    from flexgen_h2o.weights import store_root
    return store_root() / "formats"


def _manifest_hash(store: Path) -> str:
    return hashlib.sha256((store / "manifest.json").read_bytes()).hexdigest()[:16]


def llama_config(store: Path):
    """transformers' LlamaConfig for a converted Llama store (fields in the store's own names)."""
    from transformers import LlamaConfig
    c = json.loads((store / "manifest.json").read_text())["config"]
    if c.get("family") != "llama":
        raise ValueError(f"{store}: an HF folder is written for Llama stores only (this is {c.get('family')})")
    return LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["n_layers"],
                       intermediate_size=c["ffn_size"], num_attention_heads=c["n_heads"],
                       num_key_value_heads=c["n_kv_heads"], head_dim=c["head_dim"],
                       max_position_embeddings=c["max_seq_len"], rms_norm_eps=c["norm_eps"],
                       tie_word_embeddings=c["tie_word_embeddings"],
                       rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
                       bos_token_id=c["bos_id"], eos_token_id=c["eos_id"], pad_token_id=c["pad_id"])


def write_hf_folder(store: Path, dest: Path) -> Path:
    """The store as an HF folder (fp32 safetensors, config.json, tokenizer files). Written to a sibling temp
    folder and renamed, so a killed build leaves no half folder under the final name."""
    from transformers import LlamaForCausalLM
    man = json.loads((store / "manifest.json").read_text())
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model = LlamaForCausalLM(llama_config(store))
    with torch.no_grad():
        for name, param in model.named_parameters():      # the tied lm_head is the embedding parameter
            entry = man["tensors"][name.removeprefix("model.")]
            param.copy_(torch.from_numpy(np.load(store / entry["file"]).astype(np.float32)))
    model.generation_config.do_sample = False
    model.save_pretrained(str(tmp))
    tok_dir = store / (man.get("tokenizer") or "tokenizer")
    for f in tok_dir.iterdir():
        shutil.copy2(f, tmp / f.name)
    (tmp / ".ready").write_text(_manifest_hash(store) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def hf_folder(model: str = "smollm2-135m") -> Path:
    """The HF folder of `model`'s converted store, built on first use and rebuilt when the store changes."""
    from flexgen_h2o.weights import default_store_path
    store = default_store_path(model)
    if not (store / "manifest.json").is_file():
        raise FileNotFoundError(f"no converted store for {model} at {store}: run `make run` once")
    dest = formats_root() / f"{store.name}-hf"
    marker = dest / ".ready"
    if marker.is_file() and marker.read_text().strip() == _manifest_hash(store):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    return write_hf_folder(store, dest)


if __name__ == "__main__":
    print(hf_folder())
