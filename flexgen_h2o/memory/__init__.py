"""memory/: the bytes. Tier handles, the one copy primitive, staging slots and offload-dir hygiene.

Level 1 of the import rules (LAYOUT.md §8.3): imports only torch, numpy, the stdlib and `backend/`.
"""
from .holder import HolderStateError, ValueHolder, holder_grid
from .offload_dir import DiskSpaceError, OffloadDir, OffloadDirError, check_space
from .tensor import DiskFile, Index, MixedTensor, Segment, TieredTensor, normalize_index, split_sizes
from .tier import (ComputeTier, DiskFullError, DiskTier, HostTier, MixedTier, Tier, TierFullError,
                   drop_file_cache, drop_page_cache)
from .transfer import CopyHandle, Transfer, TransferTimeoutError

__all__ = [
    "ComputeTier", "CopyHandle", "DiskFile", "DiskFullError", "DiskSpaceError", "DiskTier", "HolderStateError",
    "HostTier", "Index", "MixedTensor", "MixedTier", "OffloadDir", "OffloadDirError", "Segment", "Tier",
    "TierFullError", "TieredTensor", "Transfer", "TransferTimeoutError", "ValueHolder", "check_space",
    "drop_file_cache", "drop_page_cache", "holder_grid", "normalize_index", "split_sizes",
]
