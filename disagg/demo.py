"""`python -m disagg demo`: what the unified cache changes, measured and explained.

The shipped held-out prompts (or a pair's, by path: the same token ids are
not meaningful to another tokenizer, so a pair by path gets them decoded as
bytes and re-encoded) run through the three modes of frontend.MODES. Printed
and, with --json, written:

  * per mode: acceptance length (AL), tokens/s over repeats (median, min..max),
    time to first token, KV bytes moved;
  * per prompt length: AL aggregated / shared / private and the loss private
    mode costs (the loss the shared draft KV removes);
  * the KV memory of each pool; whether shared output equals aggregated
    (it must: the demo fails otherwise);
  * the host's CPU and what a jitted call costs it to launch: the small pair's
    tok/s, and the disaggregated-over-aggregated ratio, follow the host.

On a CPU the attention kernels run in Pallas interpret mode: times there say
nothing about a GPU's, and long prompts are slow, so prompts are limited to
--max-prompt-len (512 on a CPU unless given; the output says so).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from disagg.frontend import DEFAULT_MODEL_NAME, MODES, ModelPair, make_engine
from drafter.default import load_prompts
from drafter.timing import host_cpu, launch_us
from unified_kv import bytes_per_pool

CPU_MAX_PROMPT_LEN = 512
MODE_NAMES = {"aggregated": "aggregated", "shared": "disagg-shared",
              "private": "disagg-private"}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    num_prompts: int        # prompts per prompt length
    max_new_tokens: int
    max_prompt_len: int | None   # None: 8192, or CPU_MAX_PROMPT_LEN on a CPU
    repeats: int
    move_path: str
    json_path: str | None

    @classmethod
    def from_args(cls, args) -> "DemoConfig":
        for flag in ("num_prompts", "max_new_tokens", "repeats"):
            if getattr(args, flag) < 1:
                raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(args, flag)}")
        return cls(args.num_prompts, args.max_new_tokens, args.max_prompt_len, args.repeats,
                   args.move_path, args.json)


def explanation(block_size: int, on_cpu: bool, limit_note: str | None,
                host: dict | None = None) -> list[str]:
    """The demo's explanation lines. `host`: {"cpu", "launch_us"} of this run (`run_demo`)."""
    lines = [
        f"AL (acceptance length): tokens a request keeps per decode step (the drafter's "
        f"accepted tokens + 1 from the target). 1.0 = no draft accepted; best = "
        f"{block_size} (the drafter's block size); higher is better: fewer target steps "
        f"per token.",
        "disagg-shared: the prompt is prefilled on a context worker and its KV moved to the "
        "generation worker, the drafter's context KV included (one cache, one transfer): AL "
        "and tokens equal aggregated.",
        "disagg-private: only the target's KV moves; the generation worker drafts without "
        "the prompt's context KV. Tokens stay the same (verification is lossless); AL drops: "
        "the table above gives the loss per prompt length (shared - private AL).",
        "A prompt's AL varies from 2 to 8 with its continuation, so a few prompts a length "
        "show the shared-private loss, not the length's AL: `python -m drafter.evaluate` "
        "measures that over 16 held-out prompts a length, with a 95% interval.",
        "tok/s: generated tokens per wall-clock second, all requests together (median and "
        "min..max over repeats); TTFT: submit to first token, ms; moved: KV bytes imported "
        "by the generation worker, MiB (2^20 bytes).",
    ]
    if on_cpu:
        lines.append("CPU: attention runs in Pallas interpret mode, so tok/s and TTFT here "
                     "say nothing about GPU speed; AL, tokens and bytes are the same on any "
                     "device.")
    elif host:
        lines.append(f"GPU: a small pair's steps are short, so tok/s follows the host as "
                     f"much as the GPU: each jitted call costs the host about "
                     f"{host['launch_us']:.0f} us to launch here ({host['cpu']}), and "
                     f"disagg-shared runs two engines' loops on it where aggregated runs one; "
                     f"its tok/s ratio to aggregated differs from host to host (BENCHMARKS.md, "
                     f"Serving).")
    if limit_note:
        lines.append(limit_note)
    return lines


def select_prompts(pair: ModelPair, cfg: DemoConfig, on_cpu: bool):
    """[(length, token ids)], `num_prompts` per shipped length up to the limit, and
    the note saying what the limit left out (None when nothing)."""
    limit = cfg.max_prompt_len or (CPU_MAX_PROMPT_LEN if on_cpu else None)
    shipped = load_prompts()
    lengths = sorted({p["length"] for p in shipped})
    kept = [n for n in lengths if limit is None or n <= limit]
    if not kept:
        raise SystemExit(f"--max-prompt-len {limit} is below the shortest shipped prompt "
                         f"({lengths[0]} tokens)")
    chosen = []
    for n in kept:
        chosen += [(n, p["tokens"]) for p in shipped if p["length"] == n][:cfg.num_prompts]
    if pair.name != DEFAULT_MODEL_NAME:  # the shipped ids are bytes of the embedded tokenizer
        from drafter.corpus import ByteTokenizer
        text = ByteTokenizer().decode
        chosen = [(n, pair.tokenizer.encode(text(t))) for n, t in chosen]
    left = [n for n in lengths if n not in kept]
    note = None
    if left:
        why = "on a CPU by default" if cfg.max_prompt_len is None else "by --max-prompt-len"
        note = (f"prompt lengths {left} were left out ({why}: prompts up to {limit} tokens); "
                f"--max-prompt-len {lengths[-1]} runs them all")
    return chosen, note


def run_mode(mode: str, pair: ModelPair, prompts, cfg: DemoConfig, log) -> dict:
    engine = make_engine(mode, pair, move_path=cfg.move_path, eos=False)
    log(f"{MODE_NAMES[mode]}: compiling (an untimed first run) ...")
    start = time.perf_counter()
    engine.generate(prompts, cfg.max_new_tokens)  # an untimed run compiles every shape
    compile_s = time.perf_counter() - start
    runs, results = [], None
    for i in range(cfg.repeats):
        log(f"{MODE_NAMES[mode]}: run {i + 1}/{cfg.repeats} ({len(prompts)} prompts x "
            f"{cfg.max_new_tokens} tokens)")
        engine.bytes_imported = 0
        start = time.perf_counter()
        results = engine.generate(prompts, cfg.max_new_tokens)
        runs.append(sum(len(r.tokens) for r in results) / (time.perf_counter() - start))
    return {"mode": MODE_NAMES[mode], "requests": len(results),
            "acceptance_length": float(np.mean([a for r in results for a in r.acceptance])),
            "tokens_per_s": statistics.median(runs), "tokens_per_s_runs": runs,
            "tokens_per_s_min": min(runs), "tokens_per_s_max": max(runs),
            "ttft_ms": 1e3 * float(np.mean([r.time_to_first_token_s for r in results])),
            "bytes_transferred": engine.bytes_imported, "first_run_s": compile_s,
            "tokens": [r.tokens for r in results],
            "acceptance_per_prompt": [r.acceptance_length for r in results]}


def by_prompt_length(rows, lengths) -> list[dict]:
    out = []
    for n in sorted(set(lengths)):
        idx = [i for i, m in enumerate(lengths) if m == n]
        al = {r["mode"]: float(np.mean([r["acceptance_per_prompt"][i] for i in idx]))
              for r in rows}
        shared, private = al["disagg-shared"], al["disagg-private"]
        out.append({"prompt_tokens": n, "prompts": len(idx),
                    "al_aggregated": al["aggregated"], "al_shared": shared,
                    "al_private": private, "private_loss": shared - private,
                    "private_loss_pct": 100 * (shared - private) / shared if shared else 0.0})
    return out


def run_demo(pair: ModelPair, cfg: DemoConfig, log=print) -> dict:
    on_cpu = jax.default_backend() == "cpu"
    chosen, note = select_prompts(pair, cfg, on_cpu)
    lengths, prompts = [n for n, _ in chosen], [t for _, t in chosen]
    step_cfg = pair.step_config
    log(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; {len(prompts)} "
        f"held-out prompts of {sorted(set(lengths))} tokens, {cfg.max_new_tokens} new tokens "
        f"each, {cfg.repeats} timed runs per mode")
    rows = [run_mode(mode, pair, prompts, cfg, log) for mode in MODES]
    host = {"cpu": host_cpu(), "launch_us": launch_us()}
    pools = [{"pool": p.pool_id, "kv_dtype": p.kv_dtype, "window": p.sliding_window,
              "layers": list(p.layer_names), "MiB": b / 2**20}
             for p, b in zip(step_cfg.spec.pools, bytes_per_pool(step_cfg.spec).values())]
    return {"rows": rows, "pools": pools,
            "shared_equals_aggregated": rows[0]["tokens"] == rows[1]["tokens"],
            "private_output_unchanged": rows[0]["tokens"] == rows[2]["tokens"],
            "by_prompt_length": by_prompt_length(rows, lengths),
            "best_acceptance_length": step_cfg.block_size,
            "prompt_lengths": lengths, "repeats": cfg.repeats,
            "max_new_tokens": cfg.max_new_tokens, "model": pair.name,
            "device": {"platform": jax.default_backend(), "count": len(jax.devices()),
                       "kind": jax.devices()[0].device_kind},
            "prompts_left_out": note, "host": host,
            "explanation": explanation(step_cfg.block_size, on_cpu, note, host)}


def print_table(report: dict) -> None:
    head = (f"{'mode':<16}{'AL':>6}{'tok/s (median, min..max)':>28}{'TTFT ms':>9}"
            f"{'moved MiB':>11}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in report["rows"]:
        spread = (f"{r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}.."
                  f"{r['tokens_per_s_max']:.1f})")
        print(f"{r['mode']:<16}{r['acceptance_length']:>6.2f}{spread:>28}{r['ttft_ms']:>9.0f}"
              f"{r['bytes_transferred'] / 2**20:>11.2f}")
    print(f"\nAL per prompt length (best {report['best_acceptance_length']}; loss = what "
          f"private costs, what shared saves):")
    head = (f"{'prompt tokens':>14}{'prompts':>9}{'aggregated':>12}{'shared':>8}"
            f"{'private':>9}{'loss':>7}{'loss %':>8}")
    print(head + "\n" + "-" * len(head))
    for b in report["by_prompt_length"]:
        print(f"{b['prompt_tokens']:>14}{b['prompts']:>9}{b['al_aggregated']:>12.2f}"
              f"{b['al_shared']:>8.2f}{b['al_private']:>9.2f}{b['private_loss']:>7.2f}"
              f"{b['private_loss_pct']:>7.1f}%")
    print("\nKV memory per pool:")
    for p in report["pools"]:
        print(f"  pool {p['pool']}: {p['kv_dtype']:<8} window={str(p['window']):<5} "
              f"{p['MiB']:7.1f} MiB  {', '.join(p['layers'])}")
    print(f"\ndisagg-shared tokens == aggregated: {report['shared_equals_aggregated']}; "
          f"private changes acceptance only: {report['private_output_unchanged']}\n")
    for line in report["explanation"]:
        print(f"* {line}")
