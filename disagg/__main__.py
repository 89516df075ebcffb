"""`python -m disagg demo | serve | serve-remote`: the main job.

demo   the held-out prompts (128 to 8K tokens) through aggregated,
       disaggregated-shared and disaggregated-private serving; prints what it
       measures and what it means (disagg/demo.py); --json FILE writes it too.
serve  one engine (--draft-kv aggregated | shared | private) answering JSON
       lines from a file or stdin, or with --http HOST:PORT an OpenAI-compatible
       HTTP server (/v1/completions and /v1/chat/completions streamed or not,
       /v1/models, /health, /metrics; disagg/http.py; a request without
       max_tokens gets --default-max-tokens).
serve-remote  one side (--role context | generation) of a pair in two OS
       processes, KV moved by jax.experimental.transfer (disagg/processes.py).

demo and serve take a pair by path (--target DIR --drafter DIR; the target's
tokenizer.json turns text into ids) or the embedded default pair, size each
worker's KV cache by --kv-memory-mib or --kv-memory-fraction (serve prints what
it holds), and keep compiled programs in a persistent compilation cache
(disagg/compile_cache.py).
"""

from __future__ import annotations

import json
import os
import sys

from disagg import processes
from disagg.schema import DEFAULT_REQUEST_TIMEOUT_S
from disagg.transfer import MOVE_PATHS


def build_parser():
    import argparse
    from disagg.frontend import add_model_args
    ap = argparse.ArgumentParser(prog="python -m disagg", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="aggregated vs disaggregated, shared vs private")
    add_model_args(demo)
    demo.add_argument("--num-prompts", type=int, default=2, help="prompts per prompt length")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--max-prompt-len", type=int, default=None,
                      help="leave out longer prompts (default: none; 512 on a CPU)")
    demo.add_argument("--repeats", type=int, default=3, help="timed runs per mode")
    demo.add_argument("--move-path", default="coalesced", choices=MOVE_PATHS)
    demo.add_argument("--json", default=None, help="also write the report to this file")
    srv = sub.add_parser("serve", help="serve JSON lines (file or stdin) or HTTP (--http)")
    add_model_args(srv)
    srv.add_argument("input", nargs="?", default="-", help="JSON-lines requests ('-': stdin)")
    srv.add_argument("--draft-kv", default="shared", choices=("shared", "private", "aggregated"),
                     help="disaggregated with the draft KV shared (the default: two engines, a KV "
                          "cache each) or private, or aggregated (one engine)")
    srv.add_argument("--http", type=processes.host_port, default=None, metavar="HOST:PORT",
                     help="serve OpenAI-compatible HTTP here instead of JSON lines")
    srv.add_argument("--request-timeout", type=processes.positive_seconds,
                     default=DEFAULT_REQUEST_TIMEOUT_S,
                     help="HTTP: seconds a request may wait for its next tokens (default "
                          f"{DEFAULT_REQUEST_TIMEOUT_S:g})")
    srv.add_argument("--warmup", default="first", choices=("first", "all"),
                     help="compile before the ready line: what a first request needs "
                          "(first), or every step for every prompt length up to "
                          "--max-seq-len, greedy and sampled, with and without log-"
                          "probabilities and logit adjustments (penalties, logit bias) "
                          "(all: no request then waits on a compile; the compilation "
                          "cache keeps them for restarts)")
    srv.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                     help="per-step token budget: decode rows (a verify block each) plus "
                          "prefill chunks; a larger one puts more prompts' chunks into a step "
                          "(default: every slot decoding plus eight chunks)")
    processes.add_default_max_tokens_arg(srv)
    processes.add_batch_invariant_arg(srv)
    processes.add_parser(sub)
    return ap


def serve(args) -> None:
    from disagg.accounting import page_report
    from disagg.frontend import caches_per_device, load_pair, make_engine, serve_http, warm_up
    from disagg.serving import serve_json_lines
    from drafter.shapes import param_bytes
    from unified_kv import capacity
    if args.input != "-":   # checked before the minutes of loading and compiling
        if args.http is not None:
            raise SystemExit(f"serve: give JSON-lines requests ({args.input}) or --http, not "
                             f"both; an HTTP server takes its requests over HTTP")
        if not os.path.isfile(args.input) or not os.access(args.input, os.R_OK):
            raise SystemExit(f"serve: {args.input}: no readable file there; give a JSON-lines "
                             f"file, or - (the default) for stdin")
    pair = load_pair(args.target, args.drafter, num_slots=args.num_slots,
                     max_seq_len=args.max_seq_len, kv_memory_mib=args.kv_memory_mib,
                     kv_memory_fraction=args.kv_memory_fraction, layer_loop=args.layer_loop,
                     dtype=args.dtype,
                     caches_per_device=caches_per_device(args.draft_kv))
    weights = param_bytes(pair.params)
    print(f"serve: weights {weights / 2**30:.2f} GiB; "
          f"{capacity(pair.step_config.spec).describe()}", file=sys.stderr, flush=True)
    try:
        engine = make_engine(args.draft_kv, pair,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             batch_invariant=args.batch_invariant)
    except ValueError as e:
        raise SystemExit(f"serve: {e}")
    if args.http is not None:
        serve_http(engine, pair, *args.http, mode=args.draft_kv,
                   request_timeout_s=args.request_timeout,
                   default_max_tokens=args.default_max_tokens, counter=args.counter,
                   warm_every_length=args.warmup == "all")
    else:
        def log(msg):
            print(f"serve: {msg}", file=sys.stderr, flush=True)
        seconds = warm_up(engine, pair.tokenizer, log, every_length=args.warmup == "all")
        log(f"ready: {pair.name} ({args.draft_kv}) after {seconds:.1f}s of compiling "
            f"({args.counter.summary()}); reading JSON lines from "
            f"{'stdin' if args.input == '-' else args.input}")
        serve_json_lines(engine, args.input, pair.tokenizer)
    print(f"serve: pages at exit: {json.dumps(page_report(engine))}", file=sys.stderr)


def demo(args) -> None:
    from disagg.demo import DemoConfig, print_table, run_demo
    from disagg.frontend import caches_per_device, load_pair
    cfg = DemoConfig.from_args(args)
    if cfg.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(cfg.json_path))):
        raise SystemExit(f"demo: --json {cfg.json_path}: its directory does not exist; create "
                         f"it or give another path (checked before the demo runs)")
    pair = load_pair(args.target, args.drafter, num_slots=args.num_slots,
                     max_seq_len=args.max_seq_len, kv_memory_mib=args.kv_memory_mib,
                     kv_memory_fraction=args.kv_memory_fraction, layer_loop=args.layer_loop,
                     dtype=args.dtype,
                     caches_per_device=caches_per_device("shared"))
    report = run_demo(pair, cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    report["compile_cache"] = {"dir": args.cache_dir, "programs_compiled": args.counter.compiled,
                               "programs_from_cache": args.counter.hits}
    print_table(report)
    print(f"* compilation: {args.counter.summary()} "
          f"({'cache ' + args.cache_dir if args.cache_dir else 'cache off'})")
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(report, f, indent=2)
    if not report["shared_equals_aggregated"]:
        raise SystemExit("disaggregated-shared output differs from aggregated: a bug")


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "serve-remote":
        return processes.run(args)
    from disagg.compile_cache import CompileCounter, enable_compile_cache
    cache_dir = enable_compile_cache(not args.no_compile_cache)
    args.cache_dir = str(cache_dir) if cache_dir else None
    args.counter = CompileCounter()
    try:
        return serve(args) if args.command == "serve" else demo(args)
    except KeyboardInterrupt:  # before serving began (loading, compiling)
        print(f"{args.command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
