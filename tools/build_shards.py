#!/usr/bin/env python
"""Thin entry point: `python tools/build_shards.py INPUTS --out DIR ...` = `megamlm shards build ...`."""

import sys

from megamlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["shards", "build", *sys.argv[1:]]))
