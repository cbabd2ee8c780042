"""`megamlm glue`: fine-tune a model folder on GLUE tasks, or merge a job array's reports."""

from __future__ import annotations

import argparse
from pathlib import Path

from megamlm.cli.arguments import integer_list
from megamlm.files import check_output_folder, check_writable
from megamlm.glue.recipes import RECIPES


def cmd_glue(args) -> int:
    from megamlm.glue.finetune import RECIPE_OPTIONS, FinetuneOptions
    from megamlm.glue.run import merge_reports, run_glue
    from megamlm.glue.tasks import task_names

    options = FinetuneOptions(recipe=args.recipe, packing=args.packing, predict=args.predict, save=args.save,
                              overrides=tuple(args.overrides),
                              **{key: getattr(args, key) for key in RECIPE_OPTIONS})  # None: the recipe's
    if args.merge:
        merge_reports(args.merge)
        print((Path(args.merge) / "results.md").read_text())
        return 0
    tasks = task_names(args.tasks.split(","))
    check_writable(args.out, "--out")  # before hours of fine-tuning
    for task in tasks if args.save else ():
        check_output_folder(Path(args.out) / "models" / task, overwrite=True, what="--save folder")
    run_glue(args.checkpoint, args.data_dir, tasks, args.seeds, args.out, options,
             args.max_train_samples, args.max_eval_samples, args.parallel, args.ppl)  # some task ran, or it raised
    print((Path(args.out) / "results.md").read_text())
    return 0


def add_glue_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="model folder (<run_dir>/final or converted)")
    parser.add_argument("--data-dir", help="GLUE folder: <TASK>/train.tsv, dev.tsv")
    parser.add_argument("--merge", metavar="DIR", help="instead of running: merge DIR/<TASK>/results.json "
                                                       "(slurm/glue.sbatch's array tasks) into one table")
    parser.add_argument("--tasks", default="MNLI,QNLI,QQP,RTE,SST-2,MRPC,CoLA,STS-B",
                        help="comma-separated, in any case, with or without the hyphen (rte,sst2,stsb)")
    parser.add_argument("--seeds", type=integer_list, default=[1],
                        help="comma-separated; several give median and spread")
    parser.add_argument("--out", default="glue-results")
    parser.add_argument("--recipe", choices=tuple(RECIPES), default=next(iter(RECIPES)),
                        help="the hyper-parameters every unset option takes: fairseq (RoBERTa's, the reference's) "
                             "or electra (ELECTRA's); their values: megamlm/glue/recipes.py")
    parser.add_argument("--epochs", type=int, default=None,
                        help="default: the recipe's; 0: only score the dev rows (and --predict) with the folder's "
                             "weights, e.g. a model --save wrote")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the recipe's per task")
    parser.add_argument("--lr", type=float, default=None, help="default: the recipe's per task")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per input, longer pairs truncated (default: the recipe's)")
    parser.add_argument("--packing", choices=("packed", "padded"), default="packed",
                        help="packed: a batch's sequences end to end in rows, no compute on padding; "
                             "padded: one row per sequence (fairseq's layout)")
    parser.add_argument("--max-train-samples", type=int, default=None, help="subsample training rows")
    parser.add_argument("--max-eval-samples", type=int, default=None, help="subsample dev rows")
    parser.add_argument("--parallel", type=int, default=1, help="tasks in parallel processes")
    parser.add_argument("--ppl", type=float, default=None, help="the model's validation perplexity, "
                                                                "for the table (megamlm eval ppl)")
    parser.add_argument("--dropout", type=float, default=None,
                        help="hidden and attention dropout while fine-tuning (default: the recipe's)")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="decoupled weight decay (default: the recipe's)")
    parser.add_argument("--classifier-dropout", type=float, default=None,
                        help="dropout on the classification layer's input (default: the recipe's)")
    parser.add_argument("--layerwise-lr-decay", type=float, default=None, metavar="DECAY",
                        help="ELECTRA's layer-wise learning-rate decay (e.g. 0.8): each layer at DECAY times "
                             "the lr of the one above, the head at the lr (default: the recipe's; 1: off)")
    parser.add_argument("--predict", action="store_true",
                        help="also predict each task's test files with the best epoch's weights: "
                             "<out>/test/<TASK>.tsv in GLUE's submission format (the best seed's)")
    parser.add_argument("--save", action="store_true",
                        help="write each task's best seed at its best epoch to <out>/models/<TASK>: a model folder "
                             "with the fine-tuned encoder and the classification head <task> (fairseq's "
                             "classification_heads; `megamlm glue --checkpoint` it with --epochs 0 to predict)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="overrides of the folder's config, e.g. model.classifier_pooling=mean")
