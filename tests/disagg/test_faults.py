"""Peer faults on a two-process pair, injected through a wrapper of the generation side's
RemoteSource and signals to the context process (benchmarks/bench_reliability's campaign,
two lives of the context): hung before the handoff and during the pull, a corrupted
buffer, killed after the pull (the request completes) and before it, a request to the
dead peer (which health names), then a restart on the same address (which health finds
without a request). Each fault ends its own request alone,
by name, within the timeout plus a margin; every other request equals the reference;
no page is left held on either side."""

import pytest

from benchmarks import bench_reliability
from benchmarks.bench_reliability import MARGIN_S

TIMEOUT = 1.0
# What each fault's error must say besides the request and the context's address.
ERRORS = {"hung_before_handoff": "stopped or hung", "hung_during_pull": "stopped or hung",
          "killed_before_pull": "start it again", "dead_peer": "start it there again",
          "corrupted_buffer": "checksum"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    report = bench_reliability.run(2, timeout=TIMEOUT, workdir=tmp_path_factory.mktemp("rel"))
    print({k: v for k, v in report.items() if k != "events"})   # the detection times
    return report


@pytest.mark.timeout(300)
def test_every_fault_ends_its_request_alone_by_name_and_in_time(report):
    assert report["faults"] == {"hung_before_handoff": 2, "hung_during_pull": 2,
                                "corrupted_buffer": 2, "killed_after_pull": 1,
                                "killed_before_pull": 1, "dead_peer": 2}
    assert report["requests"] == 14 and report["context_lives"] == 2
    events = {e["request_id"]: e for e in report["events"]}
    for e in events.values():
        if e["expect"] == "error":
            assert not e["ok"] and ERRORS[e["fault"]] in e["error"], str(e)
            assert f"'{e['request_id']}'" in e["error"], e
            assert e["detect_s"] <= TIMEOUT + MARGIN_S, e
            if e["fault"].startswith("hung"):   # silence since the last heartbeat, at most
                assert e["detect_s"] >= TIMEOUT / 2, e   # timeout / 4 before the stop
        else:
            assert e["ok"] and e["tokens"] == events["s0"]["tokens"], str(e)
    assert events["k0"]["fault"] == "killed_after_pull"   # its KV was here: served
    assert events["s1"]["ok"]   # the restarted context serves the next request
    assert not report["errors_not_naming"] and not report["faults_undetected"]
    assert report["max_detect_s"] <= TIMEOUT + MARGIN_S


@pytest.mark.timeout(300)
def test_nothing_lost_and_no_page_leaked_on_either_side(report):
    assert report["requests_lost"] == 0 and not report["unanswered"], report["lost_ids"]
    assert report["pages_leaked_generation"] == 0
    assert report["context_checks"] == 8 and report["pages_leaked_context"] == 0


def test_health_names_a_dead_peer_and_finds_it_back_without_a_request(report):
    """While the context is dead the source's health names it (what /health answers 503
    with); once it restarts on its address, health clears within the timeout though no
    request was sent."""
    first, last = report["health"]
    assert "cannot be reached" in first["dead"] and "cannot be reached" in last["dead"]
    assert first["back_s"] is not None and first["back_s"] <= TIMEOUT + MARGIN_S


def test_the_campaign_counts_what_it_is_shown():
    """The summary's rules on made-up events: a bad answer is lost, an unnamed error and a
    fault served are reported."""
    ok = {"answered": True, "ok": True, "tokens": [1], "error": None, "detect_s": None}
    events = [{**ok, "request_id": "s0", "fault": None, "expect": "tokens"},
              {**ok, "request_id": "b0", "fault": None, "expect": "tokens", "tokens": [2]},
              {**ok, "request_id": "c0", "fault": "corrupted_buffer", "expect": "error"},
              {**ok, "request_id": "h0", "fault": "hung_before_handoff", "expect": "error",
               "ok": False, "error": "request 'h0': hung", "detect_s": 1.2},
              {**ok, "request_id": "k0", "fault": "killed_during_pull", "expect": "either",
               "answered": False}]
    campaign = bench_reliability.Campaign.__new__(bench_reliability.Campaign)
    campaign.__dict__.update(events=events, reference=[1], address="127.0.0.1:1",
                             generation_checks=[0, 3], context_checks=[1], timeout=1.0,
                             lives=1, health=[])
    summary = bench_reliability.summary(campaign)
    assert summary["lost_ids"] == ["b0", "k0"] and summary["faults_undetected"] == ["c0"]
    assert summary["errors_not_naming"] == ["h0"]   # no address in a peer fault's error
    assert summary["pages_leaked_generation"] == 3 and summary["pages_leaked_context"] == 1
    assert summary["max_detect_s"] == 1.2 and summary["faults_total"] == 3
