"""Batch jobs you can trust, through the CLI's main in this process (tests/tiny_checkpoint.py, run_main) while
another process holds the lock: one run per --output at a time (a killed run never blocks its rerun), and a bad
checkpoint config.json is one `error:` line and exit 2 for both `python -m flexgen_h2o.run` and
`python -m flexgen_h2o.convert`. All cheap: every run stops before weights load."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from flexgen_h2o import convert
from flexgen_h2o.models import from_hf_config, resolve_model
from flexgen_h2o.models.config import CheckpointConfigError
from tests.tiny_checkpoint import REPO, cli_env, run_main

HOLDER = """
import sys, time
from flexgen_h2o.frontends.jsonl import OutputLock
OutputLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def _hold(output, env) -> subprocess.Popen:
    """Another process holding `output`'s lock, as a running batch job does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(output)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    if proc.stdout.readline().strip() != "locked":
        proc.kill()
        pytest.fail("the holder did not take the lock")
    return proc


def _batch(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hello", "id": "a"}\n')
    return inp, tmp_path / "out.jsonl", tmp_path / "out.jsonl.lock"


def test_second_run_on_the_same_output_is_refused(tmp_path):
    env = cli_env(tmp_path / "home")
    inp, out, lock = _batch(tmp_path)
    # an unknown model fails right after the lock: without the lock check the error would be about the model
    args = ["--model", "no-such-model", "--input", str(inp), "--output", str(out), "--no-progress"]
    holder = _hold(out, env)
    try:
        proc = run_main(args, env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [f"error: --output {out} is in use by another run (pid {holder.pid} holds "
                                            f"{lock}); wait for it to finish or pick another --output"]
        assert proc.stdout == "" and not out.exists()
        assert holder.poll() is None and lock.read_text() == f"{holder.pid}\n"     # the holder's lock untouched
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # the holder is gone (SIGKILL, its lock file left behind): the same command gets past the lock, to the model
    assert lock.exists()
    proc = run_main(args, env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith("error: unknown model 'no-such-model'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]                 # lock file removed too


def test_rerun_after_a_sigkilled_holder_resumes_and_removes_the_lock(tmp_path):
    env = cli_env(tmp_path / "home")
    inp, out, lock = _batch(tmp_path)
    done = {"id": "a", "prompt": "hello", "text": " there", "finish_reason": "length", "prompt_tokens": 1,
            "completion_tokens": 1, "token_ids": [7]}
    out.write_text(json.dumps(done) + "\n")
    holder = _hold(out, env)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL and lock.read_text() == f"{holder.pid}\n"
    proc = run_main(["--model", "no-such-model", "--input", str(inp), "--output", str(out)], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"resuming {out}: 1 of 1 ids already done\nnothing to do: all 1 ids of {inp} are in {out}\n"
    assert [json.loads(x) for x in out.read_text().splitlines()] == [done]
    assert not lock.exists()                                                          # removed by a normal end


# --- config.json problems: one line naming the file and the field, exit 2, for run and convert ---

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 512}
FIX = "with the value from the model's original config.json"


def _bad_configs(cfg: str) -> list[tuple[str, str, str]]:
    """(name, config.json text, the whole expected error line)."""
    missing = {k: v for k, v in LLAMA.items() if k != "hidden_size"}
    broken = '{"model_type": "llama",\n "hidden_size": 64,,\n}'
    e = pytest.raises(json.JSONDecodeError, json.loads, broken).value
    return [
        ("missing", json.dumps(missing), f'error: {cfg}: field "hidden_size" is missing (a positive integer, required '
                                         f'for model_type "llama"); add it, {FIX}'),
        ("wrong type", json.dumps(dict(LLAMA, num_hidden_layers="2")),
         f'error: {cfg}: field "num_hidden_layers" must be a positive integer, got "2"; fix it, {FIX}'),
        ("not json", broken, f"error: {cfg} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix it "
                             "or copy it again from the original checkpoint"),
        ("model_type", json.dumps(dict(LLAMA, model_type="gpt2")),
         f'error: {cfg}: model_type "gpt2" is not supported; flexgen_h2o runs OPT, Llama-like, Qwen2 and Mistral '
         'models (model_type "opt", "llama", "qwen2" or "mistral")'),
    ]


@pytest.mark.parametrize("case", ["missing", "wrong type", "not json", "model_type"])
@pytest.mark.parametrize("command", ["run", "convert"])
def test_bad_config_json_is_one_error_line(tmp_path, command, case):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = ckpt / "config.json"
    text, expected = {n: (t, x) for n, t, x in _bad_configs(str(cfg))}[case]
    cfg.write_text(text)
    env = cli_env(tmp_path / "home")
    if command == "run":
        proc = run_main(["--model", str(ckpt), "--prompt", "hi"], env)
    else:
        proc = run_main([str(ckpt), "--out", str(tmp_path / "out"), "--quiet"], env, main=convert.main)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [expected]
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]                    # no store, no home folder


def test_the_good_config_reads_and_each_field_check(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    cfg = resolve_model(str(tmp_path))
    assert (cfg.family, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers) == \
        ("llama", 64, 4, 2, 16, 2)
    opt = {"model_type": "opt", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "ffn_dim": 128,
           "vocab_size": 128}
    assert from_hf_config(opt).ffn_size == 128
    cases = [
        (dict(LLAMA, hidden_size=None), 'field "hidden_size" is missing'),                  # null is missing
        (dict(LLAMA, hidden_size=True), 'field "hidden_size" must be a positive integer, got true'),
        (dict(LLAMA, vocab_size=0), 'field "vocab_size" must be a positive integer, got 0'),
        (dict(LLAMA, rms_norm_eps="1e-5"), 'field "rms_norm_eps" must be a positive number, got "1e-5"'),
        (dict(LLAMA, tie_word_embeddings="false"), 'field "tie_word_embeddings" must be true or false'),
        (dict(LLAMA, eos_token_id=[2, "x"]), 'field "eos_token_id" must be a token id'),
        (dict(LLAMA, rope_scaling=[1]), 'field "rope_scaling" must be a JSON object, got [1]'),
        (dict(LLAMA, num_key_value_heads=3),
         '"num_attention_heads" (4) is not a multiple of "num_key_value_heads" (3)'),
        (dict(LLAMA, hidden_size=66), '"hidden_size" (66) is not a multiple of "num_attention_heads" (4)'),
        ({k: v for k, v in LLAMA.items() if k != "model_type"}, 'field "model_type" is missing; set it to "opt"'),
        (dict(opt, activation_function="gelu"), 'field "activation_function" must be "relu"'),
        ({k: v for k, v in opt.items() if k != "ffn_dim"}, 'field "ffn_dim" is missing (a positive integer, required '
                                                            'for model_type "opt")'),
        ([LLAMA], "expected a JSON object of model settings, got list"),
    ]
    for hf, why in cases:
        with pytest.raises(CheckpointConfigError) as e:
            from_hf_config(hf, source="/x/config.json")
        assert str(e.value).startswith("/x/config.json") and why in str(e.value), (hf, str(e.value))


def test_run_removes_folders_of_killed_runs_before_its_disk_preflight(tiny, tmp_path):
    """The preflight measures the offload root's free space: folders of killed runs are removed first, or their
    bytes could make it refuse the run that would remove them."""
    ckpt, env = tiny
    off = tmp_path / "off"
    stale = off / "flexgen_h2o-123-0123abcd"          # a lock file nobody holds: its run was killed
    stale.mkdir(parents=True)
    (stale / ".lock").write_text("123\n")
    (stale / "000001-kv.npy").write_bytes(b"0" * 1000)
    proc = run_main(["--model", str(ckpt), "--prompt", "hello", "--gen-len", "3", "--percent", "100", "0", "0", "0",
                     "100", "0", "--offload-dir", str(off), "--no-progress"], env,
                    merged=True)                                    # one stream, in the order printed
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    swept = f"offload dir: removed 1 folder(s) left by dead runs (1004 B) under {off}"
    assert lines.count(swept) == 1
    assert lines.index(swept) < next(i for i, x in enumerate(lines) if x.startswith("preflight:"))
    assert not stale.exists() and list(off.iterdir()) == []              # and this run's own folder is gone too
