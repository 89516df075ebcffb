"""JAX's persistent compilation cache for the CLI: a second run skips compiling.

Where: $JAX_COMPILATION_CACHE_DIR when set, else `<user cache dir>/unified-kv-dflash/jax`
($XDG_CACHE_HOME, else ~/.cache). Off: `--no-compile-cache`, or DFLASH_COMPILE_CACHE=0.
Every program is cached whatever its compile time or size (the engine's steps
are many programs, each quick to compile alone on a GPU but not on a CPU).
Must be turned on before anything is compiled.

`CompileCounter` counts programs compiled and programs read from the cache
(JAX's monitoring events), so runs can report what the cache saved.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import jax

ENV_SWITCH = "DFLASH_COMPILE_CACHE"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # a hit is counted too
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "unified-kv-dflash" / "jax"


def enable_compile_cache(enabled: bool = True) -> Path | None:
    """Turn the persistent cache on (returns its directory), unless `enabled` is
    False or DFLASH_COMPILE_CACHE=0 (returns None; nothing is changed)."""
    if not enabled or os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no",
                                                                           "off"):
        return None
    path = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_cache_dir())
    try:   # a directory that exists but takes no files would fail every entry, quietly
        path.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=path).close()
    except OSError as e:
        raise SystemExit(f"compilation cache: cannot write to {path} ({e.strerror}); set "
                         f"JAX_COMPILATION_CACHE_DIR to a writable directory, or turn the "
                         f"cache off (--no-compile-cache or {ENV_SWITCH}=0)") from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Thresholds the user set through JAX's own variables are theirs.
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


class CompileCounter:
    """Programs compiled and programs read from the persistent cache, in this
    process, since `start` (a `counts()` taken earlier; default: from the first
    counter made). One set of JAX listeners serves every counter (JAX cannot
    unregister one)."""

    _lock = threading.Lock()
    _requests = 0   # programs JAX needed (compiled or read from the cache)
    _hits = 0       # of those, read from the cache
    _listening = False

    def __init__(self, start: tuple[int, int] | None = None):
        with CompileCounter._lock:
            if not CompileCounter._listening:
                jax.monitoring.register_event_duration_secs_listener(CompileCounter._on_duration)
                jax.monitoring.register_event_listener(CompileCounter._on_event)
                CompileCounter._listening = True
        self.start = start if start is not None else self.counts()

    @staticmethod
    def _on_duration(event: str, duration: float, **kw) -> None:
        if event == _BACKEND_COMPILE:
            with CompileCounter._lock:
                CompileCounter._requests += 1

    @staticmethod
    def _on_event(event: str, **kw) -> None:
        if event == _CACHE_HIT:
            with CompileCounter._lock:
                CompileCounter._hits += 1

    @staticmethod
    def counts() -> tuple[int, int]:
        """(programs needed, programs read from the cache) in this process so far."""
        return CompileCounter._requests, CompileCounter._hits

    @property
    def hits(self) -> int:
        return self.counts()[1] - self.start[1]

    @property
    def compiled(self) -> int:
        """Programs compiled (not read from the cache) since `start`."""
        return self.counts()[0] - self.start[0] - self.hits

    def summary(self) -> str:
        return f"{self.compiled} programs compiled, {self.hits} read from the compilation cache"
