#!/usr/bin/env python
"""Thin entry point: `python tools/train.py --config FILE [overrides]` = `megamlm train ...`."""

import sys

from megamlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
