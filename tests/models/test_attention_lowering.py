"""models/attention.py: which kernel a layer's attention (and its draft block) takes."""

import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from unified_kv import LayerSpec

pg = pytest.importorskip("pallas_kernels.paged_attention_gluon",
                         reason="pip install '.[inspect]' (a Triton with Gluon)")


def args():
    q = jnp.ones((2, 1, 8, 32), jnp.bfloat16)
    pool = jnp.zeros((2, 4, 1, 2, 8, 32), jnp.float8_e4m3fn)
    return q, pool, jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32), jnp.ones(
        (2,), jnp.int32)


LAYER = LayerSpec(name="t0", role="target", num_kv_heads=2, head_dim=32, kv_dtype="fp8_e4m3")


def test_pallas_impl_routes_decode_to_gluon_when_use_gluon_says_so(monkeypatch):
    calls = []

    def fake_gluon(q, pool, table, kv_lens, q_lens, **kw):
        calls.append(kw)
        return jnp.full(q.shape, 7.0, q.dtype)

    monkeypatch.setattr(pg, "paged_attention_gluon", fake_gluon)
    monkeypatch.setattr(pg, "use_gluon", lambda q, pool, draft_block=False: not draft_block)
    out = attention.attend(*args(), LAYER, 0, impl="pallas")
    assert np.all(np.asarray(out, np.float32) == 7.0)
    assert "interpret" not in calls[0] and calls[0]["layer_offset"] == 0


def test_pallas_impl_routes_the_draft_block_to_gluon_when_use_gluon_says_so(monkeypatch):
    calls = []

    def fake_gluon(q, pool, table, ctx_lens, block_lens, block_k, block_v, **kw):
        calls.append(kw)
        return jnp.full(q.shape, 5.0, q.dtype)

    monkeypatch.setattr(pg, "draft_block_attention_gluon", fake_gluon)
    monkeypatch.setattr(pg, "use_gluon", lambda q, pool, draft_block=False: draft_block)
    q, pool, table, lens, _ = args()
    block_kv = jnp.ones((2, 1, 2, 32), jnp.bfloat16)
    out = attention.attend_draft_block(q, pool, table, lens, lens, block_kv, block_kv, LAYER, 0,
                                       causal_in_block=True, impl="pallas")
    assert np.all(np.asarray(out, np.float32) == 5.0)
    assert "interpret" not in calls[0] and calls[0]["causal_in_block"]


def test_interpret_impl_never_takes_gluon(monkeypatch):
    monkeypatch.setattr(pg, "use_gluon", lambda q, pool, draft_block=False: True)
    monkeypatch.setattr(pg, "paged_attention_gluon", lambda *a, **k: pytest.fail("gluon"))
    out = attention.attend(*args(), LAYER, 0, impl="interpret")
    assert out.shape == (2, 1, 8, 32)


def test_use_gluon_off_the_gpu():
    q, pool = args()[:2]
    assert not pg.use_gluon(q, pool)  # CPU backend (the GPU rule is tested on the H200)
