"""What the Gluon attention kernel (`paged_attention_gluon.py`) does to one key block,
as Gluon device functions: copy its K and V^T pages into shared memory, cap and mask its
logits, take one online-softmax step, and add p @ V.

The pool per kv head is [kernel pages, PAGE * D] (`pool_layout.py`): K pages key-major,
V pages transposed. A block is PPB pages on a grid aligned to page 0; table entries past
the row's blocks or the table read BAD, and BAD entries read the null page (page 0, all
zeros), so a masked key never brings NaN or Inf into the softmax. Offsets are 64-bit.
"""

from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from pallas_kernels.pool_layout import BAD_PAGE_INDEX

# Names that moved between Triton releases (3.6 on the H200, 3.9 on a CPU machine).
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

LOG2E = math.log2(math.e)
# The same values for the kernels (Gluon reads only constexpr globals).
MASK_ = gl.constexpr(-0.7 * 3.4028234663852886e38)  # finite: a row with no key stays exact
BAD_ = gl.constexpr(BAD_PAGE_INDEX)
LOG2E_ = gl.constexpr(LOG2E)


@gluon.jit
def page_entries(table_row, block, key, hi_block, table_width, PAGE: gl.constexpr,
                 PPB: gl.constexpr):
    """Table entry of each key's page (BAD past the row's blocks or the table)."""
    index = block * PPB + key // PAGE
    return gl.load(table_row + index, mask=(block < hi_block) & (index < table_width),
                   other=BAD_)


@gluon.jit
def kernel_pages(entries, layer_pages):
    """Kernel page ids (page * 2L + 2 * layer offset) of table entries, 64-bit; BAD entries
    (in front of a window, past a row's last page) read the null page (page 0, zeros)."""
    return (gl.where(entries == BAD_, 0, entries) + layer_pages).to(gl.int64)


@gluon.jit
def copy_block(k_slot, v_slot, head_pool, table_row, block, hi_block, table_width,
               layer_pages, kj, kd, vpage, vd, vj, PAGE: gl.constexpr, PPB: gl.constexpr,
               D: gl.constexpr):
    """Start one block's K [BK, D] and V^T [PPB * D, PAGE] copies (none past hi_block).
    Its table entries load here, not a block ahead: fewer registers stay live across the
    kernel's loop (docs/decisions.md)."""
    k_page = kernel_pages(page_entries(table_row, block, kj, hi_block, table_width,
                                       PAGE, PPB), layer_pages)
    k_off = (k_page * (PAGE * D) + (kj % PAGE) * D)[:, None] + kd[None, :]
    async_load(k_slot, head_pool + k_off, mask=(kj[:, None] * 0 + block) < hi_block)
    v_page = kernel_pages(page_entries(table_row, block, vpage * PAGE, hi_block,
                                       table_width, PAGE, PPB), layer_pages) + 1
    v_off = ((v_page * (PAGE * D))[:, None, None] + (vd * PAGE)[None, :, None]
             + vj[None, None, :])
    v_off = gl.max_contiguous(gl.multiple_of(v_off, [1, 1, PAGE]), [1, 1, PAGE])
    async_load(v_slot.reshape([PPB, D, PAGE]), head_pool + v_off,
               mask=(vd[None, :, None] * 0 + block) < hi_block)
    async_copy.commit_group()


@gluon.jit
def cap_logits(logits, cap_log2e, HAS_CAP: gl.constexpr):
    """Base-2 logits after the soft cap: tanh(x) x cap_log2e, tanh(x) = 1 - 2 / (e^2x + 1)."""
    if HAS_CAP:
        logits = (1.0 - 2.0 / (gl.exp2(logits * (2.0 * LOG2E_)) + 1.0)) * cap_log2e
    return logits


@gluon.jit
def mask_logits(logits, k_pos, upper, q_pos, window, HAS_WINDOW: gl.constexpr):
    """Logits [ROWS, keys] with the keys a row does not see (k_pos > upper, or not in
    its window) at MASK_."""
    visible = k_pos[None, :] <= upper[:, None]
    if HAS_WINDOW:
        visible = visible & (k_pos[None, :] > (q_pos - window)[:, None])
    return gl.where(visible, logits, MASK_)


@gluon.jit
def softmax_step(logits, m_i, l_i, SUM_BY_MMA: gl.constexpr):
    """One online-softmax step over a key block's masked, capped base-2 logits [ROWS, keys]:
    returns p, the accumulator's correction, and the new running max and sum."""
    m_new = gl.maximum(m_i, gl.max(logits, axis=1))
    # A row with nothing visible yet keeps m == MASK_: subtract 0 so its masked
    # logits still underflow to p == 0.
    m_sub = gl.where(m_new == MASK_, 0.0, m_new)
    corr = gl.exp2(m_i - m_sub)
    p = gl.exp2(logits - m_sub[:, None])
    if SUM_BY_MMA:  # the caller sums p on the tensor cores
        return p, corr, m_new, l_i
    return p, corr, m_new, l_i * corr + gl.sum(p, axis=1)


@gluon.jit
def pv_step(p, v, corr, acc, l_acc, CDT: gl.constexpr, a_layout: gl.constexpr,
            b_layout: gl.constexpr, SUM_COLS: gl.constexpr, SUM_BY_MMA: gl.constexpr):
    """acc x corr + p @ v for p [ROWS, keys] and v [keys, D], both taken to the dots' dtype
    CDT (v after p: that order keeps ptxas's schedule); with SUM_BY_MMA also l_acc x corr +
    p @ ones, p's row sums in the tensor cores' order."""
    p_op = gl.convert_layout(p.to(CDT), a_layout)
    v = v.to(CDT)
    acc = mma_v2(p_op, v, acc * corr[:, None])
    if SUM_BY_MMA:
        ones = gl.full([v.shape[0], SUM_COLS], 1.0, CDT, layout=b_layout)
        l_acc = mma_v2(p_op, ones, l_acc * corr[:, None])
    return acc, l_acc
