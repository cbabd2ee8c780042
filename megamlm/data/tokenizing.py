"""The shard build's tokenizing: documents in chunks, parsed (a jsonl line's JSON: documents.json_document),
encoded and turned into what the build stores of them (`prepare`) in this process or in `workers` processes,
handed back in input order (so that shards are byte-identical for any worker count): the build's one serial
process reads the lines and writes.

Worker processes run under concurrent.futures' ProcessPoolExecutor, which notices a worker that dies (the
out-of-memory killer, a signal): multiprocessing.Pool replaces such a worker and waits for the chunk it
held forever, and a Pile build then hung at 0% CPU with nothing said. Here that is a ShardError, and the
build's staging folder is removed as for any failed build (shards.build_shards)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Any

import numpy as np

from megamlm.data.documents import Document, Problem, ShardError, json_document
from megamlm.data.tokenizer import Tokenizer
from megamlm.stop_signals import starting_workers

CHUNK_DOCUMENTS = 256
"""Documents per encode_batch call (and per task of a worker)."""
IN_FLIGHT_PER_WORKER = 2
"""Chunks submitted ahead per worker: each has one queued behind the one it encodes, and the documents
read ahead stay bounded (a chunk's texts are held until its ids come back)."""

Prepare = Callable[[np.ndarray], Any]
"""A document's token ids (without </s>) -> what the build keeps of it (picklable: it runs in the workers)."""

_WORKER: tuple[Tokenizer, Prepare] | None = None


def _init_worker(tokenizer: Tokenizer, prepare: Prepare) -> None:
    global _WORKER
    _WORKER = tokenizer, prepare


def _prepared(tokenizer: Tokenizer, prepare: Prepare, texts: list[str | bytes]) -> list:
    """Per text (a Document's: a jsonl line's bytes are parsed here) (its subset, None: the Document's own;
    `prepare` of its ids), the Problem that makes it no document, or None for a blank line."""
    results = [json_document(text) if isinstance(text, bytes) else (text, None) for text in texts]
    is_document = [result is not None and not isinstance(result, Problem) for result in results]
    ids = iter(tokenizer.encode_batch([result[0] for result, found in zip(results, is_document) if found]))
    return [(result[1], prepare(next(ids))) if found else result for result, found in zip(results, is_document)]


def _prepare_chunk(texts: list[str | bytes]) -> list:
    return _prepared(*_WORKER, texts)


def _chunks(docs: Iterable[Document], size: int) -> Iterator[list[Document]]:
    chunk = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encoded_chunks(docs: Iterable[Document], tokenizer: Tokenizer, prepare: Prepare,
                   workers: int = 1) -> Iterator[tuple[list[Document], list]]:
    """(chunk of `docs`, per one what `_prepared` makes of its text) in input order."""
    if workers == 1:
        for chunk in _chunks(docs, CHUNK_DOCUMENTS):
            yield chunk, _prepared(tokenizer, prepare, [d.text for d in chunk])
        return
    pending: deque[tuple[list[Document], Future]] = deque()
    done = 0  # documents handed back, for the error line
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                               initargs=(tokenizer, prepare))

    def submit(chunk: list[Document] | None) -> None:
        if chunk is None:
            return
        # a submit may start a worker, which reads its start (the tokenizer: megabytes) from a pipe this
        # process writes: a stop taken meanwhile ended the write halfway (the worker's traceback followed
        # the build's line: "pickle data was truncated", or a FileNotFoundError for the pool's semaphores)
        # or left the pool waiting for a worker that never started (the build hung). Held, it is taken
        # once the submit is whole, and the pool's shutdown waits for the worker (`starting_workers`)
        with starting_workers():
            pending.append((chunk, pool.submit(_prepare_chunk, [d.text for d in chunk])))

    try:
        chunks = _chunks(docs, CHUNK_DOCUMENTS)
        for _ in range(workers * IN_FLIGHT_PER_WORKER):
            submit(next(chunks, None))
        while pending:
            chunk, future = pending.popleft()
            prepared = future.result()
            done += len(chunk)
            yield chunk, prepared
            submit(next(chunks, None))
    except BrokenProcessPool:  # from a result or a submit: a worker is gone
        raise ShardError(
            f"a tokenizer worker process (--workers {workers}) ended abruptly after {done:,} documents "
            f"(killed: the out-of-memory killer, or a signal); nothing of the build is kept; run it "
            f"again, with fewer --workers if memory ran out") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
