"""Which kernel a layer's attention (and its draft block) takes:
`pallas_kernels.attention.select_backend`, and models/attention.py following it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from pallas_kernels import attention as kernels
from pallas_kernels.device import DeviceInfo
from unified_kv import LayerSpec

pg = pytest.importorskip("pallas_kernels.paged_attention_gluon",
                         reason="a Triton with Gluon (triton>=3.5)")
FP8 = jnp.float8_e4m3fn
H200 = DeviceInfo(platform="gpu", compute_capability=(9, 0), num_sms=132)


def args():
    q = jnp.ones((2, 1, 8, 32), jnp.bfloat16)
    pool = jnp.zeros((2, 4, 1, 2, 8, 32), FP8)
    return q, pool, jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32), jnp.ones(
        (2,), jnp.int32)


LAYER = LayerSpec(name="t0", role="target", num_kv_heads=2, head_dim=32, kv_dtype="fp8_e4m3")


def route(monkeypatch, backend):
    monkeypatch.setattr(kernels, "select_backend", lambda q, pool, *, impl, draft_block=False:
                        backend(impl, draft_block))


def test_pallas_impl_routes_decode_to_gluon_when_selected(monkeypatch):
    calls = []

    def fake_gluon(q, pool, table, kv_lens, q_lens, **kw):
        calls.append(kw)
        return jnp.full(q.shape, 7.0, q.dtype)

    monkeypatch.setattr(pg, "paged_attention_gluon", fake_gluon)
    route(monkeypatch, lambda impl, draft: "pallas" if draft else "gluon")
    out = attention.attend(*args(), LAYER, 0, impl="pallas")
    assert np.all(np.asarray(out, np.float32) == 7.0)
    assert "interpret" not in calls[0] and calls[0]["layer_offset"] == 0


def test_pallas_impl_routes_the_draft_block_to_gluon_when_selected(monkeypatch):
    calls = []

    def fake_gluon(q, pool, table, ctx_lens, block_lens, block_k, block_v, **kw):
        calls.append(kw)
        return jnp.full(q.shape, 5.0, q.dtype)

    monkeypatch.setattr(pg, "draft_block_attention_gluon", fake_gluon)
    route(monkeypatch, lambda impl, draft: "gluon" if draft else "pallas")
    q, pool, table, lens, _ = args()
    block_kv = jnp.ones((2, 1, 2, 32), jnp.bfloat16)
    out = attention.attend_draft_block(q, pool, table, lens, lens, block_kv, block_kv, LAYER, 0,
                                       causal_in_block=True, impl="pallas")
    assert np.all(np.asarray(out, np.float32) == 5.0)
    assert "interpret" not in calls[0] and calls[0]["causal_in_block"]


def test_interpret_and_reference_never_take_gluon():
    q, pool = args()[:2]
    for impl in ("interpret", "reference"):
        assert kernels.select_backend(q, pool, impl=impl, device=H200) == impl
    out = attention.attend(*args(), LAYER, 0, impl="interpret")
    assert out.shape == (2, 1, 8, 32)


def test_auto_and_pallas_off_the_gpu():
    q, pool = args()[:2]
    cpu = DeviceInfo(platform="cpu", compute_capability=None, num_sms=132)
    assert kernels.select_backend(q, pool, impl="pallas", device=cpu) == "pallas"
    if jax.default_backend() == "cpu":
        assert kernels.resolve_impl("auto") == "reference"
    with pytest.raises(ValueError, match="impl='triton' is unknown"):
        kernels.resolve_impl("triton")


def test_which_calls_take_the_gluon_kernel():
    """Decode, verify and the draft block over fp8, and bf16 draft blocks of more than 32
    query rows (block 16), at batch x kv heads >= 2 x SMs, or at most SMs / 2 (where the
    Gluon kernel splits keys), take it by measurement; prefill and other bf16 calls only
    where the Pallas kernels cannot address the pool (past 2^31 elements). The rule
    follows the device's SM count."""
    for kv, fp8 in ((FP8, True), (jnp.bfloat16, False)):
        small = jax.ShapeDtypeStruct((8, 1024, 1, 2, 16, 128), kv)
        large = jax.ShapeDtypeStruct((8, 2**31 // (8 * 2 * 16 * 128) + 1, 1, 2, 16, 128), kv)
        for max_q, draft, want_small in ((1, False, fp8), (8, False, fp8), (64, False, False),
                                         (8, True, fp8), (16, False, fp8), (16, True, True)):
            q = jax.ShapeDtypeStruct((64, max_q, 32, 128), jnp.bfloat16)
            pick = kernels.select_backend(q, small, impl="pallas", draft_block=draft,
                                          device=H200)
            assert pick == ("gluon" if want_small else "pallas"), (kv, max_q, draft)
            assert kernels.select_backend(q, large, impl="pallas", draft_block=draft,
                                          device=H200) == "gluon", (kv, max_q, draft)
        for batch, want in ((2, "gluon" if fp8 else "pallas"), (8, "gluon" if fp8 else "pallas"),
                            (9, "pallas"), (32, "pallas")):  # key splits up to 8 x 8 <= 66
            q2 = jax.ShapeDtypeStruct((batch, 1, 32, 128), jnp.bfloat16)
            assert kernels.select_backend(q2, small, impl="pallas", device=H200) == want, batch
            prefill = jax.ShapeDtypeStruct((batch, 64, 32, 128), jnp.bfloat16)
            assert kernels.select_backend(prefill, small, impl="pallas", device=H200) == "pallas"
        q2 = jax.ShapeDtypeStruct((2, 16, 32, 128), jnp.bfloat16)  # the Gluon kernel splits
        assert kernels.select_backend(q2, small, impl="pallas", draft_block=True,
                                      device=H200) == "gluon"
        q20 = jax.ShapeDtypeStruct((20, 16, 32, 128), jnp.bfloat16)  # neither fills nor splits
        assert kernels.select_backend(q20, small, impl="pallas", draft_block=True,
                                      device=H200) == "pallas"
        small_heads = jax.ShapeDtypeStruct((2, 1024, 1, 2, 16, 32), kv)  # the embedded pair's
        q32 = jax.ShapeDtypeStruct((4, 16, 8, 32), jnp.bfloat16)
        assert kernels.select_backend(q32, small_heads, impl="pallas", device=H200) == "pallas"
    q = jax.ShapeDtypeStruct((64, 1, 32, 128), jnp.bfloat16)
    small = jax.ShapeDtypeStruct((8, 1024, 1, 2, 16, 128), FP8)
    bigger_gpu = DeviceInfo(platform="gpu", compute_capability=(9, 0), num_sms=300)
    assert kernels.select_backend(q, small, impl="pallas", device=bigger_gpu) == "pallas"
    volta = DeviceInfo(platform="gpu", compute_capability=(7, 0), num_sms=80)
    assert kernels.select_backend(q, small, impl="pallas", device=volta) == "pallas"


def test_a_missing_gluon_is_logged_once_or_raises_where_only_it_can_run(monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_gluon(name, globals=None, locals=None, fromlist=(), level=0):
        if fromlist and "paged_attention_gluon" in fromlist:
            raise ImportError("no Gluon in this Triton")
        return real_import(name, globals, locals, fromlist, level)

    kernels.gluon_module.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_gluon)
    try:
        q = jax.ShapeDtypeStruct((64, 1, 32, 128), jnp.bfloat16)
        small = jax.ShapeDtypeStruct((8, 1024, 1, 2, 16, 128), FP8)
        large = jax.ShapeDtypeStruct((8, 2**31 // (8 * 2 * 16 * 128) + 1, 1, 2, 16, 128), FP8)
        with caplog.at_level("WARNING"):
            for _ in range(3):
                assert kernels.select_backend(q, small, impl="pallas", device=H200) == "pallas"
        assert sum("Gluon attention kernel is unavailable" in r.message
                   for r in caplog.records) == 1
        with pytest.raises(ImportError, match="needs the Gluon attention kernel"):
            kernels.select_backend(q, large, impl="pallas", device=H200)
    finally:
        monkeypatch.undo()
        kernels.gluon_module.cache_clear()
