"""The attention entry points, and the one place a kernel is chosen.

    attend(q, pool, batch_table, kv_lens, q_lens, *, impl, ...)          decode / verify / prefill
    attend_draft_block(q, pool, batch_table, ctx_lens, block_lens,
                       block_k, block_v, *, impl, causal_in_block, ...)  the DFlash draft block

`impl` is the caller's static choice:
  "pallas"     compiled kernels (GPU): `select_backend` picks Pallas Triton or Gluon
  "interpret"  the Pallas kernels in interpret mode (CPU; slow, exact)
  "reference"  the kernels' plain-jnp references (CPU tests of whole models)
  "auto"       "pallas" on a GPU, "reference" elsewhere

`select_backend` reads the device (`device.device_info`: platform, compute capability,
SM count) and the call's shapes, at trace time. Under "pallas" it takes the Gluon kernel
(`paged_attention_gluon`) for every call over a pool past 2^31 elements (the Pallas
kernels' 32-bit offsets refuse those) and for fp8 decode, verify and draft blocks, and
bf16 draft blocks of 16 tokens, whose batch x kv heads fill the GPU twice or, at head
dim 128, are at most half its SM count (there the Gluon kernel splits keys); everything
else takes the Pallas kernels (`paged_attention`). The rule never looks at the query
count among decode and verify, so a row's decode and verify passes take the same kernel
and agree bit for bit. Nothing falls back silently: without a Triton
that has Gluon, a call that only Gluon can run raises, and the first call Gluon would
have run faster logs a warning once.
"""

from __future__ import annotations

import functools
import logging

import jax.numpy as jnp

from pallas_kernels.device import DeviceInfo, device_info
from pallas_kernels.launch_plan import FEW_Q_MAX, FEW_Q_ROWS, small_batch_split_keys
from pallas_kernels.paged_attention import (draft_block_attention,
                                            draft_block_attention_reference, paged_attention,
                                            paged_attention_reference)
from pallas_kernels.pool_layout import MAX_POOL_ELEMENTS

IMPLS = ("auto", "pallas", "interpret", "reference")
BACKENDS = ("reference", "interpret", "pallas", "gluon")
GLUON_MIN_CAPABILITY = (8, 0)  # cp.async and mma.sync (Ampere and later)
SMALL_BATCH_GLUON_HEAD_DIM = 128  # key splits at small batch measured from this head dim
# (row, kv head) programs per SM from which fp8 few-query calls take the Gluon kernel
GLUON_MIN_PROGRAMS_PER_SM = 2

log = logging.getLogger(__name__)


def resolve_impl(impl: str) -> str:
    """`impl` with "auto" resolved for this process's device."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is unknown; use one of {IMPLS}")
    if impl == "auto":
        return "pallas" if device_info().platform == "gpu" else "reference"
    return impl


@functools.cache
def gluon_module():
    """`pallas_kernels.paged_attention_gluon`, or None (logged loudly, once) when this
    Triton has no Gluon."""
    try:
        from pallas_kernels import paged_attention_gluon
    except ImportError as e:
        log.warning("the Gluon attention kernel is unavailable (%s): fp8 decode / verify / "
                    "draft blocks at large batch run the slower Pallas kernels, and pools past "
                    "2^31 elements cannot run at all. Install triton>=3.5 (pip install "
                    "'.[gpu]').", e)
        return None
    return paged_attention_gluon


def _gluon_preferred(q, pool, *, draft_block: bool, device: DeviceInfo) -> bool:
    """The measured rule (docs/decisions.md): past 2^31 pool elements always; else, when
    batch x kv heads >= 2 x the SM count or the Gluon kernel splits keys
    (`launch_plan.small_batch_split_keys`: at most half the SM count; head dim 128 and
    up), fp8 decode / verify / draft block, and a bf16 draft block of more query rows
    than FEW_Q_ROWS (block 16: the Gluon kernel reads each key block once for all of
    them, the Pallas kernel once per 32 rows)."""
    if pool.size > MAX_POOL_ELEMENTS:
        return True
    if q.shape[1] > FEW_Q_MAX:
        return False
    batch, num_kv_heads = q.shape[0], pool.shape[0]
    # smaller heads (the embedded pair's 32) keep the Pallas kernel at small batch
    splits = (q.shape[-1] >= SMALL_BATCH_GLUON_HEAD_DIM
              and small_batch_split_keys(batch, num_kv_heads, device.num_sms) > 0)
    if batch * num_kv_heads < GLUON_MIN_PROGRAMS_PER_SM * device.num_sms and not splits:
        return False
    if pool.dtype == jnp.float8_e4m3fn:
        return True
    rows = q.shape[1] * (q.shape[2] // pool.shape[0])   # query tokens x q heads per kv head
    return draft_block and rows > FEW_Q_ROWS


def select_backend(q, pool, *, impl: str, draft_block: bool = False,
                   device: DeviceInfo | None = None) -> str:
    """Which kernel runs this call (one of BACKENDS), from `impl`, the device and the
    (per-device) shapes of q [batch, max_q, num_q_heads, head_dim] and the pool."""
    impl = resolve_impl(impl)
    if impl != "pallas":
        return impl
    device = device or device_info()
    capability = device.compute_capability or (0, 0)
    if device.platform != "gpu" or capability < GLUON_MIN_CAPABILITY:
        return "pallas"
    if not _gluon_preferred(q, pool, draft_block=draft_block, device=device):
        return "pallas"
    gluon = gluon_module()
    if gluon is None:
        if pool.size > MAX_POOL_ELEMENTS:
            raise ImportError(f"a pool of {pool.size:,} elements needs the Gluon attention "
                              "kernel (64-bit offsets), and this Triton has no Gluon: "
                              "pip install 'triton>=3.5'")
        return "pallas"
    reason = gluon.supports(q, pool, draft_block=draft_block)
    if reason is None:
        return "gluon"
    if pool.size > MAX_POOL_ELEMENTS:
        raise ValueError(f"a pool of {pool.size:,} elements needs the Gluon attention kernel "
                         f"(the Pallas kernels address 2^31), which does not take {reason}")
    return "pallas"


def attend(q, pool, batch_table, kv_lens, q_lens, *, impl: str, layer_offset,
           sliding_window: int | None = None, soft_cap: float | None = None,
           k_scale: float = 1.0, v_scale: float = 1.0):
    """Decode / verify / chunked prefill attention (`paged_attention.paged_attention`'s
    contract), on the kernel `select_backend` picks."""
    kw = dict(layer_offset=layer_offset, sliding_window=sliding_window, soft_cap=soft_cap,
              k_scale=k_scale, v_scale=v_scale)
    backend = select_backend(q, pool, impl=impl)
    if backend == "reference":
        return paged_attention_reference(q, pool, batch_table, kv_lens, q_lens, **kw)
    if backend == "gluon":
        return gluon_module().paged_attention_gluon(q, pool, batch_table, kv_lens, q_lens,
                                                    **kw)
    return paged_attention(q, pool, batch_table, kv_lens, q_lens,
                           interpret=backend == "interpret", **kw)


def attend_draft_block(q, pool, batch_table, ctx_lens, block_lens, block_k, block_v, *,
                       impl: str, layer_offset, causal_in_block: bool,
                       sliding_window: int | None = None, soft_cap: float | None = None,
                       k_scale: float = 1.0, v_scale: float = 1.0):
    """DFlash draft-block attention (`paged_attention.draft_block_attention`'s contract),
    on the kernel `select_backend` picks."""
    kw = dict(layer_offset=layer_offset, causal_in_block=causal_in_block,
              sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
              v_scale=v_scale)
    args = (q, pool, batch_table, ctx_lens, block_lens, block_k, block_v)
    backend = select_backend(q, pool, impl=impl, draft_block=True)
    if backend == "reference":
        return draft_block_attention_reference(*args, **kw)
    if backend == "gluon":
        return gluon_module().draft_block_attention_gluon(*args, **kw)
    return draft_block_attention(*args, interpret=backend == "interpret", **kw)
