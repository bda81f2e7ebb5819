"""The RAM a container allows (planner/cgroup.py): a memory cgroup's limit less what the group uses, the tightest
over the process's group and its ancestors, v1 and v2; no limit, no cap."""
from __future__ import annotations

from pathlib import Path

from flexgen_h2o.planner.cgroup import cgroup_ram
from flexgen_h2o.planner.preflight import Machine

GIB = 1 << 30


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_v1_takes_the_tightest_group_and_counts_clean_file_cache_as_free(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/jobs/one\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "memory", memory_limit_in_bytes=str(9223372036854771712), memory_usage_in_bytes=str(5 * GIB))
    _write(root / "memory/jobs", memory_limit_in_bytes=str(8 * GIB), memory_usage_in_bytes=str(5 * GIB),
           memory_stat=f"cache 1\ntotal_inactive_file {GIB // 2}\ntotal_active_file {GIB}\ntotal_dirty {GIB // 4}\n"
                       f"total_writeback {GIB // 4}\n")
    _write(root / "memory/jobs/one", memory_limit_in_bytes=str(4 * GIB), memory_usage_in_bytes=str(GIB),
           memory_stat="total_inactive_file 0\n")
    # jobs/one: 4 - 1 = 3 GiB; jobs: 8 - (5 - (1.5 - 0.5 dirty or under writeback)) = 4 GiB; the root: no limit
    assert cgroup_ram(proc, root) == (4 * GIB, 3 * GIB)
    _write(root / "memory/jobs", memory_usage_in_bytes=str(7 * GIB))          # the parent is now the tighter
    assert cgroup_ram(proc, root) == (8 * GIB, 2 * GIB)


def test_v2_reads_memory_max_and_max_means_no_limit(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job\n")
    root = tmp_path / "fs"
    _write(root, cgroup_controllers="memory cpu\n")
    _write(root / "user.slice", memory_max="max\n", memory_current=str(GIB))
    _write(root / "user.slice/job", memory_max=str(2 * GIB), memory_current=str(GIB // 2),
           memory_stat=f"anon 5\ninactive_file {GIB // 8}\nactive_file {GIB // 8}\nfile_dirty 0\n")
    assert cgroup_ram(proc, root) == (2 * GIB, 2 * GIB - GIB // 4)
    _write(root / "user.slice/job", memory_max="max\n")
    assert cgroup_ram(proc, root) is None
    assert cgroup_ram(tmp_path / "missing", root) is None


def test_the_preflight_machine_is_capped_by_the_cgroup(monkeypatch):
    import sys
    preflight = sys.modules[Machine.__module__]      # the package exports a function of the module's name
    free = Machine.probe()
    monkeypatch.setattr(preflight, "cgroup_ram", lambda: (3 * GIB, GIB))
    capped = Machine.probe()
    assert (capped.ram_total, capped.ram_available) == (min(3 * GIB, free.ram_total), min(GIB, free.ram_available))
