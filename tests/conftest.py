import importlib.util
import os
import tempfile

# The CPU suite runs Pallas kernels in interpret mode; several host devices let
# mesh/sharding code run without GPUs. Set before jax initialises a backend.
_CPU_ONLY = os.environ.get("JAX_PLATFORMS") == "cpu" or not any(
    importlib.util.find_spec(m) for m in ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin"))
# Where jax can only run on the CPU, its programs are compiled without LLVM's
# optimisation (-O0): compiling is most of the suite's time, and a step program compiles
# in about 2.4 s at -O0 against 3.4 s at -O1 (tests/disagg/test_disagg.py with
# tests/drafter/test_kv_io.py: 328 s against 442 s), though its code runs slower. LLVM's
# expensive passes are off too (tests/drafter/test_lossless.py 71 s against 75 s,
# test_engine_sampling.py 79 s against 83 s). Not on a GPU machine: its kernels and
# timings keep the default. Child processes (tests/disagg) inherit the flags.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4" + (
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if _CPU_ONLY else ""))
# One persistent compilation cache for the run, shared by both xdist workers and the
# child processes: each test module drops its compiled programs when it ends (below),
# and many modules (and children) compile the same steps again.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    if on_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the H200 machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def interpret() -> bool:
    """Pallas interpret mode everywhere but on a GPU."""
    return not on_gpu()


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """The whole suite runs in one process: let each test module's compiled
    programs go when it ends instead of piling up. Without this, two of five
    full runs segfaulted inside XLA's CPU compiler in the last test files
    (tests/unified_kv/test_state.py), never when run alone."""
    yield
    jax.clear_caches()
