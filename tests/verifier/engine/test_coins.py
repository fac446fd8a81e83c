"""A sampled request's coins come from its seeded generator in blocks (``CoinStream``): the same
values, in the same order, as one ``torch.rand`` call per need, so seeded outputs are what they were
when every step drew its coins call by call."""

import numpy as np
import torch

from verifier.engine.request import CoinStream


def test_blocks_give_the_values_of_one_call_per_need():
    sizes = [1, 17, 17, 5, 300, 2, 17, 255, 1, 600, 3]  # across block boundaries and beyond a block
    stream = CoinStream(1234)
    got = np.concatenate([stream.take(n).copy() for n in sizes])
    g = torch.Generator(device="cpu")
    g.manual_seed(1234)
    want = np.concatenate([torch.rand(n, generator=g).numpy() for n in sizes])
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_a_node_coin_and_a_bonus_coin_per_step_as_before():
    """The engine used to draw rand(K) then rand(1) per step; take(K + 1) is that pair."""
    K, steps = 16, 40
    stream = CoinStream(7)
    g = torch.Generator(device="cpu")
    g.manual_seed(7)
    for _ in range(steps):
        want = torch.cat([torch.rand(K, generator=g), torch.rand(1, generator=g)]).numpy()
        assert np.array_equal(stream.take(K + 1), want)


def test_draws_are_uniform_in_unit_interval():
    x = CoinStream(3).take(20_000)
    assert x.min() >= 0.0 and x.max() < 1.0 and abs(float(x.mean()) - 0.5) < 0.01
