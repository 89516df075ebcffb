"""The model pair `python -m disagg demo | serve` run: given by path (or the embedded
one), as an engine in one of three modes, behind JSON lines or HTTP.

Modes (every one a configuration of the one Engine):
    aggregated      prefill and decode on one worker
    shared          disaggregated; the draft KV travels with the target's (the fix)
    private         disaggregated; only the target's KV travels: the generation worker
                    drafts without the prompt's draft context KV (the loss)

A pair by path is an HF Qwen3 target directory (config.json, safetensors,
tokenizer.json) and a z-lab DFlash drafter directory; text goes through the
target's own tokenizer. Without paths: the embedded pair and its byte tokenizer.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from disagg.schema import DEFAULT_MAX_TOKENS, DEFAULT_REQUEST_TIMEOUT_S
from disagg.sources import disaggregated_engine
from drafter.engine import Engine
from drafter.request import SamplingParams
from drafter.scheduler import row_shapes
from drafter.shapes import param_bytes
from drafter.steps import scans_layers
from drafter.tokenizer import TokenizerError, load_tokenizer
from models.layers import step_params
from unified_kv import CacheSpecError

MODES = ("aggregated", "shared", "private")
DEFAULT_MODEL_NAME = "dflash-default"
DEFAULT_KV_MIB = 1024


@dataclasses.dataclass(frozen=True)
class ModelPair:
    params: dict
    step_config: object
    tokenizer: object
    name: str


def add_model_args(p) -> None:
    p.add_argument("--target", default=None, help="HF Qwen3 checkpoint directory (with its "
                   "tokenizer.json); default: the embedded pair")
    p.add_argument("--drafter", default=None, help="z-lab DFlash drafter directory (with "
                   "--target)")
    p.add_argument("--num-slots", type=int, default=4, help="requests decoded together")
    p.add_argument("--max-seq-len", type=int, default=9216,
                   help="prompt + generated tokens per request, at most")
    p.add_argument("--kv-memory-mib", type=int, default=None,
                   help=f"KV cache memory of each worker, MiB (default {DEFAULT_KV_MIB})")
    p.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="instead: size the KV caches so that the weights and the caches "
                        "take this share of the device's memory (vLLM's "
                        "--gpu-memory-utilization); the rest is the steps' working memory "
                        "(a device that reports its memory)")
    p.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"),
                   help="scan: one compiled body per run of alike layers (fast compiles of "
                        "deep models); unrolled: each layer traced (fastest steps on GPUs); "
                        "auto: unrolled on GPUs up to 8 layers, scan otherwise")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="the weights' dtype on the device (with --target); auto: the "
                        "checkpoint's own, bf16 when every weight is stored in bf16, else f32")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent compilation cache (also: "
                        "DFLASH_COMPILE_CACHE=0)")


def load_pair(target=None, drafter=None, *, num_slots: int = 4, max_seq_len: int = 9216,
              kv_memory_mib: int | None = None, kv_memory_fraction: float | None = None,
              caches_per_device: int = 1, layer_loop: str = "auto",
              dtype: str = "auto") -> ModelPair:
    """The pair at `target` / `drafter` (weights in `dtype`: "auto", "bfloat16" or
    "float32"), or the embedded one when both are None, with a KV cache of
    `kv_memory_mib`, or of what `kv_memory_fraction` of the device memory leaves once
    the weights are loaded, shared by `caches_per_device` caches. The weights are on
    the device once, in the form the steps read (`served_step_params`)."""
    if (target is None) != (drafter is None):
        raise SystemExit("give both --target DIR and --drafter DIR, or neither (the "
                         "embedded pair)")
    check_cache_flags(num_slots, max_seq_len)
    params, tcfg, dcfg = load_weights(target, drafter, dtype)
    tokenizer = checkpoint_tokenizer(target, tcfg.vocab_size)
    # One device: the step form goes there once and every worker reads it. Several (a
    # mesh per worker, split_meshes): it stays on the host and each worker's executor
    # puts its replica on its own mesh, which the fraction's budget counts.
    params, cfg = served_params_and_config(
        params, tcfg, dcfg, on_device=split_meshes()[0] is None, num_slots=num_slots,
        max_seq_len=max_seq_len, kv_memory_mib=kv_memory_mib,
        kv_memory_fraction=kv_memory_fraction, caches_per_device=caches_per_device,
        layer_loop=layer_loop)
    name = DEFAULT_MODEL_NAME if target is None else Path(target).resolve().name
    return ModelPair(params, cfg, tokenizer, name)


def check_cache_flags(num_slots: int, max_seq_len: int) -> None:
    """SystemExit naming the flags, before any weights load, for a cache of no slots
    or no length."""
    if num_slots < 1 or max_seq_len < 1:
        raise SystemExit(f"--num-slots and --max-seq-len must be >= 1, got {num_slots}, "
                         f"{max_seq_len}")


def load_weights(target=None, drafter=None, dtype: str = "auto", *,
                 flags: tuple[str, str] = ("--target", "--drafter")):
    """(params on the host, target config, drafter config): the checkpoints at
    `target` / `drafter` (drafter None with a target: the target alone, its drafter
    config None), or the embedded pair when `target` is None. SystemExit naming the
    `flags` (the command's options for the two paths) when a checkpoint cannot be read
    or the drafter does not belong to the target."""
    from drafter.checkpoint import load_dflash
    from drafter.default import load_default
    from drafter.inspect import pair_checks
    from models.checkpoint import load_qwen3
    from models.config import CheckpointError
    if target is None:
        return load_default()
    for flag, path in zip(flags, (target, drafter)):
        if path is not None and not Path(path, "config.json").is_file():
            raise SystemExit(f"{flag} {path}: no config.json there; give a checkpoint "
                             f"directory")
    try:
        tcfg, target_params = load_qwen3(target, dtype, on_host=True)
    except CheckpointError as e:
        raise SystemExit(f"{flags[0]} {target}: {e}") from None
    if drafter is None:
        return {"target": target_params}, tcfg, None
    try:
        dcfg, draft_params = load_dflash(drafter, dtype, on_host=True)
    except CheckpointError as e:
        raise SystemExit(f"{flags[1]} {drafter}: {e}") from None
    if problems := pair_checks(tcfg, dcfg):
        raise SystemExit(f"{flags[1]} {drafter} does not fit {flags[0]} {target}: "
                         f"{'; '.join(problems)}; give the drafter trained for this target")
    return {"target": target_params, "draft": draft_params}, tcfg, dcfg


def served_params_and_config(params: dict, tcfg, dcfg, *, on_device: bool, num_slots: int,
                             max_seq_len: int, kv_memory_mib: int | None,
                             kv_memory_fraction: float | None, caches_per_device: int = 1,
                             layer_loop: str = "auto"):
    """(step-form params, StepConfig) of a served pair: the weights converted once
    (`served_step_params`; placed on the default device when `on_device`, else left
    for each executor to put on its mesh), then a default cache sized by the KV flags
    against the memory the weights leave (`kv_budget_bytes`, `served_step_config`)."""
    params = served_step_params(params, scans_layers(layer_loop, tcfg, dcfg),
                                on_device=on_device)
    budget = kv_budget_bytes(kv_memory_mib, kv_memory_fraction, caches_per_device,
                             pending_bytes=0 if on_device else param_bytes(params))
    return params, served_step_config(tcfg, dcfg, num_slots=num_slots,
                                      max_seq_len=max_seq_len, memory_budget_bytes=budget,
                                      layer_loop=layer_loop)


def served_step_params(params: dict, scans: bool, *, on_device: bool = True) -> dict:
    """`params` in the form the steps read (`models.layers.step_params`: layers stacked
    when `scans`, projections fused), converted on the host, then put on the default
    device once (`on_device`; else left on the host for executors to place on their
    meshes). The device never holds a checkpoint's form beside the step form, and the
    weights sit in one piece, below the KV cache allocated after them. Every engine made
    from the result reads these arrays: an executor leaves step-form weights as they
    are, so the workers of a pair on one device share one copy."""
    step = step_params(jax.tree.map(np.asarray, params), scans)   # host arrays: no copy
    return jax.device_put(step) if on_device else step


def served_step_config(tcfg, dcfg, **cache):
    """The default cache (`default_step_config`) of a served pair; SystemExit naming
    the flags when it cannot hold one request."""
    from drafter.default import default_step_config
    from unified_kv import capacity
    try:
        cfg = default_step_config(tcfg, dcfg, **cache)
    except CacheSpecError as e:
        raise SystemExit(f"the KV cache does not hold one request: {e} (--kv-memory-mib, "
                         f"--kv-memory-fraction, --max-seq-len)") from None
    # Slots past what the cache holds of the shortest requests never run; each still
    # costs its state (a page table row per pool, a vocabulary row of output counts).
    shortest = capacity(cfg.spec, max_len=1)
    if shortest.limited_by == "memory":
        raise SystemExit(f"--num-slots {cfg.spec.num_slots}: the KV cache holds at most "
                         f"{shortest.requests} requests at once, however short, so the "
                         f"other slots would never run; give --num-slots "
                         f"{shortest.requests} or fewer, or more KV memory (--kv-memory-mib, "
                         f"--kv-memory-fraction)")
    return cfg


def kv_budget_bytes(mib: int | None, fraction: float | None, caches_per_device: int = 1,
                    device=None, *, pending_bytes: int = 0) -> int:
    """One cache's memory_budget_bytes: `mib` MiB, or `fraction` of `device`'s memory
    limit less what is in use (the weights) and `pending_bytes` still to come (weights
    each worker places on its own mesh), split over `caches_per_device` caches
    (neither: DEFAULT_KV_MIB). SystemExit naming the flag when it cannot be met."""
    if mib is not None and fraction is not None:
        raise SystemExit("give --kv-memory-mib or --kv-memory-fraction, not both")
    if fraction is None:
        mib = DEFAULT_KV_MIB if mib is None else mib
        if not isinstance(mib, int) or mib < 1:
            raise SystemExit(f"--kv-memory-mib must be a positive integer, got {mib!r}")
        return mib << 20
    if not 0 < fraction <= 1:
        raise SystemExit(f"--kv-memory-fraction must be in (0, 1], got {fraction}")
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise SystemExit(f"--kv-memory-fraction: {device.platform} device {device.id} does "
                         f"not report its memory; give --kv-memory-mib instead")
    held = stats.get("bytes_in_use", 0) + pending_bytes
    free = fraction * stats["bytes_limit"] - held
    if free < 1 << 20:
        raise SystemExit(
            f"--kv-memory-fraction {fraction}: {held / 2**30:.2f} GiB of the device's "
            f"{stats['bytes_limit'] / 2**30:.2f} GiB are taken already (the weights); raise "
            f"the fraction or give --kv-memory-mib")
    return int(free // caches_per_device)


def caches_per_device(mode: str) -> int:
    """KV caches a `mode` engine puts on each device: a disaggregated pair on one
    device holds two (split_meshes)."""
    return 2 if mode != "aggregated" and split_meshes()[0] is None else 1


def checkpoint_tokenizer(target_dir, model_vocab_size: int, *, flag: str = "--target"):
    """The tokenizer of the target checkpoint in `target_dir` (None: the embedded
    pair's bytes); its `eos_token_ids` end requests. SystemExit naming `flag` and
    the directory when it cannot be read or does not fit the model."""
    try:
        return load_tokenizer(target_dir, model_vocab_size=model_vocab_size)
    except TokenizerError as e:
        raise SystemExit(f"{flag} {target_dir}: {e}") from None


def split_meshes():
    """Half the devices each; on one device both workers share it."""
    devices = np.array(jax.devices())
    if len(devices) < 2:
        return None, None
    half = len(devices) // 2
    return (jax.sharding.Mesh(devices[:half], ("tp",)),
            jax.sharding.Mesh(devices[half:2 * half], ("tp",)))


def make_engine(mode: str, pair: ModelPair, *, move_path: str = "coalesced",
                eos: bool = True, max_num_batched_tokens: int | None = None,
                batch_invariant: bool = False) -> Engine:
    """The pair's engine in `mode` (MODES); `eos`: the tokenizer's end-of-sequence
    ids end a request (unless it sets ignore_eos); `max_num_batched_tokens`: each
    engine's per-step token budget (None: Engine's default; Engine refuses one below a
    prefill chunk); `batch_invariant`: Engine's (tokens independent of the batch)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is unknown; use one of {MODES}")
    mesh_ctx, mesh_gen = split_meshes()
    eos_ids = tuple(pair.tokenizer.eos_token_ids) if eos else ()
    if mode == "aggregated":
        return Engine(pair.params, pair.step_config, mesh=mesh_gen, eos_token_ids=eos_ids,
                      max_num_batched_tokens=max_num_batched_tokens,
                      batch_invariant=batch_invariant)
    return disaggregated_engine(pair.params, pair.step_config, mode=mode,
                                context_meshes=(mesh_ctx,), mesh=mesh_gen,
                                move_path=move_path, eos_token_ids=eos_ids,
                                max_num_batched_tokens=max_num_batched_tokens,
                                batch_invariant=batch_invariant)


def warm_up(engine: Engine, tokenizer, log=None, *, every_length: bool = False) -> float:
    """Compile what first requests need (prefill of as many prompts as each row count a
    prefill call pads to: 1, 2, 4, ... up to a step's most, and decode of those bursts;
    decode calls of more rows, and other table widths, compile at first use), and with
    `every_length` every step call for every prompt length up to
    max_seq_len, greedy and sampled, with and without log-probabilities and logit
    adjustments (penalties, logit bias) (`Engine.warmup`: no request of a new length then
    waits on a compile). Returns the seconds it took."""
    start = time.perf_counter()
    prompt = tokenizer.encode("def main():") or [0]
    need = engine.scheduler.reserved_len(engine.make_request(
        "warm-up", prompt, SamplingParams(2, ignore_eos=True)))
    if need > engine.spec.max_seq_len:
        raise SystemExit(
            f"--max-seq-len {engine.spec.max_seq_len} holds no request: a {len(prompt)}-token "
            f"prompt and 2 new tokens need {need} tokens of room, {need - len(prompt) - 2} of "
            f"them for the verify and lookahead blocks every request reserves; give "
            f"--max-seq-len {need} or more")
    for batch in row_shapes(engine.scheduler.max_prefill_rows):
        if log:
            log(f"compiling: {batch} prompt(s), prefill and decode ...")
        engine.generate([prompt] * batch, 2, ignore_eos=True)
    if every_length:
        if log:
            log(f"compiling: every step for rows of up to {engine.spec.max_seq_len:,} tokens, "
                f"greedy and sampled, with and without log-probabilities and logit "
                f"adjustments ...")
        engine.warmup(sampled=True, logprobs=True, adjusted=True)
    return time.perf_counter() - start


def serve_http(engine: Engine, pair: ModelPair, host: str, port: int, *, mode: str,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
               default_max_tokens: int = DEFAULT_MAX_TOKENS, counter=None,
               warm_every_length: bool = False) -> None:
    """Listen at once (GET /health says "starting"), compile, print the ready line,
    serve until SIGINT / SIGTERM, then finish the accepted requests and return.
    `default_max_tokens`: what a request without max_tokens gets (at most the room
    its prompt leaves). `warm_every_length`: see `warm_up`."""
    from disagg.http import CompletionsApp
    from disagg.http_thread import HTTPServer, require_http
    from disagg.loop import ServingLoop
    from disagg.metrics import ServingMetrics
    from disagg.serving import install_drain_handlers
    try:
        require_http()
    except ImportError as e:
        raise SystemExit(str(e)) from None

    def log(msg):
        print(f"serve: {msg}", file=sys.stderr, flush=True)

    metrics = ServingMetrics(pair.step_config.spec, pair.step_config.block_size)
    loop = ServingLoop(engine, pair.tokenizer, metrics)
    app = CompletionsApp(loop, metrics, pair.name, request_timeout_s=request_timeout_s,
                         default_max_tokens=default_max_tokens)
    try:
        server = HTTPServer(app.app, host, port).start()
    except OSError as e:  # the address is taken or not ours
        raise SystemExit(str(e)) from None
    log(f"listening on {server.url} (GET /health answers 503 until compiled)")
    handlers = {}
    try:
        seconds = warm_up(engine, pair.tokenizer, log,   # Ctrl-C here: KeyboardInterrupt
                          every_length=warm_every_length)
        handlers = install_drain_handlers("serve", loop.close)
        app.ready.set()
        cache = f"; {counter.summary()}" if counter is not None else ""
        print(f"ready: {pair.name} ({mode}) on {server.url}/v1 after {seconds:.1f}s of "
              f"compiling{cache}", flush=True)
        loop.run()
    finally:
        loop.close()
        server.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    log(f"stopped; {counter.summary()}" if counter is not None else "stopped")
