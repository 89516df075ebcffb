"""The handshake of two worker processes: KV format and model identity.

    generation ── hello {role, kv_format, weights, eos_token_ids, transfer address,
                         keepalive_s} ──> context
    generation <── hello {role, kv_format, weights, eos_token_ids,
                          transfer address} ──────────────────────────── context
    both check the pair: check_kv_formats (disagg.kv_format), check_weights, then
    check_eos_ids (the context draws each first token, which a request's min_tokens
    keeps off the end-of-sequence ids: both must know the same ones)

Both sides check what they received, so a bad pair fails on both at once,
naming both sides' values and the fix. A context that will not serve the
peer at all (too many peers) answers {"op": "error", "error": ...} instead of
its hello.

Weights are identified by `models.checkpoint.fingerprint` (computed once per
worker). What must match follows the generation worker's draft-KV mode:
  shared   target and drafter: the drafter's context KV comes from the
           context worker's drafter, so a different drafter drafts garbage.
  private  the target only: the drafter's context is built on the generation
           side, and the context worker may have no drafter at all.
"""

from __future__ import annotations

import dataclasses

import jax

from disagg.kv_format import KVFormat, PairMismatch, check_kv_formats
from disagg.transfer import TransferError
from disagg.wire import kv_format_from_wire, kv_format_to_wire
from models.checkpoint import fingerprint
from models.layers import FUSED_PROJECTIONS, fused_parts


class ModelMismatch(PairMismatch):
    """The two workers serve different weights (same shapes, other values)."""


@dataclasses.dataclass(frozen=True)
class Weights:
    """Fingerprints of the weights a worker serves; `draft` is None without a drafter."""

    target: str
    draft: str | None

    @classmethod
    def of(cls, params, cfg=None) -> "Weights":
        """Of checkpoint-form `params`, or with `cfg` (their StepConfig) of the step form
        an engine holds (projections fused): the same weights fingerprint alike. Fused
        params without `cfg` are refused: their parts' widths are the config's."""
        if cfg is None and any(getattr(path[-1], "key", None) in FUSED_PROJECTIONS
                               for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]):
            raise ValueError("Weights.of: these params hold fused projections (the step "
                             "form); give their StepConfig too")

        def of_model(name, model_cfg):
            return fingerprint(params[name],
                               fused=fused_parts(model_cfg) if model_cfg is not None else None)
        return cls(of_model("target", cfg and cfg.target),
                   of_model("draft", cfg and cfg.draft) if params.get("draft") is not None
                   else None)


def check_weights(context: Weights, generation: Weights, mode: str) -> None:
    """Raise ModelMismatch naming both fingerprints when the pair's weights differ."""
    parts = [("target", "load the same target checkpoint on both workers")]
    if mode == "shared":
        parts.append(("draft", "load the same drafter on both workers, or run both with "
                               "--draft-kv private (the context's drafter is then unused)"))
    for part, fix in parts:
        a, b = getattr(context, part), getattr(generation, part)
        if a != b:
            raise ModelMismatch(
                f"model mismatch: the context worker serves {part} weights with fingerprint "
                f"{a}, the generation worker {b} (same shapes, different values: another "
                f"checkpoint or a damaged one); {fix}")


def check_pair(context: tuple[KVFormat, Weights], generation: tuple[KVFormat, Weights]) -> None:
    """The whole gate: KV formats (mode-aware), then the weights the mode needs equal."""
    check_kv_formats(context[0], generation[0])
    check_weights(context[1], generation[1], generation[0].mode)


def hello(role: str, kv_format: KVFormat, weights: Weights, transfer_address: str, *,
          eos_token_ids=(), **extra) -> dict:
    return {"op": "hello", "role": role, "kv_format": kv_format_to_wire(kv_format),
            "weights": dataclasses.asdict(weights), "eos_token_ids": sorted(eos_token_ids),
            "transfer_address": transfer_address, **extra}


def eos_ids_of(message: dict) -> tuple[int, ...]:
    """The end-of-sequence ids a peer's hello names (none if it names none)."""
    ids = message.get("eos_token_ids", [])
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise TransferError(f"the peer's hello has eos_token_ids={ids!r}; it must be a list "
                            f"of token ids: run the same version on both")
    return tuple(sorted(ids))


def check_eos_ids(context, generation) -> None:
    """PairMismatch naming both unless the workers end requests at the same EOS ids."""
    context, generation = tuple(sorted(context)), tuple(sorted(generation))
    if context != generation:
        raise PairMismatch(
            f"end-of-sequence mismatch: the context worker's ids are {list(context)}, the "
            f"generation worker's {list(generation)} (a request's min_tokens keeps its "
            f"first token, drawn by the context, off the generation side's); load the same "
            f"tokenizer (the same --pair) on both")


def read_hello(message: dict, role: str) -> tuple[KVFormat, Weights]:
    """The peer's (KVFormat, Weights) from its hello; TransferError for anything else."""
    if message.get("op") == "error":
        raise TransferError(f"the {role} worker refused the connection: "
                            f"{message.get('error')}")
    if message.get("op") != "hello" or message.get("role") != role:
        raise TransferError(f"expected a hello from a {role} worker, got "
                            f"{ {k: message.get(k) for k in ('op', 'role')} }")
    weights = message.get("weights")
    if not isinstance(weights, dict) or not isinstance(weights.get("target"), str):
        raise TransferError(f"the {role} worker's hello carries no weights fingerprint: "
                            f"an older version of this project? run the same version on both")
    return (kv_format_from_wire(message["kv_format"]),
            Weights(weights["target"], weights.get("draft")))
