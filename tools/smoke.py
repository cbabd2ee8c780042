#!/usr/bin/env python
"""Thin entry point: `python tools/smoke.py --config configs/demo.yaml [overrides]` = `megamlm smoke ...`."""

import sys

from megamlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["smoke", *sys.argv[1:]]))
