"""`megamlm convert`: read a checkpoint, write it in another format, prove it on a probe batch.

Sources: fairseq (a .pt from fairseq or the ALiBi/CLAP fork), megamlm (a model folder), zero (a
DeepSpeed training checkpoint of any DP × TP layout), hf (a transformers folder: hf_import.py). Targets:
megamlm (a model folder, at any TP), fairseq, hf. Every conversion runs the converted model and a
second model on the same probe batch and compares logits at every real position over the whole
vocabulary; only when they agree is the output moved into place, so a failed conversion writes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megamlm.config import Config, ConfigError, config_from_dict, replace_config
from megamlm.convert import SOURCES, TARGETS
from megamlm.convert import fairseq as fs
from megamlm.convert.fairseq_reference import fairseq_logits
from megamlm.convert.hf_export import SequenceClassifier, write_hf
from megamlm.convert.hf_import import read_hf
from megamlm.convert.parity import (classifier_logits, compare, encoder_states, megamlm_logits, probe_tokens,
                                    without_padding_column)
from megamlm.convert.safe_load import load_untrusted
from megamlm.convert.zero import consolidate
from megamlm.data.tokenizer import Dictionary, Tokenizer
from megamlm.files import OutputError, check_output_folder, check_writable, current_umask
from megamlm.model.folder import read_model_folder, staged_write
from megamlm.objectives import get_objective, objective_class
from megamlm.objectives.electra import has_generator
from megamlm.objectives.mlm import has_masked_lm_head
from megamlm.objectives.sentence_pairs import as_classification_head


@dataclass
class Model:
    """A checkpoint in megamlm terms, whatever it was read from."""

    cfg: Config
    full: dict[str, torch.Tensor]
    heads: dict[str, torch.Tensor]
    source: fs.FairseqSource | None = None
    reference: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Logits computed from the source file by an independent implementation (fairseq sources)."""
    tokenizer_files: dict[str, str] | None = None
    """Files of a tokenizer folder to ship with the model (`<out>/tokenizer/`) when it is not the
    bundled GPT-2 one: a fairseq source's dict.txt, an imported BERT's WordPiece vocab.txt."""
    generator_reference: Callable[[torch.Tensor], torch.Tensor] | None = None
    """ELECTRA's generator's logits [b, s, V] computed from the source (an imported ElectraForMaskedLM)."""
    classifier: SequenceClassifier | None = None
    """The classification head the source is (a *ForSequenceClassification read): what the checks compare."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the conversion says before its checks (e.g. rows kept in an order no label name confirms)."""


def read_fairseq(path: str | Path, dict_path: str | Path | None = None) -> Model:
    ckpt = load_untrusted(path)
    if "model" not in ckpt:
        raise fs.ConversionError(f"{path}: no 'model' entry: not a fairseq checkpoint")
    state, old_names = fs.normalize_names(ckpt["model"])
    model_cfg = fs.fairseq_model_cfg(ckpt)
    try:
        model = fs.model_config_from_fairseq(model_cfg, state)
        full, heads, constants = fs.fairseq_to_megamlm(state, model)
    except fs.ConversionError as err:
        raise fs.ConversionError(f"{path}: {err}") from None
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()}
    cfg_dict = ckpt.get("cfg") if isinstance(ckpt.get("cfg"), dict) else {"model": model_cfg}
    source = fs.FairseqSource(cfg=cfg_dict, dtype="float16" if "float16" in dtypes else "float32",
                              old_names=old_names, constants=constants)
    omit_mask = bool((cfg_dict.get("task") or {}).get("omit_mask", False))
    tokenizer, lines = _dictionary(dict_path, model.vocab_size, model.zero_mask or omit_mask)
    cfg = config_from_dict({"model": dataclasses.asdict(model),
                            "data": {"tokenizer": tokenizer, "seq_length": model.max_positions}},
                           origin=str(path))
    return Model(cfg, full, heads, source, reference=lambda tokens: fairseq_logits(state, model_cfg, tokens),
                 tokenizer_files=None if lines is None else {"dict.txt": "\n".join(lines) + "\n"})


def _dictionary(dict_path, rows: int, no_mask_row: bool) -> tuple[str, list[str] | None]:
    """(data.tokenizer value, dict.txt lines to ship or None) for a checkpoint with `rows` symbols."""
    bundled = Tokenizer.gpt2(zero_clap=no_mask_row).dictionary
    if dict_path is None:
        if rows == len(bundled):
            return ("gpt2-zero-clap" if no_mask_row else "gpt2"), None
        raise fs.ConversionError(f"the checkpoint has {rows} embedding rows, not GPT-2's {len(bundled)}: "
                                 f"pass the dictionary it was trained with (--dict dict.txt)")
    candidates = [Dictionary.load(dict_path, add_mask=not no_mask_row)]
    if no_mask_row:  # released zero-clap checkpoints: dict.txt minus its last two madeupwords
        candidates.append(Dictionary.load(dict_path, add_mask=False, drop_last=2))
    for dictionary in candidates:
        if len(dictionary) == rows:
            if dictionary.symbols == bundled.symbols:
                return ("gpt2-zero-clap" if no_mask_row else "gpt2"), None
            return "tokenizer", [f"{s} 1" for s in dictionary.symbols[4:len(dictionary.symbols)
                                                                     - dictionary.has_mask_row]]
    sizes = " or ".join(str(len(d)) for d in candidates)
    raise fs.ConversionError(f"{dict_path} gives {sizes} symbols (4 specials + lines"
                             f"{'' if no_mask_row else ' + <mask>'}) but the checkpoint has {rows} "
                             f"embedding rows: pass the dictionary the checkpoint was trained with")


def read_megamlm(path: str | Path) -> Model:
    saved = read_model_folder(path)
    return Model(saved.cfg, saved.full, saved.heads, fs.FairseqSource(**saved.source) if saved.source else None)


def read_hugging_face(path: str | Path, generator: str | Path | None = None,
                      classifier: SequenceClassifier | None = None) -> Model:
    source = read_hf(path, generator, classifier)
    return Model(source.cfg, source.full, source.heads, reference=source.reference,
                 tokenizer_files=source.tokenizer_files, generator_reference=source.generator_reference,
                 classifier=source.classifier, notes=source.notes)


def read_zero(path: str | Path) -> Model:
    cfg, full, _ = consolidate(path)
    return Model(cfg, full, {})


def convert(source: str, target: str, src: str | Path, out: str | Path, dict_path=None, tp: int = 1,
            tolerance: float = 1e-4, log=print, overwrite: bool = False,
            classifier: SequenceClassifier | None = None, generator: str | Path | None = None) -> dict:
    """Run one conversion; returns a report {max_diff: {check: value}, out: path}. An existing output
    is replaced only with `overwrite` (and a folder only when megamlm wrote everything in it). With
    `classifier` (--to hf only), the folder's classification head is written as the format's
    *ForSequenceClassification instead of the masked LM, and its logits are what is compared. With
    `generator` (--from hf of an ELECTRA discriminator), that ElectraForMaskedLM folder is read along as
    the model's generator, and its logits are compared too; with --to hf, an ELECTRA folder's generator is
    written there as ElectraForMaskedLM."""
    if source not in SOURCES or target not in TARGETS:
        raise fs.ConversionError(f"--from {source} --to {target}: allowed --from {', '.join(SOURCES)}; "
                                 f"--to {', '.join(TARGETS)}")
    if generator is not None and (source == "hf") == (target == "hf"):
        raise fs.ConversionError("--generator: the ELECTRA generator's transformers folder (ElectraForMaskedLM), "
                                 "read along with --from hf or written along with --to hf (not both)")
    if classifier is not None and target != "hf" and (source, target) != ("hf", "megamlm"):
        raise fs.ConversionError(f"--classification-head: for --to hf (writes that head as a "
                                 f"*ForSequenceClassification) and --from hf (names a *ForSequenceClassification's "
                                 f"head); --to {target} keeps every classification head as it is")
    if not tolerance >= 0:
        raise fs.ConversionError(f"--tolerance {tolerance:g} must be >= 0 (the largest |Δ| allowed per unit of logit)")
    if tp < 1:
        raise fs.ConversionError(f"--tp {tp} must be >= 1 (the tensor-parallel shards of the megamlm output)")
    if tp != 1 and target != "megamlm":
        raise fs.ConversionError(f"--tp {tp}: only --to megamlm writes tensor-parallel shards; --to {target} "
                                 f"writes the whole model")
    check_output(target, Path(out), overwrite)  # before reading anything: fail fast
    bars_off = _without_transformers_bars() if "hf" in (source, target) else contextlib.nullcontext()
    with bars_off, tempfile.TemporaryDirectory() as shipped:
        model = {"fairseq": lambda: read_fairseq(src, dict_path), "megamlm": lambda: read_megamlm(src),
                 "zero": lambda: read_zero(src),
                 "hf": lambda: read_hugging_face(src, generator, classifier if target == "megamlm" else None)}[source]()
        generator_out = None if generator is None or target != "hf" else Path(generator)
        if model.tokenizer_files is not None:  # the targets read the tokenizer from data.tokenizer
            for name, text in model.tokenizer_files.items():
                (Path(shipped) / name).write_text(text, encoding="utf-8")
            model.cfg = config_from_dict(model.cfg.to_dict(), [f"data.tokenizer={shipped}"])
        return _convert(model, source, target, src, Path(out), tp, tolerance, log, overwrite, classifier,
                        generator_out)


@contextlib.contextmanager
def _without_transformers_bars():
    """transformers (5.x) draws a bar over the tensors it loads and the shards it writes, each a second long: a
    flash on a terminal, and in a log `\\r`-joined lines in the middle of the conversion's report."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def _convert(model: Model, source: str, target: str, src, out: Path, tp: int, tolerance: float, log,
             overwrite: bool, classifier: SequenceClassifier | None = None, generator_out: Path | None = None) -> dict:
    cfg = model.cfg
    classifier = classifier or model.classifier
    log(f"read {src}: {describe(model)}")
    for note in model.notes:
        log(f"note: {note}")
    if cfg.objective.name != "mlm" and objective_class(cfg).masked_lm_inside:
        model, cfg = _masked_lm_part(model, log)
    targets = objective_class(cfg).conversion_targets
    if target not in targets:
        also = f" (this one converts to {', '.join(targets)})" if targets else ""
        raise fs.ConversionError(
            f"{src} was trained with objective.name={cfg.objective.name}: conversion to {target} (and its logit "
            f"parity check) covers masked-LM models{also}; its folder already loads at any TP degree and "
            f"`megamlm glue` fine-tunes it; nothing was written")
    bare = cfg.objective.name == "mlm" and not has_masked_lm_head(model.full)  # no head: a classifier's encoder
    if bare and (target == "fairseq" or (target == "hf" and classifier is None)):
        raise fs.ConversionError(f"{src} holds no masked-LM head (it was read from a *ForSequenceClassification or a "
                                 f"bare *Model): it converts to megamlm, and to hf with --classification-head NAME; "
                                 f"nothing was written")
    if tp != 1:  # before the probe's forwards: a large model's take minutes
        try:
            replace_config(cfg, [f"parallel.tensor_parallel={tp}"], origin=str(src))
        except ConfigError as err:
            raise ConfigError(f"--tp {tp}: {str(err).removeprefix('command line: ')}") from None
    tokens = probe_tokens(cfg)

    def probe(cfg: Config, full: dict, heads: dict) -> torch.Tensor:
        """What is compared: the model's probe output, the classification head's logits [b, labels], or (a
        folder without any head) the encoder's output [b, s, h]."""
        if classifier is not None:
            return classifier_logits(cfg, full, heads, classifier.name, tokens)
        return encoder_states(cfg, full, tokens) if bare else megamlm_logits(cfg, full, tokens)

    ours = probe(cfg, model.full, model.heads)
    pad = cfg.model.pad_token_id
    report: dict = {"max_diff": {}, "out": str(out)}  # + "symbols": {check: per position}, where not the probe's
    if model.reference is not None:
        report["max_diff"][f"{source} source"] = compare(ours, model.reference(tokens), tokens, pad,
                                                         f"the {source} source (reference forward)", tolerance,
                                                         per_sequence=classifier is not None)
    if model.generator_reference is not None:
        check = f"{source} generator"
        generator_logits = megamlm_logits(cfg, model.full, tokens, generator=True)
        report.setdefault("symbols", {})[check] = generator_logits.shape[-1]
        report["max_diff"][check] = compare(generator_logits, without_padding_column(model.generator_reference(tokens),
                                                                                     pad),
                                            tokens, pad, f"the {source} generator (reference forward)", tolerance)
    if target == "megamlm":
        _write_megamlm(model, out, tp, tokens, ours, tolerance, report, overwrite, probe, classifier is not None)
    elif target == "fairseq":
        _write_fairseq(model, out, tokens, ours, tolerance, report, overwrite)
    else:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise fs.ConversionError("--to hf needs transformers: pip install 'megamlm[hf]'") from None
        write_hf(model, out, tokens, ours, tolerance, report, overwrite, classifier, generator_out)
    for check, diff in report["max_diff"].items():
        width = report.get("symbols", {}).get(check, ours.shape[-1] if ours.dim() > 2 else None)  # ELECTRA: 1 each
        unit = "hidden units" if bare else "symbols"
        per_position = f" × {width} {unit}" if width else ""
        where = (f"{int(tokens.ne(pad).sum())} positions{per_position}" if classifier is None
                 else f"{len(tokens)} sequences × {ours.shape[-1]} outputs")
        log(f"parity vs {check}: max |Δlogit| = {diff:.2e} on {where} "
            f"(tolerance {tolerance:g})")
    log(f"wrote {out}")
    return report


def describe(model: Model) -> str:
    """One line on what a conversion read: objective, shape, vocabulary, heads."""
    m = model.cfg.model
    parts = [f"objective.name={model.cfg.objective.name}", f"{m.num_layers} layers × {m.hidden_size} hidden, "
             f"{m.num_attention_heads} heads", f"vocabulary {m.vocab_size:,}"]
    if has_generator(model.full):
        parts.append(f"generator at objective.generator_size={model.cfg.objective.generator_size:.4g}")
    if not has_masked_lm_head(model.full) and model.cfg.objective.name == "mlm":
        parts.append("no masked-LM head")
    heads = sorted({key.split(".")[0] for key in model.heads})
    if heads:
        parts.append(f"classification head{'s' if len(heads) > 1 else ''} {', '.join(heads)}")
    return "; ".join(parts)


def _masked_lm_part(model: Model, log) -> tuple[Model, Config]:
    """An MLM-based objective's model (NSP, SOP) as a masked-LM model: its further heads leave the model,
    a sentence-pair head kept as the classification head named by the objective."""
    name = model.cfg.objective.name
    objective = get_objective(model.cfg)
    heads = sorted({key.split(".")[0] for key in model.full if objective.fresh_head(key)})
    kept = as_classification_head(model.full, name)
    log(f"objective.name={name}: {', '.join(heads) or 'no further head'} "
        f"{f'kept as the classification head {name}' if kept else 'left out'}, the masked-LM model is converted")
    model.heads = {**model.heads, **kept}
    model.full = {k: v for k, v in model.full.items() if not objective.fresh_head(k)}
    model.cfg = config_from_dict(model.cfg.to_dict(), ["objective.name=mlm"])
    return model, model.cfg


def check_output(target: str, out: Path, overwrite: bool) -> None:
    """Folders (megamlm, hf): files.check_output_folder; a fairseq file: not a folder, and an
    existing file only with `overwrite`."""
    if target != "fairseq":
        check_output_folder(out, overwrite)
        return
    if out.is_dir():
        raise OutputError(f"output {out} is a directory; --to fairseq writes a file (e.g. {out}/checkpoint.pt)")
    if out.exists() and not overwrite:
        raise OutputError(f"output {out} exists; pass --overwrite to replace it")
    check_writable(out.parent)


def _write_megamlm(model: Model, out: Path, tp: int, tokens, ours, tolerance, report, overwrite, probe,
                   per_sequence: bool) -> None:
    cfg = model.cfg
    if model.tokenizer_files is not None:
        cfg = config_from_dict(cfg.to_dict(), [f"data.tokenizer={out.resolve() / 'tokenizer'}"])
    with staged_write(out, cfg, model.full, tp, model.heads, model.source, overwrite) as tmp:
        if model.tokenizer_files is not None:
            (tmp / "tokenizer").mkdir()
            for name, text in model.tokenizer_files.items():
                (tmp / "tokenizer" / name).write_text(text, encoding="utf-8")
        written = read_model_folder(tmp)
        report["max_diff"]["written megamlm folder"] = compare(
            probe(written.cfg, written.full, written.heads), ours, tokens, cfg.model.pad_token_id,
            f"the written folder {out}", tolerance, per_sequence)


def _write_fairseq(model: Model, out: Path, tokens, ours, tolerance, report, overwrite) -> None:
    cfg = model.cfg
    source = model.source or fs.FairseqSource(cfg=fs.fairseq_cfg_for(cfg.model),
                                              constants={"sentence_encoder.version": torch.tensor([3.0])})
    state = fs.megamlm_to_fairseq(model.full, cfg.model, source, model.heads)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.staging-", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp)
    os.chmod(tmp, 0o666 & ~current_umask())
    try:
        torch.save(fs.fairseq_checkpoint(state, source.cfg), tmp)
        written = load_untrusted(tmp)
        written_state, _ = fs.normalize_names(written["model"])
        report["max_diff"]["written fairseq checkpoint"] = compare(
            fairseq_logits(written_state, fs.fairseq_model_cfg(written), tokens), ours, tokens,
            cfg.model.pad_token_id, f"the written fairseq checkpoint {out}", tolerance)
        check_output("fairseq", out, overwrite)  # again: nothing appeared there meanwhile
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
