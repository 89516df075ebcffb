"""A model's layers in a step: a scan (one compiled body per run of alike layers) or
unrolled.

Layers are held in one of two forms, and the form picks how a step runs them:

    per layer (unrolled)   params["layers"] = [layer 0 dict, layer 1 dict, ...]
    stacked (scan)         params["layers"] = {name: [num_layers, ...] array}

Checkpoints and training hold the first. `stack_params` / `unstack_params` turn
one into the other; executors call `step_params` once at load (StepConfig.layer_loop),
which also fuses the projections that share an input (q|k|v, gate|up), since
stacking and fusing copy every weight. Host (numpy) weights convert on the host, so a
server can put the step form on the device once, in one piece, instead of holding a
checkpoint's form and its step form there together (`disagg.frontend.served_step_params`).

A layer's static needs are its pool, window, KV dtype and fp8 scales (its *kind*);
its offset inside the pool is data. `layer_runs` cuts a role's layers into runs
whose kinds repeat with a short period:

    kinds  A A A ... A          -> one run, period 1, repeats L
    kinds  S F S F ... S F      -> one run, period 2 (body: S then F), repeats L/2
    kinds  F F F S S S          -> two runs, period 1

and `scan_layers` runs each as `lax.scan` over its repeats: the body holds
`period` layers whatever the depth, which is what keeps compile time flat.
Layer weights are read by index from the stacked arrays; the pool offset comes in
as a traced i32 (models/attention.py takes either form). Unrolled, every layer is
traced with its own arrays and a static offset: compile time grows with depth,
and no weight is sliced.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from unified_kv import CacheSpec, LayerSpec

MAX_PERIOD = 4  # longest repeating pattern of layer kinds one scan body holds


def _xnp(*arrays):
    """numpy for host arrays (the conversion stays on the host), else jax.numpy."""
    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def stack_layers(layers) -> dict:
    """Per-layer dicts -> one dict of [num_layers, ...] arrays (already stacked: as is)."""
    if isinstance(layers, dict):
        return layers
    return jax.tree.map(lambda *ws: _xnp(*ws).stack(ws), *layers)


def unstack_layers(layers) -> list[dict]:
    """The inverse of `stack_layers`: a list of per-layer dicts."""
    if not isinstance(layers, dict):
        return list(layers)
    num = len(next(iter(jax.tree.leaves(layers))))
    return [jax.tree.map(lambda w, i=i: w[i], layers) for i in range(num)]


def stack_params(params: dict) -> dict:
    """Step params ({"target": ..., "draft": ...}) with every model's layers stacked."""
    return {name: dict(model, layers=stack_layers(model["layers"]))
            if isinstance(model, dict) and "layers" in model else model
            for name, model in params.items()}


def unstack_params(params: dict) -> dict:
    """Step params with every model's layers as a list of per-layer dicts."""
    return {name: dict(model, layers=unstack_layers(model["layers"]))
            if isinstance(model, dict) and "layers" in model else model
            for name, model in params.items()}


# Projections of one input that the step form holds as one matrix each: one matmul
# launch instead of two or three, and nothing to concatenate per call (XLA merges dots
# that share an input by concatenating their weights, which in a scanned step copies
# them on every layer of every call).
FUSED_PROJECTIONS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def fuse_projections(layer: dict) -> dict:
    """A layer's weights (one layer's dict, or stacked) with each FUSED_PROJECTIONS group
    concatenated along the output axis (already fused, or no such group: as is)."""
    out = dict(layer)
    for fused, parts in FUSED_PROJECTIONS.items():
        if all(name in out for name in parts):
            ws = [out.pop(name) for name in parts]
            out[fused] = _xnp(*ws).concatenate(ws, axis=-1)
    return out


def fused_parts(cfg) -> dict:
    """How a model's fused leaves split back into its checkpoint's (`fingerprint`'s
    `fused`): fused name -> ((part, width along the last axis), ...). `cfg`: a
    Qwen3Config or DFlashConfig."""
    kv = cfg.num_kv_heads * cfg.head_dim
    widths = {"q": cfg.num_heads * cfg.head_dim, "k": kv, "v": kv,
              "gate": cfg.intermediate_size, "up": cfg.intermediate_size}
    return {fused: tuple((name, widths[name]) for name in parts)
            for fused, parts in FUSED_PROJECTIONS.items()}


def step_params(params: dict, scan: bool) -> dict:
    """Params ({"target": ..., "draft": ...}) in the form the steps read: layers stacked
    for a scan (`scan`) or one dict per layer, projections fused (`fuse_projections`).
    Executors convert once at load, since both copy every layer weight."""
    params = stack_params(params) if scan else unstack_params(params)
    return {name: dict(model, layers=fuse_projections(model["layers"]) if scan
                       else [fuse_projections(layer) for layer in model["layers"]])
            if isinstance(model, dict) and "layers" in model else model
            for name, model in params.items()}


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Layers first .. first + period * repeats - 1 of one role, as `repeats` scan
    iterations of a body of `period` layers: body position j of iteration k is layer
    first + k * period + j.

    Attributes:
      kinds: per body position, (a LayerSpec of that kind, its pool id); every layer
        at that position has the same pool, window, KV dtype and scales.
      offsets: [repeats][period] each layer's offset in its pool.
    """

    first: int
    period: int
    repeats: int
    kinds: tuple[tuple[LayerSpec, int], ...]
    offsets: tuple[tuple[int, ...], ...]

    def layer_ids(self) -> np.ndarray:
        """i32[repeats, period]: the model's index of each layer of the run."""
        return (self.first + np.arange(self.repeats * self.period, dtype=np.int32)
                ).reshape(self.repeats, self.period)


@functools.lru_cache(maxsize=256)
def layer_runs(spec: CacheSpec, role: str, num_layers: int) -> tuple[LayerRun, ...]:
    """`role`'s layers 0 .. num_layers - 1 cut into runs, greedily from the first layer:
    at each start, the period (<= MAX_PERIOD) whose repeats cover the most layers
    (the shorter period on a tie; a lone layer is a run of one)."""
    found = [spec.find_layer(role, i) for i in range(num_layers)]
    kind = [(pool_id, layer.k_scale, layer.v_scale) for layer, pool_id, _ in found]
    runs, start = [], 0
    while start < num_layers:
        period, repeats = 1, 1
        for p in range(1, MAX_PERIOD + 1):
            r = 1
            while (start + (r + 1) * p <= num_layers
                   and kind[start + r * p:start + (r + 1) * p] == kind[start:start + p]):
                r += 1
            if r > 1 and p * r > period * repeats:
                period, repeats = p, r
        ids = range(start, start + period * repeats)
        runs.append(LayerRun(
            first=start, period=period, repeats=repeats,
            kinds=tuple((found[i][0], found[i][1]) for i in ids[:period]),
            offsets=tuple(tuple(found[i][2] for i in ids[k * period:(k + 1) * period])
                          for k in range(repeats))))
        start += period * repeats
    return tuple(runs)


class LayerRow(NamedTuple):
    """A weight every layer has, left stacked ([num_layers, ...]) with the row of the layer
    at hand: for a kernel that reads the row itself (a slice handed to a custom call is
    a copy, one launch a layer, ahead of it)."""

    stack: jax.Array
    row: jax.Array


def scan_layers(layer_fn, layers, runs: tuple[LayerRun, ...], x, pools, *,
                taps: tuple[int, ...] = (), unroll: int = 1, unsliced: tuple[str, ...] = ()):
    """Run every layer of `runs` in order.

    `layer_fn(p, x, pools, layer: LayerSpec, pool_id: int, offset) -> (x, pools)`
    is one layer, with `p` its weights. Stacked `layers` (a dict of [num_layers, ...]
    arrays) run as one `lax.scan` per run: `p` is a slice read by a traced index (the
    `unsliced` names: a `LayerRow`) and `offset` a traced i32. A list of per-layer dicts
    runs unrolled: `p` is the layer's own arrays (nothing sliced or copied) and `offset`
    a Python int. `unroll`: iterations of a run's body per loop trip (`lax.scan`'s; the
    arithmetic is the same).
    Returns (x, pools, taps_out): taps_out[i] is x after layer taps[i] (None without
    taps).
    """
    if not isinstance(layers, dict):
        return _unrolled(layer_fn, list(layers), runs, x, pools, taps)
    tapped = sorted(set(taps))
    slot_of = {layer: i for i, layer in enumerate(tapped)}
    # A tap buffer rides in the carry; layers that are no tap write its spare slot.
    feats = jnp.zeros((len(tapped) + 1, *x.shape), x.dtype) if taps else None
    for run in runs:
        ids = run.layer_ids()
        slots = np.vectorize(lambda i: slot_of.get(int(i), len(tapped)), otypes=[np.int32])(ids)

        def body(carry, xs, run=run):
            x, pools, feats = carry
            layer_ids, offsets, tap_slots = xs
            for j, (layer, pool_id) in enumerate(run.kinds):
                p = {name: LayerRow(w, layer_ids[j]) if name in unsliced else jax.tree.map(
                         lambda a: jax.lax.dynamic_index_in_dim(a, layer_ids[j],
                                                                keepdims=False), w)
                     for name, w in layers.items()}
                x, pools = layer_fn(p, x, pools, layer, pool_id, offsets[j])
                if feats is not None:
                    feats = jax.lax.dynamic_update_index_in_dim(feats, x, tap_slots[j], 0)
            return (x, pools, feats), None

        (x, pools, feats), _ = jax.lax.scan(
            body, (x, pools, feats), (ids, np.asarray(run.offsets, np.int32), slots),
            unroll=unroll)
    if not taps:
        return x, pools, None
    return x, pools, [feats[slot_of[layer]] for layer in taps]


def _unrolled(layer_fn, layers: list, runs, x, pools, taps):
    after = {}
    for run in runs:
        for k, ids in enumerate(run.layer_ids()):
            for j, (layer, pool_id) in enumerate(run.kinds):
                i = int(ids[j])
                x, pools = layer_fn(layers[i], x, pools, layer, pool_id, run.offsets[k][j])
                after[i] = x
    return x, pools, ([after[i] for i in taps] if taps else None)
