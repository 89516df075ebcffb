"""Prometheus metrics of one serving loop: an `Observer` (disagg/loop.py) writing
into its own registry (two servers in one process do not share numbers).

    dflash_time_to_first_token_seconds   histogram: submitted -> first token on the host
    dflash_inter_token_latency_seconds   histogram, per later token: the gap since the
                                         request's previous tokens, divided over the
                                         tokens that arrived together (a decode step
                                         commits several)
    dflash_request_acceptance_length     histogram, per finished request: tokens kept per
                                         decode step (1 = no draft accepted; best =
                                         the drafter's block size)
    dflash_requests_finished_total{finish_reason}, dflash_prompt_tokens_total,
    dflash_generation_tokens_total       counters
    dflash_requests_running              admitted, not finished
    dflash_requests_waiting              accepted, not yet admitted (no slot or pages)
    dflash_kv_pages_reserved{pool}       pages reserved by admitted requests (worst case:
                                         an upper bound of the pages in use)
    dflash_kv_pages_capacity{pool}       usable pages of the pool
    dflash_kv_bytes_moved_total          KV bytes imported from context workers
    dflash_kv_moved_gigabytes_per_second KV bytes imported over the last `window_s`
                                         seconds, per second (1 GB = 1e9 bytes)

Metrics are updated on the loop's thread; prometheus_client makes reading
them from the HTTP thread safe.
"""

from __future__ import annotations

import collections
import time

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


def require_prometheus():
    try:
        import prometheus_client
    except ImportError:
        raise ImportError("serving metrics need the `prometheus-client` package: "
                          "pip install prometheus-client (or pip install -e . in the "
                          "checkout)") from None
    return prometheus_client


class ServingMetrics:
    """The loop's Observer. `block_size`: the drafter's block (the best acceptance length)."""

    def __init__(self, spec, block_size: int, window_s: float = 10.0):
        pc = require_prometheus()
        self.registry = pc.CollectorRegistry()
        kw = {"registry": self.registry}
        self.ttft = pc.Histogram("dflash_time_to_first_token_seconds",
                                 "Submitted to first token on the host", buckets=LATENCY_BUCKETS,
                                 **kw)
        self.itl = pc.Histogram("dflash_inter_token_latency_seconds",
                                "Per later token: gap since the request's previous tokens over "
                                "the tokens that arrived together", buckets=LATENCY_BUCKETS, **kw)
        self.acceptance = pc.Histogram("dflash_request_acceptance_length",
                                       "Tokens kept per decode step, per finished request",
                                       buckets=tuple(range(1, block_size + 1)), **kw)
        self.finished_total = pc.Counter("dflash_requests_finished", "Finished requests",
                                         ["finish_reason"], **kw)
        self.prompt_tokens = pc.Counter("dflash_prompt_tokens", "Prompt tokens of finished "
                                        "requests", **kw)
        self.generation_tokens = pc.Counter("dflash_generation_tokens", "Tokens generated",
                                            **kw)
        self.running = pc.Gauge("dflash_requests_running", "Admitted, not finished", **kw)
        self.waiting = pc.Gauge("dflash_requests_waiting", "Accepted, not yet admitted", **kw)
        self.pages_reserved = pc.Gauge("dflash_kv_pages_reserved", "Pages reserved by admitted "
                                       "requests (worst case)", ["pool"], **kw)
        self.pages_capacity = pc.Gauge("dflash_kv_pages_capacity", "Usable pages", ["pool"],
                                       **kw)
        self.bytes_moved = pc.Counter("dflash_kv_bytes_moved", "KV bytes imported from "
                                      "context workers", **kw)
        self.moved_gbps = pc.Gauge("dflash_kv_moved_gigabytes_per_second",
                                   f"KV bytes imported over the last {window_s:g} s, per second "
                                   f"(1 GB = 1e9 bytes)", **kw)
        for pool in spec.pools:
            self.pages_capacity.labels(str(pool.pool_id)).set(pool.num_usable_pages)
            self.pages_reserved.labels(str(pool.pool_id)).set(0)
        self.window_s = window_s
        self._moved: collections.deque[tuple[float, int]] = collections.deque()
        self._bytes_seen = 0

    # ------------------------------------------------------ Observer

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def later_tokens(self, count: int, seconds_each: float) -> None:
        for _ in range(count):
            self.itl.observe(seconds_each)

    def finished(self, event, prompt_tokens: int) -> None:
        # vLLM's "abort": a cancel is not the request's error nor the server's
        self.finished_total.labels("abort" if event.cancelled else event.finish_reason).inc()
        if event.result is not None:
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(len(event.result.tokens))
            if event.result.acceptance:
                self.acceptance.observe(event.result.acceptance_length)

    def after_step(self, engine, queued: int) -> None:
        self.running.set(engine.num_active)
        self.waiting.set(queued)
        for pool, n in zip(engine.spec.pools, engine.admission.reserved_pages):
            self.pages_reserved.labels(str(pool.pool_id)).set(n)
        now, total = time.perf_counter(), engine.bytes_imported
        if total < self._bytes_seen:  # the engine's count was reset
            self._bytes_seen = 0
        if total > self._bytes_seen:
            self.bytes_moved.inc(total - self._bytes_seen)
            self._moved.append((now, total - self._bytes_seen))
            self._bytes_seen = total
        while self._moved and self._moved[0][0] < now - self.window_s:
            self._moved.popleft()
        self.moved_gbps.set(sum(n for _, n in self._moved) / self.window_s / 1e9)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format."""
        pc = require_prometheus()
        return pc.generate_latest(self.registry), pc.CONTENT_TYPE_LATEST
