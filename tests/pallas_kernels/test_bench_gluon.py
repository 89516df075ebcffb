"""The attention benchmarks on CPU: bench_gluon_attention's rows are whole and their
errors real, with the Gluon kernel (GPU only) stood in for by the Pallas kernels in
interpret mode and timing stubbed (the GPU runs time them); bench_paged_attention's
jax-op baseline computes the same attention as ours."""

import jax.numpy as jnp
import pytest

pytest.importorskip("triton.experimental.gluon._runtime",
                    reason="a Triton with Gluon (triton>=3.5)")

import benchmarks.bench_gluon_attention as bench  # noqa: E402
from pallas_kernels.paged_attention import (  # noqa: E402
    draft_block_attention, paged_attention)


@pytest.fixture
def on_cpu(monkeypatch):
    def interpreted(kernel):
        return lambda *a, **k: kernel(*a, interpret=True, **k)

    monkeypatch.setattr(bench, "paged_attention_gluon", interpreted(paged_attention))
    monkeypatch.setattr(bench, "draft_block_attention_gluon", interpreted(draft_block_attention))
    monkeypatch.setattr(bench, "time_alternating", lambda fns, *a: dict.fromkeys(fns, 1.0))
    monkeypatch.setattr(bench, "setup", lambda ctx, dtype, max_q=1, **kw: setup(
        ctx, dtype, max_q=max_q, batch=2, **kw))
    monkeypatch.setattr(bench, "draft_block_attention", interpreted(draft_block_attention))
    monkeypatch.setattr(bench, "decode_baselines", lambda *a: {"jax_op_ms": 2.0})


setup = bench.setup


def test_bench_rows(on_cpu):
    row = bench.bench(128, jnp.bfloat16, copy_bw=1e12)
    for kernel in ("gluon", "pallas"):
        for name in ("decode", "verify8", "draft8"):
            assert row[f"{kernel}_{name}_rel_err"] < 1e-2
        assert row[f"{kernel}_draft8_over_decode"] == 1.0
    assert row["gluon_speedup_vs_jax_op"] == 2.0
    prefill = bench.bench_prefill(64, 64, jnp.float8_e4m3fn, batch=1)
    assert prefill["gluon_rel_err_vs_dense"] < 1e-2 and prefill["pallas_over_gluon"] == 1.0


def test_pages_in_order(on_cpu):
    _, _, table, _, _ = setup(64, jnp.bfloat16, batch=2, pages_in_order=True)
    assert table.tolist() == [[0, 2, 4, 6], [8, 10, 12, 14]]  # page * 2L, L = 1
    _, _, shuffled, _, _ = setup(64, jnp.bfloat16, batch=2)
    assert sorted(shuffled.ravel().tolist()) == list(range(0, 16, 2))
    assert shuffled.tolist() != table.tolist()
    row = bench.bench(128, jnp.bfloat16, copy_bw=1e12, pages_in_order=True)
    assert row["pages"] == "in order" and row["gluon_decode_rel_err"] < 1e-2


def test_jax_op_baseline_is_scaled_like_the_reference():
    """The jax-op decode baseline (`jax_op_decode`) applies no softmax scale of its own,
    so q is scaled for it; unscaled, its relative errors were 8-50."""
    import jax

    from benchmarks.bench_paged_attention import jax_op_decode, reference_rel_err
    from pallas_kernels.kv_store import layer_kv

    q, pool, table, kv_lens, _ = setup(256, jnp.bfloat16, max_q=8, batch=2)
    fn, args = jax_op_decode(q[:, :1], *layer_kv(pool, 0), table, kv_lens,
                             interpret=jax.default_backend() == "cpu")
    err = reference_rel_err(fn(*args)[:, None], q[:, :1], pool, table, kv_lens,
                            jnp.ones_like(kv_lens))
    assert err < 1e-2
