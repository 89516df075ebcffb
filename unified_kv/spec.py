"""Layer specs -> pools: the static shape of the unified target/draft KV cache.

Every attention layer, target or draft, is a `LayerSpec`. Layers with the same
pool key (sliding window, KV dtype, kv heads, head dim) share one physical
*pool* and one page table; they differ only by their offset inside the pool.
A target with windowed and full FP8 layers plus a windowed BF16 drafter gives
three pools:

    pool 0: fp8  window=None  [target L0, L2, ...]
    pool 1: fp8  window=512   [target L1, L3, ...]
    pool 2: bf16 window=512   [draft D0, D1]

Physical layout of one pool (one array, sharded along kv heads):

    [num_kv_heads, num_pages, num_layers_in_pool, 2 (K, V), page_size, head_dim]

so one logical page holds every layer of the pool, K and V, and a request's
pages move in transfer as whole contiguous chunks. A K page is key-major
`[page_size, head_dim]`; a V page holds the same bytes as `[head_dim,
page_size]` (V transposed, so attention's P.V dot reads keys contiguously;
`pallas_kernels.kv_store` writes and reads both). Attention kernels read
"kernel page" `page * page_index_scale + 2 * layer_offset (+1 for V)`.

Everything here is static host config: frozen dataclasses, validated once,
with errors that name the field and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax.numpy as jnp
import numpy as np

# Page-id constants and rounding live with the kernels (the bottom layer); re-exported here.
from pallas_kernels.batch_tables import DEFAULT_BLOCK_PAGES
from pallas_kernels.pool_layout import BAD_PAGE_INDEX, NULL_PAGE, pow2_at_least  # noqa: F401

# Kernels tile keys by whole pages; Triton/Mosaic need power-of-two tiles >= 8.
SUPPORTED_PAGE_SIZES = (8, 16, 32, 64, 128, 256)
# "f32" is for exact reference runs and tests (lossless checks without bf16 rounding).
KV_DTYPES = {"bf16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn, "f32": jnp.float32}
ROLES = ("target", "draft")


def layer_name(role: str, index: int) -> str:
    """The cache's name for a model's `index`-th attention layer of `role`: "target.3",
    "draft.0". Models name their layers by it and find them by it (`CacheSpec.find_layer`)."""
    return f"{role}.{index}"


class CacheSpecError(ValueError):
    """A cache or layer spec the system cannot build; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV cache needs.

    Attributes:
      name: unique layer name, e.g. "target.3" or "draft.0".
      role: "target" or "draft".
      num_kv_heads: kv heads of the layer (GQA groups).
      head_dim: per-head dimension.
      kv_dtype: "bf16" or "fp8_e4m3" (fp8 stores K/V divided by the scales).
      sliding_window: W, or None for full attention. A query at position q
        sees keys at q-W+1 .. q (HF transformers: kv > q - W).
      k_scale, v_scale: fp8 dequantisation scales (stored = value / scale).
    """

    name: str
    role: Literal["target", "draft"]
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "bf16"
    sliding_window: int | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def pool_key(self) -> tuple:
        """What decides pool membership: layers with equal keys share a pool."""
        return (self.sliding_window, self.kv_dtype, self.num_kv_heads, self.head_dim)

    @property
    def dtype(self):
        return KV_DTYPES[self.kv_dtype]


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One physical pool: the layers of one pool key, their pages and table width.

    Attributes:
      pool_id: index into `KVState.pools` / `KVState.page_tables`.
      layer_names: layers stored in this pool, in offset order.
      roles: the set of roles ("target", "draft") of those layers.
      num_pages: physical pages in the pool, the reserved NULL_PAGE included.
      max_pages_per_seq: page-table width (logical pages of one row).
      bytes_per_page: one page of every layer in the pool, K and V.
    """

    pool_id: int
    kv_dtype: str
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    page_size: int
    layer_names: tuple[str, ...]
    roles: frozenset[str]
    num_pages: int
    max_pages_per_seq: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def dtype(self):
        return KV_DTYPES[self.kv_dtype]

    @property
    def num_usable_pages(self) -> int:
        """Pages the allocator can hand out (all but NULL_PAGE)."""
        return self.num_pages - 1

    @property
    def page_index_scale(self) -> int:
        """Kernel pages per logical page: K and V of every layer."""
        return 2 * self.num_layers

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.num_pages, self.num_layers, 2,
                self.page_size, self.head_dim)

    @property
    def bytes_per_page(self) -> int:
        itemsize = np.dtype(self.dtype).itemsize
        return (self.num_kv_heads * self.num_layers * 2 * self.page_size
                * self.head_dim * itemsize)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page


def max_live_pages(page_size: int, sliding_window: int | None, seq_len: int,
                   max_step_tokens: int) -> int:
    """Worst-case pages one row holds in a pool at any moment.

    Full pools hold every page up to `seq_len` plus the step's overrun (verify
    writes up to K+1 positions past the committed length). A windowed pool holds the pages
    covering [len - W + 1, len + step) during a step, where step <= the most
    tokens one step writes (prefill chunk or K+1 verify tokens); the live span
    is W - 1 + step tokens and may straddle one extra page boundary.
    """
    full = math.ceil((seq_len + max_step_tokens) / page_size)
    if sliding_window is None:
        return full
    span = sliding_window - 1 + max_step_tokens
    return min(full, math.ceil(span / page_size) + 1)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """The whole unified cache: pages, layers, slots and the memory budget.

    Attributes:
      page_size: tokens per page (one of SUPPORTED_PAGE_SIZES).
      layers: every attention layer, target and draft.
      num_slots: concurrent requests. Slot `num_slots` is the dummy slot that
        padding rows use; it owns no pages.
      max_seq_len: longest request (prompt + generated), in tokens.
      memory_budget_bytes: bytes for all pools together.
      max_step_tokens: most tokens one step writes per row (prefill chunk or
        K+1 verify tokens); headroom for windowed pools and table width.

    Layers of one pool key share a pool (`group_layers`); a spec of draft layers
    only is a drafter's own cache.
    """

    page_size: int
    layers: tuple[LayerSpec, ...]
    num_slots: int
    max_seq_len: int
    memory_budget_bytes: int
    max_step_tokens: int = 16

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        validate_cache_spec(self)

    @property
    def dummy_slot(self) -> int:
        return self.num_slots

    @property
    def max_pages_per_seq(self) -> int:
        # Verify may write max_step_tokens past the last committed position.
        return math.ceil((self.max_seq_len + self.max_step_tokens) / self.page_size)

    def layer(self, name: str) -> LayerSpec:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer named {name!r}; layers are "
                       f"{[l.name for l in self.layers]}")

    @functools.cached_property
    def pools(self) -> tuple[PoolSpec, ...]:
        return size_pools(self, group_layers(self.layers))

    def find_layer(self, role: str, index: int) -> tuple[LayerSpec, int, int]:
        """(the layer, its pool id, its offset in the pool) of a model's `index`-th
        attention layer of `role`."""
        layer = self.layer(layer_name(role, index))
        return (layer, *self.layer_location(layer.name))

    def layer_location(self, name: str) -> tuple[int, int]:
        """(pool_id, layer_offset) of a layer."""
        for pool in self.pools:
            if name in pool.layer_names:
                return pool.pool_id, pool.layer_names.index(name)
        raise KeyError(f"no layer named {name!r}")


def validate_cache_spec(spec: CacheSpec) -> None:
    """Raise CacheSpecError naming the offending field and the fix."""
    for field in ("page_size", "num_slots", "max_seq_len", "memory_budget_bytes",
                  "max_step_tokens"):
        value = getattr(spec, field)
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise CacheSpecError(f"CacheSpec.{field} must be a positive integer, "
                                 f"got {value!r}")
    if spec.page_size not in SUPPORTED_PAGE_SIZES:
        raise CacheSpecError(
            f"CacheSpec.page_size={spec.page_size} cannot be used by the paged "
            f"kernels; choose one of {SUPPORTED_PAGE_SIZES}")
    if not spec.layers:
        raise CacheSpecError("CacheSpec.layers is empty; give at least one target layer")
    seen = set()
    for layer in spec.layers:
        _validate_layer(layer, spec.page_size)
        if layer.name in seen:
            raise CacheSpecError(f"duplicate layer name {layer.name!r}; every "
                                 f"LayerSpec.name must be unique")
        seen.add(layer.name)
    pools = spec.pools  # cached: derived once per spec
    need = sum((max_live_pages(spec.page_size, p.sliding_window, spec.max_seq_len,
                               spec.max_step_tokens) + 1) * p.bytes_per_page for p in pools)
    if spec.memory_budget_bytes < need:
        raise CacheSpecError(
            f"CacheSpec.memory_budget_bytes={spec.memory_budget_bytes} is too small "
            f"for one request of max_seq_len={spec.max_seq_len}: it needs {need} "
            f"bytes; raise the budget or lower max_seq_len")


def _validate_layer(layer: LayerSpec, page_size: int) -> None:
    where = f"LayerSpec {layer.name!r}"
    if not isinstance(layer.name, str) or not layer.name:
        raise CacheSpecError(f"LayerSpec.name must be a non-empty string, got {layer.name!r}")
    if layer.role not in ROLES:
        raise CacheSpecError(f"{where}: role={layer.role!r} is unknown; use one of {ROLES}")
    for field in ("num_kv_heads", "head_dim"):
        value = getattr(layer, field)
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise CacheSpecError(f"{where}: {field} must be a positive integer, got {value!r}")
    if layer.kv_dtype not in KV_DTYPES:
        raise CacheSpecError(f"{where}: kv_dtype={layer.kv_dtype!r} is unknown; "
                             f"use one of {tuple(KV_DTYPES)}")
    for field in ("k_scale", "v_scale"):
        value = getattr(layer, field)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise CacheSpecError(f"{where}: {field} must be a positive finite number, "
                                 f"got {value!r}")
    window = layer.sliding_window
    if window is not None:
        if not isinstance(window, (int, np.integer)) or window <= 0:
            raise CacheSpecError(f"{where}: sliding_window must be a positive integer "
                                 f"or None, got {window!r}")
        if window < page_size:
            raise CacheSpecError(
                f"{where}: sliding_window={window} is smaller than page_size="
                f"{page_size}; use a window of at least one page or a smaller page_size")


def group_layers(layers) -> tuple[tuple[LayerSpec, ...], ...]:
    """Layers grouped by pool key, in first-seen order (which keeps pool ids stable): one
    pool each."""
    groups: dict[tuple, list[LayerSpec]] = {}
    for layer in layers:
        groups.setdefault(layer.pool_key, []).append(layer)
    return tuple(tuple(g) for g in groups.values())


def size_pools(spec: CacheSpec, groups) -> tuple[PoolSpec, ...]:
    """One pool per group of layers with one pool key, sized from the budget.

    Pools are sized in proportion to one max-length request's worst case
    (`max_live_pages` per pool): the budget buys N such requests at once,
    N = min(num_slots, budget / bytes of one), possibly fractional, and pool i
    gets floor(N * live_pages_i) usable pages plus the null page. Windowed pools so stay
    small: their per-request need is bounded by the window, not the sequence.
    """
    ps = spec.page_size
    proto = []
    for layers in groups:
        if len({l.pool_key for l in layers}) != 1:
            raise CacheSpecError(f"layers {[l.name for l in layers]} differ in window, KV "
                                 "dtype, kv heads or head dim; a pool holds layers alike in all")
        key = layers[0].pool_key
        window, kv_dtype, heads, head_dim = key
        per_row = max_live_pages(ps, window, spec.max_seq_len, spec.max_step_tokens)
        bytes_per_page = (heads * len(layers) * 2 * ps * head_dim
                          * np.dtype(KV_DTYPES[kv_dtype]).itemsize)
        proto.append((key, layers, per_row, bytes_per_page))
    one_request = sum(r * b for _, _, r, b in proto)
    null_pages = sum(b for _, _, _, b in proto)
    num_requests = min(spec.num_slots,
                       (spec.memory_budget_bytes - null_pages) / one_request)
    pools = []
    for pool_id, (key, layers, per_row, _) in enumerate(proto):
        window, kv_dtype, heads, head_dim = key
        pools.append(PoolSpec(
            pool_id=pool_id, kv_dtype=kv_dtype, num_kv_heads=heads,
            head_dim=head_dim, sliding_window=window, page_size=ps,
            layer_names=tuple(l.name for l in layers),
            roles=frozenset(l.role for l in layers),
            num_pages=math.floor(num_requests * per_row) + 1,
            max_pages_per_seq=spec.max_pages_per_seq))
    return tuple(pools)


def bucket_width(num_pages: int, max_pages_per_seq: int, *,
                 block_pages: int = DEFAULT_BLOCK_PAGES) -> int:
    """Static batch-table width (pages) for rows whose extents are at most `num_pages`.

    Powers of two of at least one kernel table block (log2 many compiled
    variants), never wider than the page table rounded up to a whole block.
    """
    if num_pages < 0:
        raise ValueError(f"num_pages must be >= 0, got {num_pages=}")
    width = max(block_pages, pow2_at_least(num_pages))
    cap = -(-max_pages_per_seq // block_pages) * block_pages
    return min(width, cap)
