"""The two-GPU benchmark's dry run (benchmarks/bench_two_gpu.py, issue 30) on host
devices: its tensor-parallel and heterogeneous-TP equality, in this process, on the
embedded default pair, comparing the token lists and per-step acceptance themselves.
The two-process part runs in the benchmark's own --quick run (a minute of CPU more);
test_remote.py checks the same two-process equality on the tiny copy pair."""

import jax
import numpy as np
import pytest

from benchmarks.two_gpu.common import equal_outputs, equality_prompts, first_difference, pair_source
from benchmarks.two_gpu.report import goals, summarise_remote
from benchmarks.two_gpu.streams import stream_metrics
from benchmarks.two_gpu.tensor_parallel import hetero_equality, tp_equality

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 8


@pytest.fixture(scope="module")
def pair():
    return pair_source(quick=True).load()


@pytest.fixture(scope="module")
def prompts():
    return equality_prompts(quick=True)


@pytest.fixture(scope="module")
def tp(pair, prompts):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (host devices on CPU, or 2 GPUs)")
    return tp_equality(*pair, prompts, MAX_NEW)


def assert_real_outputs(run, prompts):
    """Every request generated its tokens, distinct prompts gave distinct outputs and
    the drafter's blocks were accepted: an equality over these means something."""
    assert len(run["tokens"]) == len(prompts) == 2
    assert all(len(t) == MAX_NEW for t in run["tokens"])
    assert run["tokens"][0] != run["tokens"][1]
    assert all(sum(steps) == MAX_NEW - 1 for steps in run["acceptance"])  # after the first
    assert np.mean([a for r in run["acceptance"] for a in r]) > 1.5


def test_the_equality_check_sees_one_token_or_one_step_of_difference():
    a = {"tokens": [[5, 6, 7], [8, 9]], "acceptance": [[2, 1], [2]]}
    same = {"tokens": [[5, 6, 7], [8, 9]], "acceptance": [[2, 1], [2]]}
    assert equal_outputs(a, same) and first_difference(a, same) is None
    token = {"tokens": [[5, 6, 7], [8, 1]], "acceptance": [[2, 1], [2]]}
    assert not equal_outputs(a, token)
    assert first_difference(a, token).startswith("request 1: tokens differ at 1")
    step = {"tokens": [[5, 6, 7], [8, 9]], "acceptance": [[1, 2], [2]]}
    assert not equal_outputs(a, step)
    assert first_difference(a, step).startswith("request 0: acceptance")
    fewer = {"tokens": [[5, 6, 7]], "acceptance": [[2, 1]]}
    assert not equal_outputs(a, fewer)
    empty = {"tokens": [], "acceptance": []}
    assert not equal_outputs(empty, empty)   # nothing generated proves nothing
    blank = {"tokens": [[], []], "acceptance": [[], []]}
    assert not equal_outputs(blank, blank)


def test_tp2_gives_the_tp1_tokens_and_acceptance(tp, prompts):
    tp1, tp2 = tp["tp1"], tp["tp2"]
    assert tp["pool_devices"] == {"tp1": 1, "tp2": 2}   # the KV really is split in two
    assert_real_outputs(tp1, prompts)
    assert tp2["tokens"] == tp1["tokens"]
    assert tp2["acceptance"] == tp1["acceptance"]
    assert tp["tp2_equal_tp1"] is True and tp["difference"] is None


def test_context_tp2_into_generation_tp1_gives_the_aggregated_tokens(tp, pair, prompts):
    het = hetero_equality(*pair, prompts, MAX_NEW, reference=tp["tp1"])
    assert (het["context_pool_devices"], het["generation_pool_devices"]) == (2, 1)
    assert het["kv_bytes_moved"] > 0
    got = het["context_tp2_generation_tp1"]
    assert_real_outputs(got, prompts)
    assert got["tokens"] == tp["tp1"]["tokens"]
    assert got["acceptance"] == tp["tp1"]["acceptance"]
    assert het["hetero_tp_equal"] is True


def test_goal_keys_come_from_the_parts_measured():
    """The report's arithmetic on hand-made part results (no devices)."""
    run = {"wall_s": 2.0, "requests": [
        {"id": "a", "prompt_len": 100, "tokens": [1, 2, 3, 4], "acceptance": [2, 1],
         "ttft_s": 0.1, "token_times_s": [0.1, 0.3, 0.3, 0.6], "decode_time_s": 0.5,
         "finish_reason": "length", "error": None},
        {"id": "b", "prompt_len": 50, "finish_reason": "missing", "error": "no result"}]}
    m = stream_metrics([run])
    assert (m["requests"], m["completed"], m["tokens"]) == (2, 1, 4)
    assert m["tokens_per_s"] == 2.0 and m["errors"] == ["no result"]
    assert m["itl_ms_p50"] == pytest.approx(250.0)   # gaps 200 and 300 ms; 0 is one step
    assert m["ttft_ms_p50"] == pytest.approx(100.0)
    e2e = {m_: {"tokens_per_s": t, "itl_ms_p99": i}
           for m_, t, i in (("aggregated", 100.0, 40.0), ("disaggregated", 80.0, 10.0))}
    parts = {
        "tp": {"tp2_equal_tp1": True, "default_pair_b1": {"tp2_over_tp1": 1.3},
               "qwen3_8b": {"tp2_over_tp1": 0.6, "layers": 36}},
        "remote": {"serving": {"cross_process_equal": False, "stream_remote": run,
                               "handoff": [{"handoff_overhead_ms": 1.0, "kv_bytes": 20,
                                            "pull_ms": 8.0},
                                           {"handoff_overhead_ms": 3.0, "kv_bytes": 30,
                                            "pull_ms": 1.0}]},
                   "transport": {"pulls": [{"bytes": 10, "pull_ms": 4.0},
                                           {"bytes": 20, "pull_ms": 5.0}]},
                   "link": {"link": [{"bytes": 10, "d2d_ms": 1.0}, {"bytes": 20, "d2d_ms": 4.0}]}},
        "e2e": {**e2e, "tokens_equal_across_modes": True}}
    g = goals(parts)
    assert g["tp2_equal_tp1"] is True and g["cross_process_equal"] is False
    assert g["tp2_over_tp1_step"] == 0.6 and "Qwen3-8B" in g["tp2_over_tp1_step_shape"]
    assert g["transfer_over_link"] == pytest.approx(0.8) and g["transfer_over_link_bytes"] == 20
    assert g["handoff_overhead_ms_p50"] == pytest.approx(2.0)
    assert g["e2e_itl_p99_disagg_over_aggregated"] == pytest.approx(0.25)
    assert g["e2e_tokens_equal"] is True
    assert (g["stream_ttft_ms_p50"], g["stream_tokens_per_s"]) == (m["ttft_ms_p50"], 2.0)
    summarise_remote(parts["remote"])   # the report keeps metrics, not the raw stream
    assert "stream_remote" not in parts["remote"]["serving"]
    assert goals(parts)["stream_ttft_ms_p50"] == m["ttft_ms_p50"]
    assert parts["remote"]["transport"]["pulls"][0]["over_link"] == pytest.approx(0.25)
    handoff = parts["remote"]["serving"]["handoff"]
    assert handoff[0]["pull_over_link"] == pytest.approx(0.5)   # the link at those bytes
    assert "pull_over_link" not in handoff[1]                   # no link at 30 bytes
    assert "hetero_tp_equal" not in g   # a part not run gives no key
    del parts["tp"]["qwen3_8b"]
    assert goals(parts)["tp2_over_tp1_step"] == 1.3
