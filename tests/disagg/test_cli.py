"""The main job's CLI runs end to end (small) and its serving mode answers requests."""

import io
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg.__main__ import main
from disagg.processes import child_env


def test_demo_writes_the_table_and_explains_it(tmp_path, capsys):
    out = tmp_path / "demo.json"
    main(["demo", "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "2",
          "--max-prompt-len", "128", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["aggregated", "disagg-shared",
                                                  "disagg-private"]
    assert report["shared_equals_aggregated"] and report["private_output_unchanged"]
    assert report["rows"][1]["bytes_transferred"] > report["rows"][2]["bytes_transferred"] > 0
    for row in report["rows"]:  # the keys scripts read, then the new ones
        assert {"mode", "requests", "acceptance_length", "tokens_per_s", "ttft_ms",
                "bytes_transferred", "tokens", "tokens_per_s_runs", "tokens_per_s_min",
                "tokens_per_s_max"} <= set(row)
        assert len(row["tokens_per_s_runs"]) == 2
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
    assert [b["prompt_tokens"] for b in report["by_prompt_length"]] == [128]
    for b in report["by_prompt_length"]:
        assert b["al_shared"] == b["al_aggregated"]
        assert b["private_loss"] == pytest.approx(b["al_shared"] - b["al_private"])
    assert report["best_acceptance_length"] == 8
    assert "512, 2048, 8192" in report["prompts_left_out"]
    assert "--max-prompt-len" in report["prompts_left_out"]
    text = capsys.readouterr().out
    assert "disagg-shared" in text and "AL per prompt length" in text
    assert "AL (acceptance length): tokens a request keeps per decode step" in text
    assert "best = 8" in text and "higher is better" in text
    assert "python -m drafter.evaluate` measures that over 16 held-out prompts" in text
    assert "tok/s: generated tokens per wall-clock second" in text
    assert report["host"]["cpu"] and report["host"]["launch_us"] > 0
    assert "CPU: attention runs in Pallas interpret mode" in text
    assert "programs compiled" in text


def test_the_demo_says_on_a_gpu_that_its_tok_s_follows_the_host():
    from disagg.demo import explanation
    host = {"cpu": "Some CPU", "launch_us": 41.7}
    gpu = explanation(8, on_cpu=False, limit_note=None, host=host)
    assert any("42 us to launch here (Some CPU)" in line and "follows the host" in line
               for line in gpu)
    cpu = explanation(8, on_cpu=True, limit_note=None, host=host)
    assert not any("follows the host" in line for line in cpu)


BAD_LINES = [
    (b"not json", "not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"id": "n", "prompt": "x", "max_new_tokens": null}', "max_new_tokens"),
    (b'{"id": "s", "prompt": "x", "max_new_tokens": "3"}', "max_new_tokens"),
    (b'{"id": "f", "prompt": "x", "max_new_tokens": 2.9}', "max_new_tokens"),
    (b'{"id": "b", "prompt": "x", "max_new_tokens": true}', "max_new_tokens"),
    (b'{"id": "i", "prompt": 7}', "must be a string"),
    (b'{"id": "t", "tokens": [[1, 2]]}', "non-integer"),
    (b'{"id": "e", "prompt": ""}', "empty prompt"),
    (b'{"id": "z", "tokens": []}', "empty prompt"),
    (b'{"id": "u", "prompt": "x", "colour": "red"}', "unknown fields"),
    (b'{"id": "m", "tokens": [1, 258]}', "reserved"),
]


class Stdin:
    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)


def test_serve_batches_the_stream_and_answers_every_line_once(monkeypatch, capsys):
    good = [{"id": f"g{i}", "prompt": f"def f{i}(a, b):\n    return", "max_new_tokens": 6}
            for i in range(5)]
    lines = [json.dumps(g).encode() for g in good[:3]] + [l for l, _ in BAD_LINES] + \
        [json.dumps(g).encode() for g in good[3:]] + [b'{"prompt": "no id", "max_new_tokens": 2}']
    monkeypatch.setattr(sys, "stdin", Stdin(b"\n".join(lines) + b"\n"))
    main(["serve", "--draft-kv", "shared"])
    captured = capsys.readouterr()
    # the default 1 GiB holds every slot's request of max_seq_len
    assert re.search(r"weights \d+\.\d\d GiB; KV cache \d+\.\d\d GiB holds 4 request\(s\) of "
                     r"9,216 tokens at once \(4 slots; slots limit it", captured.err)
    out = [json.loads(l) for l in captured.out.strip().splitlines() if l.startswith("{")]
    by_id = {o["id"]: o for o in out}
    assert len(out) == len(lines) == len(by_id)  # one answer per line, none lost
    for g in good:
        assert by_id[g["id"]]["finish_reason"] == "length" and by_id[g["id"]]["text"]
    assert len(by_id[f"line-{len(lines)}"]["tokens"]) == 2
    errors = [o for o in out if "error" in o]
    assert len(errors) == len(BAD_LINES)
    for line_no, (raw, match) in enumerate(BAD_LINES, 4):
        rid = json.loads(raw)["id"] if raw.startswith(b'{"id"') else f"line-{line_no}"
        assert match in by_id[rid]["error"], (rid, by_id[rid])


@pytest.mark.timeout(300)
def test_serve_drains_on_sigterm_and_exits_cleanly(tmp_path):
    """SIGTERM: the lines already read are answered, then serve exits 0."""
    # The parent's 4 host devices: same XLA flags and meshes as the demo test's aggregated
    # engine, so the child's steps come from the run's compilation cache.
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "serve", "--draft-kv", "aggregated"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2], env=child_env(4))
    def send(rid, n):
        proc.stdin.write((json.dumps({"id": rid, "prompt": "def f(x):", "max_new_tokens": n})
                          + "\n").encode())
        proc.stdin.flush()

    send("s0", 4)
    first = json.loads(proc.stdout.readline())  # serving (compiled) by now
    send("s1", 200)
    time.sleep(2.0)  # read and running, not finished
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    answers = [first] + [json.loads(l) for l in out.decode().splitlines()]
    assert proc.returncode == 0, err.decode()[-2000:]
    assert [(a["id"], len(a["tokens"])) for a in answers] == [("s0", 4), ("s1", 200)]
    assert "SIGTERM" in err.decode()


def test_batch_invariant_is_a_flag_of_every_serving_command():
    from disagg.__main__ import build_parser
    parser = build_parser()
    assert parser.parse_args(["serve", "--batch-invariant"]).batch_invariant
    assert not parser.parse_args(["serve"]).batch_invariant
    for role in ("context", "generation"):
        assert parser.parse_args(["serve-remote", "--role", role,
                                  "--batch-invariant"]).batch_invariant
