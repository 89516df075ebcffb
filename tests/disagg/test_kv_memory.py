"""How much KV memory a worker takes (--kv-memory-mib, --kv-memory-fraction) and the
line that says what it holds."""

from pathlib import Path

import jax
import numpy as np
import pytest

from disagg.__main__ import main
from disagg.frontend import DEFAULT_KV_MIB, kv_budget_bytes

GIB = 1 << 30


class Device:
    """A device that reports its memory as GPUs do."""
    platform, id = "gpu", 0

    def __init__(self, limit, in_use):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def test_a_fraction_bounds_the_weights_and_the_caches_together_split_over_the_caches():
    """0.9 of 100 GiB with 20 GiB of weights: 70 GiB of KV; 10 GiB stays working memory."""
    device = Device(100 * GIB, 20 * GIB)
    assert kv_budget_bytes(None, 0.9, 1, device) == 70 * GIB
    assert kv_budget_bytes(None, 0.9, 2, device) == 35 * GIB
    assert kv_budget_bytes(None, None) == DEFAULT_KV_MIB << 20
    assert kv_budget_bytes(300, None) == 300 << 20
    # weights each worker will place on its own mesh count as if they were there
    assert kv_budget_bytes(None, 0.9, 1, device, pending_bytes=10 * GIB) == 60 * GIB


@pytest.mark.parametrize("mib, fraction, device, match", [
    (100, 0.5, None, "not both"),
    (None, 1.5, None, r"must be in \(0, 1\]"),
    (0, None, None, "positive integer"),
    (None, 0.5, Device(100 * GIB, 60 * GIB), "taken already"),
])
def test_kv_memory_flags_that_cannot_be_met_name_the_flag(mib, fraction, device, match):
    with pytest.raises(SystemExit, match=match):
        kv_budget_bytes(mib, fraction, 1, device)


def test_a_device_without_memory_figures_asks_for_mib():
    import jax
    if jax.devices()[0].memory_stats():
        pytest.skip("this device reports its memory")
    with pytest.raises(SystemExit, match="does not report its memory; give --kv-memory-mib"):
        kv_budget_bytes(None, 0.9)


def test_serve_with_too_little_kv_memory_exits_naming_the_flags():
    with pytest.raises(SystemExit, match=r"does not hold one request.*--kv-memory-mib"):
        main(["serve", "--kv-memory-mib", "1", "--no-compile-cache"])


def test_serve_remote_takes_the_same_kv_memory_flags():
    from disagg.processes import PairSource
    with pytest.raises(SystemExit, match=r"does not hold one request.*--kv-memory-mib"):
        main(["serve-remote", "--role", "context", "--kv-memory-mib", "1"])
    # a child process is started with the parent's choice, and only it
    args = PairSource(kv_memory_fraction=0.5).cli_args()
    assert "--kv-memory-fraction" in args and "--kv-memory-mib" not in args
    assert args[args.index("--kv-memory-fraction") + 1] == "0.5"


def test_more_slots_than_the_cache_could_ever_fill_are_refused_before_allocating():
    """Slots past what the cache holds of the shortest requests would never run, and
    each costs state: refused naming --num-slots and the most that could run. At that
    most, the same flags load."""
    import re

    from disagg.frontend import load_pair
    with pytest.raises(SystemExit, match=r"--num-slots 100000: .* give --num-slots (\d+) or "
                                         r"fewer") as e:
        load_pair(num_slots=100000, kv_memory_mib=64)
    most = int(re.search(r"give --num-slots (\d+)", str(e.value)).group(1))
    assert 1 <= most < 100000
    assert load_pair(num_slots=most, kv_memory_mib=64).step_config.spec.num_slots == most


def test_a_process_pair_loads_through_the_served_loader_naming_its_flag(tmp_path):
    """PairSource reads checkpoints as serve's --target/--drafter do: step form on the
    host for the worker's mesh, the drafter left out for a target-only context, and
    errors that name --pair."""
    from disagg.processes import PairSource
    pair = Path(__file__).parent.parent / "fixtures" / "copy_pair"
    params, cfg = PairSource(str(pair), num_slots=2, max_seq_len=64,
                             kv_memory_mib=8).load()
    assert set(params) == {"target", "draft"} and cfg.spec.num_slots == 2
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(params))
    alone, cfg_alone = PairSource(str(pair), num_slots=2, max_seq_len=64, kv_memory_mib=8,
                                  drafter=False).load()
    assert set(alone) == {"target"}
    assert len(cfg_alone.spec.layers) < len(cfg.spec.layers)
    with pytest.raises(SystemExit, match=r"--pair .*target: no config.json there"):
        PairSource(str(tmp_path), kv_memory_mib=8).load()
    with pytest.raises(SystemExit, match="--num-slots and --max-seq-len must be >= 1"):
        PairSource(str(pair), num_slots=0).load()
