"""The Hub path offline and the convert CLI: clear one-line errors, exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from flexgen_h2o.convert import main
from flexgen_h2o.weights import WeightStoreError, download_and_convert

NO_REPO = "flexgen-h2o-test/no-such-repo"


def test_hub_offline_fails_fast_and_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(WeightStoreError) as err:
        download_and_convert(NO_REPO, tmp_path / "store", progress=False)
    msg = str(err.value)
    assert "not converted and cannot be downloaded" in msg and NO_REPO in msg
    assert "python -m flexgen_h2o.convert /path/to/hf_folder --model NAME" in msg and "--dummy-weights" in msg
    assert time.time() - t0 < 10 and not (tmp_path / "store").exists()


@pytest.mark.parametrize("argv, pattern", [
    ([], "the following arguments are required: SRC"),
    (["/no/such/folder"], "checkpoint not found: /no/such/folder"),
    (["no-such-model"], "unknown model 'no-such-model'"),
    ([NO_REPO], "cannot be downloaded"),
    (["opt-125m", "--model", "bogus"], "unknown model 'bogus'"),
])
def test_cli_errors_in_process(argv, pattern, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--out", str(tmp_path / "store"), "--quiet"] if argv else argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and pattern in err


def test_cli_subprocess_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, "-m", "flexgen_h2o.convert", str(tmp_path / "missing.gguf")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: checkpoint not found: {tmp_path / 'missing.gguf'}"]
