"""drafter.evaluate's prompt cut: same continuation points, less context."""

import pytest

from drafter.evaluate import cut_to_context


def test_a_cut_prompt_keeps_its_first_token_its_tail_and_its_length_label():
    prompts = [{"length": 8, "tokens": [0, 1, 2, 3, 4, 5, 6, 7]},
               {"length": 3, "tokens": [0, 9, 8]}]
    cut = cut_to_context(prompts, 3)
    assert cut[0] == {"length": 8, "tokens": [0, 5, 6, 7]}
    assert cut[1] == prompts[1]   # no longer than BOS + 3: whole
    assert prompts[0]["tokens"] == [0, 1, 2, 3, 4, 5, 6, 7]   # the input is not changed


def test_a_cut_to_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        cut_to_context([{"length": 4, "tokens": [0, 1, 2, 3]}], 0)
