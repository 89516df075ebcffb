"""The KV format gate: both ends of a disaggregated pair must agree on the KV they move.

A worker's `KVFormat` is what its cache holds and which of it travels: page
size, layer specs, pools and draft-KV mode. A context worker and a generation
worker exchange their `KVFormat` when they connect and again with every
request; any difference fails at once with an error naming both sides' values
and the setting to change, never a hang or a silently wrong scatter (a drafter
reading pages of another KV format drafts garbage, and acceptance collapses
without any output changing).

What must agree depends on the generation worker's draft-KV mode:
  shared   everything: the draft KV travels, so both caches hold the same
           target and draft layers in the same pools.
  private  the same, except that a context worker without a drafter is
           accepted: only target pools travel in private mode, so its target
           layers and pools must equal the generation worker's target layers
           and the pools it receives (none of them may mix in draft layers).
"""

from __future__ import annotations

import dataclasses

from unified_kv import CacheSpec

MODES = ("shared", "private")


class PairMismatch(RuntimeError):
    """The two workers of a disaggregated pair cannot serve together (KV format or
    weights); the message names both sides' values and the fix."""


class KVFormatMismatch(PairMismatch):
    """The two workers' KV formats (cache layer specs, page size, pools) or draft-KV
    modes differ."""


@dataclasses.dataclass(frozen=True)
class KVFormat:
    page_size: int
    num_target_layers: int
    num_draft_layers: int
    layers: tuple[tuple, ...]   # (name, role, kv heads, head dim, dtype, window, k/v scales)
    mode: str
    pools: tuple[tuple[str, ...], ...] = ()   # layer names of each pool, by pool id

    @classmethod
    def of(cls, spec: CacheSpec, mode: str) -> "KVFormat":
        if mode not in MODES:
            raise ValueError(f"draft KV mode {mode!r} is unknown; use one of {MODES}")
        return cls(page_size=spec.page_size,
                   num_target_layers=sum(l.role == "target" for l in spec.layers),
                   num_draft_layers=sum(l.role == "draft" for l in spec.layers),
                   layers=tuple((l.name, l.role, l.num_kv_heads, l.head_dim, l.kv_dtype,
                                 l.sliding_window, l.k_scale, l.v_scale) for l in spec.layers),
                   mode=mode, pools=tuple(tuple(p.layer_names) for p in spec.pools))

    @property
    def target_layers(self) -> tuple[tuple, ...]:
        return tuple(l for l in self.layers if l[1] == "target")

    def sent_pools(self) -> list[tuple[int, tuple[str, ...]]]:
        """(pool id, layer names) of the pools that travel in this format's mode."""
        roles = {l[0]: l[1] for l in self.layers}
        return [(i, names) for i, names in enumerate(self.pools)
                if self.mode == "shared" or any(roles[n] != "draft" for n in names)]


_FIXES = {
    "mode": "start both workers with the same --draft-kv mode",
    "page_size": "build both caches with the same page_size",
    "num_draft_layers": "load the same drafter on both workers (its layer count differs)",
    "num_target_layers": "load the same target model on both workers",
    "layers": "use the same layer specs (kv heads, head dim, KV dtype, window, fp8 scales)",
    "pools": "build both caches from the same layer specs (layers with one pool key share a pool)",
}


def check_kv_formats(context: KVFormat, generation: KVFormat) -> None:
    """Raise KVFormatMismatch naming the first differing setting on both sides."""
    if context.num_draft_layers == 0 and generation.num_draft_layers > 0:
        return _check_target_only_context(context, generation)
    for field, fix in _FIXES.items():
        _compare(field, getattr(context, field), getattr(generation, field), fix)


def _compare(field: str, a, b, fix: str) -> None:
    if a == b:
        return
    if field == "layers":
        diffs = [(x, y) for x, y in zip(a, b) if x != y] or [(a[len(b):], b[len(a):])]
        a, b = diffs[0]
    raise KVFormatMismatch(f"KV format mismatch in {field}: context worker has {a!r}, "
                         f"generation worker has {b!r}; {fix}")


def _check_target_only_context(context: KVFormat, generation: KVFormat) -> None:
    """A context worker without a drafter: only a private-mode generation worker."""
    if generation.mode != "private":
        raise KVFormatMismatch(
            f"the context worker has no drafter, so it cannot send the draft KV that a "
            f"{generation.mode}-mode generation worker reads; start the generation worker "
            f"with --draft-kv private (its drafter then starts without the prompt), or "
            f"start the context worker with its drafter (without --no-drafter)")
    for field, fix in (("page_size", _FIXES["page_size"]),
                       ("num_target_layers", _FIXES["num_target_layers"]),
                       ("target_layers", _FIXES["layers"])):
        _compare("layers" if field == "target_layers" else field,
                 getattr(context, field), getattr(generation, field), fix)
    # The context's pools are all sent; they must be exactly the generation's sent pools.
    _compare("pools", list(enumerate(context.pools)), generation.sent_pools(),
             "a context without a drafter fills only pools of target layers; build the "
             "generation cache so that no pool mixes target and draft layers")
