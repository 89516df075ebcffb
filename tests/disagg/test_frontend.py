"""Text in and out (checkpoint tokenizers, the text stream, the shared schema), and
`serve --http` as a user runs it: a pair by path, the ready line, --default-max-tokens,
Ctrl-C, and the persistent compilation cache reused by a fresh process."""

import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest

from disagg.__main__ import build_parser
from disagg.processes import REPO_ROOT, child_env
from disagg.schema import DEFAULT_MAX_TOKENS, parse_completion, parse_line
from disagg.textstream import TextStream
from drafter.corpus import ByteTokenizer
from drafter.request import Request, RequestError
from drafter.tokenizer import TokenizerError, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")

COPY_PAIR = Path(__file__).parent.parent / "fixtures" / "copy_pair"
TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld ✓ — naïve café",
         "  spaces\tand\ttabs  ", "日本語のテキスト", "a"]


def byte_level_tokenizer(out_dir: Path, eos=None) -> Path:
    """A small byte-level BPE tokenizer.json (the kind Qwen ships), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20 + ["def main():\n    pass\n"] * 20, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    if eos is not None:
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out_dir


def test_checkpoint_tokenizer_round_trip_and_eos(tmp_path):
    root = byte_level_tokenizer(tmp_path / "ckpt", eos=[0, 5])
    tok = load_tokenizer(root)
    assert tok.eos_token_ids == (0, 5)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids and all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges were learned
    with pytest.raises(TokenizerError, match="vocab_size"):
        load_tokenizer(root, model_vocab_size=tok.vocab_size - 1)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (root / "generation_config.json").unlink()
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert load_tokenizer(root).eos_token_ids == (0,)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_each_tokens_bytes_spell_the_text_characters_split_or_not(tmp_path, kind):
    """`token_bytes` (chat logprobs' "bytes"): a token that holds part of a character gives
    that part, so the tokens' bytes, joined, are the text's UTF-8 (decoded alone, such a
    token reads U+FFFD)."""
    tok = ByteTokenizer() if kind == "bytes" else load_tokenizer(byte_level_tokenizer(tmp_path))
    for text in TEXTS:
        ids = tok.encode(text)[1:] if kind == "bytes" else tok.encode(text)
        assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    split = [t for t in tok.encode("日本語") if "\ufffd" in tok.decode([t])]
    assert split and all(tok.token_bytes(t) and b"\xef\xbf\xbd" not in tok.token_bytes(t)
                         for t in split)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_text_stream_releases_final_text_only(tmp_path, kind):
    tok = ByteTokenizer() if kind == "bytes" else load_tokenizer(byte_level_tokenizer(tmp_path))
    text = "naïve café ✓ done"
    ids = tok.encode(text)[1:] if kind == "bytes" else tok.encode(text)
    stream, pieces = TextStream(tok), []
    for t in ids:
        piece = stream.feed([t])
        assert "\ufffd" not in piece  # half a character is held back
        pieces.append(piece)
        assert text.startswith("".join(pieces))
    pieces.append(stream.finish())
    assert "".join(pieces) == text
    # A stop string that straddles feeds; the text ends before it, the tokens with it.
    stream = TextStream(tok, stop=("é ✓", "zzz"))
    got = "".join(stream.feed(ids[i:i + 3]) for i in range(0, len(ids), 3))
    assert stream.stopped and got == "naïve caf"
    assert tok.decode(stream.tokens).endswith("é ✓")
    assert not tok.decode(stream.tokens[:-1]).endswith("é ✓")
    assert stream.finish() == ""


@pytest.mark.parametrize("feed", [1, 3, 100])
def test_stop_strings_count_only_after_min_tokens(feed):
    """With min_tokens, a stop string within the first min_tokens tokens' text does not
    end the request; one that ends past it does, straddling included, however the
    tokens are fed."""
    tok = ByteTokenizer()
    text = "ab,cd,ef,gh"
    ids = tok.encode(text)[1:]

    def run(min_tokens, stop=(",",)):
        stream = TextStream(tok, stop=stop, min_tokens=min_tokens)
        got = "".join(stream.feed(ids[i:i + feed]) for i in range(0, len(ids), feed))
        return got + stream.finish(), len(stream.tokens)
    assert run(0) == ("ab", 3)
    assert run(3) == ("ab,cd", 6)      # the first "," is token 3: within min_tokens
    assert run(5) == ("ab,cd", 6)
    assert run(6) == ("ab,cd,ef", 9)   # the second "," is token 6: within
    assert run(11) == (text, 11)
    assert run(5, stop=("d,e",)) == ("ab,c", 7)   # "d,e" ends past token 5's text
    assert run(6, stop=("d,e",)) == ("ab,c", 7)
    assert run(7, stop=("d,e",)) == (text, 11)     # it ends within token 7's text
    stream = TextStream(tok, stop=("d,e", ","), include_stop=True)
    got = "".join(stream.feed(ids[i:i + feed]) for i in range(0, len(ids), feed))
    assert got + stream.finish() == "ab," and stream.stopped   # the stop string kept


class _Engine:
    # the schema's room check reads these: a request takes its prompt and its new tokens
    spec = types.SimpleNamespace(max_seq_len=264)
    scheduler = types.SimpleNamespace(
        reserved_len=lambda request: len(request.prompt) + request.params.max_new_tokens)

    def make_request(self, rid, prompt, params):
        return Request.make(rid, prompt, params, vocab_size=264, reserved_ids=(258,))


def test_json_lines_share_the_schema_stop_strings_included():
    req, stop = parse_line({"id": 7, "prompt": "x", "stop": "\n\n", "max_new_tokens": 3}, 1,
                           _Engine(), ByteTokenizer())
    assert (req.request_id, stop, req.params.max_new_tokens) == ("7", ("\n\n",), 3)
    req, _ = parse_line({"tokens": [5, 6, 7, 8], "truncate_prompt_tokens": 2}, 1, _Engine(),
                        ByteTokenizer())
    assert req.prompt == (7, 8)
    with pytest.raises(RequestError, match="truncate_prompt_tokens") as e:
        parse_line({"tokens": [5], "truncate_prompt_tokens": True}, 1, _Engine(),
                   ByteTokenizer())
    assert e.value.field == "truncate_prompt_tokens"
    with pytest.raises(RequestError, match="stop") as e:
        parse_line({"prompt": "x", "stop": [3]}, 2, _Engine(), ByteTokenizer())
    assert e.value.field == "stop"
    with pytest.raises(RequestError) as e:
        parse_line({"prompt": "x", "temperature": "hot"}, 3, _Engine(), ByteTokenizer())
    assert e.value.field == "temperature"
    req, _ = parse_line({"prompt": "x", "temperature": 0.7, "top_p": 0.9, "top_k": 40,
                         "min_p": 0.05}, 4, _Engine(), ByteTokenizer())
    assert (req.params.top_p, req.params.top_k, req.params.min_p) == (0.9, 40, 0.05)
    req, _ = parse_line({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1,
                         "repetition_penalty": 1.2}, 4, _Engine(), ByteTokenizer())
    assert (req.params.presence_penalty, req.params.frequency_penalty,
            req.params.repetition_penalty) == (0.5, -1, 1.2)
    req, _ = parse_line({"prompt": "x", "logit_bias": {"7": -100, "12": 2.5}}, 4, _Engine(),
                        ByteTokenizer())
    assert req.params.logit_bias == ((7, -100), (12, 2.5))
    req, _ = parse_line({"prompt": "x", "top_p": None, "top_k": None}, 5, _Engine(),
                        ByteTokenizer())   # null: the default, as in OpenAI's API
    assert (req.params.top_p, req.params.top_k, req.params.min_p) == (1.0, 0, 0.0)
    with pytest.raises(RequestError) as e:
        parse_line({"prompt": "x", "top_k": True}, 6, _Engine(), ByteTokenizer())
    assert e.value.field == "top_k"


def test_an_empty_stop_list_is_none_and_unseeded_samples_differ():
    """"stop": [] means no stop strings (OpenAI's and vLLM's reading); without a seed
    (absent or null) every request and choice draws its own random seed, as OpenAI's
    API does, while a seed given repeats: seed, seed + 1, ... for n choices."""
    engine, tok = _Engine(), ByteTokenizer()
    req, stop = parse_line({"prompt": "x", "stop": []}, 1, engine, tok)
    assert stop == ()
    [(_, stop)] = parse_completion({"prompt": "x", "stop": [], "max_tokens": 2}, "c", engine,
                                   tok)
    assert stop == ()
    seeds = {parse_line({"prompt": "x", "temperature": 1.0, **seed}, 1, engine, tok)[0]
             .params.seed for seed in ({}, {"seed": None}, {}, {})}
    assert len(seeds) == 4   # four draws of 2**32 seeds: alike with odds of about 1e-9
    unseeded = parse_completion({"prompt": "x", "max_tokens": 2, "n": 3}, "c", engine, tok)
    assert len({req.params.seed for req, _ in unseeded}) == 3
    seeded = parse_completion({"prompt": "x", "max_tokens": 2, "n": 3, "seed": 2**32 - 1},
                              "c", engine, tok)
    assert [req.params.seed for req, _ in seeded] == [2**32 - 1, 0, 1]
    again = parse_completion({"prompt": "x", "max_tokens": 2, "n": 3, "seed": 2**32 - 1},
                             "c", engine, tok)
    assert [r.params.seed for r, _ in again] == [r.params.seed for r, _ in seeded]


def copy_pair_with_text(root: Path) -> Path:
    """The tiny copy pair by path, with a word-level tokenizer.json over its 32 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    shutil.copytree(COPY_PAIR, root)
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz.,!?")}
    vocab["[UNK]"] = 30  # 31 is the drafter's mask token: no text maps to it
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "target" / "tokenizer.json"))
    return root


def read_line_with(proc, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([proc.stdout], [], [], left)[0]:
            break
        line = proc.stdout.readline()
        if not line:
            break
        if re.search(pattern, line):
            return line
    proc.kill()
    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f}s:\n"
                         f"{proc.stderr.read()[-3000:]}")


def serve_once(pair: Path, cache: Path) -> tuple[dict, dict, str, str]:
    """One `serve --http --default-max-tokens 5` process: ready line, a completion with
    max_tokens and one without, SIGINT."""
    env = {**child_env(1), "JAX_COMPILATION_CACHE_DIR": str(cache)}
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)  # the CLI caches everything
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg", "serve", "--http", "127.0.0.1:0", "--draft-kv",
         "aggregated", "--target", str(pair / "target"), "--drafter", str(pair / "draft"),
         "--max-seq-len", "128", "--num-slots", "2", "--default-max-tokens", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    try:
        ready = read_line_with(proc, r"^ready: ", 300)
        url = re.search(r"(http://\S+)/v1", ready).group(1)
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            assert json.loads(r.read())["status"] == "ready"
        answers = []
        for limit in ({"max_tokens": 8}, {"ignore_eos": True}):  # the second: the default
            body = json.dumps({"model": "target", "prompt": "a b c d a b c d a b c",
                               "temperature": 0, **limit}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answers.append(json.loads(r.read()))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return *answers, ready, err


@pytest.mark.timeout(600)
def test_serve_http_by_path_ready_line_ctrl_c_and_compile_cache(tmp_path):
    pair = copy_pair_with_text(tmp_path / "pair")
    cache = tmp_path / "jax-cache"
    first, defaulted, ready1, err1 = serve_once(pair, cache)
    choice = first["choices"][0]
    assert first["usage"]["prompt_tokens"] == 11  # one id per word
    assert len(choice["token_ids"]) == first["usage"]["completion_tokens"] == 8
    assert defaulted["usage"]["completion_tokens"] == 5  # --default-max-tokens
    assert defaulted["choices"][0]["finish_reason"] == "length"
    assert choice["text"] == " ".join("abcdefghijklmnopqrstuvwxyz.,!?"[i]
                                      for i in choice["token_ids"])
    compiled = int(re.search(r"stopped; (\d+) programs compiled", err1).group(1))
    assert compiled > 0 and os.listdir(cache)
    second, _, ready2, err2 = serve_once(pair, cache)
    assert second["choices"][0]["token_ids"] == choice["token_ids"]
    # a fresh process compiles nothing the first one compiled: all of it is read back
    assert re.search(r"stopped; 0 programs compiled, [1-9]\d* read from", err2), err2[-2000:]


def test_serve_flags_take_only_sensible_numbers():
    parse = build_parser().parse_args
    assert parse(["serve", "--http", "127.0.0.1:0"]).default_max_tokens == DEFAULT_MAX_TOKENS
    assert parse(["serve", "--default-max-tokens", "512"]).default_max_tokens == 512
    for bad in ("0", "-3", "2.5", "many"):
        with pytest.raises(SystemExit):
            parse(["serve", "--default-max-tokens", bad])
    assert parse(["serve", "--request-timeout", "2.5"]).request_timeout == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parse(["serve", "--request-timeout", bad])
        for flag in ("--timeout", "--idle-timeout"):   # serve-remote's, the same rule
            with pytest.raises(SystemExit):
                parse(["serve-remote", "--role", "context", flag, bad])
    assert parse(["serve-remote", "--role", "context", "--timeout", "2"]).timeout == 2.0


def test_serve_and_demo_refuse_bad_inputs_before_loading_or_compiling(tmp_path):
    """A requests file that is not there, a file beside --http (which would ignore it)
    and a --json path into no directory are refused at once, not after the load and
    the compiles (or, for --json, the whole demo)."""
    from disagg.__main__ import main
    with pytest.raises(SystemExit, match="no readable file there"):
        main(["serve", str(tmp_path / "missing.jsonl"), "--no-compile-cache"])
    requests = tmp_path / "requests.jsonl"
    requests.write_text("")
    with pytest.raises(SystemExit, match="or --http, not both"):
        main(["serve", str(requests), "--http", "127.0.0.1:0", "--no-compile-cache"])
    with pytest.raises(SystemExit, match="its directory does not exist"):
        main(["demo", "--json", str(tmp_path / "no" / "report.json"), "--no-compile-cache"])


def test_a_max_seq_len_that_holds_no_request_is_refused_before_compiling(tmp_path):
    from disagg.frontend import load_pair, make_engine, warm_up
    root = copy_pair_with_text(tmp_path / "pair")
    pair = load_pair(str(root / "target"), str(root / "draft"), num_slots=2, max_seq_len=8,
                     kv_memory_mib=16)
    engine = make_engine("aggregated", pair)
    with pytest.raises(SystemExit, match=r"--max-seq-len \d+ holds no request: .* give "
                                         r"--max-seq-len (\d+) or more") as e:
        warm_up(engine, pair.tokenizer)
    need = int(re.search(r"give --max-seq-len (\d+)", str(e.value)).group(1))
    assert need > 8
    fits = load_pair(str(root / "target"), str(root / "draft"), num_slots=2,
                     max_seq_len=need, kv_memory_mib=16)
    engine = make_engine("aggregated", fits)
    assert warm_up(engine, fits.tokenizer) > 0   # the minimum it names serves


def test_a_missing_http_package_is_named_with_its_install_command(monkeypatch):
    from disagg.http_thread import require_http
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    with pytest.raises(ImportError, match="serve --http needs uvicorn: pip install uvicorn"):
        require_http()


def test_layer_loop_flag_reaches_the_served_steps():
    from disagg.frontend import load_pair
    args = build_parser().parse_args(["serve", "--layer-loop", "unrolled"])
    assert args.layer_loop == "unrolled"
    pair = load_pair(layer_loop=args.layer_loop)
    assert pair.step_config.layer_loop == "unrolled" and not pair.step_config.scans_layers
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--layer-loop", "loop"])


def test_serve_warmup_all_warms_every_length_greedy_and_sampled():
    """`serve --warmup all` makes warm_up run Engine.warmup(sampled=True, logprobs=True,
    adjusted=True) after the first-request compiles, a burst of each row count a prefill
    call pads to (what Engine.warmup compiles: tests/drafter/test_engine.py::
    test_a_warmed_up_engine_compiles_no_step_for_prompts_in_its_range)."""
    import types

    from disagg.frontend import warm_up
    assert build_parser().parse_args(["serve", "--warmup", "all"]).warmup == "all"
    assert build_parser().parse_args(["serve"]).warmup == "first"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--warmup", "some"])
    calls = []
    engine = types.SimpleNamespace(
        spec=types.SimpleNamespace(max_seq_len=9216),
        scheduler=types.SimpleNamespace(max_prefill_rows=8, reserved_len=lambda request: 40),
        make_request=lambda request_id, prompt, params: None,
        generate=lambda prompts, n, **kw: calls.append(("generate", len(prompts))),
        warmup=lambda **kw: calls.append(("warmup", kw)))
    said = []
    warm_up(engine, ByteTokenizer(), said.append, every_length=True)
    bursts = [("generate", n) for n in (1, 2, 4, 8)]
    assert calls == bursts + [("warmup", {"sampled": True, "logprobs": True,
                                          "adjusted": True})]
    assert any("every step for rows of up to 9,216 tokens" in s for s in said)
    calls.clear()
    warm_up(engine, ByteTokenizer(), said.append)
    assert calls == bursts


def test_max_num_batched_tokens_reaches_every_engine_and_batches_more_prefill():
    """`serve --max-num-batched-tokens N`: the per-step budget of the generation engine
    and of its context worker; a larger one puts more prompts' chunks into a step; one
    below a prefill chunk is refused with the smallest value that works."""
    from disagg.frontend import load_pair, make_engine
    from drafter.request import Request, SamplingParams
    from drafter.scheduler import Scheduler, Sequence
    assert build_parser().parse_args(["serve"]).max_num_batched_tokens is None
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "2048"])
    pair = load_pair(num_slots=4)
    chunk = pair.step_config.spec.max_step_tokens
    for mode in ("aggregated", "shared"):
        engine = make_engine(mode, pair, max_num_batched_tokens=args.max_num_batched_tokens)
        budgets = [engine.scheduler.budget] + [c.engine.scheduler.budget for c in
                                               getattr(engine.kv_source, "contexts", [])]
        assert budgets == [2048] * (1 if mode == "aggregated" else 2), (mode, budgets)
        if engine.kv_source is not None:
            engine.kv_source.close()
    for mode in ("aggregated", "shared"):   # the context worker's engine refuses it too
        with pytest.raises(ValueError, match=f"--max-num-batched-tokens\\) {chunk - 1} is "
                                             f"below one prefill chunk .*give at least {chunk}"):
            make_engine(mode, pair, max_num_batched_tokens=chunk - 1)

    def chunks_in_first_step(budget):
        sched = Scheduler(pair.step_config.spec, pair.step_config.block_size,
                          max_num_batched_tokens=budget)
        for i in range(4):
            sched.add(Sequence(Request.make(f"r{i}", [1] * (2 * chunk),
                                            SamplingParams(max_new_tokens=4),
                                            vocab_size=pair.step_config.target.vocab_size), 0.0))
        return len(sched.schedule().prefill)
    assert chunks_in_first_step(2 * chunk) == 2 and chunks_in_first_step(4 * chunk) == 4


def _rewrite_json(path: Path, change) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


def _int_weights(d: Path) -> None:
    from safetensors.numpy import load_file, save_file
    tensors = load_file(d / "target" / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key] = (tensors[key] * 100).astype("int8")
    save_file(tensors, d / "target" / "model.safetensors")
    (d / "target" / "manifest.json").unlink()


def _set_dflash(key, value):
    return lambda c: c.setdefault("dflash_config", {}).__setitem__(key, value)


# (damage to a copy of the fixture pair, words the refusal must carry): each loaded silently
# and served wrong tokens, or died with a raw traceback
DAMAGED_PAIRS = [
    (lambda d: _rewrite_json(d / "draft" / "config.json", _set_dflash("mask_token_id", 100)),
     "does not fit --target"),
    (lambda d: _rewrite_json(d / "draft" / "config.json", lambda c: (
        c.__setitem__("num_target_layers", 6), _set_dflash("target_layer_ids", [0, 5])(c))),
     "reach past the target's 2 layers"),
    (lambda d: _rewrite_json(d / "target" / "config.json",
                             lambda c: c.__setitem__("rms_norm_eps", -1.0)),
     "rms_norm_eps=-1.0 must be > 0"),
    (lambda d: _rewrite_json(d / "target" / "config.json", lambda c: c.__setitem__(
        "rope_scaling", {"rope_type": "yarn", "factor": 2.0, "beta_fast": "abc"})),
     "beta_fast='abc' must be a finite number"),
    (lambda d: _rewrite_json(d / "target" / "manifest.json", lambda m: m["arrays"].__setitem__(
        "model.norm.weight", "x")), "'model.norm.weight' is malformed"),
    (_int_weights, "is int8; weights must be floating point"),
    (lambda d: _rewrite_json(d / "target" / "config.json",
                             lambda c: c.__setitem__("hidden_size", 0)),
     "hidden_size=0 must be >= 1"),
]


@pytest.mark.parametrize("damage, words", DAMAGED_PAIRS)
def test_a_damaged_or_mismatched_pair_is_refused_in_one_line(tmp_path, damage, words):
    from disagg.frontend import load_pair
    pair = tmp_path / "pair"
    shutil.copytree(Path(__file__).parent.parent / "fixtures" / "copy_pair", pair)
    damage(pair)
    with pytest.raises(SystemExit, match=re.escape(words)):
        load_pair(str(pair / "target"), str(pair / "draft"), num_slots=2, max_seq_len=64,
                  kv_memory_mib=16)


def test_a_served_pair_holds_its_weights_once_in_the_checkpoints_dtype(tmp_path, monkeypatch):
    """`load_pair` puts a checkpoint's weights on the device once, in the step form
    (stacked and fused on the host), and every engine made from the pair reads those
    arrays: a disaggregated pair on one device holds one copy, not one per worker
    beside the checkpoint's; on several devices each worker's mesh holds one.
    `--dtype auto` keeps the stored dtype (bf16 stays bf16, f32 stays f32); an explicit
    dtype converts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from disagg import frontend
    from disagg.frontend import load_pair, make_engine
    from disagg.handshake import Weights
    from drafter.checkpoint import load_dflash, save_dflash
    from models.checkpoint import load_qwen3, save_qwen3
    root = copy_pair_with_text(tmp_path / "pair")
    load = functools.partial(load_pair, str(root / "target"), str(root / "draft"),
                             num_slots=2, max_seq_len=64, kv_memory_mib=16)
    # several devices (this suite's 4 host devices: a mesh per worker): the step form
    # stays on the host, and each worker holds one replica, on its own mesh
    meshes = frontend.split_meshes()
    assert meshes[0] is not None
    pair = load()
    layers = pair.params["target"]["layers"]       # the step form: stacked (CPU), fused
    assert isinstance(layers, dict) and "qkv" in layers and "q" not in layers
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(pair.params))
    engine = make_engine("shared", pair)
    for worker, mesh in ((engine, meshes[1]), (engine.kv_source.contexts[0].engine, meshes[0])):
        assert {x.sharding.mesh for x in jax.tree.leaves(worker.executor.params)} == {mesh}
    monkeypatch.setattr(frontend, "split_meshes", lambda: (None, None))   # one device
    pair = load()
    leaves = jax.tree.leaves(pair.params)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in leaves)
    for mode in ("aggregated", "shared"):
        engine = make_engine(mode, pair)
        workers = [engine] + [c.engine for c in getattr(engine.kv_source, "contexts", ())]
        for worker in workers:
            held = jax.tree.leaves(worker.executor.params)
            assert len(held) == len(leaves) and all(a is b for a, b in zip(held, leaves))
    tcfg, target = load_qwen3(root / "target")
    dcfg, draft = load_dflash(root / "draft")
    # a peer's fingerprint of the checkpoint equals the served step form's, given its config
    assert (Weights.of(pair.params, pair.step_config)
            == Weights.of({"target": target, "draft": draft}))
    with pytest.raises(ValueError, match="fused projections .* give their StepConfig"):
        Weights.of(pair.params)
    half = tmp_path / "bf16"                       # the same pair stored in bf16
    shutil.copytree(root, half)
    to_bf16 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.bfloat16))
    save_qwen3(half / "target", tcfg, to_bf16(target))
    save_dflash(half / "draft", dcfg, to_bf16(draft))
    for dtype, want in (("auto", jnp.bfloat16), ("float32", jnp.float32)):
        got = load_pair(str(half / "target"), str(half / "draft"), num_slots=2,
                        max_seq_len=64, kv_memory_mib=16, dtype=dtype)
        assert {x.dtype for x in jax.tree.leaves(got.params)} == {jnp.dtype(want)}, dtype
    assert build_parser().parse_args(["serve", "--dtype", "bfloat16"]).dtype == "bfloat16"
