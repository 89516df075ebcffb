"""A code corpus every machine has (the Python standard library) and a byte tokenizer.

Files are split into train / held-out by a hash of their path relative to
the stdlib root, so the split is the same on every machine and Python 3.12
patch release (files that exist in one release and not another just fall on
their own side).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Iterator

import numpy as np

BOS, EOS, MASK = 256, 257, 258
VOCAB_SIZE = 264  # 256 bytes + specials, padded to a multiple of 8


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; BOS, EOS and the drafter's MASK follow."""

    vocab_size = VOCAB_SIZE
    bos, eos, mask = BOS, EOS, MASK
    eos_token_ids = (EOS,)

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS] + ids if bos else ids

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The byte a token stands for (none for BOS, EOS and MASK)."""
        return bytes([int(token)]) if 0 <= int(token) < 256 else b""


def stdlib_files(root: str | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def is_held_out(path: Path, root: Path, fraction: float = 0.05) -> bool:
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def document(text: str) -> np.ndarray:
    """A file's token array (uint16): BOS, its text's UTF-8 bytes, EOS."""
    return np.asarray(ByteTokenizer().encode(text) + [EOS], np.uint16)


def load_split(split: str, root: str | None = None) -> list[np.ndarray]:
    """Token arrays (uint16) of every file of `split` ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: use 'train' or 'heldout'")
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    out = [document(path.read_text(encoding="utf-8", errors="replace"))
           for path in stdlib_files(str(root_path))
           if is_held_out(path, root_path) == (split == "heldout")]
    if not out:
        raise RuntimeError(f"no stdlib .py files found under {root_path}")
    return out


def load_code(roots, root: str | None = None) -> list[np.ndarray]:
    """Token arrays of every .py file under `roots` (e.g. site-packages: training text
    beside the stdlib's), less any whose text is a held-out stdlib file's or whose name
    is one (a vendored or backported copy of a held-out module), so that the held-out
    prompts stay unseen."""
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    held_out = [p for p in stdlib_files(str(root_path)) if is_held_out(p, root_path)]
    names = {p.name for p in held_out} - {"__init__.py", "__main__.py"}
    texts = {hashlib.sha256(p.read_bytes()).digest() for p in held_out}
    out = []
    for extra in roots:
        for path in sorted(Path(extra).rglob("*.py")):
            if not path.is_file() or path.name in names:
                continue
            data = path.read_bytes()
            if hashlib.sha256(data).digest() not in texts:
                out.append(document(data.decode("utf-8", errors="replace")))
    return out


def random_windows(docs: list[np.ndarray], batch: int, length: int,
                   seed: int = 0, skip: int = 0) -> Iterator[np.ndarray]:
    """Endless batches i32[batch, length] of random windows of the concatenated corpus,
    after the first `skip` of them (a resumed training run's)."""
    stream = np.concatenate(docs).astype(np.int32)
    rng = np.random.default_rng(seed)
    for _ in range(skip):
        rng.integers(0, len(stream) - length, batch)
    while True:
        starts = rng.integers(0, len(stream) - length, batch)
        yield np.stack([stream[s:s + length] for s in starts])
