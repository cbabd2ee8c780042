#!/usr/bin/env python
"""Thin entry point: `python tools/convert_checkpoint.py --from fairseq --to megamlm CKPT OUT` =
`megamlm convert ...` (see `megamlm convert --help`)."""

import sys

from megamlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
