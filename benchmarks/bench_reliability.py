"""Peer faults on a two-process pair: each fault's outcome, time to detect, and pages.

    python -m benchmarks.bench_reliability [--rounds 6] [--timeout 1.0] [--out DIR]

A context worker runs as a child process (`disagg.processes.ContextProcess`: the
shipped tiny copy pair, TP 2 on host devices, `--timeout` seconds for every wait);
the generation engine runs here behind a `FaultySource`, a RemoteSource that
injects a fault at a chosen point of a chosen request. Nothing in either server is
a fault flag. A round is one life of the context process, in this order:

  served               a request after the (re)start: it reconnects and its tokens
                       equal the reference (the first round's)
  hung_before_handoff  SIGSTOP, then the request is sent; SIGCONT after its error
  hung_during_pull     SIGSTOP once its handoff arrived, before the pull; SIGCONT after
  corrupted_buffer     one pulled value changed, checksum untouched: its import
                       fails; a bystander served alongside equals the reference
  then one kill, by round (k % 3):
  killed_after_pull    0: SIGKILL once its KV is pulled: it completes, equal to the
                       reference (its KV is all here)
  killed_before_pull   1: SIGKILL once its handoff arrived, before the pull
  killed_during_pull   2: SIGKILL once the pull is requested, before it is awaited:
                       served (the bytes were across) or failed by name, either is right
  dead_peer            a request sent while the context is dead: refused by name

then the context restarts on the same address (the next round's `served`).

Rules checked for every request: it ends (one that does not is lost); one no
fault touches ends with the reference tokens; a faulted one ends with an error
naming the request (the peer's faults also name the context's address). Detection time: from
the fault (the signal, the corruption, the send to a dead peer) to the request's
error; the first request's KV warms the engine's imports and decode first, so no
detection time holds a compile. After each fault the generation allocator is conserved (free pages equal
usable pages, none reserved, no slot running), and the context's as soon as it
answers again (polled until `timeout` plus a margin).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import write_results
from disagg.control import ControlChannel
from disagg.handshake import Weights, hello, read_hello
from disagg.kv_format import KVFormat
from disagg.processes import REPO_ROOT, ContextProcess, PairSource
from disagg.remote import RemoteSource
from disagg.transfer import TransferError
from drafter.engine import Engine

PAIR_DIR = REPO_ROOT / "tests" / "fixtures" / "copy_pair"
PROMPT = list(range(1, 21))
MAX_NEW = 6
MARGIN_S = 2.0   # detection and recovery bounds: the timeout plus this (a loaded CPU)
PEER_FAULTS = ("hung_before_handoff", "hung_during_pull", "killed_before_pull",
               "killed_during_pull", "dead_peer")


class FaultySource(RemoteSource):
    """A RemoteSource that calls, for one request's pull, `before_pull[request_id]()`
    before it, `during_pull[request_id]()` once it is requested and before it is
    awaited, and `after_pull[request_id](payload)` (returning the payload to use)
    after it."""

    def __init__(self, *args, **kwargs):
        self.before_pull, self.during_pull, self.after_pull = {}, {}, {}
        super().__init__(*args, **kwargs)

    def _await(self, pieces, request_id, channel, deadline):
        if (hook := self.during_pull.pop(request_id, None)) is not None:
            hook()
        super()._await(pieces, request_id, channel, deadline)

    def _pull(self, message, channel, deadline):
        request_id = message["request_id"]
        if (hook := self.before_pull.pop(request_id, None)) is not None:
            hook()
        payload = super()._pull(message, channel, deadline)
        if (hook := self.after_pull.pop(request_id, None)) is not None and payload is not None:
            payload = hook(payload)
        return payload


def corrupt(buffer: jax.Array) -> jax.Array:
    """One value changed (to 1 if it was 0, else 0), its checksum untouched."""
    first = (0,) * buffer.ndim
    return buffer.at[first].set(jnp.where(buffer[first] == 0, 1, 0).astype(buffer.dtype))


def leaked_pages(engine) -> int:
    """Pages not free (or reserved) on an engine with nothing running; 0 when conserved."""
    free = np.asarray(engine.state.kv.num_free).tolist()
    held = sum(p.num_usable_pages - f for p, f in zip(engine.spec.pools, free))
    return held + sum(engine.admission.reserved_pages) + engine.num_active


def context_leaked(stats: dict) -> int:
    held = sum(u - f for u, f in zip(stats["usable_pages"], stats["free_pages"]))
    return held + sum(stats["reserved_pages"]) + stats["num_active"]


class Campaign:
    """One generation engine against a context process it kills, stops and restarts."""

    def __init__(self, workdir: Path, *, timeout: float = 1.0, source: PairSource | None = None,
                 start_timeout: float = 120.0):
        self.workdir, self.timeout, self.start_timeout = Path(workdir), timeout, start_timeout
        self.pair = source or PairSource(str(PAIR_DIR), num_slots=3, max_seq_len=256,
                                         kv_memory_mib=16)
        self.env = {"JAX_COMPILATION_CACHE_DIR": str(self.workdir / "jax_cache"),
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2"}
        self.params, self.cfg = self.pair.load()
        self.kv_format = KVFormat.of(self.cfg.spec, "shared")
        self.weights = Weights.of(self.params, self.cfg)
        self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
        self.events: list[dict] = []
        self.generation_checks: list[int] = []   # pages leaked after each serve
        self.context_checks: list[int] = []      # the context's, once it answers again
        # per dead context: what the source's health said, and how soon after the restart
        # it said nothing (found back without a request)
        self.health: list[dict] = []
        self.reference: list[int] | None = None
        self.ctx: ContextProcess | None = None
        self.address, self.engine, self.lives = "127.0.0.1:0", None, 0

    # ------------------------------------------------------------ processes

    def start_context(self) -> None:
        self.ctx = ContextProcess(self.pair, self.workdir / f"context{self.lives}.log", tp=2,
                                  timeout=self.timeout, extra_env=self.env,
                                  extra_args=["--warmup"], address=self.address,
                                  start_timeout=self.start_timeout)
        self.address, self.lives = self.ctx.address, self.lives + 1
        self.await_ready()
        if self.engine is not None and self.health:   # a restart: found without a request
            start, source = time.monotonic(), self.engine.kv_source
            while source.unavailable() is not None and (
                    time.monotonic() - start < self.timeout + MARGIN_S):
                time.sleep(0.02)
            if source.unavailable() is None:
                self.health[-1]["back_s"] = round(time.monotonic() - start, 3)
        if self.engine is None:
            source = FaultySource(self.address, self.kv_format, weights=self.weights,
                                  mesh=self.mesh, timeout=self.timeout)
            self.engine = Engine(self.params, self.cfg, mesh=self.mesh, kv_source=source,
                                 mode="shared", kv_timeout_s=source.engine_timeout_s)

    def await_ready(self) -> None:
        """Wait until the context answers a handshake (its warm-up compiles first),
        with a probe that leaves at once."""
        channel = ControlChannel.connect(self.address, self.start_timeout)
        try:
            channel.send(hello("generation", self.kv_format, self.weights, "127.0.0.1:0"),
                         self.timeout)
            read_hello(channel.recv(self.start_timeout), "context")
        finally:
            channel.close()

    def context_stats(self) -> dict:
        """The context's stats (a dropped channel reconnects), retried for `timeout`
        plus the margin."""
        deadline = time.monotonic() + self.timeout + MARGIN_S
        while True:
            try:
                return self.engine.kv_source.stats()
            except TransferError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def check_context(self) -> None:
        """Record the context's leaked pages once its cancels and expiries have landed."""
        deadline = time.monotonic() + 2 * self.timeout + MARGIN_S
        while (leaked := context_leaked(self.context_stats())) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.context_checks.append(leaked)

    def signal(self, sig) -> float:
        """Send `sig`; a SIGSTOP returns once the process is stopped (delivery is
        asynchronous: a running thread could still answer a pull)."""
        pid = self.ctx.proc.pid
        os.kill(pid, sig)
        at, stat = time.perf_counter(), Path(f"/proc/{pid}/stat")
        while sig == signal.SIGSTOP and stat.exists() and time.perf_counter() < at + 5:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":
                break
            time.sleep(0.001)
        return at

    def kill(self) -> float:
        self.ctx.proc.kill()
        at = time.perf_counter()
        self.ctx.proc.wait(10)
        self.ctx.stop()
        return at

    # ------------------------------------------------------------ requests

    def serve(self, request_ids, *, fault: str | None = None, faulted=(), fault_at=None,
              survives: bool | None = False, wall_s: float = 60.0) -> dict:
        """Serve `request_ids` (each PROMPT) to the end; one event per request. The
        `faulted` ones get `fault`; they must end in an error (`survives` False), with
        the reference tokens (True), or either way (None).
        `fault_at`: the fault's time, or a dict of it by request id (hooks fill it)."""
        engine = self.engine
        for request_id in request_ids:
            engine.submit(engine.make_request(request_id, PROMPT, max_new_tokens=MAX_NEW))
        ended, deadline = {}, time.perf_counter() + wall_s
        while engine.has_work and time.perf_counter() < deadline:
            results = engine.step()
            now = time.perf_counter()
            ended.update({r.request_id: (r, now) for r in results})
        if engine.has_work:   # past the wall: what is left is cancelled (and counted lost)
            for request_id in list(engine.scheduler.active):
                engine.cancel(request_id)
            engine.run(max_steps=100)
        self.generation_checks.append(leaked_pages(engine))
        out = {}
        for request_id in request_ids:
            result, end = ended.get(request_id, (None, None))
            hit = request_id in faulted
            at = fault_at.get(request_id) if isinstance(fault_at, dict) else fault_at
            failed = result is not None and not result.ok
            out[request_id] = {
                "request_id": request_id, "fault": fault if hit else None,
                "expect": ("tokens" if not hit or survives else
                           "error" if survives is False else "either"),
                "answered": result is not None, "ok": result is not None and result.ok,
                "tokens": result.tokens if result else None,
                "error": result.error if result else None,
                "detect_s": end - at if hit and failed and at is not None else None}
        self.events += out.values()
        return out

    def warm(self) -> None:
        """Compile what the rounds run (imports and decode at their lengths), so that
        no detection time holds a compile."""
        self.engine.warmup(len(PROMPT) + MAX_NEW, min_len=len(PROMPT))

    def round(self, k: int) -> None:
        """One life of the context (see the module docstring)."""
        if self.ctx is None or self.ctx.proc.poll() is not None:
            self.start_context()
        source = self.engine.kv_source
        if self.reference is None:
            self.warm()
        served = self.serve([f"s{k}"])[f"s{k}"]
        self.reference = self.reference or served["tokens"]
        self.check_context()

        at = self.signal(signal.SIGSTOP)
        self.serve([f"h{k}"], fault="hung_before_handoff", faulted={f"h{k}"}, fault_at=at)
        self.signal(signal.SIGCONT)
        self.check_context()

        times = {}

        def timed(request_id, act):
            """A hook that records the fault's time, then acts (a payload passes)."""
            def hook(*payload):
                times.setdefault(request_id, time.perf_counter())
                act()
                return payload[0] if payload else None
            return hook
        source.before_pull[f"p{k}"] = timed(f"p{k}", lambda: self.signal(signal.SIGSTOP))
        self.serve([f"p{k}"], fault="hung_during_pull", faulted={f"p{k}"}, fault_at=times)
        self.signal(signal.SIGCONT)
        self.check_context()

        def corrupted(payload):   # the fault's time: once the bad buffer exists
            bad = jax.block_until_ready(corrupt(payload.buffers[0]))
            times[f"c{k}"] = time.perf_counter()
            return dataclasses.replace(payload, buffers=(bad, *payload.buffers[1:]))
        source.after_pull[f"c{k}"] = corrupted
        self.serve([f"c{k}", f"b{k}"], fault="corrupted_buffer", faulted={f"c{k}"},
                   fault_at=times)
        self.check_context()

        kill = timed(f"k{k}", self.kill)
        if k % 3 == 0:
            source.after_pull[f"k{k}"] = kill
            self.serve([f"k{k}"], fault="killed_after_pull", faulted={f"k{k}"},
                       survives=True)
        elif k % 3 == 1:
            source.before_pull[f"k{k}"] = kill
            self.serve([f"k{k}"], fault="killed_before_pull", faulted={f"k{k}"},
                       fault_at=times)
        else:   # the pull may have finished before the kill lands: either end is right
            source.during_pull[f"k{k}"] = kill
            self.serve([f"k{k}"], fault="killed_during_pull", faulted={f"k{k}"},
                       fault_at=times, survives=None)
        self.serve([f"d{k}"], fault="dead_peer", faulted={f"d{k}"},
                   fault_at=time.perf_counter())
        self.health.append({"dead": source.unavailable(), "back_s": None})

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.stop()
        if self.engine is not None:
            self.engine.kv_source.close()


def named(event: dict, address: str) -> bool:
    """A faulted request's error names it, and a peer fault or a corrupted buffer names
    the context."""
    error = event["error"] or ""
    return f"'{event['request_id']}'" in error and (
        event["fault"] not in PEER_FAULTS + ("corrupted_buffer",) or address in error)


def is_lost(event: dict, reference) -> bool:
    """Unanswered, or owed the reference tokens (or served) without them."""
    if not event["answered"]:
        return True
    owed = event["expect"] == "tokens" or event["ok"]
    return owed and not (event["ok"] and event["tokens"] == reference)


def summary(campaign: Campaign) -> dict:
    """Counts over every request of the campaign (see the module docstring's rules)."""
    events, address = campaign.events, campaign.address
    faults: dict[str, int] = {}
    for e in events:
        if e["fault"]:
            faults[e["fault"]] = faults.get(e["fault"], 0) + 1
    lost = [e["request_id"] for e in events if is_lost(e, campaign.reference)]
    detect: dict[str, float] = {}
    for e in events:
        if e["detect_s"] is not None:
            detect[e["fault"]] = round(max(detect.get(e["fault"], 0.0), e["detect_s"]), 3)
    return {"requests": len(events), "faults": faults, "faults_total": sum(faults.values()),
            "requests_lost": len(lost), "lost_ids": lost,
            "unanswered": [e["request_id"] for e in events if not e["answered"]],
            "faults_undetected": [e["request_id"] for e in events
                                  if e["expect"] == "error" and e["ok"]],
            "errors_not_naming": [e["request_id"] for e in events if e["fault"]
                                  and e["answered"] and not e["ok"]
                                  and not named(e, address)],
            "pages_leaked_generation": sum(campaign.generation_checks),
            "pages_leaked_context": sum(campaign.context_checks),
            "context_checks": len(campaign.context_checks),
            "max_detect_s": max(detect.values(), default=None), "detect_s": detect,
            "timeout_s": campaign.timeout, "context_lives": campaign.lives,
            "health": campaign.health}


def run(rounds: int, *, timeout: float = 1.0, workdir=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        campaign = Campaign(Path(workdir or tmp), timeout=timeout)
        try:
            for k in range(rounds):
                campaign.round(k)
        finally:
            campaign.close()
    return {**summary(campaign), "events": campaign.events}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="context process lives")
    parser.add_argument("--timeout", type=float, default=1.0,
                        help="seconds any wait for the peer may take (both workers)")
    parser.add_argument("--out", default=None, help="directory for reliability.json")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = run(args.rounds, timeout=args.timeout)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    for e in report["events"]:
        if e["fault"]:
            detect = f"{e['detect_s']:.2f}s" if e["detect_s"] is not None else "-"
            print(f"  {e['fault']:20s} {e['request_id']:4s} detected in {detect:>6s}: "
                  f"{(e['error'] or 'served')[:150]}")
    print({k: v for k, v in report.items() if k != "events"})
    if args.out:
        print("wrote", write_results("reliability", report, args.out))
    return report


if __name__ == "__main__":
    main()
