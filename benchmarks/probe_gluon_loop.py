"""The fp8 decode / verify-8 key loop hand-laid-out in Gluon, as a gauge for a future kernel.

    PYTHONPATH=. python benchmarks/probe_gluon_loop.py [--ctx 32768 4096] [--out DIR]
    PYTHONPATH=. python benchmarks/probe_gluon_loop.py --compile-only   # no GPU needed

Pallas's Triton lowering picks the dots' register layouts itself: over fp8 KV it reloads
q from shared memory every key block and ptxas rebuilds q's mma.sync fragments with
register moves before each HMMA (BENCHMARKS.md, twelfth session). Gluon (Triton's
layout-explicit language, in the H200's Triton 3.6) lets a kernel hold q in registers in
the A-operand layout the fp8 keys need. This probe writes the decode / verify loop that
way over the issue's shapes (32 / 8 heads, head dim 128, 16-key pages in random order,
4-page blocks, 2 warps, fp8 K and V^T pipelined through shared memory with cp.async) and
times a 1-token decode block (16 rows at GQA 4) against an 8-token verify block (32 rows)
with torch on the GPU. It covers paging and the causal mask only; the kernel the models
use, with the whole contract, is `pallas_kernels/paged_attention_gluon.py`.
Timing needs a CUDA GPU and torch (both on the H200); `--compile-only` compiles the loop
for sm_90 with any Triton that has Gluon (`pip install '.[inspect]'`) and reports its
registers, spills and loop instructions, as `inspect_triton.py` does for the Pallas
kernel. Results: BENCHMARKS.md, twelfth session item 5 and thirteenth session.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from pallas_kernels.paged_attention_gluon import async_load, cta_barrier

try:
    import torch
except ImportError:  # compiling needs no torch; timing does
    torch = None


D, PAGE, PAGES_PER_BLOCK, KV_HEADS, GQA = 128, 16, 4, 8, 4
# The same numbers for the kernel (Gluon reads only constexpr globals).
D_, PAGE_, PPB_, KV_HEADS_, GQA_ = map(gl.constexpr, (D, PAGE, PAGES_PER_BLOCK, KV_HEADS, GQA))
BK_ = gl.constexpr(PAGE * PAGES_PER_BLOCK)
PAGE_PAIR_ = gl.constexpr(2 * PAGE * D)  # a page's K and V^T, side by side in the pool


@gluon.jit
def block_page_ids(table_ptr, block, key, num_blocks):
    """Page of each key of a block (key: its index in the block), or page 0 past the
    row's last block."""
    return gl.load(table_ptr + block * PPB_ + key // PAGE_, mask=block < num_blocks, other=0)


@gluon.jit
def k_offsets(page, key, d):
    """Offsets of a block's K [BK, D] from its kv head's first K page: key j is row
    j % PAGE of its page; each key's D bytes are contiguous."""
    return (page * PAGE_PAIR_ + (key % PAGE_) * D_)[:, None] + d[None, :]


@gluon.jit
def v_offsets(page, d, key):
    """Offsets of a block's V^T pages [PPB, D, PAGE] from its kv head's first V^T page:
    each page's [D, PAGE] tile is 2 KB contiguous, copied whole (see v_sl)."""
    offsets = ((page * PAGE_PAIR_)[:, None, None] + (d * PAGE_)[None, :, None]
               + key[None, None, :])
    return gl.max_contiguous(gl.multiple_of(offsets, [1, 1, PAGE_]), [1, 1, PAGE_])


@gluon.jit
def copy_block(k_slot, v_slot, k_pool, vt_pool, k_page, v_page, kj, kd, vj, vd, block,
               num_blocks):
    """Start a block's K and V^T copies into one pipeline slot (none past the last)."""
    async_load(k_slot, k_pool + k_offsets(k_page, kj, kd),
               mask=(kj[:, None] * 0 + block) < num_blocks)
    async_load(v_slot.reshape([PPB_, D_, PAGE_]), vt_pool + v_offsets(v_page, vd, vj),
               mask=(vd[None, :, None] * 0 + block) < num_blocks)
    async_copy.commit_group()


@gluon.jit
def paged_loop_kernel(q_ptr, pool, table_ptr, kv_len, table_width, num_pages,
                      o_ptr, ROWS: gl.constexpr, TOKENS: gl.constexpr,
                      STAGES: gl.constexpr):
    """One program: one (batch row, kv head). q f16[ROWS, D] (tokens x q heads, scaled
    for base 2); the pool fp8[kv heads, num_pages, 2, PAGE * D] holds each
    page's K [PAGE, D] and V^T [D, PAGE] side by side, as the unified cache's pools do;
    table i32[batch, table_width]; the row's TOKENS queries end at kv_len - 1."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 2],
                                                  instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    # 16-byte copies; 8 lanes per 128-byte K row ([8, 4] lanes read 1.10x slower)
    k_ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [2, 1], [1, 0])
    v_ld: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [1, 2, 1], [2, 1, 0])
    k_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    # V^T pages [PPB * D, PAGE] unswizzled: each page's 2 KB lands contiguous, as it lies in
    # the pool. A [D, BK] tile (a page's 16 bytes per 64-byte row, swizzled) scattered each
    # 128-byte line over 8 rows and the copies went to L2 a sector at a time: 4x the L2
    # requests, decode at 3.4 TB/s (BENCHMARKS.md, thirteenth session).
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BK_, D_], k_sl)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PPB_ * D_, PAGE_], v_sl)
    pid = gl.program_id(0)
    table_ptr = table_ptr + (pid // KV_HEADS_) * table_width
    # This kv head's pages: a 64-bit base once, 32-bit offsets within the head.
    head_base = (pid % KV_HEADS_).to(gl.int64) * num_pages * PAGE_PAIR_
    k_pool = pool + head_base
    vt_pool = k_pool + PAGE_ * D_  # a page's V^T follows its K
    num_blocks = gl.cdiv(gl.cdiv(kv_len, PAGE_), PPB_)

    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, a_layout))
    c = gl.arange(0, D_, layout=gl.SliceLayout(0, a_layout))
    q = gl.load(q_ptr + pid * ROWS * D_ + r[:, None] * D_ + c[None, :])   # held for the loop

    # K rows: key j of a block is row (page[j // PAGE] * PAGE + j % PAGE) of the K pool.
    kj = gl.arange(0, BK_, layout=gl.SliceLayout(1, k_ld))
    kd = gl.max_contiguous(gl.multiple_of(gl.arange(0, D_, layout=gl.SliceLayout(0, k_ld)),
                                          16), 16)
    # V^T: [PPB, D, PAGE], the block's pages' tiles; one table entry per page.
    vpage = gl.arange(0, PPB_, layout=gl.SliceLayout(1, gl.SliceLayout(2, v_ld)))
    vd = gl.arange(0, D_, layout=gl.SliceLayout(0, gl.SliceLayout(2, v_ld)))
    vj = gl.arange(0, PAGE_, layout=gl.SliceLayout(0, gl.SliceLayout(1, v_ld)))

    for s in gl.static_range(STAGES - 1):  # the pipeline's first blocks
        copy_block(k_smem.index(s), v_smem.index(s), k_pool, vt_pool,
                   block_page_ids(table_ptr, s, kj, num_blocks),
                   block_page_ids(table_ptr, s, vpage * PAGE_, num_blocks),
                   kj, kd, vj, vd, s, num_blocks)

    rows_m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    upper = kv_len - TOKENS + rows_m // GQA_       # each query's own position
    keys_m = gl.arange(0, BK_, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([ROWS, D_], gl.float32, layout=mma)
    m_i = gl.full([ROWS], -1e30, gl.float32, layout=gl.SliceLayout(1, mma))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, mma))
    # Page ids one block ahead of the copies, so no copy waits on its table load.
    kp = block_page_ids(table_ptr, STAGES - 1, kj, num_blocks)
    vp = block_page_ids(table_ptr, STAGES - 1, vpage * PAGE_, num_blocks)
    for i in range(num_blocks):
        # Block i is in once its group is; after the barrier every warp is also done with
        # block i - 1, so its slot takes block i + STAGES - 1 (no barrier at the loop's end).
        async_copy.wait_group(STAGES - 2)
        cta_barrier()
        nxt = i + STAGES - 1
        copy_block(k_smem.index(nxt % STAGES), v_smem.index(nxt % STAGES), k_pool, vt_pool,
                   kp, vp, kj, kd, vj, vd, nxt, num_blocks)
        kp = block_page_ids(table_ptr, nxt + 1, kj, num_blocks)
        vp = block_page_ids(table_ptr, nxt + 1, vpage * PAGE_, num_blocks)
        slot = i % STAGES
        k_t = k_smem.index(slot).permute((1, 0)).load(b_layout)           # K^T fp8 [D, BK]
        s_ = mma_v2(q, k_t.to(gl.float16), gl.zeros([ROWS, BK_], gl.float32, layout=mma))
        visible = (i * BK_ + keys_m)[None, :] <= upper[:, None]
        s_ = gl.where(visible, s_, -1e30)
        m_new = gl.maximum(m_i, gl.max(s_, axis=1))
        corr = gl.exp2(m_i - m_new)
        p = gl.exp2(s_ - m_new[:, None])
        l_i = l_i * corr + gl.sum(p, axis=1)
        v_pages = v_smem.index(slot).reshape([PPB_, D_, PAGE_]).permute((0, 2, 1))
        v = v_pages.reshape([BK_, D_]).load(b_layout)                     # V fp8 [BK, D]
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), a_layout), v.to(gl.float16),
                     acc * corr[:, None])
        m_i = m_new
    cols_m = gl.arange(0, D_, layout=gl.SliceLayout(0, mma))
    gl.store(o_ptr + pid * ROWS * D_ + rows_m[:, None] * D_ + cols_m[None, :],
             acc / l_i[:, None])


def compile_for_hopper(rows, tokens, stages=3, out_dir=None):
    """The kernel compiled for sm_90 on any machine; inspect_triton's SASS report."""
    from benchmarks.inspect_triton import sass_report
    from pallas_kernels.gluon_call import compile_gluon

    signature = {"q_ptr": "*fp16", "pool": "*fp8e4nv",
                 "table_ptr": "*i32", "kv_len": "i32", "table_width": "i32", "num_pages": "i32",
                 "o_ptr": "*fp32", "ROWS": "constexpr", "TOKENS": "constexpr",
                 "STAGES": "constexpr"}
    kernel = compile_gluon(paged_loop_kernel, tuple(signature.items()),
                           (("ROWS", rows), ("STAGES", stages), ("TOKENS", tokens)), 2, 90)
    out_dir = Path(out_dir or tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    cubin = out_dir / f"gluon_loop_r{rows}_s{stages}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    return sass_report(cubin)


def make_case(batch, ctx, rows, seed=0, in_order=False):
    """Random q, pool and table: each row's pages in random order in the pool, as in
    bench_paged_attention (the pool holds just the rows' pages), or in order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-ctx // PAGE)
    width = -(-width // PAGES_PER_BLOCK) * PAGES_PER_BLOCK
    pages = batch * width
    order = (torch.arange(pages, device="cuda") if in_order
             else torch.randperm(pages, device="cuda", generator=g))
    table = order.view(batch, width).int()
    pool = torch.randn(KV_HEADS, pages, 2, PAGE * D, device="cuda", generator=g).to(
        torch.float8_e4m3fn)
    q = (torch.randn(batch * KV_HEADS, rows, D, device="cuda", generator=g) * 0.2).half()
    return q, pool, table


def reference(q, pool, table, ctx, tokens):
    """f32 attention of each program's queries over its first ctx keys, causal, base 2."""
    pages = pool.float()[:, table.long()]                    # [HKV, batch, width, 2, PAGE*D]
    k = pages[..., 0, :].reshape(KV_HEADS, table.shape[0], -1, PAGE, D)
    v = pages[..., 1, :].reshape(KV_HEADS, table.shape[0], -1, D, PAGE).transpose(3, 4)
    # programs are (batch row, kv head), kv head fastest
    k = k.transpose(0, 1).reshape(q.shape[0], -1, D)[:, :ctx]
    v = v.transpose(0, 1).reshape(q.shape[0], -1, D)[:, :ctx]
    s = q.float() @ k.transpose(1, 2)
    pos = torch.arange(ctx, device="cuda")
    upper = ctx - tokens + torch.arange(q.shape[1], device="cuda") // GQA
    s = s.masked_fill(pos[None, None, :] > upper[None, :, None], float("-inf"))
    p = torch.exp2(s - s.amax(-1, keepdim=True))
    return (p @ v) / p.sum(-1, keepdim=True)


def launch(case, ctx, tokens, stages=3):
    q, pool, table = case
    out = torch.empty(q.shape, device="cuda", dtype=torch.float32)
    return out, lambda: paged_loop_kernel[(q.shape[0],)](
        q, pool, table, ctx, table.shape[1], pool.shape[1], out,
        ROWS=q.shape[1], TOKENS=tokens, STAGES=stages, num_warps=2)


def time_ms(fn, calls=50, reps=5):
    """Median over reps of calls back-to-back launches, CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="*", default=[32768, 4096])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for sm_90 and report registers and the loop; no GPU")
    args = parser.parse_args()
    if args.compile_only:
        for tokens, rows in ((1, 16), (8, 32)):
            report = compile_for_hopper(rows, tokens, out_dir=args.out)
            print(f"{tokens} token(s), {rows} rows: {report}")
        return
    if torch is None:
        raise SystemExit("timing needs torch and a CUDA GPU (the H200 has both); "
                         "--compile-only needs neither")
    results = {"checks": [], "rows": []}
    for tokens, rows in ((1, 16), (8, 32)):  # against the f32 reference, ragged-free
        case = make_case(2, 1000, rows, seed=1)
        out, fn = launch(case, 1000, tokens)
        fn()
        ref = reference(*case, 1000, tokens)[:, : GQA * tokens]
        err = float((out[:, : GQA * tokens] - ref).norm() / ref.norm())
        results["checks"].append({"tokens": tokens, "rel_err": err})
        print(f"{tokens} token(s): relative error {err:.2e}", flush=True)
    for ctx, in_order in [(ctx, o) for ctx in args.ctx for o in (False, True)]:
        row = {"ctx": ctx, "pages": "in order" if in_order else "random order"}
        decode, verify = (make_case(args.batch, ctx, rows, in_order=in_order)
                          for rows in (16, 32))
        for _ in range(2):  # alternate, keep the best of each
            for name, case, tokens in (("decode", decode, 1), ("verify8", verify, 8)):
                row[f"{name}_ms"] = min(row.get(f"{name}_ms", 1e9),
                                        time_ms(launch(case, ctx, tokens)[1]))
        row["verify8_over_decode"] = row["verify8_ms"] / row["decode_ms"]
        kv_bytes = args.batch * KV_HEADS * ctx * D * 2
        row["decode_kv_tb_s"] = kv_bytes / row["decode_ms"] / 1e9
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
        del decode, verify
    if args.out:
        with open(f"{args.out}/probe_gluon_loop.json", "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
