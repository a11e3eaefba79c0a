"""The rotation of int4 pages (pagegate.kernels.rotation): orthogonal, so dot products survive it and it undoes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.kernels.rotation import rotatable, rotate, unrotate


@settings(max_examples=30, deadline=None)
@given(log_d=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_rotation_keeps_dot_products_and_undoes(log_d: int, seed: int) -> None:
    d = 2 ** log_d
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(5, d, generator=gen, dtype=torch.float64).float(), torch.randn(7, d, generator=gen)
    torch.testing.assert_close(rotate(q) @ rotate(k).T, q @ k.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unrotate(rotate(q)), q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rotate(q).norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-6)


def test_a_spike_is_spread_over_every_channel() -> None:
    x = torch.zeros(64)
    x[3] = 8.0
    assert torch.allclose(rotate(x).abs(), torch.full((64,), 1.0))  # 8 / sqrt(64) in every channel, signs mixed
    assert (rotate(x) > 0).any() and (rotate(x) < 0).any()


@pytest.mark.parametrize("d", [0, 1, 12, 96, 512])
def test_only_powers_of_two_up_to_256_rotate(d: int) -> None:
    assert not rotatable(d)
    if d:
        with pytest.raises(ValueError, match="power-of-two"):
            rotate(torch.zeros(2, d))
