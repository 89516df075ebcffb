"""Acceptance length over a set of prompts, with bootstrap intervals over the prompts.

A continuation's AL varies from 2 to 8 from prompt to prompt, so a figure for a prompt
length is only as good as its interval over prompts; two drafters (or pairs) evaluated on
the same prompts compare through the paired difference, far tighter than their own
intervals. Reports are `drafter.evaluate`'s: per length, each prompt's steps.
"""

from __future__ import annotations

import numpy as np


def _bootstrap(num_prompts: int, statistic, level: float,
               resamples: int) -> tuple[float, float]:
    """The `level` interval of `statistic(picks)` over resamples of the prompts, drawn
    with replacement (picks: i[resamples, num_prompts])."""
    picks = np.random.default_rng(0).integers(0, num_prompts, (resamples, num_prompts))
    values = statistic(picks)
    tail = 100 * (1 - level) / 2
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def interval(per_prompt_steps: list[list[int]], level: float = 0.95,
             resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval over prompts for AL (committed tokens over steps, pooled):
    prompts drawn with replacement, `level` of the resampled ALs inside."""
    committed = np.array([sum(s) for s in per_prompt_steps], float)
    steps = np.array([len(s) for s in per_prompt_steps], float)
    return _bootstrap(len(steps), lambda p: committed[p].sum(1) / steps[p].sum(1), level,
                      resamples)


def paired_difference(base: list[list[int]], other: list[list[int]], level: float = 0.95,
                      resamples: int = 2000) -> tuple[float, float, float]:
    """AL of `other` minus AL of `base` over the same prompts, each given per prompt as
    [committed tokens, steps] (AL pooled as in `interval`), with a bootstrap interval
    that draws prompts with replacement for both at once. Paired, it is far tighter than
    the two ALs' own intervals: how hard a prompt is weighs on both alike."""
    if len(base) != len(other) or not base:
        raise ValueError(f"paired prompts: {len(base)} against {len(other)}")
    (bc, bs), (oc, os_) = (np.array(x, float).T for x in (base, other))
    low, high = _bootstrap(
        len(bs), lambda p: oc[p].sum(1) / os_[p].sum(1) - bc[p].sum(1) / bs[p].sum(1),
        level, resamples)
    return float(oc.sum() / os_.sum() - bc.sum() / bs.sum()), low, high


# What two reports must share for their prompts to pair.
PAIRED_KEYS = ("prompts", "max_new", "context", "block_size")


def unpaired(base: dict, report: dict) -> str:
    """Why two reports' prompts do not pair ("" when they do)."""
    if differing := [k for k in PAIRED_KEYS if base.get(k) != report.get(k)]:
        return "it is over other prompts: " + "; ".join(
            f"{k} {base.get(k)!r} there, {report.get(k)!r} here" for k in differing)
    return ""


def compare(base: dict, report: dict, base_name: str = "the baseline") -> list[dict]:
    """Per prompt length both reports hold: `report`'s AL minus `base`'s over the same
    prompts (`paired_difference`). Reports of other prompts, or without per-prompt steps,
    are refused by name."""
    if differing := unpaired(base, report):
        raise ValueError(f"{base_name}: {differing}")
    theirs = {row["prompt_length"]: row for row in base["by_length"]}
    rows = []
    for row in report["by_length"]:
        if (other := theirs.get(row["prompt_length"])) is None:
            continue
        if "per_prompt_steps" not in other:
            raise ValueError(f"{base_name} has no per-prompt steps (a report written before "
                             f"they were kept): evaluate the baseline again")
        diff, low, high = paired_difference(other["per_prompt_steps"], row["per_prompt_steps"])
        rows.append({"prompt_length": row["prompt_length"], "difference": diff,
                     "difference_95": [low, high]})
    if not rows:
        raise ValueError(f"{base_name} shares no prompt length with this report")
    return rows
