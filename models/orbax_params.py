"""Params saved and restored with orbax (a `params/` item), the HF-style config and the
content manifest beside them (`models.checkpoint`'s manifests: per array its sha256,
shape and dtype, plus the params' fingerprint). Restoring checks the manifest and NaN /
inf and names the directory and the array.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from models.checkpoint import (MANIFEST, CheckpointError, check_finite, fingerprint,
                               read_config, read_manifest, verify_manifest, write_manifest)


def _leaf_names(tree) -> list[tuple[str, object]]:
    """('layers.0.q', leaf) for every leaf, in tree order."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
        out.append((".".join(parts), leaf))
    return out


def save_orbax(path, params, config: dict) -> None:
    """Params with orbax (a `params/` item), the HF-style config and the manifest beside them."""
    import orbax.checkpoint as ocp
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", params, force=True)
    arrays = {name: np.asarray(leaf) for name, leaf in _leaf_names(params)}
    write_manifest(path, arrays, fingerprint(params))


def restore_orbax(path, template) -> tuple[dict, dict]:
    """(config dict, params) saved by `save_orbax`; `template` gives the tree structure.

    Refuses a checkpoint without its manifest, one whose arrays do not match
    it (damaged, truncated, missing), and NaN / inf, naming the directory and
    the array.
    """
    path = Path(path).absolute()
    config = read_config(path / "config.json")
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path}: no {MANIFEST} (every orbax checkpoint this project "
                              f"writes has one); re-save it with save_orbax, or add one with "
                              f"models.orbax_params.write_orbax_manifest if you trust its contents")
    names = [name for name, _ in _leaf_names(template)]
    missing = sorted(set(manifest["arrays"]) ^ set(names))
    if missing:
        raise CheckpointError(f"{path}: arrays in {MANIFEST} and the model differ: {missing[:10]}")
    try:
        params = _restore(path, template)
    except Exception as e:  # orbax / tensorstore raise many types; name the file, keep it short
        named = [n for n in names if n.replace(".", "/") in str(e) or n in str(e)]
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(" See full TensorStore details")[0][:300]
        raise CheckpointError(f"{path / 'params'}: orbax cannot restore it"
                              f"{' (array ' + repr(named[0]) + ')' if named else ''}: "
                              f"{type(e).__name__}: {first}; the checkpoint is damaged or "
                              f"truncated") from None
    verify_manifest(path, manifest, _finite_arrays(path, params), lambda name: path / "params")
    return config, params


def write_orbax_manifest(path, template) -> str:
    """Write the manifest of an existing orbax checkpoint from its current contents.

    Only for a checkpoint you trust; the weights are read, not rewritten.
    Returns the params' fingerprint.
    """
    path = Path(path).absolute()
    params = _restore(path, template)
    fp = fingerprint(params)
    write_manifest(path, _finite_arrays(path, params), fp)
    return fp


def _restore(path: Path, template):
    """The params under `path / "params"`, restored onto this machine's default device: a
    checkpoint written on a CPU host must load on a GPU one (orbax refuses a topology it
    cannot map)."""
    import orbax.checkpoint as ocp
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            template)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path / "params", template)


def _finite_arrays(path: Path, params) -> dict[str, np.ndarray]:
    """Every leaf of `params` by name, each checked for NaN / inf."""
    arrays = {name: np.asarray(leaf) for name, leaf in _leaf_names(params)}
    for name, a in arrays.items():
        check_finite(name, a, path / "params")
    return arrays
