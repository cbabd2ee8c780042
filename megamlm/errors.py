"""The one base class of every error a user can cause (bad input, a refused action, a corrupt file).

The CLI prints such an error as one line (`megamlm: <verb>: <message>`) and exits 2; anything else
is a bug and is reported as one line too, with the traceback under `--debug` / `MEGAMLM_DEBUG=1`.
Each layer subclasses it (ConfigError, ShardError, TokenizerError, ConversionError, ...), so a
lower layer never needs to know the CLI exists.
"""

from __future__ import annotations


class MegamlmError(ValueError):
    """Bad input or a refused action; the message names the file, line or key and what to do."""


class CorruptFileError(MegamlmError):
    """A file megamlm wrote no longer matches the size or hash it recorded when writing it."""
