"""Worker processes: `python -m disagg serve-remote`, and a context worker as a child.

By hand on one host (CPU shown; each process sizes its own devices):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      python -m disagg serve-remote --role context --address 127.0.0.1:7400 --tp 2
    python -m disagg serve-remote --role generation --address 127.0.0.1:7400 < requests.jsonl

The context prints `context worker listening on HOST:PORT ...` on stdout (its
only stdout line; logs go to stderr). The generation side reads JSON lines
{"id", "prompt": text | "tokens": [ids], "max_new_tokens"} and writes one JSON
line per request; text goes through the target's tokenizer, whose end-of-sequence
ids end requests, as in `serve`. `ContextProcess` starts the context side from Python.

A context with --no-drafter loads the target alone: it pairs with generation
workers started with --draft-kv private (their drafters start without the
prompt's draft KV); a shared-mode generation worker is refused at the handshake.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from disagg.schema import DEFAULT_REQUEST_TIMEOUT_S

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class PairSource:
    """Which model pair and cache a worker process builds (both sides must agree;
    the handshake says so when they do not)."""

    pair_dir: str | None = None   # target/ and draft/ HF checkpoints; None: the embedded pair
    num_slots: int = 4
    max_seq_len: int = 9216
    kv_memory_mib: int | None = None         # None: frontend.DEFAULT_KV_MIB
    drafter: bool = True          # False: the target alone (a context worker only)
    kv_memory_fraction: float | None = None  # instead: a share of the device's memory

    def load(self):
        """(params, StepConfig) with the default cache (fp8 target KV, bf16 draft KV;
        without the drafter, target KV only). The params are the step form on the host:
        a worker's executor puts its one replica on its mesh (`local_mesh`)."""
        from disagg.frontend import check_cache_flags, load_weights, served_params_and_config
        check_cache_flags(self.num_slots, self.max_seq_len)
        target = drafter = None
        if self.pair_dir is not None:
            target = Path(self.pair_dir) / "target"
            drafter = Path(self.pair_dir) / "draft" if self.drafter else None
        params, tcfg, dcfg = load_weights(target, drafter, flags=("--pair",) * 2)
        if not self.drafter:
            params, dcfg = {"target": params["target"]}, None
        return served_params_and_config(
            params, tcfg, dcfg, on_device=False, num_slots=self.num_slots,
            max_seq_len=self.max_seq_len, kv_memory_mib=self.kv_memory_mib,
            kv_memory_fraction=self.kv_memory_fraction)

    def tokenizer(self, model_vocab_size: int):
        """The target's tokenizer (its tokenizer.json; the embedded pair: bytes), as
        `serve` loads it; SystemExit naming --pair when it cannot be read."""
        from disagg.frontend import checkpoint_tokenizer
        target = Path(self.pair_dir) / "target" if self.pair_dir else None
        return checkpoint_tokenizer(target, model_vocab_size, flag="--pair")

    def eos_token_ids(self, model_vocab_size: int) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence ids; none for a pair without a tokenizer (a
        context worker takes token ids only; the handshake still compares the ids with
        its peer's)."""
        if self.pair_dir and not (Path(self.pair_dir) / "target" / "tokenizer.json").exists():
            return ()
        return tuple(self.tokenizer(model_vocab_size).eos_token_ids)

    def cli_args(self) -> list[str]:
        args = ["--num-slots", str(self.num_slots), "--max-seq-len", str(self.max_seq_len)]
        if self.kv_memory_mib is not None:
            args += ["--kv-memory-mib", str(self.kv_memory_mib)]
        if self.kv_memory_fraction is not None:
            args += ["--kv-memory-fraction", str(self.kv_memory_fraction)]
        args += [] if self.drafter else ["--no-drafter"]
        return args + (["--pair", str(self.pair_dir)] if self.pair_dir else [])


def add_parser(sub) -> None:
    p = sub.add_parser("serve-remote", help="one side of a two-process disaggregated pair")
    p.add_argument("--role", required=True, choices=("context", "generation"))
    p.add_argument("--address", default="127.0.0.1:0",
                   help="context: where to listen (port 0 picks one); generation: the "
                        "context worker's address")
    p.add_argument("input", nargs="?", default="-", help="generation: JSON-lines requests")
    p.add_argument("--pair", default=None, help="dir with target/ and draft/ checkpoints "
                                                "(default: the embedded pair)")
    p.add_argument("--num-slots", type=int, default=4)
    p.add_argument("--max-seq-len", type=int, default=9216)
    p.add_argument("--kv-memory-mib", type=int, default=None,
                   help="KV cache memory, MiB (default 1024)")
    p.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="instead: the weights and the cache take this share of the "
                        "device's memory")
    p.add_argument("--draft-kv", default=None, choices=("shared", "private"),
                   help="shared (default) or private; a context with --no-drafter is private")
    p.add_argument("--no-drafter", action="store_true",
                   help="context: serve the target alone (no drafter loaded); only "
                        "generation workers with --draft-kv private can pair with it")
    p.add_argument("--tp", type=int, default=1, help="devices in this worker's mesh")
    p.add_argument("--timeout", type=positive_seconds, default=30.0,
                   help="seconds any wait for the peer may take")
    p.add_argument("--idle-timeout", type=positive_seconds, default=None,
                   help="context: seconds to wait for a peer's next request (default 3600)")
    p.add_argument("--transfer-host", default="127.0.0.1",
                   help="host the KV transfer server binds and advertises")
    p.add_argument("--max-connections", type=int, default=None,
                   help="context: exit after serving this many peers")
    p.add_argument("--warmup", action="store_true",
                   help="context: compile prefill before serving (peers queue meanwhile)")
    p.add_argument("--http", type=host_port, default=None, metavar="HOST:PORT",
                   help="generation: serve OpenAI-compatible HTTP here instead of JSON lines")
    p.add_argument("--request-timeout", type=positive_seconds, default=None,
                   help="generation, HTTP: seconds a request may wait for its next tokens "
                        f"(default {DEFAULT_REQUEST_TIMEOUT_S:g})")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not keep compiled programs across runs (disagg/compile_cache.py)")
    add_default_max_tokens_arg(p)
    add_batch_invariant_arg(p)


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: give HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]") or "127.0.0.1", int(port)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return int(text)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds > 0")
    return value


def add_batch_invariant_arg(p) -> None:
    p.add_argument("--batch-invariant", action="store_true",
                   help="every prefill call runs full rows (a lone prompt's padded) and "
                        "every decode call a row per slot, so a request's greedy tokens do "
                        "not depend on what shares its steps (matmuls round by their "
                        "shapes); costs lightly loaded steps the padding")


def add_default_max_tokens_arg(p) -> None:
    from disagg.schema import DEFAULT_MAX_TOKENS
    p.add_argument("--default-max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   metavar="N", help="HTTP: max_tokens of a request that gives none, at "
                   "most the room its prompt leaves (default: %(default)s; "
                   "disagg/schema.py says why)")


def local_mesh(tp: int):
    import jax
    import numpy as np
    if tp < 1:
        raise SystemExit(f"--tp must be >= 1, got {tp}")
    devices = jax.devices()
    if len(devices) < tp:
        raise SystemExit(f"--tp {tp} needs {tp} devices, this process sees {len(devices)} "
                         f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={tp})")
    # A mesh even for one device: shardings stay the same from the first step on.
    return jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))


def run(args) -> None:
    from disagg.context_server import ContextServer
    from disagg.handshake import Weights
    from disagg.kv_format import PairMismatch
    from disagg.remote import RemoteSource
    from disagg.transfer import TransferError
    from disagg.serving import serve_json_lines
    from disagg.sources import ContextWorker
    from drafter.engine import Engine
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("disagg").setLevel(logging.INFO)
    mode = draft_kv_mode(args)
    check_role_args(args)
    from disagg.compile_cache import enable_compile_cache
    enable_compile_cache(not args.no_compile_cache)   # a restarted worker skips its compiles
    source = PairSource(args.pair, args.num_slots, args.max_seq_len, args.kv_memory_mib,
                        drafter=not args.no_drafter,
                        kv_memory_fraction=args.kv_memory_fraction)
    from models.config import CheckpointError
    try:
        params, cfg = source.load()
    except CheckpointError as e:   # names the file and the field
        raise SystemExit(f"serve-remote --pair {args.pair}: {e}") from None
    from unified_kv import capacity
    logging.getLogger("disagg").info("%s: %s", args.role, capacity(cfg.spec).describe())
    mesh = local_mesh(args.tp)
    if args.role == "context":
        try:
            eos = source.eos_token_ids(cfg.target.vocab_size)
            server = ContextServer(ContextWorker(params, cfg, mesh=mesh, mode=mode,
                                                 batch_invariant=args.batch_invariant,
                                                 eos_token_ids=eos),
                                   address=args.address, transfer_host=args.transfer_host,
                                   timeout=args.timeout,
                                   **({"idle_timeout": args.idle_timeout}
                                      if args.idle_timeout else {}))
        except OSError as e:   # in use, or not an address of this host
            raise SystemExit(f"serve-remote --role context: cannot listen on {args.address} "
                             f"({e.strerror or e}); give a free port of this host") from None
        print(f"context worker listening on {server.address} "
              f"(transfer server {server.transfer.address()})", flush=True)
        if args.warmup:
            server.warm_up()
        return server.serve(args.max_connections)
    from disagg.kv_format import KVFormat
    tokenizer = source.tokenizer(cfg.target.vocab_size)
    try:
        remote = RemoteSource(args.address, KVFormat.of(cfg.spec, mode), mesh=mesh,
                              weights=Weights.of(params, cfg), transfer_host=args.transfer_host,
                              timeout=args.timeout, eos_token_ids=tokenizer.eos_token_ids)
    except (TransferError, PairMismatch) as e:   # each names the peer and the fix
        raise SystemExit(f"serve-remote --role generation: {e}") from None
    engine = Engine(params, cfg, mesh=mesh, kv_source=remote, mode=mode,
                    speculative=cfg.draft is not None, kv_timeout_s=remote.engine_timeout_s,
                    eos_token_ids=tuple(tokenizer.eos_token_ids),
                    batch_invariant=args.batch_invariant)
    if args.http is not None:
        from disagg.frontend import DEFAULT_MODEL_NAME, ModelPair, serve_http
        name = Path(args.pair).resolve().name if args.pair else DEFAULT_MODEL_NAME
        serve_http(engine, ModelPair(params, cfg, tokenizer, name), *args.http,
                   mode=f"{mode}, context at {args.address}",
                   default_max_tokens=args.default_max_tokens,
                   request_timeout_s=args.request_timeout or DEFAULT_REQUEST_TIMEOUT_S)
    else:
        serve_json_lines(engine, args.input, tokenizer)
    logging.getLogger("disagg.remote").info("context worker at close: %s", remote.close())


def check_role_args(args) -> None:
    """SystemExit, before anything loads, for an --address that is not HOST:PORT, a
    --pair without its two checkpoints, or a flag of the other role (it would be
    ignored)."""
    from disagg.schema import DEFAULT_MAX_TOKENS
    try:
        host_port(args.address)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"serve-remote --address: {e}") from None
    if args.pair is not None:
        for part in ("target",) + (() if args.no_drafter else ("draft",)):
            if not Path(args.pair, part, "config.json").is_file():
                raise SystemExit(f"serve-remote --pair {args.pair}: no {part}/config.json "
                                 f"there; give a directory holding target/ and draft/ "
                                 f"checkpoints")
    others = {"context": {"a requests file": args.input != "-", "--http": args.http,
                          "--request-timeout": args.request_timeout,
                          "--default-max-tokens": args.default_max_tokens != DEFAULT_MAX_TOKENS},
              "generation": {"--warmup": args.warmup, "--idle-timeout": args.idle_timeout,
                             "--max-connections": args.max_connections}}[args.role]
    if given := [flag for flag, value in others.items() if value not in (None, False)]:
        other = "generation" if args.role == "context" else "context"
        raise SystemExit(f"serve-remote --role {args.role} does not take {', '.join(given)} "
                         f"(the {other} worker's); leave {'it' if len(given) == 1 else 'them'} "
                         f"out")


def draft_kv_mode(args) -> str:
    """The worker's draft-KV mode: --draft-kv, or private for a context with --no-drafter."""
    if not args.no_drafter:
        return args.draft_kv or "shared"
    if args.role != "context":
        raise SystemExit("--no-drafter is for --role context only: the generation worker "
                         "drafts, so it loads the drafter (give it --draft-kv private to "
                         "pair with a context that has none)")
    if args.draft_kv == "shared":
        raise SystemExit("--no-drafter with --draft-kv shared: a context without a drafter "
                         "has no draft KV to share; leave out --draft-kv (or give private)")
    return "private"


def child_env(num_devices: int) -> dict:
    """The parent's environment with this child's own host device count."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


class ContextProcess:
    """A context worker in a child process; `address` is where it listens.

    Its stderr goes to `log_path`. Use as a context manager, or call `stop()`.
    """

    def __init__(self, source: PairSource, log_path, *, draft_kv: str | None = None, tp: int = 1,
                 timeout: float = 30.0, extra_args=(), extra_env=None,
                 start_timeout: float = 120.0, address: str = "127.0.0.1:0"):
        cmd = [sys.executable, "-m", "disagg", "serve-remote", "--role", "context",
               "--address", address, "--tp", str(tp), "--timeout", str(timeout),
               *(["--draft-kv", draft_kv] if draft_kv else []), *source.cli_args(),
               *extra_args]
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**child_env(tp), **(extra_env or {})},
                                     cwd=REPO_ROOT)
        try:
            self.address = self._await_listening(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _await_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self.proc.stdout], [], [], left)[0]:
                break
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"context worker exited ({self.proc.wait()}) before "
                                   f"listening:\n{self.log_tail()}")
            if match := re.search(r"listening on (\S+)", line):
                return match.group(1)
        raise TimeoutError(f"context worker did not listen within {timeout:.0f}s:\n"
                           f"{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text()

    def log_tail(self, num_lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.send_signal(signal.SIGCONT)  # a stopped child cannot act on SIGTERM
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ContextProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
