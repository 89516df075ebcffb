"""pallas_kernels/gluon_call.py: a Gluon kernel called from JAX. The signature, Triton's
compile for sm_90 and the CPU error run anywhere Triton with Gluon is installed
(the test extra's Triton); the launch itself on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gluon_call as gc

gluon_runtime = pytest.importorskip(
    "triton.experimental.gluon._runtime",
    reason="a Triton with Gluon (triton>=3.5) to compile Gluon kernels")
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402


@gluon.jit
def scaled_add(x_ptr, y_ptr, n, scale, out_ptr, BLOCK: gl.constexpr):
    """out = x * scale + y over n elements."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    mask = offs < n
    x = gl.load(x_ptr + offs, mask=mask)
    gl.store(out_ptr + offs, x * scale + gl.load(y_ptr + offs, mask=mask), mask=mask)


def call(x, y, scale=2.5):
    return gc.gluon_call(scaled_add, x, y, x.size, scale, grid=(pl_cdiv(x.size, 512),),
                         out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), num_warps=4,
                         constexprs={"BLOCK": 512})


def pl_cdiv(a, b):
    return -(-a // b)


def test_signature_orders_inputs_scalars_then_outputs():
    x = jax.core.ShapedArray((1000,), jnp.float32)
    out = jax.core.ShapedArray((1000,), jnp.float32)
    sig = gc.signature(scaled_add, [x, x], (None, None, 1000, 2.5), [out], (("BLOCK", 512),))
    assert sig == {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "scale": "fp32",
                   "out_ptr": "*fp32", "BLOCK": "constexpr"}
    with pytest.raises(TypeError, match="takes 5 runtime arguments"):
        gc.signature(scaled_add, [x], (None, 1000, 2.5), [out], (("BLOCK", 512),))


def test_bad_arguments_are_named():
    x = jnp.ones(8, jnp.float32)
    with pytest.raises(TypeError, match="pass flags as constexprs"):
        gc.gluon_call(scaled_add, x, True, out_shape=x, grid=(1,), num_warps=4)
    with pytest.raises(TypeError, match="no Triton pointer type"):
        gc.gluon_call(scaled_add, jnp.ones(8, jnp.complex64), out_shape=x, grid=(1,),
                      num_warps=4)


def test_compiles_for_hopper_with_aligned_pointers():
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "scale": "fp32",
           "out_ptr": "*fp32", "BLOCK": "constexpr"}
    compiled = gc.compile_gluon(scaled_add, tuple(sig.items()), (("BLOCK", 512),), 4, 90)
    assert compiled.metadata.name == "scaled_add"
    assert ".target sm_90" in compiled.asm["ptx"]
    # every pointer declared 16-byte aligned, the scalars not
    head = next(line for line in compiled.asm["ttgir"].splitlines() if "tt.func" in line)
    assert head.count("tt.divisibility = 16") == 3 and "%n: i32 loc" in head


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU error path")
def test_on_cpu_says_it_needs_a_gpu():
    x = jnp.arange(1000, dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match="runs on a CUDA GPU only"):
        jax.jit(call)(x, x)


@pytest.mark.gpu
def test_launch_matches_numpy():
    x = jax.random.normal(jax.random.key(0), (1000,), jnp.float32)
    y = jax.random.normal(jax.random.key(1), (1000,), jnp.float32)
    out = jax.jit(call)(x, y)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * 2.5 + np.asarray(y),
                               rtol=1e-5, atol=1e-6)  # x * scale + y may fuse
