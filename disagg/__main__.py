"""`python -m disagg demo | serve`: the main job on the embedded default pair.

demo   the shipped held-out prompts through aggregated, disaggregated-shared and
       disaggregated-private serving; prints a table (acceptance length,
       tokens/s, time to first token, bytes moved, KV memory per pool)
       and with --json FILE writes it for scripts and notebooks.
serve  keeps a context and a generation worker up and serves JSON lines
       {"id": ..., "prompt": "text" (or "tokens": [ids]), "max_new_tokens": N}
       from a file or stdin, writing one JSON line per finished request.
serve-remote  one side (--role context | generation) of a pair in two OS
       processes, KV moved by jax.experimental.transfer (disagg/processes.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from disagg import processes
from disagg.accounting import page_report
from disagg.serving import serve_json_lines
from disagg.sources import disaggregated_engine
from disagg.transfer import MOVE_PATHS
from drafter.corpus import ByteTokenizer
from drafter.default import default_step_config, load_default, load_prompts
from drafter.engine import Engine
from unified_kv import bytes_per_pool


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    num_prompts: int
    max_new_tokens: int
    num_slots: int
    move_path: str
    json_path: str | None

    @classmethod
    def from_args(cls, args) -> "DemoConfig":
        if args.num_prompts < 1:
            raise SystemExit(f"--num-prompts must be >= 1, got {args.num_prompts}")
        if args.max_new_tokens < 1:
            raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        return cls(args.num_prompts, args.max_new_tokens, args.num_slots, args.move_path,
                   args.json)


def split_meshes():
    """Half the devices each; on one device both workers share it."""
    devices = np.array(jax.devices())
    if len(devices) < 2:
        return None, None
    half = len(devices) // 2
    return (jax.sharding.Mesh(devices[:half], ("tp",)),
            jax.sharding.Mesh(devices[half:2 * half], ("tp",)))


def summarize(name, results, seconds, engine):
    tokens = sum(len(r.tokens) for r in results)
    row = {"mode": name, "requests": len(results),
           "acceptance_length": float(np.mean([a for r in results for a in r.acceptance])),
           "tokens_per_s": tokens / seconds,
           "ttft_ms": 1e3 * float(np.mean([r.time_to_first_token_s for r in results])),
           "bytes_transferred": engine.bytes_imported}
    return row


def make_engine(name: str, params, step_cfg, move_path: str) -> Engine:
    """The one engine every mode is a configuration of."""
    mesh_ctx, mesh_gen = split_meshes()
    if name == "aggregated":
        return Engine(params, step_cfg, mesh=mesh_gen)
    return disaggregated_engine(params, step_cfg, mode=name.split("-")[1],
                                context_meshes=(mesh_ctx,), mesh=mesh_gen, move_path=move_path)


def run_demo(cfg: DemoConfig) -> dict:
    params, tcfg, dcfg = load_default()
    step_cfg = default_step_config(tcfg, dcfg, num_slots=cfg.num_slots)
    prompts = [p["tokens"] for p in load_prompts() if p["length"] <= 512][:cfg.num_prompts]
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; "
          f"{len(prompts)} held-out prompts, {cfg.max_new_tokens} new tokens each")
    rows = []
    for name in tqdm(("aggregated", "disagg-shared", "disagg-private"), desc="serving"):
        engine = make_engine(name, params, step_cfg, cfg.move_path)
        engine.generate(prompts[:2], 2)  # compile outside the timing
        engine.bytes_imported = 0
        start = time.perf_counter()
        results = engine.generate(prompts, cfg.max_new_tokens)
        rows.append(summarize(name, results, time.perf_counter() - start, engine))
        rows[-1]["tokens"] = [r.tokens for r in results]
    pools = [{"pool": p.pool_id, "kv_dtype": p.kv_dtype, "window": p.sliding_window,
              "layers": list(p.layer_names), "MiB": b / 2**20}
             for p, b in zip(step_cfg.spec.pools, bytes_per_pool(step_cfg.spec).values())]
    return {"rows": rows, "pools": pools,
            "shared_equals_aggregated": rows[0]["tokens"] == rows[1]["tokens"],
            "private_output_unchanged": rows[0]["tokens"] == rows[2]["tokens"]}


def print_table(report: dict) -> None:
    head = f"{'mode':<16}{'AL':>6}{'tok/s':>9}{'TTFT ms':>9}{'moved MiB':>11}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in report["rows"]:
        print(f"{r['mode']:<16}{r['acceptance_length']:>6.2f}{r['tokens_per_s']:>9.1f}"
              f"{r['ttft_ms']:>9.0f}{r['bytes_transferred'] / 2**20:>11.2f}")
    print("\nKV memory per pool:")
    for p in report["pools"]:
        print(f"  pool {p['pool']}: {p['kv_dtype']:<8} window={str(p['window']):<5} "
              f"{p['MiB']:7.1f} MiB  {', '.join(p['layers'])}")
    print(f"\ndisagg-shared tokens == aggregated: {report['shared_equals_aggregated']}; "
          f"private changes acceptance only: {report['private_output_unchanged']}")


def serve(args) -> None:
    params, tcfg, dcfg = load_default()
    step_cfg = default_step_config(tcfg, dcfg, num_slots=args.num_slots)
    name = "aggregated" if args.draft_kv == "aggregated" else f"disagg-{args.draft_kv}"
    engine = make_engine(name, params, step_cfg, "coalesced")
    serve_json_lines(engine, args.input, ByteTokenizer())
    print(f"serve: pages at exit: {json.dumps(page_report(engine))}", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m disagg", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="aggregated vs disaggregated, shared vs private")
    demo.add_argument("--num-prompts", type=int, default=6)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--num-slots", type=int, default=4)
    demo.add_argument("--move-path", default="coalesced",
                      choices=MOVE_PATHS)
    demo.add_argument("--json", default=None, help="also write the table to this file")
    srv = sub.add_parser("serve", help="serve JSON-line requests from a file or stdin")
    srv.add_argument("input", nargs="?", default="-")
    srv.add_argument("--num-slots", type=int, default=4)
    srv.add_argument("--draft-kv", default="shared", choices=("shared", "private", "aggregated"),
                     help="disaggregated with the draft KV shared or private, or aggregated")
    processes.add_parser(sub)
    args = ap.parse_args(argv)
    if args.command == "serve-remote":
        return processes.run(args)
    if args.command == "serve":
        return serve(args)
    cfg = DemoConfig.from_args(args)
    report = run_demo(cfg)
    print_table(report)
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(report, f, indent=2)
    if not report["shared_equals_aggregated"]:
        raise SystemExit("disaggregated-shared output differs from aggregated: a bug")


if __name__ == "__main__":
    main()
