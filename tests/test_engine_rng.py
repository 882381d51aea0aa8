"""Per-request random streams: Exp(1)-distributed, reproducible, independent of the batch around them."""

import torch

from serving.engine.rng import exponential_noise


def test_noise_is_exponential_and_reproducible():
    seeds = torch.tensor([0, 1, 2**40 + 3, 2**62])
    frames = torch.tensor([0, 5, 5, 1000])
    noise = exponential_noise(seeds, frames, 3, 20000)
    assert noise.shape == (4, 20000) and (noise > 0).all()
    assert torch.allclose(noise.mean(1), torch.ones(4), atol=0.03)
    assert torch.allclose(noise.std(1), torch.ones(4), atol=0.05)
    assert torch.equal(noise, exponential_noise(seeds, frames, 3, 20000))


def test_rows_do_not_depend_on_their_neighbours_and_coordinates_matter():
    seeds, frames = torch.tensor([7, 8, 9]), torch.tensor([2, 2, 2])
    batch = exponential_noise(seeds, frames, 1, 512)
    assert torch.equal(batch[1:2], exponential_noise(seeds[1:2], frames[1:2], 1, 512))
    others = [exponential_noise(seeds[:1], frames[:1] + 1, 1, 512), exponential_noise(seeds[:1], frames[:1], 2, 512),
              exponential_noise(seeds[:1] + 1, frames[:1], 1, 512)]
    for other in others:
        assert not torch.allclose(other, batch[:1])
    corr = torch.corrcoef(torch.stack([batch[0], batch[1]]))[0, 1]
    assert abs(corr) < 0.15
