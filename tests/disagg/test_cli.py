"""The main job's CLI runs end to end (small) and its serving mode answers requests."""

import io
import json
import sys

from disagg.__main__ import main


def test_demo_writes_the_table(tmp_path, capsys):
    out = tmp_path / "demo.json"
    main(["demo", "--num-prompts", "2", "--max-new-tokens", "8", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["aggregated", "disagg-shared",
                                                  "disagg-private"]
    assert report["shared_equals_aggregated"] and report["private_output_unchanged"]
    assert report["rows"][1]["bytes_transferred"] > report["rows"][2]["bytes_transferred"] > 0
    assert "disagg-shared" in capsys.readouterr().out


def test_serve_answers_json_lines_and_reports_bad_ones(monkeypatch, capsys):
    lines = [json.dumps({"id": "a", "prompt": "def add(a, b):\n    return", "max_new_tokens": 6}),
             "not json", json.dumps({"id": "c", "prompt": "", "max_new_tokens": 3})]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    main(["serve"])
    out = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()[-3:]]
    assert out[0]["id"] == "a" and len(out[0]["text"]) > 0
    assert "error" in out[1]
    assert out[2]["acceptance_length"] > 0  # BOS alone is a valid prompt
