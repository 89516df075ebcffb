"""What Triton makes of the paged-attention kernel, on a machine without a GPU.

    PYTHONPATH=. python benchmarks/inspect_triton.py [--max-q 8] [--kv fp8] [--stages 3 5]
    PYTHONPATH=. python benchmarks/inspect_triton.py --kernel old_kernel.py --out DIR
    PYTHONPATH=. python benchmarks/inspect_triton.py --kernel-kw '{"prefetch_page_ids": true}'

Pallas lowers the kernel to Triton IR for an abstract sm_90 device (jax needs
no GPU for that), Triton's own TTIR passes run on it as XLA runs them, and
the `triton` package (`pip install ".[inspect]"`; a CPU machine suffices)
compiles it for sm_90 once per pipeline stage count. Each
compile reports its shared memory, registers per thread, the
`cp.async.wait_group` counts in the PTX (a count of 0 inside the key loop
means every iteration waits for every load in flight, i.e. the loads are not
pipelined across iterations), and the key loop's SASS instructions and
register moves. The IR, PTX and SASS go to `--out`.

The triton package is not the one inside XLA (which compiles the kernel on
the H200), so what it shows is evidence to time on the GPU, not a timing.
Shapes are bench_paged_attention's decode case.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import jax

from benchmarks.bench_paged_attention import D, HKV, HQ, KV_DTYPES, setup
from benchmarks.profile_paged_attention import load_kernel

def triton_ir(kernel_file: str, *, max_q: int, kv: str, ctx: int, q_per_kv: int = HQ // HKV,
              head_dim: int = D, draft: bool = False, **kernel_kw) -> str:
    """Triton IR (text) of `paged_attention` from `kernel_file` (`draft_block_attention`
    with `draft`: max_q block queries and the block's own K/V), lowered for sm_90."""
    from jax._src.pallas.triton import lowering
    from jax._src.pallas.triton import pallas_call_registration as registration

    class _Hopper:  # what the lowering asks the (absent) GPU for
        compute_capability = 90

    modules = []
    real_info = registration.gpu_info_lib.get_gpu_info
    real_lower = lowering.lower_jaxpr_to_triton_module

    def keep_module(*args, **kwargs):
        result = real_lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    kernel = load_kernel(kernel_file, "draft_block_attention" if draft else "paged_attention")
    # The benchmark's inputs as shapes only: nothing is allocated.
    args = jax.eval_shape(functools.partial(setup, ctx, KV_DTYPES[kv], max_q=max_q,
                                            num_q_heads=q_per_kv * HKV, head_dim=head_dim))
    if draft:  # the block's own K and V
        args += 2 * (jax.ShapeDtypeStruct((args[0].shape[0], max_q, HKV, head_dim),
                                          args[0].dtype),)
    step = jax.jit(lambda *a: kernel(*a, layer_offset=0, **kernel_kw))
    registration.gpu_info_lib.get_gpu_info = lambda: _Hopper()
    lowering.lower_jaxpr_to_triton_module = keep_module
    try:
        step.trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.gpu_info_lib.get_gpu_info = real_info
        lowering.lower_jaxpr_to_triton_module = real_lower
    if len(modules) != 1:
        raise RuntimeError(f"expected one Pallas kernel in the step, lowered {len(modules)}")
    return modules[0]


def run_ttir_passes(ir_file: Path, target, num_warps: int) -> Path:
    """The IR after Triton's own TTIR passes (inliner, canonicalizer, combine, CSE, ...),
    which XLA runs on a Pallas kernel and `triton.compile` skips for an IR file: without
    them `acc + dot(p, v)` stays a dot and an add, and the kernel compiled here took
    255 registers where the H200's took 222 (with them: 216)."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend
    backend = make_backend(target)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ir.parse_mlir_module(str(ir_file), context)
    module.context = context
    backend.make_ttir(module, {}, backend.parse_options({"num_warps": num_warps}),
                      target.arch)
    passed = ir_file.with_suffix(".passes.ttir")
    passed.write_text(str(module))
    return passed


def compile_for_hopper(ir_file: Path, *, num_warps: int, num_stages: int) -> dict:
    """Compile Triton IR for sm_90 with the `triton` package; PTX/SASS beside the IR."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise SystemExit("the `triton` package compiles the IR: pip install '.[inspect]' "
                         f"(no GPU needed) ({e})") from None
    target = GPUTarget("cuda", 90, 32)
    kernel = triton.compile(str(run_ttir_passes(ir_file, target, num_warps)), target=target,
                            options={"num_warps": num_warps, "num_stages": num_stages})
    stem = ir_file.with_suffix(f".s{num_stages}")
    ptx = kernel.asm["ptx"]
    stem.with_suffix(stem.suffix + ".ttgir").write_text(kernel.asm["ttgir"])
    stem.with_suffix(stem.suffix + ".ptx").write_text(ptx)
    cubin = stem.with_suffix(stem.suffix + ".cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    report = {"num_stages": num_stages, "shared_bytes": kernel.metadata.shared,
              # how the dots spread over the warps: [1, W] splits head_dim / keys, [W, 1] rows
              "mma_warps": sorted(set(re.findall(r"nvidia_mma<\{[^}]*warpsPerCTA = (\[[\d, ]+\])",
                                                 kernel.asm["ttgir"]))),
              "wait_group": [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]}
    return report | sass_report(cubin)


def sass_report(cubin: Path) -> dict:
    """Registers, spills and the key loop's instruction mix of a cubin, with the CUDA
    tools that ship in the `triton` package; the SASS goes beside the cubin."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    report = {}
    if (tools / "cuobjdump").exists():
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin],
                               capture_output=True, text=True).stdout
        found = re.search(r"REG:(\d+)", usage)
        report["registers"] = int(found.group(1)) if found else None
    if (tools / "nvdisasm").exists():
        sass = subprocess.run([tools / "nvdisasm", "-c", cubin], capture_output=True,
                              text=True).stdout
        cubin.with_suffix(".sass").write_text(sass)
        report["spill_instructions"] = len(re.findall(r"\b(?:LDL|STL)\b", sass))
        loop = loop_opcodes(sass)
        report["loop_instructions"] = sum(loop.values())
        # register-to-register moves: ptxas gathering mma.sync operand fragments
        report["loop_register_moves"] = loop["IMAD.MOV.U32"] + loop["MOV"]
    return report


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcode counts of the longest loop in nvdisasm output: the instructions from a
    backward branch's target label up to the branch (predicates dropped)."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)(.*);", line)
        if found:
            instructions.append((found.group(1), found.group(2)))
    spans = [(labels[target.group(1)], end) for end, (op, rest) in enumerate(instructions)
             if op == "BRA" and (target := re.search(r"(\.L_x_\d+)", rest))
             and labels.get(target.group(1), end + 1) <= end]
    if not spans:
        return collections.Counter()
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return collections.Counter(op for op, _ in instructions[start:end + 1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel", default=str(Path(__file__).parents[1] / "pallas_kernels"
                                                / "paged_attention.py"))
    parser.add_argument("--max-q", type=int, default=8)
    parser.add_argument("--kv", choices=list(KV_DTYPES), default="fp8")
    parser.add_argument("--ctx", type=int, default=16384)
    parser.add_argument("--head-dim", type=int, default=D)
    parser.add_argument("--q-per-kv", type=int, default=HQ // HKV)
    parser.add_argument("--warps", type=int, default=2)
    parser.add_argument("--pages-per-block", type=int, default=4)
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--draft", action="store_true",
                        help="the draft block kernel (max_q block queries) instead")
    parser.add_argument("--kernel-kw", type=json.loads, default={},
                        help='more kernel arguments, e.g. \'{"prefetch_page_ids": true}\'')
    parser.add_argument("--out", default="/tmp/inspect_triton")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ir = triton_ir(args.kernel, max_q=args.max_q, kv=args.kv, ctx=args.ctx,
                   head_dim=args.head_dim, q_per_kv=args.q_per_kv, draft=args.draft,
                   num_warps=args.warps, pages_per_block=args.pages_per_block,
                   **args.kernel_kw)
    kernel_name = "draft_block" if args.draft else "paged_attention"
    ir_file = out / f"{kernel_name}_{args.kv}_q{args.max_q}.ttir"
    ir_file.write_text(ir)
    print(f"{ir_file}: {ir.count(chr(10))} lines of Triton IR")
    for stages in args.stages:
        print(compile_for_hopper(ir_file, num_warps=args.warps, num_stages=stages), flush=True)


if __name__ == "__main__":
    main()
