"""A training step queues its work without waiting for the device.

On a GPU, a host read of device data (`.item()`, `bool(t)`, `nonzero`, a boolean index, a blocking
copy) waits until every kernel queued before it has run; in the middle of a step it leaves the GPU
idle while the host queues what follows. Two measurements on CPU:

- the meta device: tensors without data, on which every such read fails. A step whose model and
  batch live there has no host read at all, for every variant and layout: what the batch's layout
  decides (whether any key is padded, packed rows' sample lengths and starts) is read from the copy
  it brought along on the host (`Batch.host_layout`).
- a count of the aten ops that read device data on the host, taken everywhere except where the
  batch's layout is read once per forward before the first layer: the attention backend's
  `prepare_layers` and `Batch.sample_starts` (which on the CPU read host tensors the count cannot
  tell from device ones). The layers, the heads, the loss and the backward read nothing, also for
  ELECTRA (which the meta device cannot run: its sampling needs a generator).
"""

import collections
import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megamlm.data.batch import Batch, collate
from megamlm.data.tokenizer import Tokenizer
from megamlm.model.attention import AttentionBackend
from megamlm.model.encoder import Encoder
from megamlm.objectives import get_objective
from megamlm.parallel import seed_everything
from tests.variants import VARIANTS, variant_config

DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
HOST_READS = {"_local_scalar_dense", "nonzero", "unique_consecutive", "_unique2", "unique_dim", "bincount",
              "masked_select", "repeat_interleave"}
"""aten ops whose result the host needs from the device's data (item / bool / int, data-dependent sizes)."""


class HostReads(TorchDispatchMode):
    """Counts the aten ops that read device data on the host (HOST_READS, indexing with a bool mask)."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self.counts = collections.Counter()
        self.paused = False
        self.host = {t.untyped_storage().data_ptr() for t in host_tensors}
        """Storages that stay on the host on a GPU too (Batch.HOST_FIELDS): reading them is free."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        on_host = isinstance(args[0], torch.Tensor) and args[0].untyped_storage().data_ptr() in self.host
        if not self.paused and not on_host:
            if name in HOST_READS:
                self.counts[name] += 1
            elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                         for i in args[1] if i is not None):
                self.counts["index with a bool mask"] += 1
        return func(*args, **(kwargs or {}))


def _uncounted(census: HostReads, function):
    """`function` with `census` paused while it runs (reads of the batch's host layout: the CPU cannot tell
    them from device reads; the meta-device tests show they are host reads)."""
    def run(*args, **kwargs):
        census.paused = True
        try:
            return function(*args, **kwargs)
        finally:
            census.paused = False
    return run


def _samples(vocab: int, lengths=(16, 11, 7, 13)):
    """<s> ... </s> samples, the first holding two documents."""
    rng = np.random.default_rng(0)
    samples = [np.concatenate([[0], rng.integers(4, vocab, n - 2), [2]]) for n in lengths]
    samples[0][7] = 2
    return [(s, i) for i, s in enumerate(samples)]


def _tokenizer(cfg):
    return Tokenizer.load(cfg.data.tokenizer, zero_clap=cfg.model.zero_mask)


def _batch(cfg, layout: str):
    """A padded (4 rows of 16) or packed (one row of 56) batch corrupted as the objective trains;
    sentence-pair objectives get a label per sample."""
    objective = get_objective(cfg)
    corruption = objective.corruption(_tokenizer(cfg), 1)
    labels = [0, 1, 1, 0] if objective.pairing(1) is not None else None
    return collate(_samples(min(cfg.model.vocab_size, 1000)), corruption, 0, 16 if layout == "padded" else 56,
                   pad_id=cfg.model.pad_token_id, packed=layout == "packed", pair_labels=labels)


def _step(cfg, ctx, batch, device: str = "cpu", measure=None):
    """One training forward + backward of cfg's objective (within `measure`), the model and batch on
    `device` (the batch moved as the training loop moves it)."""
    objective = get_objective(cfg)
    model = objective.build_model(ctx).train().to(device)
    batch = batch.to(torch.device(device))
    with measure or contextlib.nullcontext():
        objective.loss(model, batch).loss_sum.sum().backward()
    return model


OBJECTIVES = {"mlm": [], "electra": ["objective.name=electra", "objective.generator_size=0.5"],
              "sop": ["objective.name=sop"]}


@pytest.mark.parametrize("layout", ["padded", "packed"])
# ELECTRA's sampling needs a generator, which meta lacks; SOP adds the pair head's sample starts
@pytest.mark.parametrize("variant, objective", [(v, "mlm") for v in [*VARIANTS, "document-mask"]]
                         + [(v, "sop") for v in ("baseline", "zero-clap", "modernbert")])
def test_a_step_runs_on_the_meta_device(world, variant, objective, layout):
    # the batch brings its layout along on the host (Batch.host_layout): whether any key is padded, the
    # packed samples' lengths and starts are read there, so nothing of the step waits for the device
    seed_everything(1, world)
    extra = [*DROPOUT, *OBJECTIVES[objective]]
    if variant == "document-mask":
        variant, extra = "baseline", extra + ["model.document_mask=true"]
    vocab = len(_tokenizer(variant_config(variant, extra)).dictionary)
    cfg = variant_config(variant, extra + [f"model.vocab_size={vocab}"])
    model = _step(cfg, world, _batch(cfg, layout), "meta")
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device.type == "meta" for g in grads)


def test_without_its_host_layout_a_batch_is_read_from_the_device(world):
    # not vacuous: the same step with the layout only on the device reads it there, which meta refuses
    seed_everything(1, world)
    cfg = variant_config("baseline", [f"model.vocab_size={len(_tokenizer(variant_config('baseline')).dictionary)}"])
    batch = dataclasses.replace(_batch(cfg, "packed"), host_layout=None)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        _step(cfg, world, batch, "meta")


def test_the_meta_device_refuses_a_host_read():
    # what the test above relies on: a read of device data fails there instead of passing unseen
    with pytest.raises(RuntimeError, match="meta"):
        bool(torch.zeros(3, device="meta").any())


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("variant, objective", [(v, "mlm") for v in VARIANTS]
                         + [(v, o) for v in ("baseline", "zero-clap", "modernbert") for o in ("electra", "sop")])
def test_only_the_attention_inputs_read_the_batch(world, variant, objective, layout, monkeypatch):
    seed_everything(1, world)
    cfg = variant_config(variant, DROPOUT + OBJECTIVES[objective])
    vocab = len(_tokenizer(cfg).dictionary)  # the objective's corruption draws from the tokenizer's ids
    cfg = variant_config(variant, DROPOUT + OBJECTIVES[objective] + [f"model.vocab_size={vocab}"])
    batch = _batch(cfg, layout)
    census = HostReads(host_tensors=[getattr(batch, name) for name in Batch.HOST_FIELDS])
    # the batch's layout, read before the first layer: the attention inputs, and where the samples
    # of packed rows start (sentence-pair objectives classify there)
    monkeypatch.setattr(AttentionBackend, "prepare_layers", _uncounted(census, AttentionBackend.prepare_layers))
    monkeypatch.setattr(Batch, "sample_starts", property(_uncounted(census, Batch.sample_starts.fget)))
    _step(cfg, world, batch, measure=census)
    assert dict(census.counts) == {}


def test_the_census_sees_the_mask_free_check(world):
    # not vacuous: preparing a padded batch for the learned-position baseline asks whether any key is
    # padded (one read per forward, to pick SDPA's mask-free kernel), and the census counts it
    cfg = variant_config("baseline")
    backend = get_objective(cfg).build_model(world).attention
    padding = torch.zeros(2, 8, dtype=torch.bool)
    census = HostReads()
    with census:
        prepared = backend.prepare_layers(cfg.model.layer_attention(), padding, None, None, torch.float32)
    assert [inputs.attention for inputs in prepared.values()] == [None]  # nothing padded: no mask
    assert census.counts == {"_local_scalar_dense": 1}


def test_fine_tuning_reads_its_loss_once_per_epoch(world, monkeypatch):
    # GLUE steps are small and launch-bound on a GPU: a read per update (the epoch's loss sum, before)
    # kept the host from queuing the next step while the GPU ran this one
    from megamlm.glue.finetune import FinetuneOptions, SentenceClassifier, finetune
    from megamlm.glue.tasks import TASKS, Example

    seed_everything(1, world)
    cfg = variant_config("zero-clap", ["model.vocab_size=50262"])
    model = SentenceClassifier(Encoder(cfg.model, world, seed=1), 2, seed=1)
    rng = np.random.default_rng(0)
    words = "the a of to and in is it that was good bad".split()
    examples = [Example((" ".join(rng.choice(words, 6)),), int(rng.integers(2))) for _ in range(24)]
    census = HostReads()
    # whether any key is padded is read from the host copy classify passes (the meta-device test below)
    monkeypatch.setattr(AttentionBackend, "prepare_layers", _uncounted(census, AttentionBackend.prepare_layers))
    with census:
        finetune(model, TASKS["SST-2"], examples, examples[:8], _tokenizer(cfg),
                 FinetuneOptions(epochs=2, batch_size=8, packing="padded"), seed=1, ctx=world, log=lambda *a: None)
    assert census.counts == {"_local_scalar_dense": 2}  # 3 updates per epoch, 2 epochs: one read per epoch


@pytest.mark.parametrize("variant", ["baseline", "zero-clap"])
@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_fine_tuning_batches_bring_their_layout_along(world, packing, variant):
    # GLUE's forward on the meta device: the learned-position baseline's mask-free check and packed
    # rows' sample lengths come from the batch's host copy (classify passes it), so no read fails; so does
    # whether ALiBi's score term alone will do (zero-clap)
    from megamlm.glue.finetune import SentenceClassifier, classify

    seed_everything(1, world)
    cfg = variant_config(variant)
    model = SentenceClassifier(Encoder(cfg.model, world, seed=1), 3, seed=1).to("meta")
    sequences = [[0, 5, 6, 7, 2], [0, 8, 2], [0, 9, 10, 2, 2, 11, 2]]
    logits = classify(model, sequences, cfg.model.pad_token_id, packing, torch.device("meta"))
    assert logits.shape == (3, 3) and logits.device.type == "meta"


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_the_layout_is_read_once_per_forward_whatever_the_number_of_patterns(backend):
    # ModernBERT's global and local layers share one reading of a packed batch's sample lengths
    from megamlm.model.backends import ATTENTION_BACKENDS
    from megamlm.model.positions import build_position

    cfg = variant_config("modernbert")
    patterns = cfg.model.layer_attention()
    attention = ATTENTION_BACKENDS[backend](build_position(cfg.model, 0, 1))
    batch = collate(_samples(1000), lambda sample, epoch, index: (sample, sample % 3 == 0), 0, 56, pad_id=1,
                    packed=True)
    reads = []
    for used in ([patterns[0]], patterns):
        census = HostReads()
        with census:
            attention.prepare_layers(used, batch.segments < 0, None, batch.segments, torch.float32)
        reads.append(sum(census.counts.values()))
    assert len(set(patterns)) == 2 and reads[0] == reads[1] > 0, reads
