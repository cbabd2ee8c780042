"""megamlm: masked language model pretraining on megatron-core and DeepSpeed."""

import warnings

# megatron-core announces at import that it falls back to torch when apex / Transformer Engine are
# absent; that is the supported CPU configuration here, not something a user must act on. DeepSpeed's
# ZeRO calls torch.distributed's flat collectives by the names torch 2.13 deprecated (a warning a rank).
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated", "When using async grad allreduce",
                 r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"):
    warnings.filterwarnings("ignore", message=_message)

__version__ = "0.1.0"

from megamlm.model.encoder import Encoder  # noqa: E402  (after the warning filters above)
from megamlm.objectives import MaskedLM, from_pretrained  # noqa: E402

__all__ = ["Encoder", "MaskedLM", "__version__", "from_pretrained"]
