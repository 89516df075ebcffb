"""The layout gate: both ends of a disaggregated pair must agree on the cache layout.

A context worker and a generation worker exchange a `Layout` when they
connect and again with every request; any difference fails at once with an
error naming both sides' values and the setting to change, never a hang or
a silently wrong scatter (a drafter reading another layout's pages drafts
garbage, and acceptance collapses without any output changing).
"""

from __future__ import annotations

import dataclasses

from unified_kv import CacheSpec

MODES = ("shared", "private")


class LayoutMismatch(RuntimeError):
    """The two workers' cache layouts or draft-KV modes differ."""


@dataclasses.dataclass(frozen=True)
class Layout:
    page_size: int
    num_target_layers: int
    num_draft_layers: int
    layers: tuple[tuple, ...]   # (name, role, kv heads, head dim, dtype, window, k/v scales)
    mode: str

    @classmethod
    def of(cls, spec: CacheSpec, mode: str) -> "Layout":
        if mode not in MODES:
            raise ValueError(f"draft KV mode {mode!r} is unknown; use one of {MODES}")
        return cls(page_size=spec.page_size,
                   num_target_layers=sum(l.role == "target" for l in spec.layers),
                   num_draft_layers=sum(l.role == "draft" for l in spec.layers),
                   layers=tuple((l.name, l.role, l.num_kv_heads, l.head_dim, l.kv_dtype,
                                 l.sliding_window, l.k_scale, l.v_scale) for l in spec.layers),
                   mode=mode)


_FIXES = {
    "mode": "start both workers with the same --draft-kv mode",
    "page_size": "build both caches with the same page_size",
    "num_draft_layers": "load the same drafter on both workers (its layer count differs)",
    "num_target_layers": "load the same target model on both workers",
    "layers": "use the same layer specs (kv heads, head dim, KV dtype, window, fp8 scales)",
}


def check_layouts(context: Layout, generation: Layout) -> None:
    """Raise LayoutMismatch naming the first differing setting on both sides."""
    for field, fix in _FIXES.items():
        a, b = getattr(context, field), getattr(generation, field)
        if a == b:
            continue
        if field == "layers":
            diffs = [(x, y) for x, y in zip(a, b) if x != y] or [(a[len(b):], b[len(a):])]
            a, b = diffs[0]
        raise LayoutMismatch(f"layout mismatch in {field}: context worker has {a!r}, "
                             f"generation worker has {b!r}; {fix}")
