"""The framework-free batch-size search (autoremat.integrations.batch_size)."""

from __future__ import annotations

import pytest

from autoremat.integrations.batch_size import confirmed_largest, predicted_largest


@pytest.mark.parametrize("largest", [4, 5, 7, 8, 9, 31, 64, 100])
def test_predicted_largest_finds_the_threshold(largest: int) -> None:
    probes: list[int] = []

    def fits(size: int) -> bool:
        probes.append(size)
        return size <= largest

    assert predicted_largest(4, 100, fits) == largest
    assert len(probes) <= 2 * 5 + 2  # doubling then bisection: logarithmic


def test_predicted_largest_respects_the_limit() -> None:
    assert predicted_largest(4, 50, lambda s: True) == 50
    assert predicted_largest(4, 4, lambda s: True) == 4
    with pytest.raises(ValueError, match="original"):
        predicted_largest(0, 4, lambda s: True)


def test_confirmed_largest_backs_off_to_what_runs() -> None:
    tried: list[int] = []

    def trial(size: int) -> str | None:
        tried.append(size)
        return f"plan@{size}" if size <= 11 else None

    assert confirmed_largest(4, 16, trial) == (11, "plan@11")
    assert tried[0] == 16 and all(t > 4 for t in tried)
    assert confirmed_largest(4, 16, lambda s: None) is None
    assert confirmed_largest(4, 4, trial) is None  # nothing above the original to confirm
