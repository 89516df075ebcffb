"""Throwaway: fp8 decode / verify-16 at batch 8-48 (between the Gluon kernel's key-split
and one-program-per-row regimes): Pallas default vs Gluon with key splits of each size."""
import jax, jax.numpy as jnp
from benchmarks.bench_paged_attention import FP8, HKV, D, setup, ours
from benchmarks.timing import device_copy_bandwidth, time_call
from pallas_kernels import paged_attention_gluon as G
from pallas_kernels.attention import select_backend

bw = device_copy_bandwidth()
print(f"copy {bw/1e12:.2f} TB/s", flush=True)
for ctx in (1024, 8192):
    for batch in (8, 16, 32, 48):
        for max_q in (1, 16):
            q, pool, table, kv_lens, q_lens = setup(ctx, FP8, max_q=max_q, batch=batch)
            args = (q, pool, table, kv_lens, q_lens)
            kv = batch * ctx * HKV * D * 2
            row = [f"ctx {ctx} b{batch} q{max_q} sel={select_backend(q, pool, impl='pallas')}"]
            try:
                t = time_call(ours(*args), *args)
                row.append(f"pallas {t*1e6:.1f}us ({kv/t/bw:.2f})")
            except Exception as e:
                row.append(f"pallas failed {e!s:.80}")
            for sk in (0, 256, 512, 1024):
                if sk and sk >= ctx:
                    continue
                f = jax.jit(lambda *a, sk=sk: G._call(*a, a[0], a[0], layer_offset=0, split_keys=sk))
                try:
                    t = time_call(f, *args)
                    row.append(f"gluon/{sk} {t*1e6:.1f}us ({kv/t/bw:.2f})")
                except Exception as e:
                    row.append(f"gluon/{sk} failed {e!s:.80}")
            print("  ".join(row), flush=True)
