"""router/prediction.py: the index's predictions against what workers reused (pure, fake clock)."""

from __future__ import annotations

import pytest

from router.prediction import PredictionCheck, PredictionTracker, accuracy_of


def test_accuracy_counts_both_over_and_under_prediction():
    assert accuracy_of([(64, 64), (0, 0)]) == 1.0
    assert accuracy_of([(64, 0)]) == 0.0  # promised blocks the worker lacked
    assert accuracy_of([(0, 64)]) == 0.0  # missed blocks the worker had
    assert accuracy_of([(64, 64), (0, 64)]) == pytest.approx(0.5)
    assert accuracy_of([(0, 0)]) == 1.0


def test_no_verdict_before_min_samples_then_one_resync_and_a_fresh_window():
    now = [0.0]
    tracker = PredictionTracker(PredictionCheck(window=8, min_samples=4, threshold=0.7, cooldown_s=10),
                                clock=lambda: now[0])
    for _ in range(3):
        assert tracker.record("d0", 96, 96) is False
    assert tracker.accuracy("d0") is None
    assert tracker.record("d0", 96, 96) is False and tracker.accuracy("d0") == 1.0
    verdicts = [tracker.record("d0", 0, 96) for _ in range(2)]  # 4 right, 2 wrong: 4/6 < 0.7
    assert verdicts == [False, True]
    assert tracker.accuracy("d0") is None  # the old samples judged the old entries


def test_a_resync_is_asked_at_most_once_per_cooldown():
    now = [0.0]
    tracker = PredictionTracker(PredictionCheck(window=4, min_samples=2, threshold=0.5, cooldown_s=10),
                                clock=lambda: now[0])
    asked = [tracker.record("d0", 0, 64) for _ in range(6)]
    assert asked == [False, True, False, False, False, False]
    now[0] = 11.0
    assert tracker.record("d0", 0, 64) is True
    assert tracker.record("d1", 64, 64) is False  # each worker has its own window


@pytest.mark.parametrize("fields, name", [({"min_samples": 0}, "min_samples"),
                                          ({"window": 4, "min_samples": 5}, "min_samples"),
                                          ({"threshold": 1.5}, "threshold"),
                                          ({"cooldown_s": -1}, "cooldown_s")])
def test_bad_settings_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        PredictionCheck(**fields)
