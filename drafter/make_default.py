"""Train the embedded default pair: a byte-level Qwen3 code model and its DFlash drafter.

    PYTHONPATH=. python -m drafter.make_default --out DIR [--target-steps N] [--draft-steps N]
        [--extra-code DIR ...]

Corpus: the Python standard library (drafter/corpus.py), held-out split by file, and
with --extra-code every .py file under the given directories (less copies of held-out
files). Writes DIR/target and DIR/draft as safetensors checkpoints (HF / DFlash key
maps, bf16 to stay small) plus loss curves; `drafter.default.import_pair` turns them
into the orbax checkpoints the package ships. `--draft-steps 0` trains the target alone;
`--target-from DIR/target` then trains a drafter for it (resumable with --state-dir).
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from drafter.corpus import MASK, VOCAB_SIZE, load_code, load_split, random_windows
from drafter.dflash import DFlashConfig, init_params as init_draft
from drafter.train import LABELS, train_drafter
from drafter.checkpoint import load_dflash, save_dflash
from drafter.inspect import pair_checks
from models.checkpoint import load_qwen3, save_qwen3
from models.qwen3 import Qwen3Config, init_params as init_target
from models.training import saved_step, train_target


def target_config() -> Qwen3Config:
    return Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768,
                       num_layers=6, num_heads=8, num_kv_heads=2, head_dim=32,
                       rope_theta=100_000.0,
                       layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2,
                       sliding_window=256, tie_word_embeddings=True)


DRAFT_ATTENTION = {"sliding": "sliding_attention", "full": "full_attention"}


def draft_config(num_layers: int = 2, attention: str = "sliding",
                 target_layer_ids: tuple[int, ...] = (1, 4)) -> DFlashConfig:
    """The shipped drafter's shape (2 sliding-window layers reading target layers 1 and
    4), or a deeper one / one whose layers attend to the whole context / one that reads
    other target layers."""
    return DFlashConfig(num_layers=num_layers, hidden_size=256, intermediate_size=768,
                        num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                        mask_token_id=MASK, num_target_layers=6, target_layer_ids=target_layer_ids,
                        layer_types=(DRAFT_ATTENTION[attention],) * num_layers,
                        sliding_window=256, rope_theta=100_000.0)


def batches(docs, batch, length, seed, skip=0):
    for x in random_windows(docs, batch, length, seed, skip):
        yield jnp.asarray(x)


def parse_windows(specs: list[str]) -> list[tuple[int, int]]:
    """["1024x16", "8192x2"] -> [(1024, 16), (8192, 2)]: window length x batch."""
    out = []
    for spec in specs:
        try:
            length, batch = (int(v) for v in spec.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--windows {spec!r}: give LENGTHxBATCH, e.g. 8192x2") from None
        if length < 2 or batch < 1:
            raise SystemExit(f"--windows {spec!r}: the length must be >= 2 and the batch >= 1")
        out.append((length, batch))
    return out


def mixed_batches(docs, windows: list[tuple[int, int]], seed, skip=0):
    """Batches of each (length, batch) in turn: one jitted shape per window kind; after
    `skip` batches, the ones an uninterrupted run draws from there."""
    streams = [batches(docs, batch, length, seed + k, len(range(k, skip, len(windows))))
               for k, (length, batch) in enumerate(windows)]
    for _ in range(skip % len(windows)):  # take up the turn where the saved run stopped
        streams.append(streams.pop(0))
    while True:
        for stream in streams:
            yield next(stream)


def greedy_tail_batches(batches, params, tcfg: Qwen3Config, tail: int,
                        windows: list[tuple[int, int]], kv_dtype: str = "fp8_e4m3",
                        sampled: int = 0):
    """Each window's last `tail` tokens replaced by the target's own greedy continuation
    of the rest, as the plain engine serves it (by default the shipped cache's fp8 target
    KV), so a drafter trains on the sequences it will be asked to draft. With `sampled`,
    the `sampled` tokens before the tail are drawn from the target at temperature 1 first:
    a context the target never trained on, as a held-out prompt is, where the window's
    own text is one it may have learnt by heart. One engine, sized for the largest of
    `windows` (LENGTHxBATCH, every shape `batches` holds), serves every batch, so its
    programs compile once for all of them. A function of the windows alone (the draws'
    seed is the batch's checksum): a resumed run draws the same batches."""
    from drafter.default import default_step_config
    from drafter.engine import Engine
    longest, widest = max(t for t, _ in windows), max(n for _, n in windows)
    # room past the window for the engine's lookahead rows
    cfg = default_step_config(tcfg, None, num_slots=widest,
                              max_seq_len=-(-(longest + 32) // 16) * 16,
                              target_kv_dtype=kv_dtype)
    engine = Engine(params, cfg, speculative=False)
    for x in batches:
        n, t = x.shape
        if t > longest or n > widest:
            raise ValueError(f"a batch of {n} windows of {t} tokens is not among the "
                             f"windows {windows} the engine was sized for")
        heads = np.asarray(x)[:, :t - tail - sampled]
        if sampled:
            seed = zlib.crc32(heads.tobytes())
            drawn = engine.generate([h.tolist() for h in heads], sampled,
                                    temperature=1.0, seed=seed)
            heads = np.concatenate([heads, np.asarray([r.tokens for r in drawn])], 1)
        outs = engine.generate([h.tolist() for h in heads], tail)
        yield jnp.asarray(np.concatenate([heads, np.asarray([r.tokens for r in outs])], 1),
                          jnp.int32)


# The arguments that fix a drafter's training run (with its windows and corpus): a
# resumed run must give the same.
RUN_ARGS = ("from_default", "fresh_draft", "draft_from", "target_from", "draft_layers",
            "draft_attention", "draft_target_layers", "draft_steps", "draft_lr", "draft_labels",
            "anchor_spacing", "greedy_tail", "sampled_context", "extra_code")


def resumable_run(args, windows, corpus: dict) -> int:
    """Check --state-dir / --run-steps; record the run's settings (the training corpus's
    size among them: another machine's stdlib is other data) in a new state directory,
    or compare them with the recorded ones. Returns the step the drafter's training goes
    on from (0 for a new run)."""
    if args.state_dir is None:
        if args.run_steps is not None:
            raise SystemExit("--run-steps stops a run to go on later: give --state-dir too")
        return 0
    if args.run_steps is not None and args.run_steps < 1:
        raise SystemExit(f"--run-steps {args.run_steps}: give at least 1")
    if not (args.from_default or args.target_from):
        raise SystemExit("--state-dir keeps the drafter's training state: give --from-default "
                         "or --target-from (a target trained in the same run is not kept)")
    settings = ({k: getattr(args, k) for k in RUN_ARGS}
                | {"windows": windows, "corpus": corpus})
    settings = json.loads(json.dumps(settings))  # tuples as lists, as read back
    record = Path(args.state_dir) / "run.json"
    step = saved_step(args.state_dir)
    if record.exists():
        saved = json.loads(record.read_text())
        if changed := [k for k in settings if saved.get(k) != settings[k]]:
            raise SystemExit(
                f"--state-dir {args.state_dir} holds a run with other settings: "
                + "; ".join(f"{k} was {saved.get(k)!r}, now {settings[k]!r}" for k in changed)
                + ". Give the same settings, or another directory for a new run.")
    elif step:
        raise SystemExit(f"--state-dir {args.state_dir} holds a training state but no "
                         f"run.json: its settings are unknown; give another directory")
    else:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(settings, indent=1))
    if step:
        print(f"drafter: going on from step {step} of {args.draft_steps} "
              f"({args.state_dir})", flush=True)
    return step


def trains_on(args) -> bool:
    """Whether the run trains an existing drafter on (the shipped one or --draft-from's)
    rather than a new one."""
    return args.draft_from is not None or (args.from_default and not args.fresh_draft)


def train_pair_drafter(args, target, tcfg, dcfg, draft, train_docs, windows,
                       resume_from: int):
    """The run's drafter training for `target`, as the arguments set it: (draft, losses)."""
    t0 = time.time()
    # A continued run draws other windows than the first (seed 2, not 1).
    windows_in_turn = mixed_batches(train_docs, windows, 2 if trains_on(args) else 1,
                                    skip=resume_from)
    if args.greedy_tail is not None:
        windows_in_turn = greedy_tail_batches(windows_in_turn, {"target": target}, tcfg,
                                              args.greedy_tail, windows,
                                              sampled=args.sampled_context or 0)
    draft, d_losses = train_drafter(target, tcfg, dcfg, draft, windows_in_turn,
                                    steps=args.draft_steps, lr=args.draft_lr, anchors_per_seq=32,
                                    anchor_spacing=args.anchor_spacing, gamma=4.0,
                                    labels=args.draft_labels, tail=args.greedy_tail,
                                    time_budget_s=args.budget_s, ckpt_dir=args.state_dir,
                                    run_steps=args.run_steps)
    print(f"drafter: {len(d_losses)} steps in {time.time() - t0:.0f}s, loss "
          f"{np.mean(d_losses[:20]):.3f} -> {np.mean(d_losses[-50:]):.3f}", flush=True)
    return draft, d_losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--target-steps", type=int, default=3000)
    ap.add_argument("--draft-steps", type=int, default=2000,
                    help="0: train the target alone (DIR/target; a drafter for it comes "
                         "later, from --target-from DIR/target)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--draft-batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--stdlib", default=None, help="stdlib root (default: this Python's)")
    ap.add_argument("--extra-code", nargs="+", default=None, metavar="DIR",
                    help="train on every .py file under these directories too (e.g. "
                         "site-packages), less copies of held-out stdlib files")
    ap.add_argument("--target-from", default=None,
                    help="load a trained target checkpoint (HF key names) instead of training one")
    ap.add_argument("--from-default", action="store_true",
                    help="continue training the shipped drafter on the shipped target "
                         "(writes only DIR/draft and the drafter's loss curve)")
    ap.add_argument("--fresh-draft", action="store_true",
                    help="with --from-default: train a new drafter (--draft-layers, "
                         "--draft-attention) for the shipped target instead of continuing "
                         "the shipped drafter")
    ap.add_argument("--draft-from", default=None, metavar="DIR",
                    help="continue this candidate drafter (a DFlash checkpoint, e.g. an "
                         "earlier run's DIR/draft): for the shipped target with "
                         "--from-default, instead of the shipped drafter, or for "
                         "--target-from's target, instead of a new drafter")
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="a new drafter's depth (default 2)")
    ap.add_argument("--draft-attention", choices=tuple(DRAFT_ATTENTION), default=None,
                    help="a new drafter's attention over the context: a 256-token window "
                         "(sliding, the default) or all of it")
    ap.add_argument("--draft-target-layers", type=int, nargs="+", default=None,
                    metavar="I", help="with --fresh-draft: the target layers whose outputs "
                                      "the new drafter reads (default: 1 4, the shipped one's)")
    ap.add_argument("--windows", nargs="+", default=None, metavar="LENGTHxBATCH",
                    help="the drafter's training windows, taken in turn (e.g. 1024x16 "
                         "8192x2: long windows show it the target's features far into a "
                         "prompt); default: --length x --draft-batch")
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--draft-labels", choices=LABELS, default="data",
                    help="what the drafter learns to predict: the data's next tokens (the "
                         "DFlash recipe) or the target's greedy choices (distillation)")
    ap.add_argument("--anchor-spacing", type=int, default=None, metavar="N",
                    help="train one draft block per N tokens of each window (default: 32 "
                         "blocks a window, whatever its length)")
    ap.add_argument("--greedy-tail", type=int, default=None, metavar="N",
                    help="end every drafter window in N tokens of the target's own greedy "
                         "continuation (the plain engine's) and anchor blocks there alone")
    ap.add_argument("--sampled-context", type=int, default=None, metavar="M",
                    help="with --greedy-tail: draw the M tokens before the tail from the "
                         "target at temperature 1, so the tail continues text the target "
                         "never trained on, as it does after a held-out prompt")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget per model; training stops early when spent")
    ap.add_argument("--state-dir", default=None, metavar="DIR",
                    help="keep the drafter's training state (weights, AdamW moments, step) "
                         "here, saved every 500 steps and when the run stops; a run given "
                         "a DIR that holds one goes on from it, with the schedule and the "
                         "windows of an uninterrupted run (the settings must match: "
                         "DIR/run.json)")
    ap.add_argument("--run-steps", type=int, default=None, metavar="N",
                    help="with --state-dir: stop after N drafter steps in this run")
    args = ap.parse_args(argv)
    if args.fresh_draft and not args.from_default:
        raise SystemExit("--fresh-draft trains a new drafter for the shipped target: give "
                         "--from-default too")
    if args.draft_from is not None and (args.fresh_draft or not (args.from_default
                                                                  or args.target_from)):
        raise SystemExit("--draft-from continues a candidate drafter: give --from-default "
                         "(the shipped target) or --target-from DIR (its target), and not "
                         "--fresh-draft")
    if args.draft_steps < 0:
        raise SystemExit(f"--draft-steps {args.draft_steps}: give 0 (the target alone) or more")
    if args.draft_steps == 0 and (args.from_default or args.target_from or args.state_dir):
        raise SystemExit("--draft-steps 0 trains a new target alone: leave out --from-default, "
                         "--target-from and --state-dir")
    if trains_on(args) and (args.draft_layers, args.draft_attention) != (None, None):
        raise SystemExit("--draft-layers and --draft-attention shape a new drafter; a drafter "
                         "trained on keeps its own shape (its config.json): leave them out, "
                         "or give --fresh-draft for a new one")
    args.draft_layers = 2 if args.draft_layers is None else args.draft_layers
    args.draft_attention = args.draft_attention or "sliding"
    if args.draft_layers < 1:
        raise SystemExit(f"--draft-layers {args.draft_layers}: give at least 1")
    layer_ids = args.draft_target_layers
    if layer_ids is not None and not args.fresh_draft:
        raise SystemExit("--draft-target-layers shapes a new drafter: give --from-default "
                         "--fresh-draft too")
    if layer_ids is not None and len(set(layer_ids)) != len(layer_ids):
        raise SystemExit(f"--draft-target-layers {layer_ids}: each layer once")
    tcfg = target_config()
    try:  # the config checks the layers against the target's
        dcfg = draft_config(args.draft_layers, args.draft_attention,
                            *([tuple(layer_ids)] if layer_ids else []))
    except ValueError as e:
        raise SystemExit(f"--draft-target-layers {layer_ids}: {e}") from None
    if args.anchor_spacing is not None and args.anchor_spacing < 1:
        raise SystemExit(f"--anchor-spacing {args.anchor_spacing}: give at least 1 token")
    windows = parse_windows(args.windows or [f"{args.length}x{args.draft_batch}"])
    shortest = min(length for length, _ in windows)
    if args.greedy_tail is not None and not 2 <= args.greedy_tail < shortest:
        raise SystemExit(f"--greedy-tail {args.greedy_tail}: give at least 2 tokens and fewer "
                         f"than the shortest window's {shortest}")
    if args.sampled_context is not None:
        if args.greedy_tail is None:
            raise SystemExit("--sampled-context comes before a greedy tail: give "
                             "--greedy-tail too")
        if not 1 <= args.sampled_context < shortest - args.greedy_tail:
            raise SystemExit(f"--sampled-context {args.sampled_context}: give at least 1 "
                             f"token, and fewer than the shortest window's {shortest} less "
                             f"the tail's {args.greedy_tail}")
    out = Path(args.out)
    train_docs = load_split("train", args.stdlib)
    if args.extra_code:
        if missing := [d for d in args.extra_code if not Path(d).is_dir()]:
            raise SystemExit(f"--extra-code {' '.join(missing)}: no such directory")
        train_docs += load_code(args.extra_code, args.stdlib)
    corpus = {"files": len(train_docs), "bytes": int(sum(map(len, train_docs)))}
    print(f"train corpus: {corpus['files']} files, {corpus['bytes'] / 1e6:.1f}M bytes",
          flush=True)
    resume_from = resumable_run(args, windows, corpus)
    t0 = time.time()
    draft = init_draft(dcfg, jax.random.key(1))
    if args.from_default:
        from drafter.default import load_default
        params, tcfg, shipped_dcfg = load_default()
        target, t_losses = params["target"], []
        if not args.fresh_draft and args.draft_from is None:
            draft, dcfg = params["draft"], shipped_dcfg
    elif args.target_from:
        tcfg, target = load_qwen3(args.target_from)
        t_losses = []
    else:
        target, t_losses = train_target(tcfg, init_target(tcfg, jax.random.key(0)),
                                        batches(train_docs, args.batch, args.length, 0),
                                        steps=args.target_steps, lr=2e-3,
                                        time_budget_s=args.budget_s)
        print(f"target: {len(t_losses)} steps in {time.time() - t0:.0f}s, loss "
              f"{np.mean(t_losses[:20]):.3f} -> {np.mean(t_losses[-50:]):.3f}", flush=True)
    if args.draft_from is not None:
        dcfg, draft = load_dflash(args.draft_from, jnp.float32)
        if problems := pair_checks(tcfg, dcfg):
            which = "the shipped target" if args.from_default else args.target_from
            raise SystemExit(f"--draft-from {args.draft_from}: it does not fit {which}: "
                             f"{'; '.join(problems)}")
    d_losses = []
    if args.draft_steps:
        draft, d_losses = train_pair_drafter(args, target, tcfg, dcfg, draft, train_docs,
                                             windows, resume_from)
    bf16 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)
    if not args.from_default:
        save_qwen3(out / "target", tcfg, bf16(target))
    if args.draft_steps:
        save_dflash(out / "draft", dcfg, bf16(draft))
    (out / "losses.json").write_text(json.dumps({"target": t_losses, "draft": d_losses}))


if __name__ == "__main__":
    main()
