"""The shipped default pair: it loads, it is lossless, and its drafter still drafts well."""

from pathlib import Path

import jax
import numpy as np
import pytest

from drafter.default import default_step_config, load_default, load_prompts
from drafter.engine import Engine
from drafter.make_default import draft_config, target_config


@pytest.fixture(scope="module")
def default_pair():
    return load_default()


def test_shipped_checkpoints_load_with_the_recipe_configs(default_pair):
    params, tcfg, dcfg = default_pair
    assert tcfg == target_config() and dcfg == draft_config()
    assert params["target"]["embed"].shape == (tcfg.vocab_size, tcfg.hidden_size)
    assert len(params["draft"]["layers"]) == dcfg.num_layers
    assert all(np.isfinite(np.asarray(x, np.float32)).all()
               for x in (params["target"]["embed"], params["draft"]["fc"]))


def test_speculative_equals_plain_on_shipped_prompts_and_acceptance_floor(default_pair):
    params, tcfg, dcfg = default_pair
    prompts = [p["tokens"] for p in load_prompts() if p["length"] == 128][:4]
    # batch-invariant: each kind of call has one shape (rows batched otherwise: test_lossless)
    engines = (Engine(params, default_step_config(tcfg, dcfg, num_slots=4), batch_invariant=True),
               Engine(params, default_step_config(tcfg, None, num_slots=4), speculative=False,
                      batch_invariant=True))
    speculative, plain = (e.generate(prompts, 32) for e in engines)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
    al = float(np.mean([a for r in speculative for a in r.acceptance]))
    # Measured 3.0 on these prompts (CPU, f32 params, fp8 target KV); a broken
    # drafter path (context, positions, masks) falls towards 1.
    assert al > 2.5, f"acceptance length {al:.2f} fell below the floor"
    # Penalized, with drafts accepted: a verify position counts the drafts before it.
    penalized_spec, penalized_plain = (e.generate(prompts, 32, presence_penalty=0.4,
                                                  frequency_penalty=0.3,
                                                  repetition_penalty=1.1) for e in engines)
    assert [r.tokens for r in penalized_spec] == [r.tokens for r in penalized_plain]
    assert [r.tokens for r in penalized_spec] != [r.tokens for r in speculative]
    al = float(np.mean([a for r in penalized_spec for a in r.acceptance]))
    assert al > 1.5, f"penalized acceptance length {al:.2f}: drafts were hardly accepted"


def small_stdlib(tmp_path, text: str, *, files: int) -> Path:
    """A small stand-in for the stdlib corpus (only training's window shapes matter)."""
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    for k in range(files):
        (stdlib / f"m{k}.py").write_text(text * (40 + k))
    return stdlib


def test_the_shipped_drafter_trains_on_in_turn_windows(tmp_path):
    """`make_default --from-default --windows` continues the shipped drafter on windows of
    each length in turn; `evaluate --draft` refuses a drafter of another target by name
    (it serves a fitting candidate: the next test)."""
    import json

    from drafter import evaluate, make_default

    stdlib = small_stdlib(tmp_path, "def f(x):\n    return x + 1\n", files=4)
    assert make_default.parse_windows(["64x2", "128X1"]) == [(64, 2), (128, 1)]
    with pytest.raises(SystemExit, match="LENGTHxBATCH"):
        make_default.parse_windows(["64"])
    out = tmp_path / "pair"
    make_default.main(["--out", str(out), "--from-default", "--windows", "64x2", "128x1",
                       "--draft-steps", "2", "--stdlib", str(stdlib)])
    assert len(json.loads((out / "losses.json").read_text())["draft"]) == 2
    copy_draft = Path(__file__).parent.parent / "fixtures" / "copy_pair" / "draft"
    with pytest.raises(SystemExit, match="does not fit the shipped target: drafter "
                                         "num_target_layers=2, target has 6 layers"):
        evaluate.main(["--draft", str(copy_draft), "--lengths", "128"])


def test_a_fresh_deeper_drafter_trains_for_the_shipped_target_and_evaluates(tmp_path):
    """`make_default --from-default --fresh-draft` trains a new drafter of the asked depth,
    attention and target layers for the shipped target (layers it does not have are
    refused by name); `evaluate --draft --compare-to shipped` measures that candidate
    (not the shipped drafter), losslessly, paired with the shipped drafter in one run."""
    import json

    from drafter import evaluate, make_default
    from drafter.checkpoint import load_dflash_config

    stdlib = small_stdlib(tmp_path, "for i in range(3):\n    print(i)\n", files=3)
    with pytest.raises(SystemExit, match="give --from-default too"):
        make_default.main(["--out", str(tmp_path / "x"), "--fresh-draft"])
    for layers, message in ((["1", "6"], r"target_layer_ids \[6\] outside the target's 6 "
                                         r"layers"),
                            (["2", "2"], "each layer once")):
        with pytest.raises(SystemExit, match=message):
            make_default.main(["--out", str(tmp_path / "x"), "--from-default",
                               "--fresh-draft", "--draft-target-layers", *layers])
    with pytest.raises(SystemExit, match="shapes a new drafter"):
        make_default.main(["--out", str(tmp_path / "x"), "--from-default",
                           "--draft-target-layers", "1", "3", "5"])
    out = tmp_path / "pair"
    make_default.main(["--out", str(out), "--from-default", "--fresh-draft", "--draft-layers",
                       "3", "--draft-attention", "full", "--draft-target-layers", "1", "3",
                       "5", "--windows", "64x2", "--draft-steps", "2", "--stdlib", str(stdlib)])
    dcfg = load_dflash_config(out / "draft")
    assert dcfg.num_layers == 3 and set(dcfg.layer_types) == {"full_attention"}
    assert dcfg.target_layer_ids == (1, 3, 5)
    report = tmp_path / "eval.json"
    evaluate.main(["--draft", str(out / "draft"), "--lengths", "128", "--max-new", "8",
                   "--context", "16", "--quick", "--compare-to", "shipped", "--json",
                   str(report)])
    row = json.loads(report.read_text())
    (mine,) = row["by_length"]
    assert row["draft"] == str(out / "draft") and mine["lossless"]
    # the shipped drafter, evaluated first in the same run, is the paired baseline: a
    # trained drafter, it accepts more than one trained for 2 steps
    compared = row["compared_to"]
    (base,), (paired,) = compared["baseline_by_length"], compared["by_length"]
    assert compared["draft"] == "shipped" and compared["file"] is None and base["lossless"]
    assert base["acceptance_length"] > mine["acceptance_length"]
    assert paired["difference"] == pytest.approx(
        mine["acceptance_length"] - base["acceptance_length"])


def test_a_drafter_run_stopped_and_resumed_equals_the_uninterrupted_run(tmp_path):
    """`make_default --state-dir DIR --run-steps N` stops after N drafter steps with its
    training state saved; the same command again goes on from there, with the schedule,
    keys and windows (two lengths in turn, stopped mid-turn, each ending in target draws
    and the target's greedy continuation) of an uninterrupted run:
    the drafter and loss curve are bit for bit the uninterrupted run's. Other settings
    or another corpus on the same directory are refused by name, before any training."""
    import json

    from drafter import make_default
    from drafter.checkpoint import load_dflash

    stdlib = small_stdlib(tmp_path, "def f(x):\n    return x + 1\n", files=3)
    args = ["--from-default", "--fresh-draft", "--draft-layers", "1", "--windows", "48x2",
            "32x2", "--anchor-spacing", "8", "--greedy-tail", "16", "--sampled-context", "6",
            "--draft-steps", "5", "--stdlib", str(stdlib)]
    whole, parts, state = tmp_path / "whole", tmp_path / "parts", tmp_path / "state"
    make_default.main(["--out", str(whole), *args])
    make_default.main(["--out", str(parts), *args, "--state-dir", str(state),
                       "--run-steps", "3"])
    assert make_default.saved_step(state) == 3
    make_default.main(["--out", str(parts), *args, "--state-dir", str(state)])
    (_, p_whole), (_, p_parts) = (load_dflash(d / "draft") for d in (whole, parts))
    for a, b in zip(jax.tree.leaves(p_whole), jax.tree.leaves(p_parts), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    curves = [json.loads((d / "losses.json").read_text())["draft"] for d in (whole, parts)]
    assert len(curves[0]) == 5 and curves[1] == curves[0]
    with pytest.raises(SystemExit, match="--anchor-spacing 0: give at least 1 token"):
        make_default.main(["--out", str(parts), *[a if a != "8" else "0" for a in args]])
    with pytest.raises(SystemExit, match="--greedy-tail 32: give at least 2 tokens and fewer "
                                         "than the shortest window's 32"):
        make_default.main(["--out", str(parts), *[a if a != "16" else "32" for a in args]])
    with pytest.raises(SystemExit, match="--sampled-context 16: give at least 1 token, and "
                                         "fewer than the shortest window's 32 less the tail's 16"):
        make_default.main(["--out", str(parts), *[a if a != "6" else "16" for a in args]])
    changed = [a if a != "5" else "6" for a in args]          # --draft-steps 6
    with pytest.raises(SystemExit, match="draft_steps was 5, now 6"):
        make_default.main(["--out", str(parts), *changed, "--state-dir", str(state)])
    (tmp_path / "other").mkdir()
    other = small_stdlib(tmp_path / "other", "x = 1\n", files=2)      # another machine's
    with pytest.raises(SystemExit, match="corpus was"):
        make_default.main(["--out", str(parts), *args[:-1], str(other), "--state-dir",
                           str(state)])
    with pytest.raises(SystemExit, match="give --state-dir too"):
        make_default.main(["--out", str(parts), *args, "--run-steps", "2"])
    with pytest.raises(SystemExit, match="give --from-default or --target-from"):
        make_default.main(["--out", str(parts), "--state-dir", str(tmp_path / "new")])


def test_a_candidate_drafter_trains_on_from_its_checkpoint(tmp_path):
    """`make_default --from-default --draft-from DIR` continues a candidate (an earlier
    run's DIR/draft) rather than the shipped drafter, and `--target-from T --draft-from
    DIR` continues it for the target in T; a drafter of another target is refused by
    name, and the flag needs a target (--from-default or --target-from) without
    --fresh-draft; a shape given for a drafter trained on is refused, not ignored."""
    from drafter import make_default
    from drafter.checkpoint import load_dflash

    stdlib = small_stdlib(tmp_path, "x = [1, 2, 3]\n", files=3)
    first = tmp_path / "first"
    make_default.main(["--out", str(first), "--from-default", "--fresh-draft",
                       "--draft-layers", "3", "--windows", "64x2", "--draft-steps", "1",
                       "--stdlib", str(stdlib)])
    again = tmp_path / "again"
    make_default.main(["--out", str(again), "--from-default", "--draft-from",
                       str(first / "draft"), "--windows", "64x2", "--draft-steps", "2",
                       "--stdlib", str(stdlib)])
    (dcfg0, p0), (dcfg1, p1) = (load_dflash(d / "draft") for d in (first, again))
    assert dcfg1.num_layers == dcfg0.num_layers == 3   # the candidate's shape, not shipped
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p0),
                                                         jax.tree.leaves(p1)))
    from drafter.default import load_default
    from models.checkpoint import save_qwen3
    params, tcfg, _ = load_default()
    shipped_target = tmp_path / "shipped_target"     # the shipped target as a checkpoint
    save_qwen3(shipped_target, tcfg, params["target"])
    onward = tmp_path / "onward"          # the same drafter, for a target given by path
    make_default.main(["--out", str(onward), "--target-from", str(shipped_target),
                       "--draft-from", str(again / "draft"), "--windows", "64x2",
                       "--draft-steps", "2", "--stdlib", str(stdlib)])
    dcfg2, p2 = load_dflash(onward / "draft")
    assert dcfg2 == dcfg1 and any(not np.array_equal(a, b) for a, b in
                                  zip(jax.tree.leaves(p1), jax.tree.leaves(p2)))
    for argv, message in ((["--draft-from", str(first / "draft")], "give --from-default"),
                          (["--from-default", "--fresh-draft", "--draft-from",
                            str(first / "draft")], "not --fresh-draft"),
                          (["--from-default", "--draft-from", str(first / "draft"),
                            "--draft-layers", "4"], "keeps its own shape"),
                          (["--from-default", "--draft-attention", "full"],
                           "keeps its own shape")):
        with pytest.raises(SystemExit, match=message):
            make_default.main(["--out", str(tmp_path / "x"), *argv])
    copy_draft = Path(__file__).parent.parent / "fixtures" / "copy_pair" / "draft"
    with pytest.raises(SystemExit, match="does not fit the shipped target"):
        make_default.main(["--out", str(tmp_path / "y"), "--from-default", "--draft-from",
                           str(copy_draft), "--stdlib", str(stdlib)])
    with pytest.raises(SystemExit, match=f"does not fit {shipped_target}"):
        make_default.main(["--out", str(tmp_path / "y"), "--target-from", str(shipped_target),
                           "--draft-from", str(copy_draft), "--stdlib", str(stdlib)])


def test_extra_code_leaves_out_copies_of_held_out_stdlib_files(tmp_path):
    """`load_code` reads every .py under its roots but a held-out stdlib file's copy,
    whether by its text under another name or by its name with other text."""
    from drafter.corpus import is_held_out, load_code

    stdlib = small_stdlib(tmp_path, "x = 1\n", files=60)
    held = next(p for p in sorted(stdlib.glob("*.py")) if is_held_out(p, stdlib))
    extra = tmp_path / "site" / "pkg"
    extra.mkdir(parents=True)
    (extra / "copy.py").write_bytes(held.read_bytes())
    (extra / held.name).write_text("y = 2\n")
    (extra / "other.py").write_text("z = 3\n")
    (extra / "notes.txt").write_text("not code\n")
    (doc,) = load_code([tmp_path / "site"], str(stdlib))
    assert bytes(doc[1:-1].astype(np.uint8)) == b"z = 3\n"


def test_a_new_pair_trains_on_extra_code_and_evaluates_beside_the_shipped_one(tmp_path):
    """`make_default --extra-code DIR` trains a target and drafter on the stdlib and DIR's
    code; `evaluate --target --draft --compare-to shipped` measures that pair, against its
    own target's plain decodes (lossless), paired with the shipped pair in one run."""
    import json

    from drafter import evaluate, make_default

    stdlib = small_stdlib(tmp_path, "def g(a):\n    return a * 2\n", files=3)
    extra = tmp_path / "site"
    extra.mkdir()
    (extra / "mod.py").write_text("import os\nprint(os.sep)\n" * 50)
    common = ["--stdlib", str(stdlib), "--batch", "2", "--length", "64", "--draft-batch", "2",
              "--target-steps", "2", "--draft-steps", "2"]
    with pytest.raises(SystemExit, match="--extra-code .*nowhere: no such directory"):
        make_default.main(["--out", str(tmp_path / "x"), *common, "--extra-code",
                           str(tmp_path / "nowhere")])
    out = tmp_path / "pair"
    make_default.main(["--out", str(out), *common, "--extra-code", str(extra)])
    alone = tmp_path / "target_alone"                 # --draft-steps 0: the target alone
    make_default.main(["--out", str(alone), *common[:-1], "0", "--extra-code", str(extra)])
    assert not (alone / "draft").exists()
    assert json.loads((alone / "losses.json").read_text()) == {
        "target": json.loads((out / "losses.json").read_text())["target"], "draft": []}
    for flags in (["--from-default"], ["--target-from", str(alone / "target")]):
        with pytest.raises(SystemExit, match="--draft-steps 0 trains a new target alone"):
            make_default.main(["--out", str(alone), *common[:-1], "0", *flags])
    with pytest.raises(SystemExit, match="give its drafter with --draft DIR too"):
        evaluate.main(["--target", str(out / "target")])
    report = tmp_path / "eval.json"
    evaluate.main(["--target", str(out / "target"), "--draft", str(out / "draft"),
                   "--lengths", "128", "--max-new", "8", "--context", "16", "--quick",
                   "--compare-to", "shipped", "--json", str(report)])
    row = json.loads(report.read_text())
    (mine,) = row["by_length"]
    assert row["target"] == str(out / "target") and mine["lossless"]
    compared = row["compared_to"]
    (base,) = compared["baseline_by_length"]
    assert compared["draft"] == "shipped" and base["lossless"]
    assert base["acceptance_length"] > mine["acceptance_length"]
