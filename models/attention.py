"""Glue between model layers and the paged kernels: one place picks the kernel path.

`impl`:
  "pallas"     compiled Pallas kernels (GPU)
  "interpret"  the same kernels in Pallas interpret mode (CPU; slow, exact)
  "reference"  the kernels' plain-jnp references (CPU tests of whole models)
  "auto"       "pallas" on GPU, "reference" elsewhere
The choice is explicit and static; nothing falls back silently at run time.
Under "pallas", decode, verify and the draft block over fp8 KV at batch x kv heads >= 264,
and every call over a pool past the Pallas kernels' 2^31 elements (prefill and the draft
block too), take the Gluon kernel (`pallas_kernels/paged_attention_gluon.py`,
`use_gluon`): a trace-time rule of the batch, heads and pool, so a row's plain decode and
its verify take the same kernel.

Tensor parallelism: a worker on a mesh traces its steps under
`jax.set_mesh(mesh)` with pools split along kv heads over the mesh's first
axis (`unified_kv.init_state`). XLA cannot partition a Pallas kernel, so the
kernel paths run under `jax.shard_map` over that axis: each device attends
its own kv heads (and their query heads) over its own slice of the pool.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.kv_store import write_kv
from pallas_kernels.paged_attention import (draft_block_attention,
                                            draft_block_attention_reference, paged_attention,
                                            paged_attention_reference)
from unified_kv import LayerSpec

IMPLS = ("auto", "pallas", "interpret", "reference")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is unknown; use one of {IMPLS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return impl


def _kernel_args(layer: LayerSpec, offset: int, impl: str) -> dict:
    return dict(layer_offset=offset, sliding_window=layer.sliding_window,
                k_scale=layer.k_scale, v_scale=layer.v_scale,
                **({} if impl == "reference" else {"interpret": impl == "interpret"}))


def write_layer_kv(pool, table, starts, num_tokens, k, v, layer: LayerSpec, offset: int):
    """Store new K/V of one layer; returns the pool. Rows the step could not
    allocate for were already reported by `allocate_pages`; their writes drop."""
    pool, _ = write_kv(pool, table, starts, num_tokens, k, v, layer_offset=offset,
                       k_scale=layer.k_scale, v_scale=layer.v_scale)
    return pool


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


def attend(q, pool, table, kv_lens, q_lens, layer: LayerSpec, offset: int, *, impl: str):
    """Decode / verify / prefill attention of one layer (queries' K/V already stored)."""
    impl = resolve_impl(impl)
    args = _kernel_args(layer, offset, impl)
    if impl == "reference":
        return paged_attention_reference(q, pool, table, kv_lens, q_lens, **args)

    def kernel(q, pool, table, kv_lens, q_lens):
        gluon = gluon_kernel(q, pool) if impl == "pallas" else None
        if gluon is not None:
            return gluon.paged_attention_gluon(q, pool, table, kv_lens, q_lens,
                                               **_without_interpret(args))
        return paged_attention(q, pool, table, kv_lens, q_lens, **args)
    return _per_kv_head_shard(kernel, 2, 3)(q, pool, table, kv_lens, q_lens)


def _without_interpret(args: dict) -> dict:
    return {k: v for k, v in args.items() if k != "interpret"}


def gluon_kernel(q, pool, *, draft_block: bool = False):
    """The Gluon kernels' module if `use_gluon` picks it for these (per-device) shapes,
    else None. Without a Triton that has Gluon the Pallas kernels run: they take every
    such call but pools past 2^31 elements, which they refuse by name."""
    try:
        from pallas_kernels import paged_attention_gluon
    except ImportError:
        return None
    if not paged_attention_gluon.use_gluon(q, pool, draft_block=draft_block):
        return None
    return paged_attention_gluon


def attend_draft_block(q, pool, table, ctx_lens, block_lens, block_k, block_v, layer: LayerSpec,
                       offset: int, *, causal_in_block: bool, impl: str):
    """DFlash draft-block attention of one draft layer."""
    impl = resolve_impl(impl)
    args = dict(_kernel_args(layer, offset, impl), causal_in_block=causal_in_block)
    if impl == "reference":
        return draft_block_attention_reference(q, pool, table, ctx_lens, block_lens, block_k,
                                               block_v, **args)

    def kernel(q, block_k, block_v, pool, table, ctx_lens, block_lens):
        gluon = gluon_kernel(q, pool, draft_block=True) if impl == "pallas" else None
        if gluon is not None:
            return gluon.draft_block_attention_gluon(q, pool, table, ctx_lens, block_lens,
                                                     block_k, block_v,
                                                     **_without_interpret(args))
        return draft_block_attention(q, pool, table, ctx_lens, block_lens, block_k, block_v,
                                     **args)
    return _per_kv_head_shard(kernel, 4, 3)(q, block_k, block_v, pool, table, ctx_lens,
                                            block_lens)
