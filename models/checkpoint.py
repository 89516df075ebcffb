"""Checkpoints: the HF Qwen3 safetensors key map, content manifests, fingerprints. Params in
orbax, with the same manifests: `models/orbax_params.py`.

A key map is a list of (checkpoint key, path into our params, transposed?).
Loading checks every key and shape against the config, refuses tensors the
model would not use (listing them) and any NaN / inf; saving walks the same
map, so a save/load round trip is exact.
Every error names the file (config, shard or orbax directory) and the key.

    HF Qwen3                                     ours
    model.embed_tokens.weight        [V, H]      embed
    model.layers.N.self_attn.q_proj.weight       layers[N].q   (transposed)
    model.layers.N.self_attn.q_norm.weight       layers[N].q_norm
    model.layers.N.mlp.gate_proj.weight          layers[N].gate (transposed)
    model.layers.N.input_layernorm.weight        layers[N].input_norm
    model.norm.weight, lm_head.weight            norm, lm_head (transposed)

The DFlash drafter's key map lives in drafter/checkpoint.py (models never
imports drafter).

Integrity. Every checkpoint this project writes (safetensors or orbax) has a
`manifest.json` beside its config: per array, its sha256 over the stored
bytes, shape and dtype, plus the params' `fingerprint`. Loading checks it: a
flipped byte, a truncated file, a missing or extra array fails with the file
and the array named. HF checkpoints have no manifest; they still get the key,
shape and NaN / inf checks. `fingerprint(params)` is a cheap identity of the
weights being served (one pass on the device), for handshakes between workers.
"""

from __future__ import annotations

import functools
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from models.config import CheckpointError, ConfigError, read_config  # noqa: F401 (re-exported)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "unified-kv-dflash/manifest-1"

LAYER_KEYS = [  # (checkpoint suffix, our name, transposed)
    ("self_attn.q_proj.weight", "q", True), ("self_attn.k_proj.weight", "k", True),
    ("self_attn.v_proj.weight", "v", True), ("self_attn.o_proj.weight", "o", True),
    ("self_attn.q_norm.weight", "q_norm", False), ("self_attn.k_norm.weight", "k_norm", False),
    ("mlp.gate_proj.weight", "gate", True), ("mlp.up_proj.weight", "up", True),
    ("mlp.down_proj.weight", "down", True), ("input_layernorm.weight", "input_norm", False),
    ("post_attention_layernorm.weight", "post_norm", False),
]
# Buffers some exporters save that carry no weights (HF skips them on load too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def qwen3_key_map(cfg) -> list[tuple[str, tuple, bool]]:
    keys = [("model.embed_tokens.weight", ("embed",), False), ("model.norm.weight", ("norm",), False)]
    if not cfg.tie_word_embeddings:
        keys.append(("lm_head.weight", ("lm_head",), True))
    for i in range(cfg.num_layers):
        keys += [(f"model.layers.{i}.{k}", ("layers", i, name), t) for k, name, t in LAYER_KEYS]
    return keys


# ---------------------------------------------------------------- hashes and fingerprints

def array_sha256(a: np.ndarray) -> str:
    """sha256 of an array's bytes in C order (what safetensors and the manifest store)."""
    a = np.ascontiguousarray(a)
    return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


def _hash_all(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    names = list(arrays)
    with ThreadPoolExecutor(max_workers=4) as pool:  # hashlib releases the GIL
        return dict(zip(names, pool.map(lambda n: array_sha256(arrays[n]), names)))


def _mix32(words, seed: int):
    """murmur3's finaliser over (word ^ index * golden ^ seed): u32 -> u32, per element."""
    idx = jnp.arange(words.shape[0], dtype=jnp.uint32)
    h = words ^ (idx * jnp.uint32(0x9E3779B9)) ^ jnp.uint32(seed)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _digest(a):
    """u32[4] of one array: four seeded sums of mixed 32-bit words."""
    if jnp.issubdtype(a.dtype, jnp.floating):
        a = a.astype(jnp.float32)  # the values served, whatever the storage dtype
    elif a.dtype.itemsize != 4:
        a = a.astype(jnp.int32)
    words = jax.lax.bitcast_convert_type(a, jnp.uint32).reshape(-1)
    # sums mod 2^32 are exact, so any device, reduction order or sharding agrees
    return jnp.stack([jnp.sum(_mix32(words, s), dtype=jnp.uint32)
                      for s in (0x1B873593, 0xE6546B64, 0x68E31DA4, 0x27D4EB2F)])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _piece_digest(a, columns, stacked: bool):
    """u32[4] of `a` (u32[num_layers, 4], one per layer slice, when `stacked`), or of
    its last-axis `columns` (start, stop) only."""
    if columns is not None:
        a = a[..., columns[0]:columns[1]]
    return jax.vmap(_digest)(a) if stacked else _digest(a)


def fingerprint(params, fused=None) -> str:
    """A 32-hex-digit identity of a params pytree, computed on the device in one pass.

    Covers every leaf's tree path, shape and values (floats as f32, so a bf16
    checkpoint loaded as bf16 or f32 gives the same fingerprint). Equal
    weights give equal fingerprints on any device or sharding; a changed
    value changes it. It detects different or damaged weights, not an
    adversary (128 bits of integer mixing, not a cryptographic hash).
    Layers stacked (models/layers.py) or listed give the same fingerprint, and so
    do fused projections when `fused` names their parts (`fused_parts`:
    fused leaf name -> ((part name, width along the last axis), ...)).
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if not flat:
        return hashlib.sha256(b"empty").hexdigest()[:32]
    pieces = []  # (checkpoint path, leaf, last-axis columns or None)
    for path, leaf in flat:
        parts = (fused or {}).get(getattr(path[-1], "key", None))
        if parts is None:
            pieces.append((path, leaf, None))
            continue
        start = 0
        for name, width in parts:
            pieces.append((path[:-1] + (jax.tree_util.DictKey(name),), leaf,
                           (start, start + width)))
            start += width
        if start != leaf.shape[-1]:
            raise ValueError(f"{jax.tree_util.keystr(path)}: parts {parts} cover {start} "
                             f"columns of {leaf.shape[-1]}")
    # one call per piece, on the leaf's own device(s): target and drafter may sit apart
    digests = jax.device_get([_piece_digest(leaf, columns, _stacked_at(path) is not None)
                              for path, leaf, columns in pieces])
    entries = []
    for (path, leaf, columns), d in zip(pieces, digests):
        shape = leaf.shape if columns is None else (*leaf.shape[:-1], columns[1] - columns[0])
        j = _stacked_at(path)
        if j is None:
            entries.append((path, shape, d))
        else:  # a stacked layer leaf counts as its per-layer slices
            entries += [(path[:j] + (jax.tree_util.SequenceKey(i),) + path[j:], shape[1:],
                         d[i]) for i in range(shape[0])]
    if len(entries) != len(flat):  # the list form's order: by path, layer index included
        entries.sort(key=lambda e: tuple(getattr(k, "key", getattr(k, "idx", None))
                                         for k in e[0]))
    h = hashlib.sha256()
    for path, shape, d in entries:
        h.update(f"{jax.tree_util.keystr(path)}:{tuple(shape)}:".encode())
        h.update(np.asarray(d, np.uint32).tobytes())
    return h.hexdigest()[:32]


def _stacked_at(path) -> int | None:
    """Where a leaf of stacked layers (`models.layers.stack_layers`: params["layers"] a
    dict of [num_layers, ...] arrays) would have its layer index; None for other leaves."""
    for j in range(1, len(path)):
        if (getattr(path[j - 1], "key", None) == "layers"
                and isinstance(path[j], jax.tree_util.DictKey)):
            return j
    return None


def write_manifest(path, arrays: dict[str, np.ndarray], params_fingerprint: str | None = None,
                   files: dict[str, str] | None = None) -> None:
    """`manifest.json` in `path`: per array name, sha256 / shape / dtype (and its file)."""
    hashes = _hash_all(arrays)
    entries = {}
    for name in sorted(arrays):
        entries[name] = {"sha256": hashes[name], "shape": list(arrays[name].shape),
                         "dtype": str(arrays[name].dtype)}
        if files:
            entries[name]["file"] = files[name]
    manifest = {"format": MANIFEST_FORMAT, "fingerprint": params_fingerprint, "arrays": entries}
    (Path(path) / MANIFEST).write_text(json.dumps(manifest, indent=1))


def read_manifest(path) -> dict | None:
    """The manifest of checkpoint directory `path`, or None when it has none."""
    file = Path(path) / MANIFEST
    if not file.exists():
        return None
    manifest = read_config(file)
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("arrays"), dict):
        raise CheckpointError(f"{file}: not a manifest this project writes "
                              f"(format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r})")
    for name, entry in manifest["arrays"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("shape"), list) and isinstance(entry.get("dtype"), str)):
            raise CheckpointError(f"{file}: the entry of array {name!r} is malformed (it needs "
                                  f"sha256, shape and dtype); the manifest is damaged: "
                                  f"regenerate it, or delete it if you trust the weights")
    return manifest


def verify_manifest(path, manifest: dict, arrays: dict[str, np.ndarray],
                    where=lambda name: None) -> None:
    """Every array the manifest lists is present with its hash, shape and dtype; no others."""
    path = Path(path)
    listed = manifest["arrays"]
    missing = sorted(set(listed) - set(arrays))
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} arrays listed in {MANIFEST} are missing: "
                              f"{missing[:10]}")
    extra = sorted(set(arrays) - set(listed))
    if extra:
        raise CheckpointError(f"{path}: {len(extra)} arrays not in its {MANIFEST}: {extra[:10]}")
    hashes = _hash_all(arrays)
    for name in sorted(listed):
        want, a = listed[name], arrays[name]
        file = where(name) or path
        if list(a.shape) != want["shape"] or str(a.dtype) != want["dtype"]:
            raise CheckpointError(f"{file}: array {name!r} is {a.dtype}{list(a.shape)}, its "
                                  f"manifest says {want['dtype']}{want['shape']}")
        if hashes[name] != want["sha256"]:
            raise CheckpointError(f"{file}: array {name!r} does not match its sha256 in "
                                  f"{path / MANIFEST}: the checkpoint is damaged")


def check_finite(name: str, a, file) -> None:
    """Refuse NaN / inf in a loaded array (host numpy or device)."""
    a = np.asarray(a)
    if a.dtype.kind in "iub":
        return
    bad = int(a.size - np.count_nonzero(np.isfinite(a.astype(np.float32))))
    if bad:
        raise CheckpointError(f"{file}: array {name!r} has {bad} NaN / inf values "
                              f"(of {a.size}); the checkpoint is damaged")


# ---------------------------------------------------------------- safetensors

def _safetensors_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_config(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map object")
        return sorted(set(weight_map.values()))
    return sorted(p.name for p in path.glob("*.safetensors"))


def read_safetensors_with_files(path) -> tuple[dict[str, np.ndarray], dict[str, Path]]:
    """(tensors, the file each came from) of a checkpoint directory: one file or shards."""
    path = Path(path)
    files = _safetensors_files(path)
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    tensors, sources = {}, {}
    for name in files:
        file = path / name
        try:
            part = load_file(file)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file}: cannot read it as safetensors ({e}); the file is "
                                  f"damaged or truncated") from None
        for key in part:
            if key in tensors:
                raise CheckpointError(f"{file}: tensor {key!r} is also in {sources[key]}")
            sources[key] = file
        tensors.update(part)
    manifest = read_manifest(path)
    if manifest is not None:
        verify_manifest(path, manifest, tensors, sources.get)
    return tensors, sources


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory: one file, or shards with an index."""
    return read_safetensors_with_files(path)[0]


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def stored_dtype(tensors, keys):
    """The dtype a checkpoint's weights serve in when asked for "auto": bf16 when every
    tensor of `keys` is stored in bf16 (an 8B model then takes half the memory and
    reads of f32), else f32."""
    return (jnp.bfloat16 if all(str(tensors[k].dtype) == "bfloat16" for k in keys if k in tensors)
            else jnp.float32)


def params_from_tensors(tensors, key_map, template, dtype=jnp.float32, *, where=None,
                        source="checkpoint", tied=None, on_host: bool = False):
    """Fill a params pytree shaped like `template` (from init_params/eval_shape).

    Refuses a missing key, a wrong shape, NaN / inf, and any tensor the key map
    does not use (all of them listed). `where(key)` names a tensor's file;
    `tied=(head, embed)` accepts a tied checkpoint's redundant head when it
    equals the embedding. `dtype`: a dtype or its name, or "auto" (`stored_dtype`).
    `on_host`: numpy arrays, for a caller that converts them before they reach a device.
    """
    where = where or (lambda key: None)
    dtype = (stored_dtype(tensors, [key for key, _, _ in key_map]) if dtype == "auto"
             else jnp.dtype(dtype))
    params = jax.tree.map(lambda _: None, template)
    for key, path, transposed in key_map:
        if key not in tensors:
            raise CheckpointError(f"{source}: checkpoint is missing {key!r} (needed for "
                                  f"{'.'.join(map(str, path))})")
        file = where(key) or source
        value = tensors[key].T if transposed else tensors[key]
        want = _get(template, path).shape
        if value.shape != want:
            raise CheckpointError(f"{file}: {key!r} has shape {tensors[key].shape}, expected "
                                  f"{want[::-1] if transposed else want} from the config")
        if tensors[key].dtype.kind != "f" and str(tensors[key].dtype) != "bfloat16":
            raise CheckpointError(f"{file}: {key!r} is {tensors[key].dtype}; weights must be "
                                  f"floating point (bf16, f16 or f32): quantized checkpoints "
                                  f"are not supported")
        check_finite(key, tensors[key], file)
        _set(params, path, np.ascontiguousarray(value, dtype) if on_host
             else jnp.asarray(value, dtype))
    used = {key for key, _, _ in key_map}
    unused = sorted(k for k in tensors if k not in used and not k.endswith(IGNORED_SUFFIXES))
    if tied is not None and tied[0] in unused:
        head, embed = tied
        if np.array_equal(np.asarray(tensors[head]), np.asarray(tensors[embed])):
            unused.remove(head)
    if unused:
        files = sorted({str(where(k) or source) for k in unused})
        hint = ("; bias tensors need attention_bias, which is not implemented"
                if any(k.endswith(".bias") for k in unused) else "")
        if tied is not None and tied[0] in unused:
            hint += (f"; {tied[0]!r} differs from {tied[1]!r} but tie_word_embeddings is true "
                     f"(set it false to use the separate head)")
        raise CheckpointError(f"{', '.join(files)}: {len(unused)} tensors the model does not use: "
                              f"{unused[:20]}{' ...' if len(unused) > 20 else ''}{hint}")
    return params


def tensors_from_params(params, key_map) -> dict[str, np.ndarray]:
    out = {}
    for key, path, transposed in key_map:
        value = np.asarray(_get(params, path))  # keeps bf16 (ml_dtypes) as bf16
        out[key] = np.ascontiguousarray(value.T if transposed else value)
    return out


def write_safetensors(path, tensors: dict[str, np.ndarray], config: dict, num_shards: int = 1,
                      params_fingerprint: str | None = None):
    """Write config.json, one file (or `num_shards` shards plus the index) and the manifest."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    if num_shards == 1:
        save_file(tensors, path / "model.safetensors")
        files = dict.fromkeys(names, "model.safetensors")
    else:
        files = {}
        for s in range(num_shards):
            shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::num_shards]}
            save_file(part, path / shard)
            files.update(dict.fromkeys(part, shard))
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": files}, indent=2))
    write_manifest(path, tensors, params_fingerprint, files)


def load_safetensors_params(path, cfg, init_params, key_map, dtype, *, tied=None,
                            on_host: bool = False):
    """Params for `cfg` from the safetensors of checkpoint directory `path`
    (`params_from_tensors`' dtype and on_host)."""
    template = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tensors, sources = read_safetensors_with_files(path)
    return params_from_tensors(tensors, key_map(cfg), template, dtype, where=sources.get,
                               source=Path(path), tied=tied, on_host=on_host)


def load_qwen3(path, dtype=jnp.float32, *, on_host: bool = False):
    """(Qwen3Config, params) from an HF Qwen3 checkpoint directory (`params_from_tensors`'
    dtype and on_host)."""
    from models.config import load_qwen3_config
    from models.qwen3 import init_params
    cfg = load_qwen3_config(path)
    tied = (("lm_head.weight", "model.embed_tokens.weight") if cfg.tie_word_embeddings
            else None)
    return cfg, load_safetensors_params(path, cfg, init_params, qwen3_key_map, dtype, tied=tied,
                                        on_host=on_host)


def save_qwen3(path, cfg, params, num_shards: int = 1):
    write_safetensors(path, tensors_from_params(params, qwen3_key_map(cfg)), cfg.to_hf(),
                      num_shards, fingerprint(params))
