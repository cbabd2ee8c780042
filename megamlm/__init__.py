"""megamlm: masked language model pretraining on megatron-core and DeepSpeed."""

import importlib
import warnings

from megamlm import megatron_import

# megatron-core announces at import that it falls back to torch when apex / Transformer Engine are
# absent; that is the supported CPU configuration here, not something a user must act on. DeepSpeed's
# ZeRO calls torch.distributed's flat collectives by the names torch 2.13 deprecated (a warning a rank).
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated", "When using async grad allreduce",
                 r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"):
    warnings.filterwarnings("ignore", message=_message)
megatron_import.install()  # megatron.core's torch.compile wrappers made on first call: its import ~2 s shorter

__version__ = "0.1.0"

_API = {"Encoder": "megamlm.model.encoder", "MaskedLM": "megamlm.objectives", "from_pretrained": "megamlm.objectives"}
"""The package's names and their modules, imported on first use (PEP 562): `import megamlm.data...` in a
shard build's tokenizer worker took 5.5 s and 440 MB (torch and megatron-core) to tokenize text."""

__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'megamlm' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
