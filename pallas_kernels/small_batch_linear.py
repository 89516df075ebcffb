"""`x @ w[layer]` for a few rows: a weight-streaming Triton kernel over a stacked weight.

    parts = linear_parts(x, w_stack, layer)     # f32[splits, M, N]
    y = parts.sum(0)                            # what `linear` returns (in x's dtype)

At a few rows a decode step's matmuls are matrix-vector products: every weight byte is
read once and used M times, so the step is bound by how fast the weights stream. The
kernel reads `w_stack[layer]` ([K, N], row-major) in tiles of BLOCK_K rows x BLOCK_N
columns, each program owning BLOCK_N columns and one K range (a *split*), so that
N / BLOCK_N x K / K_SPLIT programs fill every SM even where N is 4096. Each split writes
its own f32 part: no atomics, and a fixed summation order, so a row's bits depend on
(its x, w, plan) only, never on the batch's other rows; the plan depends on the row
count only through the padding of the dot's rows.

The layer is an i32[1] operand read in the kernel (64-bit offsets: a stack of 36
4096 x 24576 layers has 3.6e9 elements, past what Pallas Triton addresses), so a
scanned step passes the whole stack and no slice of it is ever materialised. Inside a
scan XLA's own matmul reads its slice through a dynamic-slice fusion, which its
autotuner skips (docs/decisions.md, Matmuls at small batch). The parts' sum is left to
the caller's next elementwise fusion (SwiGLU, residual add), where XLA folds it.

GPU only (`gluon_call` compiles it with Triton); `linear_reference` is the pure-jnp
meaning beside it, and the route everywhere else (`models.layers.linear`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.gluon_call import gluon_call

MAX_ROWS = 64         # rows (tokens) the kernel takes; more rows are a matmul's job
TARGET_PROGRAMS = 512  # about 4 programs per SM on an H200 (132 SMs)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, layer_ptr, out_ptr,
                   M: tl.constexpr, M_PAD: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr,
                   USE_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    layer = tl.load(layer_ptr).to(tl.int64)
    w_base = w_ptr + layer * K * N
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, M_PAD)
    ks = tl.arange(0, BLOCK_K)
    if USE_DOT:
        part = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
        for k0 in range(split * K_SPLIT, (split + 1) * K_SPLIT, BLOCK_K):
            k = k0 + ks
            w = tl.load(w_base + k[:, None].to(tl.int64) * N + cols[None, :],
                        mask=col_ok[None, :], other=0.0)
            x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rows[:, None] < M,
                        other=0.0)
            part = tl.dot(x, w, part)
    else:
        acc = tl.zeros([M_PAD, BLOCK_K, BLOCK_N], dtype=tl.float32)
        for k0 in range(split * K_SPLIT, (split + 1) * K_SPLIT, BLOCK_K):
            k = k0 + ks
            w = tl.load(w_base + k[:, None].to(tl.int64) * N + cols[None, :],
                        mask=col_ok[None, :], other=0.0)
            x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rows[:, None] < M,
                        other=0.0)
            acc += x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
        part = tl.sum(acc, axis=1)
    out = out_ptr + split * M * N + rows[:, None] * N + cols[None, :]
    tl.store(out, part, mask=(rows[:, None] < M) & col_ok[None, :])


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """How a [M, K] x [K, N] product is cut: BLOCK_N columns and K_SPLIT rows of the
    weight per program."""

    block_n: int
    block_k: int
    k_split: int
    num_warps: int
    use_dot: bool = False

    def splits(self, k: int) -> int:
        return k // self.k_split


def plan(m: int, k: int, n: int, *, block_n: int = 64, block_k: int = 64,
         num_warps: int = 4, target_programs: int = TARGET_PROGRAMS,
         use_dot: bool = True) -> LinearPlan:
    """The largest K range per program (a power-of-two fraction of K, whole BLOCK_K
    tiles) that still gives about `target_programs` programs. The defaults (mma dots
    over 64 x 64 tiles) read the 8B shape's weights fastest at 1-16 rows on the H200
    (`small_batch_linear.json`)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"small_batch_linear takes 1..{MAX_ROWS} rows, got {m}")
    if k % block_k:
        raise ValueError(f"small_batch_linear: K={k} is not a multiple of BLOCK_K={block_k}")
    column_blocks = -(-n // block_n)
    splits = 1
    while (column_blocks * splits < target_programs and k % (2 * splits * block_k) == 0):
        splits *= 2
    return LinearPlan(block_n, block_k, k // splits, num_warps, use_dot)


def linear_parts(x, w_stack, layer, *, linear_plan: LinearPlan | None = None):
    """f32[splits, M, N] partial products of x [M, K] with w_stack[layer] ([L, K, N]);
    `layer`: i32[1] (or a scalar). Their sum over axis 0 is x @ w_stack[layer]."""
    m, k = x.shape
    n = w_stack.shape[-1]
    if w_stack.shape[1] != k:
        raise ValueError(f"small_batch_linear: x has K={k}, the weight {w_stack.shape}")
    p = linear_plan or plan(m, k, n)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    m_pad = max(1 << (m - 1).bit_length(), 16 if p.use_dot else 1)
    return gluon_call(
        _linear_kernel, x, w_stack, layer,
        out_shape=jax.ShapeDtypeStruct((p.splits(k), m, n), jnp.float32),
        grid=(-(-n // p.block_n), p.splits(k)), num_warps=p.num_warps,
        constexprs={"M": m, "M_PAD": m_pad, "K": k, "N": n, "BLOCK_N": p.block_n,
                    "BLOCK_K": p.block_k, "K_SPLIT": p.k_split, "USE_DOT": p.use_dot},
        name=f"small_batch_linear_m{m}_k{k}_n{n}")


def linear_reference(x, w_stack, layer, splits: int = 1):
    """The parts `linear_parts` computes: f32 products of x with K-range `s` of the
    layer's weight, s < splits."""
    w = jax.lax.dynamic_index_in_dim(w_stack, jnp.asarray(layer).reshape(()), keepdims=False)
    m, k = x.shape
    xs = x.astype(jnp.float32).reshape(m, splits, k // splits).transpose(1, 0, 2)
    ws = w.astype(jnp.float32).reshape(splits, k // splits, -1)
    return jnp.einsum("smk,skn->smn", xs, ws, precision=jax.lax.Precision.HIGHEST)


def linear(x, w_stack, layer):
    """x [M, K] @ w_stack[layer], in x's dtype (f32 accumulation)."""
    return linear_parts(x, w_stack, layer).sum(0).astype(x.dtype)
