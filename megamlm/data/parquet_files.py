"""Parquet corpus files, the Hugging Face Hub's layout (FineWeb, Wikipedia, most datasets' `refs/convert/parquet`):
a "text" column, one document per row, read in row batches with pyarrow when it is installed (`pip install
megamlm[parquet]`). A file is Parquet by its first bytes (`PAR1`), as compression.py tells the compressions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from megamlm.errors import MegamlmError

MAGIC = b"PAR1"
TEXT_COLUMN = "text"
"""The column a document's text is read from (the Hub's and the Pile's name)."""
META_COLUMN = "meta"
"""The Pile's column of each document's metadata (a struct, or a JSON string, with its `pile_set_name`), read
where a file has it, as a jsonl line's "meta"."""

BATCH_ROWS = 1024
"""Rows read at a time: a row group of FineWeb holds ~10^5 documents, so memory stays a batch's."""


class ParquetError(MegamlmError):
    """A Parquet input megamlm cannot read (names the file)."""


def is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _pyarrow_parquet(path: Path):
    try:
        import pyarrow.parquet
    except ImportError:
        raise ParquetError(f"input {path} is a Parquet file, and reading it needs pyarrow: `pip install "
                           f"'megamlm[parquet]'` (or write its {TEXT_COLUMN} column as jsonl elsewhere)") from None
    return pyarrow.parquet


def _opened(path: Path):
    """pyarrow's ParquetFile of `path`: a damaged file (truncated, not Parquet after its magic) named."""
    parquet = _pyarrow_parquet(path)
    try:
        return parquet.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses with the reason
        raise ParquetError(f"input {path} is not a readable Parquet file ({type(err).__name__}: {err}); "
                           f"re-download it") from None


def check_parquet(path: Path) -> None:
    """Raise ParquetError naming `path` unless pyarrow reads it and its "text" column holds strings."""
    schema = _opened(path).schema_arrow
    if TEXT_COLUMN not in schema.names:
        raise ParquetError(f"input {path} has no {TEXT_COLUMN!r} column (columns: {', '.join(schema.names[:8])}"
                           f"{' ...' if len(schema.names) > 8 else ''}); megamlm reads a document from each row's "
                           f"{TEXT_COLUMN!r}")
    kind = schema.field(TEXT_COLUMN).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise ParquetError(f"input {path}: its {TEXT_COLUMN!r} column holds {kind}, not strings")


def parquet_rows(path: Path) -> Iterator[tuple[int, str | None, object]]:
    """(row number from 1, its text or None where null, its meta as pyarrow gives it (a dict, a string, None;
    None where the file has no meta column)), in file order."""
    row = 0
    opened = _opened(path)
    columns = [TEXT_COLUMN] + ([META_COLUMN] if META_COLUMN in opened.schema_arrow.names else [])
    try:
        for batch in opened.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            metas = batch.column(1).to_pylist() if len(columns) > 1 else [None] * batch.num_rows
            for text, meta in zip(batch.column(0).to_pylist(), metas):
                row += 1
                yield row, text, meta
    except ParquetError:
        raise
    except Exception as err:  # a damaged page past the footer: never a silently shorter corpus
        raise ParquetError(f"{path}: damaged Parquet data after row {row} ({type(err).__name__}: {err}); "
                           f"re-download it") from None
