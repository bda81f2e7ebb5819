"""memory/: the bytes. Tiers (compute, host, disk) and their byte accounting, the TieredTensor handles they hand
out, one-slot ValueHolders for the schedule's buffers, the copy lanes the executor runs staging jobs on
(`Transfer`), and the offload folder's hygiene (a private per-run folder, stale-folder sweep, space check).

Level 1 of the import rules (`docs/architecture.md`): imports only torch, numpy, the stdlib and `backend/`.
"""
from .holder import HolderStateError, ValueHolder
from .offload_dir import DiskSpaceError, OffloadDir, OffloadDirError, check_space
from .tensor import TieredTensor
from .tier import (ComputeTier, DiskFullError, DiskTier, HostTier, Tier, TierFullError, drop_file_cache,
                   release_free_heap)
from .transfer import Transfer

__all__ = [
    "ComputeTier", "DiskFullError", "DiskSpaceError", "DiskTier", "HolderStateError", "HostTier", "OffloadDir",
    "OffloadDirError", "Tier", "TierFullError", "TieredTensor", "Transfer", "ValueHolder", "check_space",
    "drop_file_cache",
    "release_free_heap",
]
