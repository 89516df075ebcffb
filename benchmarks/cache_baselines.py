"""The baselines the unified cache is measured against.

The unified cache keeps target and draft layers in one KVState: one set of
free lists, per-pool page tables (layers of a pool share a table), and one
kernel that builds the batch's tables each step. The contrasts:

  * two caches: the target's KV in one KVState and the drafter's in another
    (what a system without draft layers in the cache does): two allocations,
    two table builds, two retirements per step. `two_cache_decode_step` is
    `drafter.uniform_steps.decode_step` over such a pair.
  * per-layer tables: `PerLayerCacheSpec`, every layer its own pool, table and
    free list (runs through the ordinary steps).
  * full-capacity rebuilds: `FullRebuildStepConfig`, every slot's full-width
    table rebuilt each step, then the batch's rows picked (the ordinary steps).

`split_state` turns a unified state into the equivalent two-cache state (same
pages, same data), so the two decode steps can be checked token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

from drafter.dflash import draft_block, write_context
from drafter.sampling import Sampler, accept, emitted_tokens
from drafter.steps import StepConfig, matmul_precision_for
from models.qwen3 import forward
from unified_kv import bucket_width
from unified_kv import (CacheSpec, KVState, allocate_pages, bytes_per_request,
                        retire_window_pages)
from unified_kv.spec import size_pools


@dataclasses.dataclass(frozen=True)
class PerLayerCacheSpec(CacheSpec):
    """Every layer its own pool, page table and free list, instead of one per pool key."""

    @functools.cached_property
    def pools(self):
        return size_pools(self, tuple((layer,) for layer in self.layers))


@dataclasses.dataclass(frozen=True)
class FullRebuildStepConfig(StepConfig):
    """Steps that rebuild every slot's full-capacity device table, then pick the batch's
    rows, instead of building the batch's rows only."""

    def device_tables(self, kv, slot_ids, table_width: int):
        spec = self.spec
        every_slot = jnp.arange(spec.num_slots + 1, dtype=jnp.int32)
        full = bucket_width(spec.max_pages_per_seq, spec.max_pages_per_seq)
        tables = super().device_tables(kv, every_slot, full)
        return tuple(t[slot_ids, :table_width] for t in tables)


def _as(cls, config):
    """`config`'s fields in a `cls` (a subclass of its class)."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def per_layer(cfg: StepConfig) -> StepConfig:
    """`cfg` with every layer in its own pool."""
    return dataclasses.replace(cfg, spec=_as(PerLayerCacheSpec, cfg.spec))


def full_rebuild(cfg: StepConfig) -> StepConfig:
    """`cfg` with every slot's full-capacity table rebuilt each step."""
    return _as(FullRebuildStepConfig, cfg)


@flax.struct.dataclass
class TwoCacheState:
    target_kv: KVState
    draft_kv: KVState
    anchors: jax.Array   # i32[num_slots + 1]
    drafts: jax.Array    # i32[num_slots + 1, block_size - 1]


def split_config(cfg: StepConfig) -> tuple[StepConfig, StepConfig]:
    """(target-cache config, draft-cache config): the unified spec's layers by
    role, each cache budgeted for as many max-length requests as the unified
    one, so the pools come out the same size."""
    spec = cfg.spec
    per_pool = bytes_per_request(spec, spec.max_seq_len)

    def need(pools):  # (one max-length request, null pages) in bytes
        return (sum(per_pool[p.pool_id] for p in pools),
                sum(p.bytes_per_page for p in pools))

    one, null = need(spec.pools)
    requests = min(spec.num_slots, (spec.memory_budget_bytes - null) / one)

    def only(role):
        layers = tuple(l for l in spec.layers if l.role == role)
        one_r, null_r = need([p for p in spec.pools if role in p.roles])
        return dataclasses.replace(spec, layers=layers,
                                   memory_budget_bytes=math.ceil(null_r + requests * one_r) + 1)
    return (dataclasses.replace(cfg, spec=only("target")),
            dataclasses.replace(cfg, spec=only("draft")))


def split_state(cfg: StepConfig, kv: KVState, cfgs) -> tuple[KVState, KVState]:
    """The two-cache equivalent of a unified state (no pool may mix roles)."""
    out = []
    for part in cfgs:
        ids = []
        for pool in part.spec.pools:
            pool_id, _ = cfg.spec.layer_location(pool.layer_names[0])
            unified = cfg.spec.pools[pool_id]
            if len(unified.roles) > 1:
                raise ValueError(f"pool {pool_id} of the unified cache holds target and draft "
                                 f"layers {unified.layer_names}; two caches cannot share it "
                                 f"(give the draft layers another KV dtype or window)")
            if unified.shape != pool.shape:
                raise ValueError(f"pool {pool_id} of the unified cache {unified.shape} has no "
                                 f"twin in the split cache ({pool.shape}); give the spec a "
                                 f"budget that covers every slot")
            ids.append(pool_id)
        pick = lambda xs: tuple(xs[i] for i in ids)
        out.append(kv.replace(pools=pick(kv.pools), page_tables=pick(kv.page_tables),
                              free_pages=pick(kv.free_pages), num_free=kv.num_free[jnp.array(ids)],
                              target_lens=kv.target_lens + 0, draft_ctx_lens=kv.draft_ctx_lens + 0))
    return tuple(out)


def two_cache_decode_step(params, state: TwoCacheState, slot_ids, key, *,
                          cfgs: tuple[StepConfig, StepConfig], table_width: int,
                          temperature: float = 0.0):
    """`decode_step` with the target's and the drafter's KV in separate caches."""
    with jax.default_matmul_precision(matmul_precision_for(params, cfgs[0].matmul_precision)):
        return _two_cache_decode(params, state, slot_ids, key, cfgs, table_width, temperature)


def _two_cache_decode(params, state, slot_ids, key, cfgs, table_width, temperature):
    tcfg, dcfg = cfgs
    block = tcfg.block_size
    active = slot_ids != tcfg.spec.dummy_slot
    p = state.target_kv.target_lens[slot_ids]
    tkv, ok_t = allocate_pages(tcfg.spec, state.target_kv, slot_ids, p + block, p + block)
    dkv, ok_d = allocate_pages(dcfg.spec, state.draft_kv, slot_ids, p + block, p + block)
    ok = ok_t & ok_d
    live = active & ok
    tokens = jnp.concatenate([state.anchors[slot_ids][:, None], state.drafts[slot_ids]], axis=1)
    t_tables = tcfg.device_tables(tkv, slot_ids, table_width)
    d_tables = dcfg.device_tables(dkv, slot_ids, table_width)
    verify_len = jnp.where(live, block, 0).astype(jnp.int32)
    logits, t_pools, feats = forward(params["target"], tcfg.target, tcfg.spec, tkv.pools,
                                     t_tables, tokens, p, verify_len,
                                     feature_layers=tcfg.draft.target_layer_ids, impl=tcfg.impl)
    accepted, bonus = accept(logits, tokens[:, 1:],
                             Sampler.uniform(tokens.shape[0], temperature, key))
    num_out = jnp.where(live, accepted + 1, 0).astype(jnp.int32)
    d_pools = write_context(params["draft"], dcfg.draft, dcfg.spec, dkv.pools, d_tables, feats,
                            p, num_out)
    new_len = p + num_out

    def commit(kv, pools):
        return kv.replace(pools=pools, target_lens=kv.target_lens.at[slot_ids].set(new_len),
                          draft_ctx_lens=kv.draft_ctx_lens.at[slot_ids].set(new_len))

    tkv, dkv = commit(tkv, t_pools), commit(dkv, d_pools)
    drafts, _ = draft_block(params["draft"], dcfg.draft, params["target"], dcfg.target,
                            dcfg.spec, dkv.pools, d_tables, bonus, new_len, live, impl=dcfg.impl)
    state = TwoCacheState(
        target_kv=retire_window_pages(tcfg.spec, tkv, slot_ids),
        draft_kv=retire_window_pages(dcfg.spec, dkv, slot_ids),
        anchors=state.anchors.at[slot_ids].set(jnp.where(live, bonus, state.anchors[slot_ids])),
        drafts=state.drafts.at[slot_ids].set(jnp.where(live[:, None], drafts,
                                                       state.drafts[slot_ids])))
    return state, emitted_tokens(tokens, accepted, bonus), num_out, ok


def kv_memory_bytes(spec: CacheSpec) -> dict:
    """Bytes a cache holds on the device: pools, page tables, free lists."""
    pools = sum(p.nbytes for p in spec.pools)
    tables = sum((spec.num_slots + 1) * p.max_pages_per_seq * 4 for p in spec.pools)
    free = sum(p.num_pages * 4 for p in spec.pools)
    return {"pools": pools, "page_tables": tables, "free_lists": free,
            "total": pools + tables + free}
