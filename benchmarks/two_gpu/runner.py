"""The two-GPU benchmark's parent: starts children on chosen devices, each under a time
limit, and reads their results."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.two_gpu.common import say

REPO = Path(__file__).resolve().parent.parent.parent


class Runner:
    """Starts children on chosen devices, each under a time limit; reads their results."""

    def __init__(self, platform: str, visible: list[str], work: Path, log_dir: Path):
        self.platform, self.visible, self.work, self.log_dir = platform, visible, work, log_dir
        self.count = 0
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                               self.env.get("PYTHONPATH")]))
        self.env["PYTHONUNBUFFERED"] = "1"
        # One compilation cache for the run's children (each GPU is its process's
        # device 0, so the data-parallel and generation processes reuse compiles).
        self.env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "jax_cache"))
        self.env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

    @property
    def shared_gpu(self) -> bool:
        return self.platform == "gpu" and len(self.visible) < 2

    def device_env(self, devices: list[int]) -> dict:
        """The environment of a process that sees `devices` (indices 0 / 1 of the pair)."""
        if self.platform == "gpu":
            ids = [self.visible[min(d, len(self.visible) - 1)] for d in devices]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(dict.fromkeys(ids))}
            if self.shared_gpu:   # one GPU: every process gets a share of its memory
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.4"
            return env
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                       os.environ.get("XLA_FLAGS", ""))
        return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count="
                             f"{len(devices)}".strip()}

    def start(self, name: str, spec: dict, devices: list[int]):
        self.count += 1
        stem = self.work / f"{self.count:02d}-{name}"
        spec_path, result_path = f"{stem}.spec.json", f"{stem}.result.json"
        Path(spec_path).write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "benchmarks.bench_two_gpu", "--child", name,
               "--spec", spec_path, "--result", result_path]
        proc = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **self.device_env(devices)},
                                start_new_session=True)
        return proc, result_path

    def wait(self, jobs: list, limit_s: float, tag: str) -> list[dict]:
        """Wait for every job until `limit_s`; one still running then is stopped with its
        children (its process group). Each job's results, with "status"."""
        deadline = time.monotonic() + max(limit_s, 1.0)
        out = []
        for proc, result_path in jobs:
            try:
                rc = proc.wait(max(0.0, deadline - time.monotonic()))
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                self.stop(proc)
                status = f"stopped at its {limit_s:.0f} s limit"
            result = json.loads(Path(result_path).read_text()) if Path(result_path).exists() \
                else {}
            result["status"] = status
            if status != "ok":
                say(tag, f"child {' '.join(proc.args[3:5])}: {status}")
            out.append(result)
        return out

    def stop(self, proc) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(10)
                return
            except subprocess.TimeoutExpired:
                continue

    def run(self, name: str, spec: dict, devices: list[int], limit_s: float,
            tag: str) -> dict:
        return self.wait([self.start(name, spec, devices)], limit_s, tag)[0]


def probe() -> tuple[str, list[str]]:
    """(platform, visible GPU ids) without initialising a backend in this process."""
    code = ("import jax; d = jax.devices(); print(d[0].platform, len(d))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    if out.returncode:
        raise SystemExit(f"cannot start jax: {out.stderr[-2000:]}")
    platform, count = out.stdout.split()[-2:]
    if platform != "gpu":
        return "cpu", []
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return "gpu", visible or [str(i) for i in range(int(count))]
