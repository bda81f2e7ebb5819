"""block_schedule as pure data: the zig-zag order and the ordering guarantees the executor relies on."""
from __future__ import annotations

from collections import Counter
from itertools import product

import pytest

from flexgen_h2o.schedule.zigzag import Op, Step, block_schedule

SIZES = [(1, 1, 1), (1, 3, 1), (2, 1, 3), (3, 2, 1), (2, 4, 2), (3, 5, 4), (4, 3, 3)]
ORDERS = [False, True]


def _steps(n_tokens, n_layers, n_batches, overlap):
    return list(block_schedule(n_tokens, n_layers, n_batches, overlap=overlap))


def _index(steps, op):
    """(i, j, k) -> position of that op; per-layer ops are keyed (i, j). Fails on duplicates."""
    where = {}
    for pos, s in enumerate(steps):
        if s.op is not op:
            continue
        key = (s.token, s.layer) if op in (Op.LOAD_WEIGHT, Op.FREE_WEIGHT) else (s.token, s.layer, s.batch)
        assert key not in where, f"{op} {key} appears twice"
        where[key] = pos
    return where


def _next(i, j, k, n_layers, n_batches):
    """The (i, j, k) that follows in zig-zag order (batch innermost)."""
    k += 1
    if k == n_batches:
        k, j = 0, j + 1
    if j == n_layers:
        j, i = 0, i + 1
    return i, j, k


@pytest.mark.parametrize("overlap", ORDERS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_compute_is_zigzag_and_exactly_once(size, overlap):
    n_t, n_l, n_b = size
    steps = _steps(*size, overlap)
    computes = [(s.token, s.layer, s.batch) for s in steps if s.op is Op.COMPUTE]
    # lexicographic (i, j, k): every batch of a layer before the next layer, batch innermost
    assert computes == list(product(range(n_t), range(n_l), range(n_b)))
    assert all(isinstance(s, Step) and 0 <= s.token < n_t and 0 <= s.layer < n_l for s in steps)
    assert all(s.batch == -1 for s in steps if s.op in (Op.LOAD_WEIGHT, Op.FREE_WEIGHT))


@pytest.mark.parametrize("overlap", ORDERS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_weights_loaded_once_per_layer_and_freed_after_last_batch(size, overlap):
    n_t, n_l, n_b = size
    steps = _steps(*size, overlap)
    load, free, comp = _index(steps, Op.LOAD_WEIGHT), _index(steps, Op.FREE_WEIGHT), _index(steps, Op.COMPUTE)
    pairs = set(product(range(n_t), range(n_l)))
    assert set(load) == pairs and set(free) == pairs          # exactly once each (duplicates fail in _index)
    for i, j in pairs:
        first, last = comp[i, j, 0], comp[i, j, n_b - 1]
        assert load[i, j] < first, f"weights of ({i},{j}) loaded after its first compute"
        assert free[i, j] > last, f"weights of ({i},{j}) freed before its last batch computed"
        # the weights are not reloaded per batch: all batches of (i, j) run between one load and its free
        assert all(load[i, j] < comp[i, j, k] < free[i, j] for k in range(n_b))
    # one holder per layer: on layer j, loads and frees alternate (load, free, load, free, ...). With a single
    # schedule layer the overlapped order prefetches token i+1's copy before freeing token i's; the engine
    # always has >= 2 schedule layers (embed, head).
    for j in range(n_l if (n_l >= 2 or not overlap) else 0):
        seq = [s.op for s in steps if s.op in (Op.LOAD_WEIGHT, Op.FREE_WEIGHT) and s.layer == j]
        assert seq == [Op.LOAD_WEIGHT, Op.FREE_WEIGHT] * n_t
    # at most one staged layer in plain order, two (current + prefetched next) when overlapped
    live, peak = 0, 0
    for s in steps:
        live += {Op.LOAD_WEIGHT: 1, Op.FREE_WEIGHT: -1}.get(s.op, 0)
        peak = max(peak, live)
    assert live == 0
    assert peak <= (2 if overlap else 1)
    # in one token step, each layer's weights cross the link once, whatever the number of batches
    assert Counter(s.token for s in steps if s.op is Op.LOAD_WEIGHT) == {i: n_l for i in range(n_t)}


@pytest.mark.parametrize("overlap", ORDERS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_kv_load_before_and_store_after_compute(size, overlap):
    n_t, n_l, n_b = size
    steps = _steps(*size, overlap)
    every = set(product(range(n_t), range(n_l), range(n_b)))
    load, comp, store = _index(steps, Op.LOAD_KV), _index(steps, Op.COMPUTE), _index(steps, Op.STORE_KV)
    hidden = _index(steps, Op.LOAD_HIDDEN)
    assert set(load) == every and set(store) == every      # each exactly once: no (i, j, k) stored twice
    for key in every:
        assert load[key] < comp[key] < store[key]
        assert hidden[key] < comp[key]
    # one-slot holders per (layer, batch): token i's staged KV is consumed before token i+1's is staged, and
    # token i's update is sent home before token i+1 computes (needs >= 2 slots per token step overlapped)
    if not overlap or n_l * n_b >= 2:
        for i, j, k in every:
            if i + 1 < n_t:
                assert comp[i, j, k] < load[i + 1, j, k]
                assert store[i, j, k] < comp[i + 1, j, k]
    # KV committed at token i is home before token i+1 stages it (FIFO kv lane). Holds whenever a token step
    # has >= 3 (layer, batch) slots, which every engine schedule has (embed, >= 1 attention layer, head).
    if n_l * n_b >= 3:
        for i, j, k in every:
            if i + 1 < n_t:
                assert store[i, j, k] < load[i + 1, j, k]
    # the overlapped schedule ends with a SYNC: no transfer is left in flight
    if overlap:
        assert steps[-1].op is Op.SYNC


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_overlapped_prefetches_next_layer_and_next_batch(size):
    n_t, n_l, n_b = size
    steps = _steps(*size, True)
    load_w, load_kv, comp = _index(steps, Op.LOAD_WEIGHT), _index(steps, Op.LOAD_KV), _index(steps, Op.COMPUTE)
    store = _index(steps, Op.STORE_KV)
    for i, j, k in product(range(n_t), range(n_l), range(n_b)):
        ni, nj, nk = _next(i, j, k, n_l, n_b)
        if ni >= n_t:
            continue
        # the next batch's KV (wrapping to the next layer / token) is requested before this batch computes
        assert load_kv[ni, nj, nk] < comp[i, j, k]
        # the previous batch's KV goes home after this batch computes (write-back overlaps compute)
        assert store[i, j, k] > comp[ni, nj, nk]
    for i, j in product(range(n_t), range(n_l)):
        ni, nj = (i, j + 1) if j + 1 < n_l else (i + 1, 0)
        if ni < n_t:
            # the next layer's weights stream in while this layer's first batch computes
            assert load_w[ni, nj] < comp[i, j, 0]
    # the block starts with the first layer's weights and the first batch's KV, then waits for them
    assert [s.op for s in steps[:3]] == [Op.LOAD_WEIGHT, Op.LOAD_KV, Op.SYNC]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_plain_order_has_no_prefetch(size):
    n_t, n_l, n_b = size
    steps = _steps(*size, False)
    load_w, comp = _index(steps, Op.LOAD_WEIGHT), _index(steps, Op.COMPUTE)
    for i, j in product(range(n_t), range(n_l)):
        if (i, j) != (0, 0):
            pi, pj = (i, j - 1) if j else (i - 1, n_l - 1)
            assert load_w[i, j] > comp[pi, pj, n_b - 1]
    assert not any(s.op is Op.SYNC for s in steps)
    # per batch: load KV, load hidden, compute, store KV, store hidden, back to back
    per_batch = [s.op for s in steps if s.batch >= 0]
    assert per_batch == [Op.LOAD_KV, Op.LOAD_HIDDEN, Op.COMPUTE, Op.STORE_KV, Op.STORE_HIDDEN] * (n_t * n_l * n_b)


def test_both_orders_hold_the_same_steps():
    plain = Counter(s for s in _steps(3, 4, 2, False) if s.op is not Op.SYNC)
    over = Counter(s for s in _steps(3, 4, 2, True) if s.op is not Op.SYNC)
    assert plain == over


@pytest.mark.parametrize("size", SIZES)
def test_batch_major_takes_each_batch_through_every_layer_in_turn(size):
    """A pipeline stage's order when its weights are resident: batch k's last layer computes before batch k+1's
    first (so batch k can leave for the next stage), each (layer, batch) exactly once, the zig-zag's steps."""
    n_t, n_l, n_b = size
    steps = list(block_schedule(*size, overlap=True, batch_major=True))
    comp = [(s.token, s.batch, s.layer) for s in steps if s.op is Op.COMPUTE]
    assert comp == list(product(range(n_t), range(n_b), range(n_l)))
    per_batch = [s.op for s in steps if s.batch >= 0]
    assert per_batch == [Op.LOAD_KV, Op.LOAD_HIDDEN, Op.COMPUTE, Op.STORE_KV, Op.STORE_HIDDEN] * (n_t * n_l * n_b)
    plain = Counter(s for s in _steps(*size, False) if s.batch >= 0)
    assert Counter(s for s in steps if s.batch >= 0) == plain


@pytest.mark.parametrize("overlap", ORDERS)
@pytest.mark.parametrize("bad", [(0, 2, 2), (2, 0, 2), (2, 2, 0), (-1, 2, 2), (2, 2, -3)])
def test_rejects_sizes_below_one(bad, overlap):
    # raised on the call itself, not lazily on first iteration
    with pytest.raises(ValueError, match=">= 1"):
        block_schedule(*bad, overlap=overlap)


@pytest.mark.parametrize("overlap", ORDERS)
@pytest.mark.parametrize("batch_major", [False, True])
def test_a_later_start_is_the_same_schedule_shifted(overlap, batch_major):
    """Decoding after a prompt pass that already ran (start=1) is the schedule of the remaining steps, each token
    index moved by start."""
    later = list(block_schedule(6, 3, 2, overlap=overlap, batch_major=batch_major, start=2))
    shifted = [Step(s.op, s.token + 2, s.layer, s.batch)
               for s in block_schedule(4, 3, 2, overlap=overlap, batch_major=batch_major)]
    assert later == shifted and later[0].token == 2
