"""A transformers folder's weights: one file (model.safetensors or pytorch_model.bin) or the shards its
`.index.json` maps, checked against the keys and shapes transformers' own class gives its config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megamlm.convert.fairseq import ConversionError
from megamlm.convert.hf_formats import ROBERTAS, HFFormat

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
"""A folder's weights: one of these files, or the shards its `.index.json` maps."""


def read_weights(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file errors name, every tensor): one weights file, or a sharded checkpoint's files through its
    `<name>.index.json` (transformers writes those above max_shard_size)."""
    for name in WEIGHT_FILES:
        path, index = folder / name, folder / f"{name}.index.json"
        if path.is_file():
            return path, _load_weights(path)
        if index.is_file():
            return index, _read_shards(index)
    raise ConversionError(f"{folder}: no weights ({' or '.join(WEIGHT_FILES)}) and no shard index "
                          f"({' or '.join(f'{name}.index.json' for name in WEIGHT_FILES)})")


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors / pickle errors have no common base
        raise ConversionError(f"{path}: cannot read the weights ({type(err).__name__}: {err})") from None


def _read_shards(index: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the shard files `index` maps them to (checked: each file is there and holds its tensors)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ConversionError(f"{index}: not a shard index (a JSON object with a weight_map: {err})") from None
    state = {}
    for file in files:
        path = index.parent / file
        if not path.is_file():
            raise ConversionError(f"{index}: names the shard {file}, which {index.parent} lacks")
        shard = _load_weights(path)
        missing = sorted(key for key, where in weight_map.items() if where == file and key not in shard)
        if missing:
            raise ConversionError(f"{path}: lacks {', '.join(missing[:3])}, which {index.name} places there")
        state.update(shard)
    return state


def check_keys(path: Path, state: dict[str, torch.Tensor], expected: dict[str, torch.Size], fmt: HFFormat) -> None:
    """Every key the model needs, at its shape (the decoder, tied to the embedding, may be absent)."""
    optional = {fmt.decoder.format(kind="weight"), fmt.decoder.format(kind="bias"),
                f"{fmt.prefix}.embeddings.position_ids", f"{fmt.prefix}.embeddings.token_type_ids"}
    if fmt in ROBERTAS:  # its one token type is optional (folded into the positions)
        optional.add(fmt.token_types)
    missing = sorted(k for k in expected if k not in state and k not in optional)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConversionError(f"{path}: missing {', '.join(missing[:3])}{more} for the shape config.json gives")
    for key, shape in expected.items():
        if key in state and tuple(state[key].shape) != tuple(shape):
            raise ConversionError(f"{path}: {key} has shape {tuple(state[key].shape)}, config.json gives "
                                  f"{tuple(shape)}")


def expected_shapes(values: dict, fmt: HFFormat, classifier: bool = False,
                     base: bool = False) -> dict[str, torch.Size]:
    """The state dict's shapes transformers gives this config.json (a model on the meta device; `classifier`:
    of the format's *ForSequenceClassification; `base`: of its bare encoder, whose keys get `prefix` and whose
    pooler, which megamlm does not keep, may be absent)."""
    with torch.device("meta"):
        model = fmt.build(values, classifier=classifier, base=base)
    shapes = {key: tensor.shape for key, tensor in model.state_dict().items()}
    if base:
        shapes = {f"{fmt.prefix}.{key}": shape for key, shape in shapes.items() if not key.startswith("pooler.")}
    return shapes
