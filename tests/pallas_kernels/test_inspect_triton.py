"""benchmarks/inspect_triton.py: the kernel's Triton IR without a GPU."""

import pytest

from benchmarks import inspect_triton
from pallas_kernels import paged_attention


def fp8_verify_ir(**kernel_kw):
    """The loop as BENCHMARKS.md read it: eager rescale (no branch in the loop),
    page ids loaded inside the iteration, unless kernel_kw says otherwise."""
    kernel_kw = {"rescale_threshold": 0.0, "prefetch_page_ids": False, **kernel_kw}
    return inspect_triton.triton_ir(paged_attention.__file__, max_q=8, kv="fp8", ctx=1024,
                                    num_warps=2, pages_per_block=4, **kernel_kw)


def test_triton_ir_of_the_kernel_lowers_for_hopper_without_a_gpu():
    ir = fp8_verify_ir()
    assert "tt.func" in ir and "scf.for" in ir  # the kernel and its key loop
    assert ir.count("tt.dot") == 2              # q.K and p.V
    assert "f8E4M3FN" in ir                     # the fp8 pool is read as fp8


def test_triton_compiles_the_ir_for_hopper_and_reports_its_pipelining(tmp_path):
    pytest.importorskip("triton", reason="pip install '.[inspect]' to compile the IR")
    ir_file = tmp_path / "kernel.ttir"
    ir_file.write_text(fp8_verify_ir())
    shallow = inspect_triton.compile_for_hopper(ir_file, num_warps=2, num_stages=3)
    deep = inspect_triton.compile_for_hopper(ir_file, num_warps=2, num_stages=5)
    # The page-table load feeding the K/V addresses keeps 3 stages from
    # overlapping loads across iterations; 5 do (BENCHMARKS.md).
    assert max(shallow["wait_group"]) == 0 < max(deep["wait_group"]), (
        f"{shallow=} {deep=}: this triton pipelines differently; re-read BENCHMARKS.md")
    assert deep["shared_bytes"] > shallow["shared_bytes"] > 0
    assert (tmp_path / "kernel.s5.sass").stat().st_size > 0
    ir_file = tmp_path / "prefetched.ttir"
    ir_file.write_text(fp8_verify_ir(prefetch_page_ids=True))
    prefetched = inspect_triton.compile_for_hopper(ir_file, num_warps=2, num_stages=3)
    assert max(prefetched["wait_group"]) > 0  # pipelined at 3 stages


@pytest.mark.parametrize("kv,head_dim,q_per_kv", [("bf16", 32, 4), ("fp8", 32, 4), ("bf16", 64, 8),
                                                  ("bf16", 128, 4)])
def test_decode_and_verify_lay_their_dots_out_alike(tmp_path, kv, head_dim, q_per_kv):
    """Triton splits head_dim over the warps for blocks with fewer rows than
    head_dim and rows otherwise; decode and verify must agree (launch_plan)."""
    pytest.importorskip("triton", reason="pip install '.[inspect]' to compile the IR")
    layouts = []
    for max_q in (1, 8):
        ir_file = tmp_path / f"q{max_q}.ttir"
        ir_file.write_text(inspect_triton.triton_ir(
            paged_attention.__file__, max_q=max_q, kv=kv, ctx=1024, head_dim=head_dim,
            q_per_kv=q_per_kv))
        layouts.append(inspect_triton.compile_for_hopper(ir_file, num_warps=2,
                                                         num_stages=3)["mma_warps"])
    assert layouts[0] == layouts[1] == ["[1, 2]"], layouts


def accumulator_definitions(ir):
    """The line defining each tt.dot's accumulator operand (its third)."""
    lines = ir.splitlines()
    definitions = []
    for line in lines:
        if "tt.dot" not in line:
            continue
        acc = line.split("tt.dot", 1)[1].split(",")[2].split()[0]
        definitions.append(next((d for d in lines if d.strip().startswith(f"{acc} =")),
                                f"{acc} (a block argument)"))
    return definitions


def test_triton_s_own_ttir_passes_fold_the_accumulator_into_the_p_v_dot(tmp_path):
    """XLA runs Triton's TTIR passes on a Pallas kernel; `triton.compile` skips
    them for an IR file, and without them `acc + dot(p, v)` stays an add after
    a dot from zero (255 registers where the H200 took 222; BENCHMARKS.md)."""
    pytest.importorskip("triton", reason="pip install '.[inspect]' to compile the IR")
    from triton.backends.compiler import GPUTarget
    ir_file = tmp_path / "kernel.ttir"
    ir_file.write_text(fp8_verify_ir())
    raw_qk, raw_pv = accumulator_definitions(ir_file.read_text())
    assert "tt.splat" in raw_pv  # Pallas's dot starts from zeros
    passed = inspect_triton.run_ttir_passes(ir_file, GPUTarget("cuda", 90, 32), num_warps=2)
    qk, pv = accumulator_definitions(passed.read_text())
    assert "arith.constant" in qk  # q.K still starts from zeros
    assert "arith.constant" not in pv and "tt.splat" not in pv, pv  # acc carried in the dot
