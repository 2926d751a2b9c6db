"""loadtest.arrivals: Poisson offsets from a seeded rng, bounded by count and duration."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from loadtest.arrivals import Bounds, ClosedLoop, Poisson, poisson_offsets, scheduled_offsets


def test_poisson_gaps_have_mean_one_over_rate():
    offsets = list(itertools.islice(poisson_offsets(4.0, random.Random(0)), 20001))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential: the standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    assert math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) == pytest.approx(0.25, rel=0.05)


def test_poisson_offsets_are_reproducible_by_seed():
    first = list(itertools.islice(poisson_offsets(10.0, random.Random(5)), 50))
    assert first == list(itertools.islice(poisson_offsets(10.0, random.Random(5)), 50))
    assert first != list(itertools.islice(poisson_offsets(10.0, random.Random(6)), 50))


def test_an_infinite_rate_sends_everything_at_once():
    assert scheduled_offsets(math.inf, random.Random(0), Bounds(5)) == [0.0] * 5


def test_schedule_stops_at_the_count_or_the_duration():
    assert len(scheduled_offsets(100.0, random.Random(0), Bounds(7))) == 7
    by_time = scheduled_offsets(100.0, random.Random(0), Bounds(10_000, duration_s=1.0))
    assert 70 <= len(by_time) <= 130 and max(by_time) < 1.0


def test_bad_arrival_settings_are_rejected_with_the_flag_name():
    with pytest.raises(ValueError, match="--rate"):
        Poisson(0.0)
    with pytest.raises(ValueError, match="--concurrency"):
        ClosedLoop(0)
    with pytest.raises(ValueError, match="--requests"):
        Bounds(0)
    with pytest.raises(ValueError, match="--duration"):
        Bounds(1, duration_s=0.0)
