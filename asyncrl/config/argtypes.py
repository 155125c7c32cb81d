"""argparse types for the command lines' numbers, so a bad value is argparse's error naming the flag."""

from __future__ import annotations


def positive_seconds(text: str) -> float:
    """An argparse type for a command-line duration: a number > 0 (argparse's error names the flag)."""
    import argparse

    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def finite_number(text: str) -> float:
    """An argparse type for a command-line number that must be finite (not nan, not inf)."""
    return _finite(text)


def _finite(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def on_or_off(text: str) -> bool:
    """An argparse type for a flag that also takes a value, as its config key would: true/false, yes/no, on/off."""
    import argparse

    value = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
    try:
        return value[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None
