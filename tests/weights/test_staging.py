"""Staging buffers (reuse and accounting on the compute tier) and row lookups of offloaded embedding tables."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flexgen_h2o.backend import get_backend
from flexgen_h2o.memory import ComputeTier
from flexgen_h2o.weights.staging import RowLookup, StagingPool, file_rows, host_rows


def test_pool_reuses_buffers_and_charges_the_compute_tier():
    tier = ComputeTier(get_backend("cpu"))
    pool = StagingPool(tier, reuse=True)
    a = pool.take((64, 32), torch.float32)
    b = pool.take((64, 32), torch.float32)
    assert tier.current_bytes == 2 * 64 * 32 * 4 and pool.lent_count == 2
    pool.give(a)
    c = pool.take((64, 32), torch.float32)
    assert c.data_ptr() == a.data_ptr()                      # the same memory, no new allocation
    assert tier.current_bytes == tier.peak_bytes == 2 * 64 * 32 * 4
    pool.give(torch.zeros(3))                                # not lent by the pool: ignored
    pool.give(b)
    pool.give(c)
    pool.clear()
    assert tier.current_bytes == 0 and pool.lent_count == 0


def test_pool_without_reuse_frees_at_once():
    tier = ComputeTier(get_backend("cpu"))
    pool = StagingPool(tier, reuse=False)
    pool.give(pool.take((10,), torch.float16))
    assert tier.current_bytes == 0 and tier.peak_bytes == 20


def _table_file(tmp_path, rows=50, width=6, offset=128):
    table = np.arange(rows * width, dtype=np.float16).reshape(rows, width)
    path = tmp_path / "table.bin"
    path.write_bytes(b"\x00" * offset + table.tobytes())
    return table, path, offset


def test_file_rows_reads_runs_and_single_rows(tmp_path):
    table, path, offset = _table_file(tmp_path)
    ids = torch.tensor([0, 1, 2, 7, 30, 31, 49])
    rows = file_rows(path, offset, table.shape)(ids)
    np.testing.assert_array_equal(rows.numpy(), table[ids.numpy()])
    with pytest.raises(IndexError, match="out of range for an embedding table of 50 rows"):
        file_rows(path, offset, table.shape)(torch.tensor([3, 50]))


@pytest.mark.parametrize("source", ["file", "host"])
def test_row_lookup_gathers_any_id_shape_and_counts_only_distinct_rows(tmp_path, source):
    table, path, offset = _table_file(tmp_path)
    read = file_rows(path, offset, table.shape) if source == "file" else host_rows(torch.from_numpy(table))
    counted = []
    lookup = RowLookup(table.shape, read, torch.device("cpu"), counted.append)
    ids = torch.tensor([[4, 9, 4], [0, 49, 9]])
    out = lookup.lookup(ids)
    assert out.shape == (2, 3, 6) and out.dtype == torch.float16
    np.testing.assert_array_equal(out.numpy(), table[ids.numpy()])
    assert counted == [4 * 6 * 2]                            # rows 0, 4, 9, 49
