"""benchmarks/probe_gluon_loop.py and inspect_triton's loop report, without a GPU."""

import pytest

from benchmarks import inspect_triton
from pallas_kernels import paged_attention

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, R3 ;
        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/              @!P0 HMMA.16816.F32 R4, R8, R14, R4 ;
        /*0040*/               @P1 BRA `(.L_x_0) ;
        /*0050*/                   BRA `(.L_x_1) ;
.L_x_1:
        /*0060*/                   EXIT ;
"""


def test_loop_opcodes_counts_the_longest_backward_branch_body():
    loop = inspect_triton.loop_opcodes(SASS)
    # the loop is .L_x_0 .. its BRA; the MOV before it and the forward branch are outside
    assert loop == {"IMAD.MOV.U32": 1, "HMMA.16816.F32": 2, "BRA": 1}
    assert inspect_triton.loop_opcodes("no loop here") == {}


def test_gluon_loop_holds_q_in_registers_where_the_pallas_kernel_rebuilds_it(tmp_path):
    pytest.importorskip("triton.experimental.gluon._runtime",
                        reason="pip install '.[inspect]' (a Triton with Gluon) to compile")
    from benchmarks import probe_gluon_loop

    decode = probe_gluon_loop.compile_for_hopper(16, 1, out_dir=tmp_path)
    verify = probe_gluon_loop.compile_for_hopper(32, 8, out_dir=tmp_path)
    ir = tmp_path / "kernel.ttir"
    ir.write_text(inspect_triton.triton_ir(paged_attention.__file__, max_q=8, kv="fp8",
                                           ctx=1024, num_warps=2, pages_per_block=4))
    pallas = inspect_triton.compile_for_hopper(ir, num_warps=2, num_stages=5)
    # Pallas reloads q from shared memory every key block and ptxas rebuilds its mma.sync
    # fragments with register moves; held in registers, q needs almost none.
    assert pallas["loop_register_moves"] > 100
    assert verify["loop_register_moves"] < 16 and decode["loop_register_moves"] < 16
    assert verify["loop_instructions"] < 0.75 * pallas["loop_instructions"]
    assert decode["registers"] <= 255 and verify["registers"] <= 255
