"""Round trips HF checkpoint -> store: every tensor must equal the fp16 cast of the HF tensor."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flexgen_h2o.weights import WeightStoreError, convert_checkpoint, open_store


def _assert_same(store, model, cfg, hf) -> None:
    reader = open_store(store, hf.specs_of(cfg))
    sd = model.state_dict()
    for spec in hf.specs_of(cfg):
        got = reader.read(spec.name)
        assert got.dtype == np.float16 and not got.flags.writeable
        np.testing.assert_array_equal(got, sd[spec.hf_name].to(torch.float16).numpy(), err_msg=spec.name)
    assert {k: reader.config[k] for k in ("n_layers", "n_kv_heads", "hidden_size")} == {
        "n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads, "hidden_size": cfg.hidden_size}


@pytest.mark.parametrize("kind", ["llama", "opt", "opt-proj"])
@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_round_trip(tmp_path, kind, sharded, hf):
    model = hf.tiny_llama() if kind == "llama" else hf.tiny_opt(32 if kind == "opt-proj" else 64)
    cfg = hf.cfg_of(model)
    model.save_pretrained(tmp_path / "hf", **({"max_shard_size": "20KB"} if sharded else {}))
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == sharded
    store = convert_checkpoint(tmp_path / "hf", cfg, tmp_path / "store", progress=False)
    _assert_same(store, model, cfg, hf)
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["format"] == 1 and len(manifest["tensors"]) == len(hf.specs_of(cfg))
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_bin_shards_with_extra_tensors(tmp_path, hf):
    """pytorch_model-*.bin shards with an index; extra tensors (rotary inv_freq) are ignored."""
    model = hf.tiny_llama()
    cfg = hf.cfg_of(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    keys = list(sd)
    folder = tmp_path / "hf"
    folder.mkdir()
    model.config.to_json_file(folder / "config.json")
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: sd[k] for k in part}, folder / name)
        weight_map.update({k: name for k in part})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _assert_same(convert_checkpoint(folder, None, tmp_path / "store", progress=False), model, cfg, hf)


def test_single_bin_without_model_prefix(tmp_path, hf):
    """A bare-base-model state dict (`decoder.*`, no `model.` prefix) still maps onto the specs."""
    model = hf.tiny_opt()
    cfg = hf.cfg_of(model)
    sd = {k.removeprefix("model."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    _assert_same(convert_checkpoint(tmp_path / "pytorch_model.bin", cfg, tmp_path / "store", progress=False),
                 model, cfg, hf)


def test_config_read_from_folder(llama_folder, tmp_path, hf):
    folder, model, cfg = llama_folder
    store = convert_checkpoint(folder, None, tmp_path / "store", progress=False)
    assert open_store(store, hf.specs_of(cfg)).config["n_layers"] == 2


def test_missing_tensor_names_it(llama_folder, tmp_path):
    folder, _, cfg = llama_folder
    with pytest.raises(WeightStoreError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight"):
        convert_checkpoint(folder, cfg.replace(n_layers=3), tmp_path / "store", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_wrong_shape_mid_way_leaves_nothing(llama_folder, tmp_path):
    """The FFN tensors fail after others were written: no store and no temporary folder remain."""
    folder, _, cfg = llama_folder
    with pytest.raises(WeightStoreError, match=r"gate_proj\.weight.*\[128, 64\].*\[96, 64\]"):
        convert_checkpoint(folder, cfg.replace(ffn_size=96), tmp_path / "store", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_reconvert_replaces_old_store(llama_folder, tmp_path, hf):
    folder, model, cfg = llama_folder
    dest = tmp_path / "store"
    dest.mkdir()
    (dest / "stale.npy").write_bytes(b"old")
    convert_checkpoint(folder, cfg, dest, progress=False)
    assert not (dest / "stale.npy").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    _assert_same(dest, model, cfg, hf)


def test_missing_source(tmp_path, hf):
    with pytest.raises(WeightStoreError, match="not found"):
        convert_checkpoint(tmp_path / "nope", None, tmp_path / "store", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightStoreError, match="no checkpoint in"):
        convert_checkpoint(tmp_path / "empty", hf.cfg_of(hf.tiny_opt()), tmp_path / "store", progress=False)
