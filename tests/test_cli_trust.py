"""The CLI against the holes a new user found (issue 50), in-process on the tiny checkpoint: empty stop strings
and prompts, the help texts, a rerun with other settings, a full disk mid-job, batch mode's run-window RSS, and
preflight terms that add up to their need."""
from __future__ import annotations

import errno
import json
import os

import pytest

from flexgen_h2o import run
from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.frontends.cli import build_parser
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import PRESETS
from flexgen_h2o.planner.preflight import Machine, checks
from flexgen_h2o.planner.memory import estimate

GIB = 1 << 30


def _main(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = run.main(argv)
    except SystemExit as e:                    # argparse's refusals exit from the parser
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _batch(tmp_path, n: int = 2):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"Hello number {i}", "id": f"q{i}"}) + "\n" for i in range(n)))
    return inp


@pytest.fixture()
def home(tiny, monkeypatch):
    ckpt, env = tiny
    monkeypatch.setenv("FLEXGEN_H2O_HOME", env["FLEXGEN_H2O_HOME"])
    return ckpt


def test_an_empty_stop_string_or_prompt_is_one_error_line(tmp_path, capsys):
    rc, out, err = _main(capsys, ["--stop", "", "--prompt", "hi"])
    assert (rc, out, err) == (2, "", "error: argument --stop: an empty stop string is not allowed (see --help)\n")
    rc, out, err = _main(capsys, ["--prompt", ""])
    assert (rc, out, err) == (2, "", "error: argument --prompt: an empty prompt is not allowed (see --help)\n")
    # a request line may carry stops (OpenAI's body.stop): an empty one is refused there too, before any model
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x", "stop": ""}}) + "\n")
    rc, out, err = _main(capsys, ["--model", "no-such-model", "--input", str(inp), "--output",
                                  str(tmp_path / "o.jsonl")])
    assert rc == 2 and err == f"error: {inp}: line 1: body.stop must be a string or a list of non-empty strings\n"


def test_help_says_what_each_generation_flag_does_and_its_default():
    text = " ".join(build_parser().format_help().split())
    for flag, says in (("--top-p TOP_P", "nucleus sampling"), ("--seed SEED", "sampling seed (default 0)"),
                       ("--gpu-batch-size GPU_BATCH_SIZE", "(default 4)"), ("--temperature TEMPERATURE", "0 (default)"),
                       ("--hh-ratio HH_RATIO", "of each prompt's own length")):
        assert f"{flag} " in text and says in text.split(f"{flag} ", 1)[1][:200], flag
    assert "as the H2O FlexGen port" not in text


def test_a_rerun_with_other_settings_is_refused_and_overwrite_starts_over(home, tmp_path, capsys):
    inp, real, alias = _batch(tmp_path), tmp_path / "real.jsonl", tmp_path / "alias.jsonl"
    alias.symlink_to(real)
    base = ["--model", str(home), "--input", str(inp), "--output", str(alias), "--no-progress", "--gen-len", "4"]
    rc, out, err = _main(capsys, [*base, "--metrics-json", str(tmp_path / "m.json")])
    assert rc == 0, err
    assert alias.is_symlink() and len(real.read_text().splitlines()) == 2         # written through the link
    settings = json.loads((tmp_path / "real.jsonl.settings.json").read_text())
    assert (settings["gen_len"], settings["policy"], settings["device"]) == (4, "full", "cpu")
    assert not {"gpu_batch_size", "percent", "offload_dir"} & set(settings)       # what never changes a text
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["peak_rss_bytes"] >= metrics["peak_rss_run_bytes"] > 10 << 20   # batch mode fills it too
    before = real.read_text()
    rc, out, err = _main(capsys, [*base, "--gen-len", "6", "--hh-ratio", "0.5"])
    assert rc == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"error: --output {alias} was made with other settings (--gen-len (the default "
                          "max_new_tokens) was 4, now 6, --hh-ratio was none, now 0.5, --policy / --h2o-variant / "
                          "--full-cache was \"full\", now \"h2o\")") and "pass --overwrite to start over" in err
    assert real.read_text() == before
    # placement and the block cut do not change a text: the same job, nothing to do
    rc, out, err = _main(capsys, [*base, "--gpu-batch-size", "1", "--num-gpu-batches", "2", "--percent", "100", "0",
                                  "0", "100", "100", "0"])
    assert rc == 0 and "nothing to do" in out, err
    rc, out, err = _main(capsys, [*base, "--gen-len", "6", "--overwrite"])
    assert rc == 0, err
    assert json.loads((tmp_path / "real.jsonl.settings.json").read_text())["gen_len"] == 6 and alias.is_symlink()


def test_a_full_disk_mid_job_leaves_whole_lines_and_the_rerun_resumes(home, tmp_path, capsys, monkeypatch):
    inp, out = _batch(tmp_path), tmp_path / "out.jsonl"
    args = ["--model", str(home), "--input", str(inp), "--output", str(out), "--no-progress", "--gen-len", "3",
            "--gpu-batch-size", "1", "--no-refill"]
    real_write, writes = os.write, []

    def write(fd, data):                       # the output's second block: half of it lands, then ENOSPC
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(out):
            writes.append(len(data))
            if len(writes) == 2:
                real_write(fd, bytes(data[:len(data) // 2]))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", write)
    rc, _, err = _main(capsys, args)
    monkeypatch.undo()
    assert rc == 2 and err == (f"error: cannot write {out}: No space left on device; the lines already in it are whole "
                               "and kept: make room (or fix the cause) and rerun the same command to resume the job\n")
    text = out.read_text()
    assert text.endswith("\n") and len(text.splitlines()) == 1                 # no torn line
    rc, stdout, err = _main(capsys, args)
    assert rc == 0 and f"resuming {out}: 1 of 2 ids already done" in stdout, err
    assert "dropped a torn last line" not in stdout and len(out.read_text().splitlines()) == 2


def test_the_disk_and_gpu_lines_list_every_term_of_their_need(tmp_path):
    cfg = PRESETS["opt-1.3b"]
    off = OffloadPolicy.from_percent([100, 0, 0, 0, 100, 0])            # KV on disk
    est = estimate(cfg, off, EvictionConfig(), prompt_len=512, gen_len=32, compute_dtype_bytes=2)
    machine = Machine(ram_available=64 * GIB, ram_total=64 * GIB, device_free=64 * GIB, device_total=80 * GIB)
    results = checks(est, machine, offload_root=tmp_path)
    assert [c.resource.split(" ")[0] for c in results] == ["GPU", "RAM", "disk"]
    for c in results:
        assert c.need == sum(c.parts.values()), (c.resource, c.need, c.parts)
    assert results[2].parts["headroom"] > 0 and results[0].parts["headroom"] > 0
