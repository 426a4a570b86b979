"""Target training (eagleflow.embedded.train_target): the length-grouped batch stream. The training
itself runs in the train_tiny_target rule (minutes), not here."""

import random

import torch

from eagleflow.embedded.train_target import _batches, _pad


def _samples(n=500, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(5, 72)
        out.append(
            (list(range(10, 10 + length)), [0] * (length // 2) + [1] * (length - length // 2))
        )
    return out


def test_length_grouped_batches_cover_every_sample_once_per_epoch_with_little_padding():
    samples = _samples()
    stream = _batches(samples, 512, pad_id=0, generator=torch.Generator().manual_seed(0))
    seen, real, padded = [], 0, 0
    total = sum(len(x) for x, _ in samples)
    while real < total:
        ids, labels = next(stream)
        assert ids.shape == labels.shape and ids.shape[1] % 8 == 0
        unpadded = max(int((row != 0).sum()) for row in ids)
        assert (
            ids.shape[0] == 1 or ids.shape[0] * unpadded <= 512
        )  # the budget, before rounding up to 8
        for row, lab in zip(ids, labels):
            n = int((row != 0).sum())
            seen.append(n)
            # labels: the ids where the loss mask is 1, -100 elsewhere (padding included)
            assert (lab[:n][lab[:n] != -100] == row[:n][lab[:n] != -100]).all()
            assert (lab[:n] != -100).sum() == n - n // 2 and (lab[n:] == -100).all()
        real += int((ids != 0).sum())
        padded += ids.numel()
    assert real == total  # exactly one epoch, every sample once
    assert sorted(seen) == sorted(len(x) for x, _ in samples)
    assert 1 - real / padded < 0.2  # plain random batches of these lengths were about half padding


def test_batch_stream_is_deterministic_from_the_seed():
    samples = _samples(200)
    a = _batches(samples, 256, 0, torch.Generator().manual_seed(3))
    b = _batches(samples, 256, 0, torch.Generator().manual_seed(3))
    for _ in range(20):
        (x1, y1), (x2, y2) = next(a), next(b)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_pad_rounds_up_to_a_multiple_of_eight():
    ids, labels = _pad([([5, 6, 7], [0, 1, 1]), ([8], [1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0]]
    assert labels.tolist()[0][:3] == [-100, 6, 7] and labels.tolist()[1][:2] == [8, -100]
