"""Batch JSONL: strict input with line numbers, appends of whole lines, resume by id, input-order output."""
from __future__ import annotations

import json
import os

import pytest

from flexgen_h2o.config import ConfigError
from flexgen_h2o.frontends.jsonl import (OutputLock, Request, ResultsFile, check_writable, read_requests,
                                         record)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_requests_ids_defaults_and_blank_lines(tmp_path):
    path = _write(tmp_path / "in.jsonl", ['{"prompt": "a", "id": "x"}', "", '{"prompt": "bb", "max_new_tokens": 3}',
                                          '  ', '{"prompt": "ccc", "id": 0}'])
    reqs = read_requests(path, default_max_new=7)
    assert [(r.id, r.prompt, r.max_new_tokens, r.line) for r in reqs] == [
        ("x", "a", 7, 1), (3, "bb", 3, 3), (0, "ccc", 7, 5)]     # no id: the line number


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "a", ', "not valid JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"text": "a"}', "unknown key(s) 'text'"),
    ('{"prompt": ""}', "\"prompt\" must be a non-empty string"),
    ('{"prompt": 5}', "\"prompt\" must be a non-empty string"),
    ('{"prompt": "a", "id": 1.5}', "\"id\" must be a string or an integer"),
    ('{"prompt": "a", "id": true}', "\"id\" must be a string or an integer"),
    ('{"prompt": "a", "max_new_tokens": 0}', "\"max_new_tokens\" must be an integer >= 1"),
    ('{"prompt": "a", "max_new_tokens": "9"}', "\"max_new_tokens\" must be an integer >= 1"),
    ('{"prompt": "a", "id": "first"}', "id \"first\" was already used on line 1"),
])
def test_bad_line_names_its_number(tmp_path, line, why):
    path = _write(tmp_path / "in.jsonl", ['{"prompt": "ok", "id": "first"}', '{"prompt": "fine"}', line])
    with pytest.raises(ConfigError) as e:
        read_requests(path, 4)
    assert f"{path}: line 3: " in str(e.value) and why in str(e.value)
    assert "\n" not in str(e.value)


def test_ids_that_read_alike_as_text_are_refused(tmp_path):
    # 3 and "3" would be one key to a reader that keys by text (a dict from a CSV, pandas): one id
    path = _write(tmp_path / "in.jsonl", ['{"prompt": "a", "id": 3}', '{"prompt": "b", "id": "3"}'])
    with pytest.raises(ConfigError) as e:
        read_requests(path, 1)
    assert str(e.value) == f'{path}: line 2: id "3" reads as the id 3 of line 1; ids must differ as text'
    # a line without an id takes its line number: an explicit "2" on another line is that id too
    path = _write(tmp_path / "in2.jsonl", ['{"prompt": "a", "id": "2"}', '{"prompt": "b"}'])
    with pytest.raises(ConfigError, match='line 2: id 2 reads as the id "2" of line 1'):
        read_requests(path, 1)
    ok = _write(tmp_path / "ok.jsonl", ['{"prompt": "a", "id": 3}', '{"prompt": "b", "id": "03"}'])
    assert [r.key for r in read_requests(ok, 1)] == ["3", '"03"']          # the key stays the JSON form


def test_empty_input_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no prompts"):
        read_requests(_write(tmp_path / "in.jsonl", ["", " "]), 1)


def test_check_writable(tmp_path):
    check_writable(tmp_path / "new.jsonl", "--output")
    assert not (tmp_path / "new.jsonl").exists() and os.listdir(tmp_path) == []     # the probe left nothing
    with pytest.raises(ConfigError, match="does not exist"):
        check_writable(tmp_path / "missing" / "out.jsonl", "--output")
    with pytest.raises(ConfigError, match="is a directory"):
        check_writable(tmp_path, "--output")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="does not exist"):      # a regular file is no folder
        check_writable(tmp_path / "file" / "out.jsonl", "--output")


def _reqs(n):
    return [Request(f"r{i}", f"prompt {i}", 4, i + 1) for i in range(n)]


def _rec(req, text="t"):
    return record(req, text, [1, 2], "length", 3)


def test_append_load_and_finalize_in_input_order(tmp_path):
    reqs = _reqs(5)
    out = ResultsFile(tmp_path / "out.jsonl")
    assert out.load(reqs) == 0 and not out.path.exists()
    out.append([_rec(reqs[3]), _rec(reqs[1])])             # bucket order, as a run writes it
    lines = out.path.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["r3", "r1"]
    # a second process resumes: it sees two ids done
    again = ResultsFile(out.path)
    assert again.load(reqs) == 2 and set(again.done) == {'"r3"', '"r1"'}
    again.append([_rec(reqs[i]) for i in (4, 0, 2)])
    again.finalize(reqs)
    recs = [json.loads(x) for x in out.path.read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"r{i}" for i in range(5)]
    assert recs[0] == {"id": "r0", "prompt": "prompt 0", "max_new_tokens": 4, "text": "t", "finish_reason": "length",
                       "prompt_tokens": 3, "completion_tokens": 2, "token_ids": [1, 2]}
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    # the rewritten file is readable as the appended one was (mkstemp's own mode is 0600)
    assert os.stat(out.path).st_mode & 0o777 == 0o644


def test_finalize_refuses_missing_ids(tmp_path):
    reqs = _reqs(2)
    out = ResultsFile(tmp_path / "out.jsonl")
    out.append([_rec(reqs[0])])
    with pytest.raises(RuntimeError, match="r1"):
        out.finalize(reqs)


def test_torn_last_line_is_dropped_and_redone(tmp_path):
    reqs = _reqs(3)
    path = tmp_path / "out.jsonl"
    whole = json.dumps(_rec(reqs[0])) + "\n"
    path.write_text(whole + json.dumps(_rec(reqs[1]))[:25])        # a crash mid-line (power cut)
    out = ResultsFile(path)
    assert out.load(reqs) == 1 and out.repaired
    assert path.read_text() == whole                               # only whole lines remain
    out.append([_rec(reqs[1]), _rec(reqs[2])])
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["r0", "r1", "r2"]


@pytest.mark.parametrize("content, why", [
    ('{"id": "zz", "prompt": "p", "text": ""}\n', "not in the input"),
    ('{"id": "r0", "prompt": "other", "text": ""}\n', "different prompt"),
    # the line's own max_new_tokens changed since: its answer would differ (a line without the field: before it
    # was recorded, resumed as it is)
    ('{"id": "r0", "prompt": "prompt 0", "max_new_tokens": 9, "text": ""}\n', "different prompt or max_new_tokens"),
    ('garbage\n', "line 1 is not a result line"),
    ('{"prompt": "prompt 0"}\n', "line 1 is not a result line"),
])
def test_resume_refuses_foreign_output(tmp_path, content, why):
    path = tmp_path / "out.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=why):
        ResultsFile(path).load(_reqs(2))
    assert path.read_text() == content                              # untouched


def test_overwrite_truncates_only_when_the_first_block_lands(tmp_path):
    reqs = _reqs(2)
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps(_rec(reqs[0], "old")) + "\n")
    out = ResultsFile(path, overwrite=True)
    assert out.load(reqs) == 0
    assert "old" in path.read_text()                                # still there until a result exists
    out.append([_rec(reqs[1], "new")])
    out.append([_rec(reqs[0], "new")])
    assert [json.loads(x)["text"] for x in path.read_text().splitlines()] == ["new", "new"]


def test_output_lock_refuses_a_second_holder_and_is_removed_on_release(tmp_path):
    out = tmp_path / "out.jsonl"
    first = OutputLock(out).acquire()
    lock = tmp_path / "out.jsonl.lock"
    assert lock.read_text() == f"{os.getpid()}\n"
    with pytest.raises(ConfigError) as e:          # a second open file is a second holder, even in one process
        OutputLock(out).acquire()
    assert str(e.value) == (f"--output {out} is in use by another run (pid {os.getpid()} holds {lock}); "
                            "wait for it to finish or pick another --output")
    assert lock.read_text() == f"{os.getpid()}\n"  # the refused one leaves the holder's file alone
    first.release()
    assert not lock.exists() and not out.exists()
    first.release()                                # idempotent
    with OutputLock(out):                          # free again
        assert lock.exists()
    assert not lock.exists()


def test_output_lock_takes_over_a_lock_file_nobody_holds(tmp_path):
    lock = tmp_path / "out.jsonl.lock"
    lock.write_text("999999999\n")                # left by a killed run: the file is there, its flock is not
    with OutputLock(tmp_path / "out.jsonl"):
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists()


def test_a_line_from_before_max_new_tokens_was_recorded_resumes(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "r0", "prompt": "prompt 0", "text": "", "token_ids": []}\n')
    assert ResultsFile(path).load(_reqs(2)) == 1
