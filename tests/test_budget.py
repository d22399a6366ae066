"""Tests for autoremat.budget.parse_budget: every accepted form, every rejection."""

from __future__ import annotations

import pytest

import autoremat.budget as budget_mod
from autoremat.budget import ACCEPTED_FORMS, DEFAULT_MARGIN, device_free_bytes, parse_budget


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("6GB", 6 * 10**9),
        ("6 GB", 6 * 10**9),
        (" 6gb ", 6 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("800kB", 800_000),
        ("1000B", 1000),
        ("1000", 1000),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("4KiB", 4096),
        ("1e3", 1000),
        ("2.01kB", 2010),      # exact decimal, not int(2009.9999999999998)
        ("0.57MB", 570_000),
        (0, 0),
        (1000, 1000),
        (6 * 10**9, 6 * 10**9),
    ],
)
def test_size_forms(value, expected):
    got = parse_budget(value)
    assert got == expected
    assert isinstance(got, int)


@pytest.mark.parametrize(
    ("value", "peak", "expected"),
    [
        ("40%", 1000, 400),
        ("100%", 1000, 1000),
        (" 12.5 % ", 1000, 125),
        ("29%", 100, 29),   # exact: int(0.29 * 100) would be 28
        (0.4, 1000, 400),
        (1.0, 1000, 1000),
        (0.29, 100, 29),
        (0.5, 7, 3),
    ],
)
def test_fraction_forms(value, peak, expected):
    got = parse_budget(value, unoptimised_peak_bytes=peak)
    assert got == expected
    assert isinstance(got, int)


@pytest.mark.parametrize("value", ["40%", 0.4])
def test_fraction_without_peak(value):
    with pytest.raises(ValueError) as err:
        parse_budget(value)
    assert repr(value) in str(err.value)
    assert "unoptimised" in str(err.value)


@pytest.mark.parametrize(
    "value", ["lots", "", "   ", "-5GB", -1, True, False, 1.5, 0.0, -0.5, "150%", "0%", "-10%", "abc%",
              "5 parsecs", "1.5", "GB", "6 G B", None, [1], {"bytes": 1}, (1,)],
)
def test_rejections_name_value_and_forms(value):
    with pytest.raises(ValueError) as err:
        parse_budget(value, unoptimised_peak_bytes=1000)
    msg = str(err.value)
    assert f"budget={value!r}" in msg
    assert ACCEPTED_FORMS in msg


def test_unknown_unit_is_named():
    with pytest.raises(ValueError, match="unknown unit 'parsecs'"):
        parse_budget("5 parsecs")


def test_huge_size_does_not_overflow():
    assert parse_budget("1e30GB") == 10**39


# ---------------------------------------------------------------------- "auto"
def test_auto_on_this_machine_is_positive_int():
    got = parse_budget("auto")
    assert isinstance(got, int) and got > 0
    free = device_free_bytes()
    assert isinstance(free, int) and free > 0
    # the default margin keeps 10% back
    assert got <= free * (1 - DEFAULT_MARGIN) * 1.5


@pytest.fixture
def fixed_free(monkeypatch):
    monkeypatch.delenv("AUTOREMAT_MARGIN", raising=False)
    monkeypatch.setattr(budget_mod, "device_free_bytes", lambda device=None: 10_000)


def test_auto_margin_and_resident(fixed_free):
    assert parse_budget("auto") == 9_000
    assert parse_budget(" AUTO ") == 9_000
    assert parse_budget("auto", resident_bytes=1_000) == 8_000
    assert parse_budget("auto", margin=0.0) == 10_000
    assert parse_budget("auto", margin=0.25, resident_bytes=500) == 7_000


def test_auto_env_margin(fixed_free, monkeypatch):
    monkeypatch.setenv("AUTOREMAT_MARGIN", "0.5")
    assert parse_budget("auto") == 5_000
    # an explicit margin wins over the environment
    assert parse_budget("auto", margin=0.2) == 8_000
    monkeypatch.setenv("AUTOREMAT_MARGIN", "lots")
    with pytest.raises(ValueError, match="AUTOREMAT_MARGIN"):
        parse_budget("auto")


@pytest.mark.parametrize("margin", [-0.1, 1.0, 2.0])
def test_auto_bad_margin(fixed_free, margin):
    with pytest.raises(ValueError, match="margin"):
        parse_budget("auto", margin=margin)


def test_auto_nothing_left(fixed_free):
    with pytest.raises(ValueError, match="explicit budget"):
        parse_budget("auto", resident_bytes=9_000)


def test_auto_real_resident_lowers_budget(monkeypatch):
    monkeypatch.delenv("AUTOREMAT_MARGIN", raising=False)
    free = device_free_bytes()
    monkeypatch.setattr(budget_mod, "device_free_bytes", lambda device=None: free)
    a = parse_budget("auto", margin=0.0)
    b = parse_budget("auto", margin=0.0, resident_bytes=2**20)
    assert a == free and a - b == 2**20


def test_numpy_scalars_are_numbers() -> None:
    """Issue 29 item 12: np.float64(0.7) raised decimal.InvalidOperation (repr 'np.float64(0.7)')."""
    np = pytest.importorskip("numpy")
    assert parse_budget(np.float64(0.7), unoptimised_peak_bytes=1000) == 700
    assert parse_budget(np.float32(0.5), unoptimised_peak_bytes=1000) == 500
    assert parse_budget(np.int64(4096)) == 4096
    with pytest.raises(ValueError, match="bool"):
        parse_budget(np.bool_(True))
    with pytest.raises(ValueError, match="give bytes as an int"):
        parse_budget(np.float64(6e9), unoptimised_peak_bytes=1000)


def test_negative_size_string_is_refused_as_negative() -> None:
    with pytest.raises(ValueError, match="cannot be negative"):
        parse_budget("-1GB")
