"""`megamlm convert`: a checkpoint from one format to another (fairseq, megamlm, ZeRO, Hugging Face), written only
when its logits agree with the source's on a probe batch."""

from __future__ import annotations

import argparse

from megamlm.convert import SOURCES, TARGETS


def cmd_convert(args) -> int:
    from megamlm.convert.hf_export import SequenceClassifier
    from megamlm.convert.pipeline import convert
    from megamlm.glue.tasks import TASKS

    classifier = None
    if args.classification_head:  # a GLUE task's head (megamlm glue --save) gets the task's class names
        task = next((t for t in TASKS.values() if t.head_name == args.classification_head), None)
        classifier = SequenceClassifier(args.classification_head, task.labels if task else None)
    # the world of one it sets up is left as is: converting is the whole process (or a caller's step)
    convert(args.source, args.target, args.src, args.out, dict_path=args.dict, tp=args.tp,
            tolerance=args.tolerance, overwrite=args.overwrite, classifier=classifier, generator=args.generator)
    return 0


def add_convert_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True, choices=SOURCES,
                        help="fairseq: a fairseq/ALiBi-CLAP-fork .pt; megamlm: a model folder; "
                             "zero: a DeepSpeed training checkpoint (run dir or step folder); "
                             "hf: a transformers folder (save_pretrained, sharded or not) of a RoBERTa, BERT, ALBERT, "
                             "ModernBERT or ELECTRA model: masked LM, pretraining or sequence-classification class")
    parser.add_argument("--to", dest="target", required=True, choices=TARGETS,
                        help="megamlm: a model folder; fairseq: a .pt file; hf: a transformers folder")
    parser.add_argument("src", help="the checkpoint to read")
    parser.add_argument("out", help="where to write (nothing is written unless the logits agree)")
    parser.add_argument("--dict", default=None, help="the fairseq dict.txt (default: bundled GPT-2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel shards of a megamlm output")
    parser.add_argument("--classification-head", metavar="NAME", default=None,
                        help="--to hf: write the folder's classification head NAME (e.g. `rte` from megamlm glue "
                             "--save) as the model's *ForSequenceClassification, with a GLUE task's label names; "
                             "--from hf of a *ForSequenceClassification: the head it becomes (default: config.json's "
                             "finetuning_task), its rows in the GLUE task's label order where id2label names them")
    parser.add_argument("--generator", metavar="FOLDER", default=None,
                        help="ELECTRA's generator as transformers' ElectraForMaskedLM folder (e.g. "
                             "google/electra-base-generator): --from hf reads it along with the discriminator, so "
                             "that continued pretraining starts from both; --to hf writes an ELECTRA folder's there")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="max |logit difference| allowed, relative to max(1, |logit|)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output megamlm wrote (a folder holding anyone "
                             "else's files is always refused)")
