"""Argument types shared by the verbs' parsers."""

from __future__ import annotations

import argparse


def integer_list(text: str) -> list[int]:
    """A comma-separated list of integers (`--seeds 1,2,3`, `--lengths 128,256`); argparse says which
    item is not one, in its one line."""
    values = []
    for item in text.split(","):
        try:
            values.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not an integer (a comma-separated list of "
                                             f"integers, e.g. 1,2,3)") from None
    return values
