"""Call a Gluon kernel (Triton's layout-explicit language) from JAX on a CUDA GPU.

    out = gluon_call(kernel, q, k_pool, table, 32768, out_shape=jax.ShapeDtypeStruct(...),
                     grid=(512,), num_warps=2, constexprs={"ROWS": 16})

Arrays pass as pointers (each a whole XLA buffer, 16-byte aligned), Python ints and floats
as i32 / fp32 scalars fixed at trace time, and one pointer per output follows the inputs,
as in `jax_triton.triton_call`. The kernel is compiled by Triton's own Gluon pipeline
(`triton.compile`, cached per signature) and launched through jaxlib's Triton kernel call,
the custom call jax-triton uses.

Why not `jax_triton.triton_call`: jax-triton 0.4.1 (the first with Gluon, for Triton >= 3.7)
runs a Gluon kernel's IR through Triton's TTIR -> TTGIR optimizer, which re-lays-out the
kernel's tensors and the hand-chosen layouts are lost (fp8 verify about 1.45x slower on
the H200: docs/decisions.md). The H200's image has Triton 3.6.

Needs `triton` with Gluon (>= 3.5; the GPU machine's own) and jaxlib's CUDA plugin;
on another backend the call fails at lowering with an error that says so.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

_POINTER_TYPES = {jnp.dtype(jnp.float32): "*fp32", jnp.dtype(jnp.float16): "*fp16",
                  jnp.dtype(jnp.bfloat16): "*bf16", jnp.dtype(jnp.float8_e4m3fn): "*fp8e4nv",
                  jnp.dtype(jnp.int32): "*i32", jnp.dtype(jnp.int64): "*i64",
                  jnp.dtype(jnp.uint8): "*u8", jnp.dtype(jnp.int8): "*i8"}

def _scalar_type(scalar) -> str:
    """Triton's type of a scalar argument (gluon_call keeps ints and floats only)."""
    return "i32" if isinstance(scalar, int) else "fp32"


gluon_call_p = Primitive("gluon_call")
gluon_call_p.multiple_results = True


def gluon_call(kernel, *args, out_shape, grid, num_warps, constexprs=None, name=None):
    """Launch `kernel` over `grid` with `args` then one pointer per output; returns the
    outputs (a tuple if out_shape is a sequence, else one array)."""
    single = not isinstance(out_shape, (tuple, list))
    outs = (out_shape,) if single else tuple(out_shape)
    arrays, arg_slots = [], []   # per argument: None for an array, else the scalar
    for arg in args:
        if isinstance(arg, (jax.Array, np.ndarray)) or hasattr(arg, "aval"):
            if jnp.dtype(arg.dtype) not in _POINTER_TYPES:
                raise TypeError(f"gluon_call: no Triton pointer type for an array of "
                                f"{arg.dtype}; pass one of {sorted(map(str, _POINTER_TYPES))}")
            arrays.append(arg)
            arg_slots.append(None)
        elif isinstance(arg, (bool, np.bool_)) or not isinstance(arg, (int, float, np.number)):
            raise TypeError(f"gluon_call: arguments are arrays, ints or floats; got {arg!r} "
                            "(pass flags as constexprs)")
        else:  # a scalar, fixed in this trace
            arg_slots.append(int(arg) if isinstance(arg, (int, np.integer)) else float(arg))
    grid = tuple(grid) + (1,) * (3 - len(grid))
    results = gluon_call_p.bind(
        *arrays, kernel=kernel, arg_slots=tuple(arg_slots), grid=grid, num_warps=num_warps,
        constexprs=tuple(sorted((constexprs or {}).items())),
        out_avals=tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in outs),
        name=name or kernel.__name__)
    return results[0] if single else tuple(results)


@gluon_call_p.def_abstract_eval
def _abstract_eval(*avals, out_avals, **_):
    return list(out_avals)


def signature(kernel, in_avals, arg_slots, out_avals, constexprs):
    """Triton's signature of the call: parameter name -> type ("*fp16", "i32", ...).
    `arg_slots` has one entry per input argument: None for an array, else the scalar."""
    names = list(kernel.arg_names)
    types, arrays = [], iter(in_avals)
    for scalar in arg_slots:
        if scalar is None:
            types.append(_POINTER_TYPES[jnp.dtype(next(arrays).dtype)])
        else:
            types.append(_scalar_type(scalar))
    types += [_POINTER_TYPES[jnp.dtype(o.dtype)] for o in out_avals]
    constexpr_names = {n for n, _ in constexprs}
    runtime = [n for n in names if n not in constexpr_names]
    if len(runtime) != len(types):
        raise TypeError(f"gluon_call: {kernel.__name__} takes {len(runtime)} runtime "
                        f"arguments ({', '.join(runtime)}) but got {len(types)} (inputs, "
                        "then one per output)")
    sig = dict(zip(runtime, types))
    sig.update({n: "constexpr" for n in constexpr_names})
    return {n: sig[n] for n in names}


@functools.lru_cache(maxsize=None)
def compile_gluon(kernel, sig_items: tuple, constexprs: tuple, num_warps: int, capability: int):
    """Triton's own compile of a Gluon kernel for `capability` (e.g. 90); every pointer is
    declared 16-byte aligned, as XLA's buffers are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(sig_items)
    pointers = [(i,) for i, t in enumerate(sig.values()) if t.startswith("*")]
    source = GluonASTSource(fn=kernel, signature=sig, constexprs=dict(constexprs),
                            attrs={p: [["tt.divisibility", 16]] for p in pointers})
    # FMA fusion pinned on: Triton's default changes in 3.10, and decode and verify
    # must keep the arithmetic their bit-for-bit tests were measured with.
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": True})


def _cuda_lowering(ctx, *arrays, kernel, arg_slots, grid, num_warps, constexprs, out_avals, name):
    from jax._src.lib import gpu_triton

    capability = gpu_triton.get_compute_capability(0)
    sig = signature(kernel, ctx.avals_in, arg_slots, out_avals, constexprs)
    compiled = compile_gluon(kernel, tuple(sig.items()), constexprs, num_warps, capability)
    meta = compiled.metadata
    kernel_args = [meta.name, num_warps, 1, meta.shared, compiled.asm["ptx"], "", capability]
    scratch = getattr(meta, "global_scratch_size", 0) or 0
    if scratch:
        kernel_args += [scratch, getattr(meta, "global_scratch_align", 1)]
    params = []
    for scalar in arg_slots:
        if scalar is None:
            params.append(gpu_triton.create_array_parameter(0, 16))
        else:
            params.append(gpu_triton.create_scalar_parameter(scalar, _scalar_type(scalar)))
    params += [gpu_triton.create_array_parameter(0, 16) for _ in out_avals]
    call = gpu_triton.TritonKernelCall(gpu_triton.TritonKernel(*kernel_args), *grid, params)
    rule = jax.ffi.ffi_lowering("triton_kernel_call_ffi", api_version=4)
    return rule(ctx, *arrays, opaque=zlib.compress(call.to_proto(name, b"")))


def _no_gpu_lowering(ctx, *arrays, name, **_):
    raise NotImplementedError(
        f"gluon_call({name}) runs on a CUDA GPU only (it launches a compiled Triton kernel); "
        f"this computation is lowered for {ctx.module_context.platforms}. Use the Pallas "
        "kernels (interpret=True on CPU) there.")


mlir.register_lowering(gluon_call_p, _cuda_lowering, platform="cuda")
mlir.register_lowering(gluon_call_p, _no_gpu_lowering, platform="cpu")
