"""Glue between model layers and the paged kernels: a layer's spec becomes the kernel's
arguments, and tensor parallelism runs the kernel per device.

`impl` ("auto", "pallas", "interpret", "reference") is the caller's static choice;
`pallas_kernels.attention.select_backend` turns it into a kernel for each call (the
only place one is chosen: Pallas Triton, Gluon, interpret mode or the jnp reference).

Tensor parallelism: a worker on a mesh traces its steps under
`jax.set_mesh(mesh)` with pools split along kv heads over the mesh's first
axis (`unified_kv.init_state`). XLA cannot partition a Pallas kernel, so the
kernel paths run under `jax.shard_map` over that axis: each device attends
its own kv heads (and their query heads) over its own slice of the pool, and
the kernel is chosen from those per-device shapes.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import attention as kernels
from pallas_kernels.attention import IMPLS, resolve_impl  # noqa: F401  (re-exported)
from pallas_kernels.kv_store import write_kv
from pallas_kernels.rope_store import (rope_store, rope_store_reference, split_projections,
                                      unaddressable)
from models.layers import LayerRow
from unified_kv import LayerSpec

log = logging.getLogger(__name__)


def _layer_args(layer: LayerSpec, offset: int) -> dict:
    return dict(layer_offset=offset, sliding_window=layer.sliding_window,
                k_scale=layer.k_scale, v_scale=layer.v_scale)


def write_layer_kv(pool, table, starts, num_tokens, k, v, layer: LayerSpec, offset):
    """Store new K/V of one layer (at pool `offset`: int or traced i32), already normed
    and rotated (the drafter's context K/V); returns the pool.
    Rows the step could not allocate for were already reported by `allocate_pages`;
    their writes drop."""
    pool, _ = write_kv(pool, table, starts, num_tokens, k, v, layer_offset=offset,
                       k_scale=layer.k_scale, v_scale=layer.v_scale)
    return pool


def store_rotated_kv(qkv, q_norm, k_norm, cos, sin, pool, targets, layer: LayerSpec, offset, *,
                     num_q_heads: int, eps: float, impl: str):
    """One layer's q and k normed and rotated, its K/V stored at pool `offset` (int or
    traced i32), in one kernel (`pallas_kernels.rope_store`): (q' [N, Hq * D], pool).
    qkv: the raw projections (`models.qwen3.projections`); q_norm, k_norm: [D], or
    `LayerRow`s of the stacks (the kernel reads the row); targets: `store_targets`.
    A pool (per device) the kernel cannot address runs the same arithmetic as XLA ops,
    with a warning once."""
    impl = resolve_impl(impl)
    norm_row = q_norm.row if isinstance(q_norm, LayerRow) else 0
    q_norm, k_norm = (w.stack if isinstance(w, LayerRow) else w for w in (q_norm, k_norm))
    kw = dict(eps=eps, k_scale=layer.k_scale, v_scale=layer.v_scale)
    args = (q_norm, k_norm, cos, sin)
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else mesh.shape[mesh.axis_names[0]]
    reason = unaddressable((pool.shape[0] // devices,) + pool.shape[1:], pool.dtype)
    if reason and impl != "reference":
        _warn_once(f"rope_store cannot address {reason}: norms, RoPE and the K/V store run "
                   "as XLA ops (several launches a layer). Size the pool below 2^31 "
                   "elements or above 4 GiB to fuse them.")
    if impl == "reference" or reason:  # plain jnp: XLA partitions it itself
        return rope_store_reference(qkv, *args, pool, *targets, offset, num_q_heads=num_q_heads,
                                    norm_row=norm_row, **kw)
    if devices == 1:
        return rope_store(qkv, *args, pool, *targets, offset, num_q_heads=num_q_heads,
                          norm_row=norm_row, interpret=impl == "interpret", **kw)
    # Tensor parallel: each device norms its own heads and stores into its slice of the
    # pool; the fused projections split into q, k, v first, so each splits by heads.
    axis = mesh.axis_names[0]
    qkv = split_projections(qkv, num_q_heads, pool.shape[0], pool.shape[-1])

    def per_device(q, k, v, pool, offset, norm_row, pages, slots, *args):
        return rope_store((q, k, v), *args, pool, pages, slots, offset,
                          num_q_heads=num_q_heads // devices, norm_row=norm_row,
                          interpret=impl == "interpret", **kw)
    heads = P(None, axis)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(heads,) * 3 + (P(axis),) + (P(),) * 8,
                         out_specs=(heads, P(axis)), check_vma=False)(
        *qkv, pool, jnp.asarray(offset, jnp.int32), jnp.asarray(norm_row, jnp.int32),
        *targets, *args)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def _per_kv_head_shard(kernel, num_heads_args: int, num_other_args: int):
    """`kernel(*head_split_args, *replicated_args)` run per device of the
    context mesh's first axis: head-split args (q and K/V: [B, T, heads, D];
    the pool: [kv heads, ...]) split along heads, the rest replicated.
    Without a context mesh (or a 1-device axis) the kernel runs as is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape[mesh.axis_names[0]] == 1:
        return kernel
    axis = mesh.axis_names[0]
    heads = (P(None, None, axis),) * (num_heads_args - 1) + (P(axis),)
    return jax.shard_map(kernel, mesh=mesh, in_specs=heads + (P(),) * num_other_args,
                         out_specs=P(None, None, axis), check_vma=False)


def attend(q, pool, table, kv_lens, q_lens, layer: LayerSpec, offset, *, impl: str):
    """Decode / verify / prefill attention of one layer (queries' K/V already stored),
    at pool `offset` (int or traced i32: the kernels take it as an input)."""
    impl = resolve_impl(impl)

    def kernel(q, pool, table, kv_lens, q_lens, offset):
        return kernels.attend(q, pool, table, kv_lens, q_lens, impl=impl,
                              **_layer_args(layer, offset))
    if impl == "reference":  # plain jnp: XLA partitions it itself
        return kernel(q, pool, table, kv_lens, q_lens, offset)
    return _per_kv_head_shard(kernel, 2, 4)(q, pool, table, kv_lens, q_lens,
                                            jnp.asarray(offset, jnp.int32))


def attend_draft_block(q, pool, table, ctx_lens, block_lens, block_k, block_v, layer: LayerSpec,
                       offset, *, causal_in_block: bool, impl: str):
    """DFlash draft-block attention of one draft layer, at pool `offset` (int or traced)."""
    impl = resolve_impl(impl)

    def kernel(q, block_k, block_v, pool, table, ctx_lens, block_lens, offset):
        return kernels.attend_draft_block(q, pool, table, ctx_lens, block_lens, block_k,
                                          block_v, causal_in_block=causal_in_block, impl=impl,
                                          **_layer_args(layer, offset))
    args = (q, block_k, block_v, pool, table, ctx_lens, block_lens)
    if impl == "reference":
        return kernel(*args, offset)
    return _per_kv_head_shard(kernel, 4, 4)(*args, jnp.asarray(offset, jnp.int32))
