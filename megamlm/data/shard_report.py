"""`megamlm shards inspect`: what a shard folder holds (its build, splits, samples per block mode), and
with `verify` every document read back as training reads it.

The summary reads the manifest and stats the shards (as `ShardSet` does before training: a missing or
resized shard is named). Verification reads each shard's index against the manifest's sha256, and each
document against its CRC-32, its token count and the dictionary (`ShardSet.read_tokens`): the damage
training would skip and count, listed before a run instead of during it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from megamlm.data.shards import summary_table
from megamlm.data.blocks import BLOCK_MODES
from megamlm.data.documents import ShardError
from megamlm.data.progress import progress_bar
from megamlm.data.stream import CorruptShardError, ShardSet

SHOWN = 5
"""Damaged documents named per shard (the rest are counted)."""


@dataclass
class SplitCheck:
    """What verifying one split found."""

    documents: int = 0
    """Documents read back."""
    damaged: dict[str, list[str]] = field(default_factory=dict)
    """Shard file -> what is wrong with it (an unreadable index, or one line per damaged document)."""
    damaged_documents: int = 0
    excluded: list[str] = field(default_factory=list)
    """Shards missing or of another size than the manifest says (training leaves them out)."""


def _splits(folder: Path) -> dict[str, ShardSet | str]:
    """Each split of the manifest -> its ShardSet, or why none of its shards can be read."""
    manifest = ShardSet.read_manifest(folder)
    sets = {}
    for split in manifest["splits"]:
        with warnings.catch_warnings():  # the excluded shards are listed in the report instead
            warnings.simplefilter("ignore")
            try:
                sets[split] = ShardSet(folder, split)
            except ShardError as err:  # no shard of the split can be read
                sets[split] = str(err)
    return sets


def describe(folder: str | Path) -> str:
    """The folder's build, its splits (shards, documents, tokens, samples per block mode) and per-subset
    counts, as printed by `megamlm shards inspect`."""
    folder = Path(folder)
    manifest = ShardSet.read_manifest(folder)
    option = manifest.get("options", {}).get  # builds before options were recorded: "?"
    lines = [f"{folder}: format {manifest.get('format', 1)}, samples of {manifest['seq_length']} tokens "
             f"(long documents: {option('long_docs', '?')}; text: {option('text_mode', '?')})",
             f"dictionary: {manifest.get('dictionary_size', 0):,} symbols "
             f"(sha256 {manifest['dictionary_sha256'][:12]})",
             f"inputs: {', '.join(option('inputs', [])) or '?'} (valid fraction {option('valid_fraction', '?')}, "
             f"seed {option('seed', '?')})",
             f"{'split':<8}{'shards':>7}{'documents':>12}{'tokens':>15}{'tokens/doc':>12}"
             + "".join(f"{f'samples ({mode})':>22}" for mode in BLOCK_MODES) + f"{'padded fill':>13}"]
    for split, info in manifest["splits"].items():
        blocks = {mode: sum(s.get("blocks", {}).get(mode, 0) for s in info["shards"]) for mode in BLOCK_MODES}
        # `complete` samples padded to the length: <s> and the tokens of each, over its slots (`megamlm plan --fill`)
        fill = (info["tokens"] + blocks["complete"]) / max(blocks["complete"] * manifest["seq_length"], 1)
        lines.append(f"{split:<8}{len(info['shards']):>7,}{info['documents']:>12,}{info['tokens']:>15,}"
                     f"{info['tokens'] / max(info['documents'], 1):>12,.1f}"
                     + "".join(f"{blocks[mode]:>22,}" for mode in BLOCK_MODES) + f"{fill:>13.3f}")
    for split, shards in _splits(folder).items():
        excluded = [shards] if isinstance(shards, str) else shards.excluded
        lines += [f"{split}: training leaves out {path}" for path in excluded]
    return "\n".join(lines + [summary_table(manifest, splits=False)])


def verify(folder: str | Path, progress: bool = True) -> dict[str, SplitCheck]:
    """Read every document of every split back (the module docstring); split -> what it found."""
    checks = {}
    for split, shards in _splits(Path(folder)).items():
        check = checks[split] = SplitCheck()
        if isinstance(shards, str):
            check.excluded.append(shards)
            continue
        check.excluded += shards.excluded
        bar = progress_bar(shards.shards, desc=f"verifying {split}", unit=" shards", enabled=progress)
        for i, shard in enumerate(bar):
            name = shard["path"].name
            try:
                starts = shards.doc_starts(i)
            except CorruptShardError as err:  # the index: no document of the shard can be located
                check.damaged[name] = [str(err)]
                continue
            try:  # the whole shard in one read; a damaged document makes it read them one by one
                shards.read_tokens(i, 0, int(starts[-1]))
            except CorruptShardError:
                check.damaged[name] = _damaged_documents(shards, i, starts)
                check.damaged_documents += len(check.damaged[name])
            check.documents += len(starts) - 1
    return checks


def _damaged_documents(shards: ShardSet, shard: int, starts) -> list[str]:
    found = []
    for doc in range(len(starts) - 1):
        try:
            shards.read_tokens(shard, int(starts[doc]), int(starts[doc + 1]))
        except CorruptShardError as err:
            found.append(str(err))
    return found


def verify_report(checks: dict[str, SplitCheck]) -> tuple[str, bool]:
    """(the lines `megamlm shards inspect --verify` prints, whether everything read back intact)."""
    lines, intact = [], True
    for split, check in checks.items():
        problems = len(check.damaged) + len(check.excluded)
        intact &= problems == 0
        lines.append(f"verified {split}: {check.documents:,} documents read, " + (
            "no damage" if not problems else
            f"{check.damaged_documents:,} damaged documents in {len(check.damaged)} shard(s), "
            f"{len(check.excluded)} shard(s) left out"))
        lines += [f"  left out: {path}" for path in check.excluded]
        for name, found in check.damaged.items():
            lines += [f"  {line}" for line in found[:SHOWN]]
            if len(found) > SHOWN:
                lines.append(f"  ... and {len(found) - SHOWN} more in {name}")
    return "\n".join(lines), intact
