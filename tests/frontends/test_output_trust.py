"""The batch output against what a new user tried (issue 50): a symlinked --output, a disk that fills up mid
write, and a rerun with other settings, for one process (ResultsFile) and for torchrun's parts (DistributedJob).
All in-process, on the output files alone: no model."""
from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass

import pytest

from flexgen_h2o.config import ConfigError
from flexgen_h2o.frontends.jsonl import OutputLock, OutputWriteError, ResultsFile
from flexgen_h2o.frontends.parts import DistributedJob, existing_parts, part_path
from flexgen_h2o.frontends.requests import Request
from flexgen_h2o.frontends.settings import check_settings, save_settings, settings_path

SETTINGS = {"version": 1, "model": "tiny", "gen_len": 8, "policy": "full", "hh_ratio": None, "stop": []}


def _reqs(n: int) -> list[Request]:
    return [Request(f"r{i}", f"prompt {i}", 4, i + 1) for i in range(n)]


def _rec(req: Request, text: str = "t") -> dict:
    return {"id": req.id, "prompt": req.prompt, "text": text, "finish_reason": "length", "prompt_tokens": 2,
            "completion_tokens": 1, "token_ids": [5]}


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# --- a. a symlinked output is that output ---

def test_an_alias_of_the_output_takes_its_lock_and_the_rewrite_keeps_the_link(tmp_path):
    real, alias = tmp_path / "real.jsonl", tmp_path / "alias.jsonl"
    real.write_text("")
    alias.symlink_to(real)
    with OutputLock(real):
        with pytest.raises(ConfigError, match=f"--output {alias} is in use by another run .* holds {real}.lock"):
            OutputLock(alias).acquire()
    reqs = _reqs(2)
    out = ResultsFile(alias, settings=SETTINGS)
    out.load(reqs)
    out.append([_rec(reqs[1])])
    out.append([_rec(reqs[0])])
    out.finalize(reqs)                                   # the input-order rewrite: temporary file and a rename
    assert alias.is_symlink() and os.readlink(alias) == str(real)
    assert [r["id"] for r in _lines(real)] == ["r0", "r1"]
    # the settings record and the parts of torchrun's ranks sit beside the real file, whichever name is used
    assert settings_path(alias) == settings_path(real) == tmp_path / "real.jsonl.settings.json"
    assert part_path(alias, 1) == tmp_path / "real.jsonl.rank1.part"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.jsonl", "real.jsonl", "real.jsonl.settings.json"]


# --- d. a failing write leaves whole lines and says the job resumes ---

def _fail_after(monkeypatch, nbytes: int) -> None:
    """os.write writes `nbytes` of what it is given, then the disk is full (ENOSPC), as a real device does."""
    real_write = os.write

    def write(fd, data):
        if nbytes:
            real_write(fd, bytes(data[:nbytes]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_mid_write_leaves_whole_lines_and_names_the_file(tmp_path, monkeypatch):
    reqs = _reqs(3)
    path = tmp_path / "out.jsonl"
    out = ResultsFile(path)
    out.load(reqs)
    out.append([_rec(reqs[0])])
    before = path.read_bytes()
    _fail_after(monkeypatch, 25)                         # half a line reaches the file, then ENOSPC
    with pytest.raises(OutputWriteError) as e:
        out.append([_rec(reqs[1]), _rec(reqs[2])])
    monkeypatch.undo()
    assert path.read_bytes() == before and before.endswith(b"\n")             # cut back to the last whole line
    assert str(e.value) == (f"cannot write {path}: No space left on device; the lines already in it are whole and "
                            "kept: make room (or fix the cause) and rerun the same command to resume the job")
    assert set(out.done) == {reqs[0].key}                # the failed block is not counted as done
    again = ResultsFile(path)
    assert again.load(reqs) == 1 and not again.repaired


def test_a_full_disk_at_the_final_rewrite_keeps_the_old_file(tmp_path, monkeypatch):
    reqs = _reqs(2)
    path = tmp_path / "out.jsonl"
    out = ResultsFile(path)
    out.load(reqs)
    out.append([_rec(reqs[1]), _rec(reqs[0])])
    before = path.read_bytes()
    real_fsync = os.fsync

    def fsync(fd):                                       # the temporary file's data does not fit
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OutputWriteError, match=f"cannot write {path}: No space left on device;.*rerun the same"):
        out.finalize(reqs)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


# --- e. the settings that change answers ---

def test_settings_are_recorded_before_the_first_line_and_a_resume_with_others_is_refused(tmp_path):
    reqs = _reqs(2)
    path = tmp_path / "out.jsonl"
    out = ResultsFile(path, settings=SETTINGS)
    assert out.load(reqs) == 0 and not settings_path(path).exists()     # nothing written before a result
    out.append([_rec(reqs[0])])
    assert json.loads(settings_path(path).read_text()) == SETTINGS
    other = dict(SETTINGS, gen_len=24, hh_ratio=0.5)
    with pytest.raises(ConfigError) as e:
        ResultsFile(path, settings=other).load(reqs)
    assert str(e.value) == (f"--output {path} was made with other settings (--gen-len (the default max_new_tokens) "
                            "was 8, now 24, --hh-ratio was none, now 0.5); rerun with its settings to resume it, use "
                            "another --output, or pass --overwrite to start over")
    assert ResultsFile(path, settings=dict(SETTINGS)).load(reqs) == 1            # the same settings resume
    # --overwrite: the old file is cut when the first block lands, and the new record written before that block
    fresh = ResultsFile(path, overwrite=True, settings=other)
    assert fresh.load(reqs) == 0 and json.loads(settings_path(path).read_text()) == SETTINGS
    fresh.append([_rec(reqs[1], "new")])
    assert json.loads(settings_path(path).read_text()) == other and [r["text"] for r in _lines(path)] == ["new"]


def test_an_output_from_before_the_record_resumes_and_a_stale_record_without_results_is_replaced(tmp_path):
    reqs = _reqs(2)
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps(_rec(reqs[0])) + "\n")           # made before settings were recorded
    out = ResultsFile(path, settings=SETTINGS)
    assert out.load(reqs) == 1
    out.append([_rec(reqs[1])])
    assert json.loads(settings_path(path).read_text()) == SETTINGS
    assert check_settings(path, SETTINGS) is True
    empty = tmp_path / "empty.jsonl"                            # a record but no result: nothing to protect
    save_settings(empty, dict(SETTINGS, gen_len=99))
    out = ResultsFile(empty, settings=SETTINGS)
    assert out.load(reqs) == 0
    out.append([_rec(reqs[0])])
    assert json.loads(settings_path(empty).read_text()) == SETTINGS


@dataclass
class OneRank:
    """torchrun's world reduced to rank 0 alone: its collectives hand values straight back."""
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return True

    def broadcast(self, value):
        return value

    def gather(self, value):
        return [value]


def test_torchrun_parts_resume_under_the_same_settings_check(tmp_path):
    reqs = _reqs(3)
    out = tmp_path / "out.jsonl"
    save_settings(out, SETTINGS)
    part_path(out, 1).write_text(json.dumps(_rec(reqs[2])) + "\n")    # a rank's block from a killed job
    job = DistributedJob(OneRank(), str(out), overwrite=False, read=lambda: reqs,
                         settings=dict(SETTINGS, stop=["END"]))
    with pytest.raises(ConfigError, match=r"was made with other settings \(--stop was \[\], now \[\"END\"\]\)"):
        job.__enter__()
    assert not (tmp_path / "out.jsonl.lock").exists()                 # the refusal released the lock
    with DistributedJob(OneRank(), str(out), overwrite=False, read=lambda: reqs, settings=SETTINGS) as job:
        assert job.done == {reqs[2].key}
    other = dict(SETTINGS, gen_len=3)
    with DistributedJob(OneRank(), str(out), overwrite=True, read=lambda: reqs, settings=other) as job:
        assert job.done == set() and not existing_parts(out)
        assert json.loads(settings_path(out).read_text()) == other     # in place before any rank appends
