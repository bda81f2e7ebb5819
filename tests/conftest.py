"""Shared fixtures: the compiled kernels (`kernel`), the converted tiny checkpoint (`tiny`), the SmolLM2 load
(`smollm2`), and the `slow` and `gpu` markers; the portable kernel build started early (pytest_collection_finish)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real SmolLM2 weights or long runs")
    config.addinivalue_line("markers", "gpu: needs CUDA")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


PORTABLE_TEST = ("test_portable_kernels.py", "test_the_portable_build_gives_the_same_values")
_background: list[subprocess.Popen] = []


def pytest_collection_finish(session):
    """Where tests/test_portable_kernels.py's build will run, compile it now in a background process on one core:
    a fresh machine (CI) or an edited csrc/ compiles all the kernels once more without the AVX2 flags, and the tests
    before it leave the second core mostly idle. The test's own build then finds it in torch's cache, or waits for
    it under kernels/build.py's build lock."""
    from flexgen_h2o.kernels import build
    if session.config.option.collectonly or os.environ.get(build.OFF_SWITCH, "1") == "0":
        return
    at = [i for i, item in enumerate(session.items)
          if (item.path.name, getattr(item, "originalname", item.name)) == PORTABLE_TEST]
    if not at or at[0] < 200:                  # run alone or early, it builds faster on both cores itself
        return
    env = {**os.environ, build.ISA_SWITCH: "portable", "MAX_JOBS": "1"}     # MAX_JOBS: ninja's -j (torch)
    _background.append(subprocess.Popen(
        [sys.executable, "-c", "from flexgen_h2o.kernels import build; build.jit_build()"], env=env,
        cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True))


def pytest_sessionfinish(session):
    for proc in _background:                  # a run that ended first (-x, Ctrl-C) stops the build and its compilers
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


@pytest.fixture
def kernel():
    """A kernels.Kernels holding the compiled build, every kernel on (the environment's switches aside): skipped
    where they cannot be built or are switched off, failed in CI, which must build them."""
    from flexgen_h2o.kernels import build, dispatch
    ext = build.load()
    if ext is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the compiled kernels: {build.unavailable_reason()}")
        pytest.skip(f"compiled kernels unavailable: {build.unavailable_reason()}")
    if os.environ.get(build.OFF_SWITCH, "1") == "0":
        pytest.skip(f"compiled kernels switched off ({build.OFF_SWITCH}=0)")
    return dispatch.Kernels(ext)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny Llama checkpoint of tests/tiny_checkpoint.py, converted once per session into its own
    $FLEXGEN_H2O_HOME: (checkpoint folder, the CLI's environment for that home). A test that writes into the home
    (the cost model's cached rates, say) takes a copy of it (tiny_checkpoint.own_home)."""
    from flexgen_h2o.loader import load_model
    from tests.tiny_checkpoint import cli_env, environment, make_checkpoint
    root = tmp_path_factory.mktemp("tiny")
    ckpt = make_checkpoint(root / "tiny")
    env = cli_env(root / "home")
    with environment(env):
        load_model(str(ckpt), progress=False)
    return ckpt, env


SMOLLM2_QUESTIONS = ["What is the capital of France?",
                     "Name three colours of the rainbow and explain where rainbows come from."]


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the bundled GGUF, loaded once per session: (the engine's loaded store, the same
    weights in transformers' LlamaForCausalLM in fp32, SMOLLM2_QUESTIONS as chat-templated token ids). A test that
    changes the transformers model (its attention implementation, say) puts it back."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from flexgen_h2o.loader import load_model
    loaded = load_model("smollm2-135m", progress=False)
    cfg = loaded.config
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                         intermediate_size=cfg.ffn_size, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
                         rms_norm_eps=cfg.norm_eps, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": cfg.rope_theta},
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(hf_cfg)
    state = {}
    for name in model.state_dict():
        ours = name.removeprefix("model.") if name != "lm_head.weight" else "embed_tokens.weight"
        state[name] = torch.from_numpy(loaded.read(ours).copy()).float()
    model.load_state_dict(state)
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in SMOLLM2_QUESTIONS]
    return loaded, model.eval(), prompts
