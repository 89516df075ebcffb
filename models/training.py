"""A small, resumable training loop (optax + orbax + tqdm) and target LM training.

`train_loop` is shared by target training and drafter training: it jits one
update, shows progress, saves a loss curve and orbax checkpoints of
(params, optimizer state, step), and resumes from the newest checkpoint in
`ckpt_dir` when one exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from models.qwen3 import Qwen3Config, dense_forward


def saved_step(ckpt_dir: str | Path | None) -> int:
    """The step of the newest training checkpoint in `ckpt_dir` (0 when there is none):
    where a resumed `train_loop` goes on."""
    if ckpt_dir is None or not (Path(ckpt_dir) / "state").exists():
        return 0
    import orbax.checkpoint as ocp
    manager = ocp.CheckpointManager(Path(ckpt_dir).absolute() / "state")
    try:
        return int(manager.latest_step() or 0)
    finally:
        manager.close()


def train_loop(loss_fn: Callable, params, batches: Iterator, *, steps: int, lr: float,
               ckpt_dir: str | Path | None = None, save_every: int = 500,
               desc: str = "train", warmup: int = 50, seed: int = 0,
               time_budget_s: float | None = None, run_steps: int | None = None):
    """Minimise `loss_fn(params, batch, key)` over `steps` AdamW updates.

    Returns (params, losses) where losses has one float per step run (a
    resumed run returns the whole curve, from the checkpoint's loss.json).
    With `time_budget_s`, training stops early (saying so) when the budget is
    spent, and with `run_steps` after that many updates in this call, so a run
    on a lent machine always ends with a checkpoint. A resumed run follows the
    same schedule (one warm-up and cosine over `steps`) and the same per-step
    keys as an uninterrupted one; `batches` must continue where the saved run's
    left off (`saved_step` says where).
    """
    import time
    started = time.monotonic()
    warmup = min(warmup, steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1),
                                                  lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    # Committed to the device, as a state restored from a checkpoint is: jit keys its
    # cache on committed-ness, so a resumed run reuses the fresh run's compiled update.
    state = jax.device_put({"params": params, "opt_state": opt.init(params),
                            "step": jnp.int32(0)}, jax.devices()[0])
    losses: list[float] = []
    manager = None
    if ckpt_dir is not None:
        import orbax.checkpoint as ocp
        ckpt_dir = Path(ckpt_dir).absolute()
        manager = ocp.CheckpointManager(ckpt_dir / "state",
                                        options=ocp.CheckpointManagerOptions(max_to_keep=2))
        if manager.latest_step() is not None:
            state = manager.restore(manager.latest_step(),
                                    args=ocp.args.StandardRestore(state))
            curve = ckpt_dir / "loss.json"
            losses = json.loads(curve.read_text())[:int(state["step"])] if curve.exists() else []

    @jax.jit
    def update(state, batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, key)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state, "step": state["step"] + 1}, loss

    key = jax.random.key(seed)
    start = int(state["step"])
    bar = tqdm(range(start, steps), desc=desc, initial=start, total=steps, leave=False)
    for step in bar:
        state, loss = update(state, next(batches), jax.random.fold_in(key, step))
        losses.append(float(loss))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.4f}")
        run_done = run_steps is not None and step + 1 - start >= run_steps and step + 1 < steps
        out_of_time = time_budget_s is not None and time.monotonic() - started > time_budget_s
        stopping = run_done or out_of_time
        if manager is not None and ((step + 1) % save_every == 0 or step + 1 == steps
                                    or stopping):
            import orbax.checkpoint as ocp
            manager.save(step + 1, args=ocp.args.StandardSave(state))
            (ckpt_dir / "loss.json").write_text(json.dumps(losses))
        if stopping:
            spent = f"{run_steps} steps" if run_done else f"time budget {time_budget_s:.0f}s"
            print(f"{desc}: {spent} spent, stopping at step {step + 1} of {steps}"
                  + (f" (saved in {ckpt_dir}: a run with the same directory goes on)"
                     if manager is not None else ""), flush=True)
            break
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    return state["params"], losses


def lm_loss(cfg: Qwen3Config):
    """Next-token cross-entropy of the target on batches i32[N, T]."""
    def loss(params, tokens, key):
        del key
        logits, _ = dense_forward(params, cfg, tokens[:, :-1])
        labels = tokens[:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss


def train_target(cfg: Qwen3Config, params, batches, *, steps: int, lr: float = 3e-3, **kw):
    """Train a target LM; see `train_loop` for checkpointing and resuming."""
    return train_loop(lm_loss(cfg), params, batches, steps=steps, lr=lr, desc="target", **kw)
