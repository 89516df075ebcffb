"""What the kernels need to know about the device they run on: platform, compute
capability and SM count, read from jax's device once per process."""

from __future__ import annotations

import dataclasses
import functools

import jax

# Plans made without a GPU (Pallas interpret mode on CPU) assume the H200's SM count, the
# machine the compiled tests run on, so a CPU run plans the launches a GPU run takes.
DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    platform: str                                # "gpu", "cpu", "tpu"
    compute_capability: tuple[int, int] | None   # (9, 0) on Hopper; None off CUDA
    num_sms: int                                 # streaming multiprocessors (DEFAULT_NUM_SMS off GPU)


def _capability(device) -> tuple[int, int] | None:
    value = getattr(device, "compute_capability", None)
    if not value:
        return None
    major, _, minor = str(value).partition(".")
    return int(major), int(minor or 0)


@functools.cache
def device_info() -> DeviceInfo:
    """The default backend's first device (every device of one process is the same kind)."""
    device = jax.devices()[0]
    platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    num_sms = getattr(device, "core_count", None) if platform == "gpu" else None
    return DeviceInfo(platform=platform, compute_capability=_capability(device),
                      num_sms=int(num_sms) if num_sms else DEFAULT_NUM_SMS)
