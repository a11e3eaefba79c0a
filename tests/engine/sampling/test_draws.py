"""Draws is torch's CPU generator, number for number, before and after it hands over to one."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.engine.sampling.draws import Draws


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), before=st.integers(0, 40), after=st.integers(1, 10))
def test_draws_are_torch_rand_and_hand_over_where_they_are(seed: int, before: int, after: int) -> None:
    draws, reference = Draws(seed), torch.Generator().manual_seed(seed)
    assert [draws.uniform() for _ in range(before)] == [float(torch.rand(1, generator=reference))
                                                          for _ in range(before)]
    handed = draws.torch_generator()
    assert torch.equal(handed.get_state(), reference.get_state())
    assert [draws.uniform() for _ in range(after)] == [float(torch.rand(1, generator=reference))
                                                         for _ in range(after)]
    assert draws.torch_generator() is handed
