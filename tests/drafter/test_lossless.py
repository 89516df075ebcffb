"""Speculative decoding is lossless: greedy output equals plain greedy decoding."""

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from tests.drafter.tiny import tiny_pair


def run_both(params, speculative_cfg, plain_cfg, prompts, max_new, arrivals=None):
    """Speculative output served batched (requests joining mid-run), against plain
    greedy output of each prompt served alone: one prefill row shape to compile for
    the plain steps, however the batch would have packed the prompts."""
    speculative = Engine(params, speculative_cfg).generate(prompts, max_new,
                                                           arrival_steps=arrivals)
    plain_engine = Engine(params, plain_cfg, speculative=False)
    plain = [plain_engine.generate([p], max_new)[0] for p in prompts]
    return speculative, plain


@pytest.mark.parametrize("num_slots,num_prompts,kwargs", [
    (1, 3, dict()),                                             # batch 1
    (4, 9, dict(draft_window=None)),                            # full-attention drafter
    (16, 16, dict(target_kv_dtype="fp8_e4m3")),                 # batch 16, fp8 target KV
    (3, 6, dict(block_size=8, target_window=8, draft_window=8)),  # windows of one page
])
def test_speculative_equals_plain_greedy(num_slots, num_prompts, kwargs):
    # room for the GPU engine's lookahead: 8 decode steps a call, each reserving a block
    params, speculative_cfg, plain_cfg = tiny_pair(num_slots=num_slots, max_seq_len=256,
                                                   **kwargs)
    rng = np.random.default_rng(num_slots)
    # Lengths around page (8) and window (8/16) boundaries.
    lengths = rng.choice([1, 7, 8, 9, 15, 16, 17, 31, 33], num_prompts)
    prompts = [rng.integers(0, 63, n).tolist() for n in lengths]
    arrivals = rng.integers(0, 6, num_prompts).tolist()  # requests join mid-run
    speculative, plain = run_both(params, speculative_cfg, plain_cfg, prompts, 24, arrivals)
    for i, (s, p) in enumerate(zip(speculative, plain)):
        assert s.tokens == p.tokens, f"prompt {i} (len {lengths[i]}) diverged"
        assert len(s.tokens) == 24
        assert sum(s.acceptance) + 1 >= 24  # committed tokens cover the output
        assert all(1 <= a <= speculative_cfg.block_size for a in s.acceptance)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Gluon kernel runs on a GPU")
def test_speculative_equals_plain_greedy_on_the_gluon_kernel(monkeypatch):
    """Every call the Gluon kernel takes goes to it (the fp8 target's prefill, decode and
    verify, the bf16 drafter's draft blocks), whatever the batch: its verify and decode
    lay their warps out differently and must still agree bit for bit."""
    pytest.importorskip("pallas_kernels.paged_attention_gluon")
    from pallas_kernels import attention as kernels

    taken = []
    select = kernels.select_backend

    def select_and_record(q, pool, **kw):
        taken.append(select(q, pool, **kw) == "gluon")
        return "gluon" if taken[-1] else "pallas"

    # every call the Gluon kernel takes is preferred to it, whatever the batch
    monkeypatch.setattr(kernels, "_gluon_preferred", lambda *a, **k: True)
    monkeypatch.setattr(kernels, "select_backend", select_and_record)
    # max_seq_len: a GPU engine's 8 decode steps a call and one call ahead reserve
    # 2 x 8 verify blocks beyond prompt + outputs
    params, speculative_cfg, plain_cfg = tiny_pair(num_slots=8, max_seq_len=256, kv_dtype="bf16",
                                                   target_kv_dtype="fp8_e4m3", impl="pallas",
                                                   head_dim=32, block_size=8)
    rng = np.random.default_rng(5)
    lengths = rng.choice([1, 8, 9, 16, 17, 33], 10)
    prompts = [rng.integers(0, 63, n).tolist() for n in lengths]
    speculative, plain = run_both(params, speculative_cfg, plain_cfg, prompts, 24,
                                  rng.integers(0, 6, 10).tolist())
    assert any(taken)
    for i, (s, p) in enumerate(zip(speculative, plain)):
        assert s.tokens == p.tokens, f"prompt {i} (len {lengths[i]}) diverged"
