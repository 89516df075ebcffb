"""Probe (not kept): fp8 paged attention for decode / verify with Hopper wgmma, queries as
the dots' N: S^T = K Q^T (K fp8 -> f16 in registers, each warp 16 keys; Q^T in shared
memory), O^T = V^T P^T (V^T in registers, P^T through shared memory). Timed against the
shipped Gluon kernel on the bench's data; checked against the reference."""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, fence_async_shared
from pallas_kernels.gluon_key_block import (LOG2E, MASK_, async_load, cta_barrier,
                                            kernel_pages, page_entries)


@gluon.jit
def copy_kv(k_slot, v_slot, head_pool, table_row, block, hi_block, table_width, layer_pages,
            kj, kd, vd, vk, PAGE: gl.constexpr, PPB: gl.constexpr, D: gl.constexpr):
    k_page = kernel_pages(page_entries(table_row, block, kj, hi_block, table_width,
                                       PAGE, PPB), layer_pages)
    k_off = (k_page * (PAGE * D) + (kj % PAGE) * D)[:, None] + kd[None, :]
    async_load(k_slot, head_pool + k_off, mask=(kj[:, None] * 0 + block) < hi_block)
    v_page = kernel_pages(page_entries(table_row, block, vk, hi_block, table_width,
                                       PAGE, PPB), layer_pages) + 1
    v_off = (v_page * (PAGE * D) + vk % PAGE)[None, :] + (vd * PAGE)[:, None]   # [D, BK]
    async_load(v_slot, head_pool + v_off, mask=(vd[:, None] * 0 + block) < hi_block)
    async_copy.commit_group()


@gluon.jit
def wg_kernel(q_ptr, pool_ptr, table_ptr, kv_lens_ptr, q_lens_ptr, table_width, head_pages,
              logit_scale, v_scale, o_ptr, MAX_Q: gl.constexpr, HQ: gl.constexpr,
              GQA: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, PPB: gl.constexpr,
              N: gl.constexpr, STAGES: gl.constexpr, KW: gl.constexpr, A_SMEM: gl.constexpr):
    BK: gl.constexpr = PPB * PAGE
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, N, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=KW)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D], gl.float16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, N], gl.float16)
    k_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=2, max_phase=4, order=[1, 0])
    k_ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])    # [BK, D]
    v_ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])    # [D, BK]
    q_ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])    # [N, D]
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BK, D], k_sl)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BK], v_sl)
    q_smem = gl.allocate_shared_memory(gl.float16, [N, D], q_sl)
    p_smem = gl.allocate_shared_memory(gl.float16, [BK, N], p_sl)
    k16_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, D], gl.float16)
    v16_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, BK], gl.float16)
    k16_smem = gl.allocate_shared_memory(gl.float16, [BK, D], k16_sl)
    v16_smem = gl.allocate_shared_memory(gl.float16, [D, BK], v16_sl)

    b, h = gl.program_id(0), gl.program_id(1)
    kv_len = gl.load(kv_lens_ptr + b)
    q_len = gl.load(q_lens_ptr + b)
    q_start = kv_len - q_len
    table_row = table_ptr + b * table_width
    head_pool = pool_ptr + h.to(gl.int64) * head_pages * (PAGE * D)

    r = gl.arange(0, N, layout=gl.SliceLayout(1, q_ld))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, q_ld))
    tok = r // GQA
    q_row = (b * MAX_Q + tok) * HQ + h * GQA + r % GQA
    q = gl.load(q_ptr + q_row[:, None] * D + c[None, :], mask=(tok < q_len)[:, None], other=0.0)
    q_smem.store((q.to(gl.float32) * logit_scale).to(gl.float16))
    fence_async_shared()

    key_end = kv_len
    hi_block = gl.cdiv(gl.cdiv(key_end, PAGE), PPB)
    kj = gl.arange(0, BK, layout=gl.SliceLayout(1, k_ld))
    kd = gl.arange(0, D, layout=gl.SliceLayout(0, k_ld))
    vd = gl.arange(0, D, layout=gl.SliceLayout(1, v_ld))
    vk = gl.arange(0, BK, layout=gl.SliceLayout(0, v_ld))
    for stage in gl.static_range(STAGES - 1):
        copy_kv(k_smem.index(stage), v_smem.index(stage), head_pool, table_row, stage,
                hi_block, table_width, 0, kj, kd, vd, vk, PAGE, PPB, D)

    cols = gl.arange(0, N, layout=gl.SliceLayout(0, acc_l))
    valid = (cols // GQA) < q_len
    upper = gl.where(valid, q_start + cols // GQA, -1)
    keys = gl.arange(0, BK, layout=gl.SliceLayout(1, acc_l))
    acc = gl.zeros([D, N], gl.float32, layout=acc_l)
    m_i = gl.full([N], MASK_, gl.float32, layout=gl.SliceLayout(0, acc_l))
    l_i = gl.zeros([N], gl.float32, layout=gl.SliceLayout(0, acc_l))
    for i in range(hi_block):
        async_copy.wait_group(STAGES - 2)
        cta_barrier()
        nxt = i + STAGES - 1
        copy_kv(k_smem.index(nxt % STAGES), v_smem.index(nxt % STAGES), head_pool, table_row,
                nxt, hi_block, table_width, 0, kj, kd, vd, vk, PAGE, PPB, D)
        slot = i % STAGES
        if A_SMEM:  # both blocks converted once into shared memory in the dots' layout
            k16_smem.store(k_smem.index(slot).load(k_ld).to(gl.float16))
            v16_smem.store(v_smem.index(slot).load(v_ld).to(gl.float16))
            fence_async_shared()
            cta_barrier()
            s = warpgroup_mma(k16_smem, q_smem.permute((1, 0)),
                              gl.zeros([BK, N], gl.float32, layout=acc_l))
        else:
            k = k_smem.index(slot).load(a_l).to(gl.float16)
            s = warpgroup_mma(k, q_smem.permute((1, 0)),
                              gl.zeros([BK, N], gl.float32, layout=acc_l))
        k_pos = i * BK + keys
        s = gl.where(k_pos[:, None] <= upper[None, :], s, MASK_)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_sub = gl.where(m_new == MASK_, 0.0, m_new)
        corr = gl.exp2(m_i - m_sub)
        p = gl.exp2(s - m_sub[None, :])
        l_i = l_i * corr + gl.sum(p, axis=0)
        p_smem.store(p.to(gl.float16))
        fence_async_shared()
        cta_barrier()
        if A_SMEM:
            acc = warpgroup_mma(v16_smem, p_smem, acc * corr[None, :])
        else:
            vt = v_smem.index(slot).load(a_l).to(gl.float16)
            acc = warpgroup_mma(vt, p_smem, acc * corr[None, :])
        m_i = m_new
    async_copy.wait_group(0)
    has = l_i > 0
    out = gl.where(has[None, :], acc * (v_scale / gl.where(has, l_i, 1.0))[None, :], 0.0)
    dd = gl.arange(0, D, layout=gl.SliceLayout(1, acc_l))
    o_row = (b * MAX_Q + cols // GQA) * HQ + h * GQA + cols % GQA
    gl.store(o_ptr + o_row[None, :] * D + dd[:, None], out.to(o_ptr.dtype.element_ty),
             mask=((cols // GQA) < MAX_Q)[None, :] & valid[None, :])


def wg_attention(q, pool, table, kv_lens, q_lens, kw=2, stages=3, a_smem=False):
    from pallas_kernels.gluon_call import gluon_call
    from pallas_kernels.pool_layout import pow2_at_least
    batch, max_q, hq, d = q.shape
    hkv, num_pages, num_layers, _, page, _ = pool.shape
    gqa = hq // hkv
    n = max(8, pow2_at_least(max_q * gqa))
    scalars = (table.shape[1], num_pages * num_layers * 2, float(LOG2E / np.sqrt(d)), 1.0)
    cx = dict(MAX_Q=max_q, HQ=hq, GQA=gqa, D=d, PAGE=page, PPB=64 // page, N=n,
              STAGES=stages, KW=kw, A_SMEM=a_smem)
    return gluon_call(wg_kernel, q, pool, table, kv_lens, q_lens, *scalars,
                      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(batch, hkv),
                      num_warps=4, constexprs=cx, name=f"wg_attention_q{max_q}")


if __name__ == "__main__":
    from benchmarks.bench_paged_attention import FP8, setup, reference_rel_err
    from benchmarks.timing import time_alternating
    from pallas_kernels.paged_attention_gluon import paged_attention_gluon
    kw = int(os.environ.get("KW", "2"))
    out = {"device": jax.devices()[0].device_kind, "rows": []}
    for ctx in [int(c) for c in sys.argv[1:]] or [4096, 32768]:
        q, pool, table, kv_lens, _ = setup(ctx, FP8, max_q=16)
        batch = q.shape[0]
        row = {"ctx": ctx}
        res = {}
        for name, tokens in (("decode", 1), ("verify8", 8), ("verify16", 16)):
            qq = q[:, 16 - tokens:]
            args = (qq, pool, table, kv_lens, jnp.full((batch,), tokens, jnp.int32))
            fns = {"shipped": jax.jit(lambda *a: paged_attention_gluon(*a, layer_offset=0)),
                   "wgmma": jax.jit(lambda *a: wg_attention(*a, kw=2)),
                   "wgmma_smem": jax.jit(lambda *a: wg_attention(*a, a_smem=True)),
                   "wgmma_smem_s2": jax.jit(lambda *a: wg_attention(*a, a_smem=True,
                                                                    stages=2))}
            for k, f in list(fns.items()):
                try:
                    res[(name, k)] = np.asarray(f(*args).astype(jnp.float32))
                except Exception as e:
                    print(k, "FAILED", str(e)[-600:], flush=True)
                    del fns[k]
                    continue
                row[f"{name}_{k}_rel_err"] = float(reference_rel_err(f(*args), *args))
            for k, ms in time_alternating(fns, *args).items():
                row[f"{name}_{k}_ms"] = ms
            print(ctx, name, {k: v for k, v in row.items() if k.startswith(name)}, flush=True)
        for k in ("shipped", "wgmma", "wgmma_smem", "wgmma_smem_s2"):
            for name in ("verify8", "verify16"):
                if (name, k) not in res or ("decode", k) not in res:
                    continue
                row[f"{name}_{k}_over_decode"] = row[f"{name}_{k}_ms"] / row[f"decode_{k}_ms"]
                row[f"{name}_{k}_last_eq_decode"] = bool(np.array_equal(
                    res[(name, k)][:, -1], res[("decode", k)][:, 0]))
        print(json.dumps(row, indent=1), flush=True)
        out["rows"].append(row)
    d = os.environ.get("OUT", "/tmp")
    json.dump(out, open(os.path.join(d, "probe_wgmma.json"), "w"), indent=1)
