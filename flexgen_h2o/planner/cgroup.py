"""The RAM a container gives this process: its memory cgroup's limit, which psutil does not see.

A job under Docker, Kubernetes or Slurm (or `systemd-run -p MemoryMax=`) runs in a memory cgroup: past its limit
the kernel reclaims the group's page cache and then kills, whatever the machine has free. psutil reports the
machine's memory, so a planner that trusts it alone plans for RAM the job cannot have. This reads the limits of
the process's cgroup and its ancestors (v1 `memory.limit_in_bytes`, v2 `memory.max`) and what each already uses
(less its clean file cache, which the kernel reclaims before it kills, as the machine's MemAvailable counts it;
counting only the inactive part would charge the page cache of earlier runs' weight files to the job).
"""
from __future__ import annotations

from pathlib import Path

UNLIMITED = 1 << 60          # v1 writes "no limit" as a page-rounded 2**63


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


V1_FILE_KEYS = ("total_active_file", "total_inactive_file", "total_dirty", "total_writeback")
V2_FILE_KEYS = ("active_file", "inactive_file", "file_dirty", "file_writeback")


def _clean_file_cache(stat: Path, keys: tuple[str, str, str, str]) -> int:
    """A group's file pages (active and inactive) less the dirty ones and those under writeback."""
    active, inactive, dirty, writeback = (_stat(stat, k) for k in keys)
    return max(0, active + inactive - dirty - writeback)


def _groups(proc_cgroup: Path, fs_root: Path) -> list[tuple[Path, str]]:
    """(folder, version) of the process's memory cgroup and every ancestor up to the mount's root."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, version = fs_root / "memory", "v1"
            break
    else:
        v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
        if not v2 or not (fs_root / "cgroup.controllers").exists():
            return []
        base, version, rel = fs_root, "v2", v2[0]
    out, folder = [], base / rel.lstrip("/")
    while True:
        if folder.is_dir():
            out.append((folder, version))
        if folder == base or base not in folder.parents:
            return out
        folder = folder.parent


def cgroup_ram(proc_cgroup: str | Path = "/proc/self/cgroup",
               fs_root: str | Path = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(limit, available) bytes of the tightest memory cgroup over this process, or None when none limits it."""
    best: tuple[int, int] | None = None
    for folder, version in _groups(Path(proc_cgroup), Path(fs_root)):
        if version == "v1":
            limit = _read_int(folder / "memory.limit_in_bytes")
            used = _read_int(folder / "memory.usage_in_bytes")
            reclaimable = _clean_file_cache(folder / "memory.stat", V1_FILE_KEYS)
        else:
            limit = _read_int(folder / "memory.max")
            used = _read_int(folder / "memory.current")
            reclaimable = _clean_file_cache(folder / "memory.stat", V2_FILE_KEYS)
        if limit is None:
            continue
        available = max(0, limit - max(0, (used or 0) - reclaimable))
        if best is None or available < best[1]:
            best = (limit, available)
    return best
