"""The jitted programs an executor calls, built once per step config and shared by every
executor of it, and their copies (`StepConfig.graph_copies`).

    packed_step_for(cfg, kind, copy)   prefill chunks, or decode steps   (state donated)
    import_step_for(cfg, copy)         arrived KV into empty slots       (state donated)
    export_step_for(cfg, copy)         a slot's live pages into buffers
    redraft_step_for(cfg)              a fresh draft block for imported rows (private mode)
    mark_step_for(cfg)                 a prompt's tokens, for its repetition penalty
"""

from __future__ import annotations

import collections
import functools

import jax

from drafter.kv_io import export_step, import_step, redraft_step
from drafter.mixed_step import packed_step
from drafter.seen import mark_prompt_step
from drafter.steps import StepConfig


@functools.lru_cache(maxsize=64)
def packed_step_for(cfg: StepConfig, kind: str = "decode", copy: int = 0):
    """The jitted step with `cfg` bound, shared by every executor of that config: a
    static config argument would be hashed and compared on every call. `kind`
    ("prefill" or "decode", the calls it takes) picks its compiler options
    (`StepConfig.graph_calls`); each `copy` is a program of its own
    (`StepConfig.graph_copies`)."""
    del copy  # only keys the cache: a distinct jit object compiles its own executable
    return jax.jit(functools.partial(packed_step, cfg=cfg),
                   static_argnames=("num_prefill", "num_decode", "table_width", "speculative",
                                    "greedy", "truncated", "decode_steps", "logprobs",
                                    "adjusted"),
                   donate_argnums=1,
                   compiler_options=cfg.compiler_options_for(kind))


@functools.lru_cache(maxsize=64)
def import_step_for(cfg: StepConfig, copy: int = 0):
    del copy  # as in packed_step_for
    return jax.jit(functools.partial(import_step, cfg=cfg), static_argnames=("pool_ids", "mode"),
                   donate_argnums=0, compiler_options=cfg.compiler_options_for("import"))


@functools.lru_cache(maxsize=64)
def export_step_for(cfg: StepConfig, copy: int = 0):
    del copy  # as in packed_step_for
    return jax.jit(export_step.__wrapped__, static_argnames=("pool_ids", "buckets"),
                   compiler_options=cfg.compiler_options_for("export"))


@functools.lru_cache(maxsize=64)
def redraft_step_for(cfg: StepConfig):
    """Private mode's redraft of arrived rows: part of a step's imports, so of their kind."""
    return jax.jit(functools.partial(redraft_step, cfg=cfg), static_argnames=("table_width",),
                   donate_argnums=1, compiler_options=cfg.compiler_options_for("import"))


@functools.lru_cache(maxsize=64)
def mark_step_for(cfg: StepConfig):
    """`mark_prompt_step`, as a request with a repetition penalty takes its slot (beside
    its first prefill chunk or its import, so of the prefill's kind)."""
    return jax.jit(mark_prompt_step, donate_argnums=0,
                   compiler_options=cfg.compiler_options_for("prefill"))


class Copies:
    """Copies of one jitted program (`StepConfig.graph_copies`), each variant's calls
    taking them in turn. With one call in flight ahead, a call's fresh buffers cannot sit
    where the last call's do, but can where the call before last put its own: where
    they do, each copy's CUDA graphs find the addresses they were recorded with."""

    def __init__(self, copies):
        self.copies = tuple(copies)
        self._turns: collections.Counter = collections.Counter()

    def __call__(self, variant, *args, **kwargs):
        turn = self._turns[variant]
        self._turns[variant] += 1
        return self.copies[turn % len(self.copies)](*args, **kwargs)


def traced_on_mesh(mesh, jitted):
    """Call `jitted` with `mesh` as the context mesh, so the Pallas kernels run
    per device over the kv heads (models/attention.py)."""
    if mesh is None:
        return jitted

    @functools.wraps(jitted)
    def call(*args, **kwargs):
        with jax.set_mesh(mesh):
            return jitted(*args, **kwargs)
    return call
