"""RoPE scaling in the serving path: a YaRN target with a linear-scaled drafter stays lossless."""

import dataclasses

import numpy as np

from drafter.engine import Engine
from models.rope import RopeScaling
from tests.drafter.tiny import tiny_pair


def test_scaled_rope_pair_is_lossless_and_scaling_reaches_the_cache():
    params, speculative_cfg, plain_cfg = tiny_pair(num_slots=4)
    target = dataclasses.replace(speculative_cfg.target, rope_scaling=RopeScaling("yarn", 4.0, 16))
    draft = dataclasses.replace(speculative_cfg.draft, rope_scaling=RopeScaling("linear", 2.0))
    scaled_speculative = dataclasses.replace(speculative_cfg, target=target, draft=draft)
    scaled_plain = dataclasses.replace(plain_cfg, target=target)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 63, n).tolist() for n in (5, 17, 33, 40)]
    # batch-invariant engines: one shape a call kind, fewer compiles (rows are not the
    # subject here)
    speculative = Engine(params, scaled_speculative, batch_invariant=True).generate(prompts, 16)
    plain = Engine(params, scaled_plain, speculative=False,
                   batch_invariant=True).generate(prompts, 16)
    assert [s.tokens for s in speculative] == [p.tokens for p in plain]
    unscaled = Engine(params, plain_cfg, speculative=False,
                      batch_invariant=True).generate(prompts, 16)
    assert [p.tokens for p in plain] != [u.tokens for u in unscaled]
