"""benchmarks/studies/engine_ab.py: another revision's package beside this one, under its own name."""
import pytest

from benchmarks.common import REPO_ROOT
from benchmarks.studies import engine_ab


def test_the_base_package_is_the_revisions_own_with_its_imports_renamed(tmp_path):
    name = engine_ab.base_package("HEAD", tmp_path)
    tree = tmp_path / name
    engine = (tree / "engine.py").read_text()
    assert "from flexgen_h2o_base.kv" in engine and "from flexgen_h2o." not in engine
    assert not any("import flexgen_h2o." in p.read_text() or "from flexgen_h2o." in p.read_text()
                   for p in tree.rglob("*.py"))
    assert list(tree.rglob("_kernels*.so")) or pytest.skip("no install build of the kernels to copy")


def test_a_revision_whose_kernels_differ_is_refused(tmp_path, monkeypatch):
    """One build serves both trees, so their sources must be the same bytes."""
    here = tmp_path / "repo"
    (here / "flexgen_h2o" / "kernels" / "csrc").mkdir(parents=True)
    (here / "flexgen_h2o" / "kernels" / "csrc" / "bindings.cpp").write_text("// not HEAD's\n")
    real_run = engine_ab.subprocess.run
    monkeypatch.setattr(engine_ab, "REPO_ROOT", here)
    monkeypatch.setattr(engine_ab.subprocess, "run", lambda cmd, **kw: real_run(
        cmd, **{**kw, "cwd": REPO_ROOT} if cmd[:2] == ["git", "archive"] else kw))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(SystemExit, match="compiled kernels differ"):
        engine_ab.base_package("HEAD", scratch)
