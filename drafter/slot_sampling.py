"""Each slot's sampling parameters: the host arrays every step call carries.

One row per slot (the dummy slot's too: it pads), set as a request takes its slot
(`set`). A call's static variant follows from the rows it runs (`variant`): greedy
unless a row samples, truncated if a sampled row truncates, log-probabilities if a row
asks for them, adjusted if a row has penalties or logit-bias entries
(drafter/sampling.py: each is a program of its own).

Logit-bias entries each apply to the tokens at positions below their `bias_until`: a
request's own logit_bias to every token; with min_tokens, its stop ids (and the
end-of-sequence ids unless it ignores them) at -inf to positions below its prompt's
length + min_tokens, so its first min_tokens tokens are none of them. A position, not a
count of generated tokens, because the device knows each row's position in every call,
a verify block's positions included, in every serving mode.
"""

from __future__ import annotations

import numpy as np

from drafter.request import MAX_LOGIT_BIAS, Request

# `bias_until` of an entry that applies to every token.
EVERY_POSITION = np.iinfo(np.int32).max


class SlotSampling:
    def __init__(self, slots: int, eos_token_ids=()):
        self.eos_token_ids = tuple(eos_token_ids)
        self.temperatures = np.zeros(slots, np.float32)
        self.seeds = np.zeros(slots, np.uint32)
        self.top_ks = np.zeros(slots, np.int32)
        self.top_ps = np.ones(slots, np.float32)
        self.min_ps = np.zeros(slots, np.float32)
        self.presence_penalties = np.zeros(slots, np.float32)
        self.frequency_penalties = np.zeros(slots, np.float32)
        self.repetition_penalties = np.ones(slots, np.float32)
        self.bias_ids = np.zeros((slots, MAX_LOGIT_BIAS), np.int32)
        self.bias_values = np.zeros((slots, MAX_LOGIT_BIAS), np.float32)
        self.bias_until = np.zeros((slots, MAX_LOGIT_BIAS), np.int32)
        self.wants_logprobs = np.zeros(slots, bool)
        self.wants_prompt_logprobs = np.zeros(slots, bool)

    def set(self, slot: int, request: Request) -> None:
        params = request.params
        self.temperatures[slot] = params.temperature
        self.seeds[slot] = params.seed
        self.top_ks[slot] = params.top_k
        self.top_ps[slot] = params.top_p
        self.min_ps[slot] = params.min_p
        self.presence_penalties[slot] = params.presence_penalty
        self.frequency_penalties[slot] = params.frequency_penalty
        self.repetition_penalties[slot] = params.repetition_penalty
        bans = params.early_bans(request.request_id, self.eos_token_ids)
        entries = ([(t, v, EVERY_POSITION) for t, v in params.logit_bias]
                   + [(t, -np.inf, len(request.prompt) + params.min_tokens) for t in bans])
        # Unused entries add 0.0 to token 0: x + 0.0 is x, whatever else adds to it.
        self.bias_ids[slot], self.bias_values[slot], self.bias_until[slot] = 0, 0.0, 0
        if entries:
            ids, values, until = zip(*entries)
            n = len(entries)
            self.bias_ids[slot, :n], self.bias_values[slot, :n] = ids, values
            self.bias_until[slot, :n] = until
        self.wants_logprobs[slot] = params.logprobs is not None
        self.wants_prompt_logprobs[slot] = params.prompt_logprobs is not None

    def wants(self, slots, *, prompt: bool) -> bool:
        """Whether one of `slots` asks for its prompt's log-probabilities (`prompt`) or its
        tokens'."""
        return bool((self.wants_prompt_logprobs if prompt else self.wants_logprobs)[slots].any())

    def variant(self, slots) -> dict:
        """The static choices of a call over `slots`: greedy, truncated, logprobs,
        adjusted."""
        hot = [s for s in slots if self.temperatures[s] > 0]
        truncated = bool(hot) and bool(np.any((self.top_ks[hot] > 0) | (self.top_ps[hot] < 1)
                                              | (self.min_ps[hot] > 0)))
        adjusted = bool(np.any((self.presence_penalties[slots] != 0)
                               | (self.frequency_penalties[slots] != 0)
                               | (self.repetition_penalties[slots] != 1)
                               | (self.bias_values[slots] != 0).any(axis=1)))
        return dict(greedy=not hot, truncated=truncated,
                    logprobs=self.wants(slots, prompt=False), adjusted=adjusted)

    def batch_fields(self, adjusted: bool) -> dict:
        """The StepBatch fields of every slot's parameters; the logit-bias entries only
        in a call that adjusts (else width 0: nothing carried)."""
        width = MAX_LOGIT_BIAS if adjusted else 0
        return dict(temperatures=self.temperatures, seeds=self.seeds, top_ks=self.top_ks,
                    top_ps=self.top_ps, min_ps=self.min_ps,
                    presence_penalties=self.presence_penalties,
                    frequency_penalties=self.frequency_penalties,
                    repetition_penalties=self.repetition_penalties,
                    bias_ids=self.bias_ids[:, :width], bias_values=self.bias_values[:, :width],
                    bias_until=self.bias_until[:, :width])
