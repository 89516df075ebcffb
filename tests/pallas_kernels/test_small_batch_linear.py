"""pallas_kernels/small_batch_linear.py: x @ w_stack[layer] streamed by a Triton kernel.
The plan and Triton's compile for sm_90 run anywhere the test extra's Triton is
installed; the launch against `linear_reference` on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="Triton compiles the kernel")
from pallas_kernels import gluon_call as gc  # noqa: E402
from pallas_kernels import small_batch_linear as sbl  # noqa: E402


def test_plan_fills_the_sms_with_whole_tiles_and_ignores_the_row_count():
    p = sbl.plan(1, 4096, 24576)
    assert (p.block_n, p.block_k, p.use_dot) == (64, 64, True)
    assert p.splits(4096) == 2 and p.k_split == 2048      # 384 columns x 2 = 768 programs
    assert sbl.plan(4, 4096, 4096).splits(4096) == 8      # 64 columns x 8 = 512
    assert sbl.plan(16, 4096, 4096) == sbl.plan(1, 4096, 4096)
    # a K with few whole tiles stops splitting where the next split would break a tile
    assert sbl.plan(1, 192, 64).splits(192) == 1
    with pytest.raises(ValueError, match="1..64 rows"):
        sbl.plan(65, 4096, 4096)
    with pytest.raises(ValueError, match="not a multiple of BLOCK_K"):
        sbl.plan(1, 100, 64)


def test_reference_parts_sum_to_the_matmul():
    x = jax.random.normal(jax.random.key(0), (3, 256), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (4, 256, 96), jnp.float32)
    parts = sbl.linear_reference(x, w, jnp.int32(2), splits=4)
    assert parts.shape == (4, 3, 96)
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(x) @ np.asarray(w[2]),
                               rtol=1e-5, atol=1e-4)


def test_compiles_for_hopper_with_64_bit_weight_offsets():
    p = sbl.plan(1, 4096, 24576)
    constexprs = (("M", 1), ("M_PAD", 16), ("K", 4096), ("N", 24576),
                  ("BLOCK_N", p.block_n), ("BLOCK_K", p.block_k), ("K_SPLIT", p.k_split),
                  ("USE_DOT", True))
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "layer_ptr": "*i32", "out_ptr": "*fp32",
           **{name: "constexpr" for name, _ in constexprs}}
    compiled = gc.compile_gluon(sbl._linear_kernel, tuple(sig.items()), constexprs,
                                p.num_warps, 90)
    assert ".target sm_90" in compiled.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in compiled.asm["ptx"]
    # the layer's base offset is computed in 64 bits: 36 layers of 4096 x 24576 pass 2^31
    ttgir = compiled.asm["ttgir"]
    assert "arith.extsi %layer : i32 to i64" in ttgir
    assert "tt.addptr %w_ptr, %w_base : !tt.ptr<bf16>, i64" in ttgir


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("k,n", [(4096, 6144), (1024, 24576 // 8), (3072, 640)])
def test_kernel_matches_the_reference(rows, k, n):
    keys = jax.random.split(jax.random.key(rows * k + n), 2)
    x = jax.random.normal(keys[0], (rows, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (3, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    layer = jnp.array([1], jnp.int32)
    p = sbl.plan(rows, k, n)
    got = jax.jit(sbl.linear_parts)(x, w, layer)
    want = sbl.linear_reference(x, w, layer, splits=p.splits(k))
    assert got.shape == want.shape == (p.splits(k), rows, n)
    # f32 accumulation of exact bf16 products: only the summation order differs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_a_row_has_the_same_bits_alone_and_among_sixteen():
    x = jax.random.normal(jax.random.key(3), (16, 4096), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(4), (2, 4096, 4096)) / 64).astype(jnp.bfloat16)
    layer = jnp.array([1], jnp.int32)
    alone = jax.jit(sbl.linear)(x[5:6], w, layer)
    among = jax.jit(sbl.linear)(x, w, layer)
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(among[5]))


@pytest.mark.gpu
def test_layers_past_two_to_the_31_elements_are_read_where_they_are():
    # 3 layers of 32768 x 24576: the last layer starts at 1.6e9 elements and ends past
    # 2^31, where 32-bit offsets would wrap into another layer
    k, n = 32768, 24576
    w = jnp.broadcast_to(jnp.arange(1, 4, dtype=jnp.bfloat16)[:, None, None], (3, k, n))
    x = jnp.ones((1, k), jnp.bfloat16)
    out = jax.jit(sbl.linear)(x, w, jnp.array([2], jnp.int32))
    assert float(out.min()) == float(out.max()) == 3.0 * k
