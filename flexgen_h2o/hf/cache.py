"""H2OCache: a transformers 5.x `Cache` whose layers are the engine's fixed-slot KV caches (kv/cache.py).

Every keep/evict decision comes from flexgen_h2o.kv: the EvictionConfig is resolved into a Budget, the policy
from get_policy ranks the prompt (select_prefill) and picks one victim per (sequence, KV head) after each
decode step (choose_victim), and kv.cache.KVCache owns the slot storage (K, V, fp32 score, true position).
This module only adapts that storage to the order in which transformers calls it:

    update(k, v, layer)   -> prompt: returned as is (attention runs over the prompt itself), kept pending;
                             decode: the new row is written into a free slot and the slot window returned
    attention function    -> computes the output AND the per-key attention mass (hf/attention.py), then
    commit_prefill/decode -> the policy keeps the budget: the prompt is packed into budget + 1 slots, or one
                             victim slot per (b, g) is freed for the next token

The attention function finds the layer through `claim(key)`: `update` leaves a (layer, returned key) pair in a
thread-local, because transformers passes the cache to the attention module but not to the attention function.
"""
from __future__ import annotations

import dataclasses
import threading

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from flexgen_h2o.formats import quant_format
from flexgen_h2o.kernels import resolve as resolve_kernels
from flexgen_h2o.kv import Budget, EvictionConfig, get_policy, policy_for
from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.kv.layouts import kv_cache
from flexgen_h2o.kv.pages import PagedKVCache
from flexgen_h2o.models.layer import KVSpec, KVView, LayerOutput
from flexgen_h2o.models.ops import write_slot

ATTN_NAME = "flexgen_h2o"
NEEDS_ATTENTION = (f"H2OCache needs the attention function that reports attention mass: load the model with "
                   f"attn_implementation='{ATTN_NAME}' or call flexgen_h2o.hf.enable_h2o(model)")
_OPTIONS = {f.name for f in dataclasses.fields(EvictionConfig)}
_ACTIVE = threading.local()          # the layer whose update() returned the tensors now being attended


def claim(key: Tensor) -> H2OLayer | None:
    """The H2O layer that returned `key` from update(), once; None when the key came from another cache."""
    pending = getattr(_ACTIVE, "pending", None)
    if pending is None or pending[1] is not key:
        return None
    _ACTIVE.pending = None
    return pending[0]


class H2OLayer(CacheLayerMixin):
    """One attention layer: a KVCache of budget + 1 slots per (sequence, KV head), allocated at the prompt."""
    is_compileable = False
    is_sliding = False
    is_croppable = False             # evicted tokens are gone: no rollback for assisted decoding

    def __init__(self, owner: H2OCache, index: int = 0):
        super().__init__()
        self.owner, self.index = owner, index
        self.store: KVCache | None = None
        self.seen = 0                # tokens processed, pads included: transformers' sequence length
        self.next_pos: Tensor | None = None     # (b,) true position of each sequence's next token
        self._pending: tuple[Tensor, Tensor] | None = None
        self._write_slot: Tensor | None = None
        self._window = 0             # slots returned by the last decode update

    # --- the CacheLayerMixin protocol ---

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        t = key_states.shape[2]
        if self.store is None:
            self.lazy_initialization(key_states, value_states)
            self._pending = (key_states, value_states)
            self.seen += t
            return key_states, value_states
        if t != 1:
            raise NotImplementedError(f"H2OCache takes the whole prompt in one forward, then one token per step; "
                                      f"got {t} new tokens on a filled cache (chunked prefill, assisted or "
                                      f"speculative decoding are not supported)")
        store, budget = self.store, self.owner.budget
        if budget.capacity <= budget.budget and self.seen + 1 > store.capacity:
            # a non-evicting cache sized by max_new_tokens has no free slot left
            raise RuntimeError(f"H2OCache was sized for max_new_tokens={self.owner.max_new_tokens}; this step "
                               f"would be token {self.seen + 1} of at most {store.capacity}")
        slot = store.free_slots()                                               # (b, g)
        # the position marks the slot valid, so the new token attends to itself like any kept token; a
        # compressed row is written (packed) by commit_decode
        store.place_token(slot, None if store.fmt.quantized else key_states,
                          None if store.fmt.quantized else value_states, self.next_pos)
        s = max(store.n_used, int(slot.max()) + 1)          # never-used slots past s are not even read
        self._pending, self._write_slot, self._window = (key_states, value_states), slot, s
        self.seen += 1
        if not store.fmt.quantized:
            return store.windows(s)
        # a compressed cache: its window dequantized, the new token unrounded (as the engine attends to it)
        k, v = store.values(s, key_states.device, key_states.dtype)
        write_slot(k, slot, key_states)
        write_slot(v, slot, value_states)
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1                    # no limit on the sequence: the cache evicts instead

    def reset(self) -> None:
        self.store, self.keys, self.values, self.next_pos = None, None, None, None
        self.seen, self._pending, self.is_initialized = 0, None, False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("H2OCache cannot roll back tokens: evicted ones are gone (assisted and "
                                  "speculative decoding need a DynamicCache)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._map_batch(lambda x: x[torch.as_tensor(indices, device=x.device)])

    def _map_batch(self, fn) -> None:
        """Apply a batch-dimension map (beam reorder, repeat, select) to the store's per-sequence parts
        (KVCache.map_rows) and to the next positions."""
        if self.store is None:
            return
        self.store.map_rows(fn)
        self.next_pos = fn(self.next_pos)
        self.keys, self.values = self.store.k, self.store.v

    # --- called by the attention function (hf/attention.py) ---

    @property
    def needs_scores(self) -> bool:
        return self.owner.policy.needs_scores

    def slot_mask(self) -> Tensor:
        """(b, g, s) bool: which slots of the window returned by the last update hold a token (the new one too)."""
        return self.store.pos_window(self._window) >= 0

    @property
    def write_slot(self) -> Tensor:
        """(b, g) long: the slot the last update wrote the new token into."""
        return self._write_slot

    def commit_prefill(self, scores: Tensor | None, token_valid: Tensor) -> None:
        """Keep the policy's choice of the prompt rows. scores (b, g, p) fp32 column sums over the real queries
        (None when the policy ranks without them); token_valid (b, p) bool, False for padding."""
        k, v = self._pending
        b, g, p, d = k.shape
        owner = self.owner
        token_pos = torch.where(token_valid, token_valid.long().cumsum(-1) - 1, -1)      # true positions, pads -1
        device = k.device
        pages = owner.eviction.pages
        if pages is not None and self.index < pages.dense_layers:
            pages = None                        # a dense layer reads its whole window
        self.store = kv_cache(KVSpec(g, d), b, owner.budget.capacity, owner.policy, owner.budget, dtype=k.dtype,
                             alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device),
                             generator=owner.generator(device), kernels=owner.kernels, fmt=owner.kv_format,
                             pages=pages, summaries=dict(summary_device=device, summary_dtype=k.dtype))
        self.store.commit_prefill(k, v, scores, token_pos)
        self.next_pos = token_valid.long().sum(-1)
        self.keys, self.values = self.store.k, self.store.v
        self._pending = None

    def select(self, query: Tensor) -> tuple[KVView, Tensor, Tensor] | None:
        """Under page selection (EvictionConfig.pages), the view of the pages this step's query (b, h, 1, d) needs
        (kv/pages.py) and the new token's K and V rows; None for a cache that attends over its whole window."""
        if not isinstance(self.store, PagedKVCache):
            return None
        return self.store.select(query.device, query.dtype, query), *self._pending

    def commit_decode(self, mass: Tensor | None) -> None:
        """Add this step's attention mass (b, g, s) to the scores and free one victim slot per (b, g)."""
        k_new, v_new = self._pending
        st, s = self.store, self._window
        view = KVView(k=k_new, v=v_new, valid=st.pos_window(s) >= 0, write_slot=self._write_slot)   # (k, v unread)
        st.commit_decode(view, LayerOutput(hidden=None, k_new=k_new, v_new=v_new, scores=mass), self.next_pos)
        self.next_pos = self.next_pos + 1
        self._pending = self._write_slot = None

    # --- inspection ---

    @property
    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes

    def kept_positions(self) -> list[list[list[int]]]:
        return [] if self.store is None else self.store.kept_positions()


class H2OCache(Cache):
    """Fixed-size H2O KV cache for `model.generate(..., cache=H2OCache(...))` (transformers 5.24's name for
    the argument; `past_key_values=` still works but warns that it will be removed).

    Pass an EvictionConfig, or its fields as keywords (policy defaults to "h2o"):
        H2OCache(hh_size=64, recent_size=64)                    # 64 heavy hitters + 64 recent per KV head
        H2OCache(hh_ratio=0.1)                                   # 10 % + 10 % of the (padded) prompt length
        H2OCache(EvictionConfig(policy="h2o-port", hh_ratio=0.1, sink_size=4, score_reduce="mean"))
    max_new_tokens (optional) caps the slots at prompt + max_new_tokens, as the engine does; it is required
    for policy "full". query_chunk: prompt queries per block when scoring (memory ~ b * heads * chunk * prompt).
    kv_bits 4 or 8 stores K and V group-wise quantized (group_size values per group along head_dim, FlexGen's
    --compress-cache); attention reads them dequantized, the new token's own row unrounded.
    """

    def __init__(self, eviction: EvictionConfig | None = None, *, max_new_tokens: int | None = None,
                 query_chunk: int = 128, kv_bits: int | None = None, group_size: int = 64, **options):
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise ValueError(f"unknown H2OCache option(s) {', '.join(unknown)}; use EvictionConfig fields: "
                             f"{', '.join(sorted(_OPTIONS))}")
        if eviction is not None and options:
            raise ValueError("pass either an EvictionConfig or its fields as keywords, not both")
        eviction = eviction if eviction is not None else EvictionConfig(**{"policy": "h2o", **options})
        if eviction.pages is not None and eviction.pages.ahead:
            raise ValueError("reading pages a layer ahead is the engine's schedule (it overlaps the read with the "
                             "layer before); in transformers' generate each layer reads its own: drop ahead")
        if eviction.position_rolling:
            raise ValueError("position_rolling needs pre-RoPE keys; transformers caches keys after RoPE, so the HF "
                             "cache keeps true positions (use the engine for rolling)")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if eviction.policy == "full" and max_new_tokens is None:
            raise ValueError("policy 'full' sizes the cache for the whole run: pass max_new_tokens")
        if query_chunk < 1:
            raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
        super().__init__(layers=[])
        self.eviction, self.max_new_tokens, self.query_chunk = eviction, max_new_tokens, query_chunk
        self.kv_format = None if kv_bits is None else quant_format(kv_bits, group_size)   # None: the model's dtype
        self.policy = get_policy(eviction.policy)
        self.kernels = resolve_kernels()   # its attention's and decode commit's kernels, resolved once per cache
        self.budget: Budget | None = None
        self._generator: torch.Generator | None = None
        self._unattended: H2OLayer | None = None

    def resolve(self, prompt_len: int) -> Budget:
        """Slot counts for a padded prompt of `prompt_len` tokens (ratios are fractions of it)."""
        budget = self.eviction.resolve(prompt_len, self.max_new_tokens or 1)
        if self.max_new_tokens is None:
            budget = dataclasses.replace(budget, max_tokens=None)       # run length unknown: budget + 1 slots
        self.policy = policy_for(self.eviction, budget)
        self.budget = budget
        return budget

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self._generator is None:
            self._generator = self.eviction.generator(device)   # one per cache (random policy only)
        return self._generator

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        if self._unattended is not None and self._unattended._pending is not None:
            raise RuntimeError(NEEDS_ATTENTION)     # the last layer's tensors never reached our attention function
        while len(self.layers) <= layer_idx:
            self.layers.append(H2OLayer(self, len(self.layers)))
        if self.budget is None:
            self.resolve(key_states.shape[2])        # before the first attention: it decides whether to score
        layer = self.layers[layer_idx]
        keys, values = layer.update(key_states, value_states)
        self._unattended = layer
        _ACTIVE.pending = (layer, keys)
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.budget, self._generator, self._unattended = None, None, None
        self.policy = get_policy(self.eviction.policy)

    @property
    def nbytes(self) -> int:
        """Bytes allocated by every layer's slots: K, V, fp32 scores and int32 positions."""
        return sum(layer.nbytes for layer in self.layers)

    def kept_positions(self) -> list[list[list[list[int]]]]:
        """[layer][sequence][KV head] -> sorted true positions kept (for tests and debugging)."""
        return [layer.kept_positions() for layer in self.layers]
