"""The HTTP server the test_http modules drive with the official `openai` client and raw
HTTP, one per test process (`server`, registered by tests/disagg/conftest.py).

The embedded pair, aggregated, on a free local port, with a small default max_tokens
(DEFAULT_MAX_TOKENS, as `serve --default-max-tokens` sets it); its ServingLoop runs on a
thread of the test process. Text goes through a byte-level tokenizer.json the fixture
writes (ids equal to the embedded byte tokenizer's) whose tokenizer_config.json carries a
small chat template. The engine's own greedy output for the test prompts and the
rendered chats is computed first (it is also the warm-up); another process's server
compiles nothing the first compiled (the suite's persistent compilation cache).
"""

import json
from pathlib import Path
import threading
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from disagg.frontend import load_pair, make_engine, warm_up  # noqa: E402
from disagg.http import CompletionsApp  # noqa: E402
from disagg.http_thread import HTTPServer  # noqa: E402
from disagg.loop import ServingLoop  # noqa: E402
from disagg.metrics import ServingMetrics  # noqa: E402
from drafter.corpus import BOS, EOS, ByteTokenizer  # noqa: E402
from drafter.tokenizer import load_tokenizer  # noqa: E402

PROMPTS = ["def add(a, b):\n    return", "import os\n\ndef main():\n", "class Point:\n    def",
           "for i in range(10):\n    "]
MAX_TOKENS = 16
DEFAULT_MAX_TOKENS = 24  # the module server's; above MAX_TOKENS, far below any room
CHAT_TEMPLATE = (
    "{% if messages[0].role == 'assistant' %}"
    "{{ raise_exception('a conversation opens with a system or user message') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
PENALTIES = dict(presence_penalty=1.2, frequency_penalty=0.6)
CHATS = {  # messages -> the prompt the template renders, spelled out by hand
    "add": ([{"role": "system", "content": "Write Python."},
             {"role": "user", "content": "def add(a, b):"}],
            "<system>Write Python.</system>\n<user>def add(a, b):</user>\n<assistant>"),
    "loop": ([{"role": "user", "content": "import os"},
              {"role": "assistant", "content": "def main():"},
              {"role": "user", "content": "for i in range(10):"}],
             "<user>import os</user>\n<assistant>def main():</assistant>\n"
             "<user>for i in range(10):</user>\n<assistant>"),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def chat_tokenizer(root: Path):
    """A byte-level tokenizer.json whose ids are the embedded byte tokenizer's (a byte's
    id is its value, <bos> and <eos> are BOS and EOS, <bos> opens an encoded text), and
    a tokenizer_config.json with CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = {c: b for b, c in bytes_to_unicode().items()} | {"<bos>": BOS, "<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", BOS)])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}))
    return root


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server a test process shares across the HTTP modules (tests/disagg/conftest.py
    registers it): its references take most of a minute to compute, and every test leaves
    it as it found it (no request running, nothing patched)."""
    pair = load_pair(num_slots=4)
    # batch-invariant: one shape a call kind, so concurrent clients compile nothing new
    # (the front end, not the rows, is the subject here)
    engine = make_engine("aggregated", pair, batch_invariant=True)
    tok = load_tokenizer(chat_tokenizer(tmp_path_factory.mktemp("chat")),
                         model_vocab_size=pair.step_config.target.vocab_size)
    assert [tok.encode(p) for p in PROMPTS] == [ByteTokenizer().encode(p) for p in PROMPTS]
    warm_up(engine, tok)
    chat_ids = {k: [BOS, *text.encode()] for k, (_, text) in CHATS.items()}
    greedy = engine.generate([tok.encode(p) for p in PROMPTS] + list(chat_ids.values()),
                             MAX_TOKENS)
    with_logprobs = engine.generate([tok.encode(PROMPTS[0]), chat_ids["add"]], MAX_TOKENS,
                                    logprobs=3)
    penalized = engine.generate([tok.encode(PROMPTS[0]), chat_ids["add"]], MAX_TOKENS,
                                **PENALTIES)
    prompt_logprobs = engine.generate([tok.encode(PROMPTS[0])], 1,
                                      prompt_logprobs=2)[0].prompt_logprobs
    metrics = ServingMetrics(pair.step_config.spec, pair.step_config.block_size)
    loop = ServingLoop(engine, tok, metrics)
    app = CompletionsApp(loop, metrics, pair.name, request_timeout_s=120,
                         default_max_tokens=DEFAULT_MAX_TOKENS)
    http = HTTPServer(app.app, "127.0.0.1", 0).start()
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    app.ready.set()
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", timeout=120,
                           max_retries=0)
    yield {"url": http.url, "client": client, "name": pair.name, "tok": tok,
           "greedy": {p: r.tokens for p, r in zip([*PROMPTS, *CHATS], greedy)},
           "chat_ids": chat_ids, "engine": engine, "block": pair.step_config.block_size,
           "app": app, "logprobs": {"prompt": with_logprobs[0], "chat": with_logprobs[1]},
           "penalized": {"prompt": penalized[0].tokens, "chat": penalized[1].tokens},
           "prompt_logprobs": prompt_logprobs}
    loop.close()
    thread.join(60)
    http.stop()
    assert not thread.is_alive(), "the serving loop did not stop after close()"


def post(url, body, timeout=120):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(url, timeout=30):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def assert_refused(url, body, param, words):
    """POSTing `body` to `url` gets a 400 invalid_request_error naming `param`, its message
    holding `words`."""
    status, text = post(url, body)
    err = json.loads(text)["error"]
    assert status == 400, (body, text)
    assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    assert words in err["message"], (body, err)
