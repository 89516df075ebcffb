"""A child process of the two-GPU benchmark (`python -m benchmarks.bench_two_gpu --child
NAME --spec FILE --result FILE`): runs one child function, saving its results as it goes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from benchmarks.two_gpu.cross_process import (child_bulk_offer, child_bulk_pull, child_link,
                                              child_remote)
from benchmarks.two_gpu.e2e import child_e2e
from benchmarks.two_gpu.tensor_parallel import child_hetero, child_tp


CHILDREN = {"tp": child_tp, "hetero": child_hetero, "remote": child_remote,
            "bulk-offer": child_bulk_offer, "bulk-pull": child_bulk_pull, "link": child_link,
            "e2e": child_e2e}


class Sink(dict):
    """A child's results, written to its result file after every step (atomically)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def save(self) -> None:
        Path(self.path + ".tmp").write_text(json.dumps(self, default=_jsonable))
        os.replace(self.path + ".tmp", self.path)


def _jsonable(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def child_main(name: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    sink = Sink(result_path)
    import jax
    sink["devices"] = [str(d) for d in jax.devices()]
    sink["device_kind"] = jax.devices()[0].device_kind
    sink.save()
    CHILDREN[name](spec, sink)
    sink["finished"] = True
    sink.save()
