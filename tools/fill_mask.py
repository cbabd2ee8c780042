#!/usr/bin/env python
"""Thin entry point: `python tools/fill_mask.py MODEL_DIR "text with <mask>"` = `megamlm fill-mask ...`."""

import sys

from megamlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["fill-mask", *sys.argv[1:]]))
