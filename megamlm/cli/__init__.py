"""`megamlm <verb>`: the command-line entry point. The experiment verbs (train, plan, config, params,
deepspeed-config) take `--config FILE` (repeatable, merged in order) and dotted overrides
(`model.position=alibi`); the others (shards, fill-mask, hostfile, convert, glue, eval) take their own
arguments."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback

from megamlm.cli.convert import add_convert_args, cmd_convert
from megamlm.cli.evaluate import add_eval_args, cmd_eval
from megamlm.cli.glue import add_glue_args, cmd_glue
from megamlm.cli.shards import add_shards_args, cmd_shards
from megamlm.cli.torchrun import (INTERRUPTED_EXIT, PEER_GONE_EXIT, failed, launch_problem, launches_ranks,
                                  relaunch_with_torchrun)
from megamlm.config import Config, ConfigError, load_config, load_config_and_origins
from megamlm.console import leave_quietly_for_a_gone_reader, print_line, stdout_reader_gone
from megamlm.errors import MegamlmError, error_line, peer_gone, room_errno, warnings_as_lines
from megamlm.stop_signals import Stopped, raising_on_stop_signals


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML experiment file (repeatable; later files win)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted overrides applied after the files, e.g. model.position=alibi")


def _add_config_verb_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--explain", action="append", nargs="?", const="", default=None, metavar="NAME",
                        help="instead of the YAML, each key's value, default, allowed values and meaning: of a "
                             "section (train), a key (model.position), keys that start so (train.spike), or "
                             "every key (no NAME); repeatable")


def cmd_config(cfg: Config, args) -> int:
    if args.explain is None:
        print(cfg.to_yaml(), end="")
    else:
        from megamlm.config.explain import explain

        print(explain(cfg, args.explain, args.origins), end="")
    return 0


def cmd_params(cfg: Config, args) -> int:
    from megamlm.objectives import get_objective
    from megamlm.parallel import destroy_distributed, init_distributed

    ctx = init_distributed(cfg.parallel)
    model = get_objective(cfg).build_model(ctx)
    m = cfg.model
    embedding = m.vocab_size * m.embedding_dim
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:
        total = model.parameter_count()
        shared = " (one shared layer)" if m.share_layers else ""
        print(f"{'layers x hidden x heads x ffn':<32}{m.num_layers} x {m.hidden_size} x "
              f"{m.num_attention_heads} x {m.ffn_hidden_size}{shared}")
        width = f" ({m.vocab_size:,} x {m.embedding_dim})" if m.embedding_dim != m.hidden_size else ""
        print(f"{'token embedding (tied)':<32}{embedding:>14,}{width}")
        print(f"{'everything else':<32}{total - embedding:>14,}")
        print(f"{'total':<32}{total:>14,}  ({total / 1e6:.1f}M)")
        print(f"{'padded vocabulary at TP=' + str(ctx.tp_size):<32}{model.padded_vocab_size:>14,}")
    destroy_distributed()
    return 0


def cmd_train(cfg: Config, args) -> int:
    from megamlm.parallel import destroy_distributed
    from megamlm.train.loop import train

    try:  # a diverged run (TrainingDiverged) is one line, exit 2; its log and checkpoints stay in train.run_dir
        summary = train(cfg, resume=args.resume, overwrite=args.overwrite,
                        allow_batch_change=args.allow_batch_change)
        if args.fill_mask and not summary.get("preempted"):
            print_fill_mask(summary["model_dir"], args.fill_mask, topk=3)
    finally:
        destroy_distributed()
    return INTERRUPTED_EXIT if summary.get("signal") == "SIGINT" else 0  # Ctrl-C: saved, but not finished


def cmd_train_check(cfg: Config, args) -> int:
    """`megamlm train --check`: one line for the first thing the run would refuse (exit 2), else one that
    says what it would do, and what the run would warn of in its log before its first update (exit 0); no
    rank starts, nothing is written."""
    from megamlm.data.shards import other_build
    from megamlm.train.preflight import check_before_launch

    would = check_before_launch(cfg, args.nproc, args.nodes, args.resume, args.overwrite, args.allow_batch_change)
    print(f"megamlm: train --check: nothing refused: {would}")
    if warning := other_build(cfg.data):
        print(f"megamlm: train --check: warning: {warning}")
    return 0


def print_fill_mask(model_dir: str, text: str, topk: int) -> None:
    """Top-k fills on every rank's process group (a TP=1 copy of the model on each; rank 0 prints)."""
    from megamlm.data.tokenizer import Tokenizer
    from megamlm.fill_mask import fill_mask
    from megamlm.objectives import load_pretrained
    from megamlm.parallel import init_distributed

    ctx = init_distributed(load_config([]).parallel)
    cfg, model = load_pretrained(model_dir, ctx)
    tokenizer = Tokenizer.load(cfg.data.tokenizer, zero_clap=cfg.model.zero_mask)
    if not 1 <= topk <= cfg.model.vocab_size:
        raise MegamlmError(f"--topk {topk}: must be between 1 and the vocabulary size {cfg.model.vocab_size}")
    results = fill_mask(model, tokenizer, text, topk)
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:
        print(f"fill-mask: {text}")
        for filled, prob, token in results:
            print(f"  {prob:7.4f}  {token!r:>14}  {filled}")


def cmd_fill_mask(args) -> int:
    from megamlm.parallel import destroy_distributed

    try:
        print_fill_mask(args.model_dir, args.text, args.topk)
    finally:
        destroy_distributed()
    return 0


def _add_train_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes on this machine (relaunches under torchrun); the layout is "
                             "parallel.tensor_parallel x data parallel over --nproc x --nodes")
    parser.add_argument("--nodes", type=int, default=1,
                        help="machines of the run, each running this command with the same --nproc and "
                             "--rendezvous (slurm/pretrain.sbatch does)")
    parser.add_argument("--rendezvous", default=None, metavar="HOST:PORT",
                        help="with --nodes > 1: where the machines meet (one of them: torchrun's c10d "
                             "rendezvous)")
    parser.add_argument("--rendezvous-id", default="megamlm", metavar="ID",
                        help="the run's name at the rendezvous, unique among runs that share HOST:PORT "
                             "(SLURM: the job id)")
    parser.add_argument("--resume", default=None, metavar="auto|TAG",
                        help="auto: continue from the newest complete, verified checkpoint of "
                             "train.run_dir (if any); TAG: that checkpoint (stepNNNNNNNN). The layout "
                             "(TP, DP, ZeRO stage, micro-batch) may differ from the checkpoint's: it is "
                             "resharded; the global batch must not")
    parser.add_argument("--allow-batch-change", action="store_true",
                        help="resume with another global batch: the data position is converted in "
                             "samples (rounded down to whole updates of the new batch)")
    parser.add_argument("--overwrite", action="store_true",
                        help="train.run_dir holds a run: start over, moving the old run aside "
                             "(to <run_dir>.replaced-<time>)")
    parser.add_argument("--check", action="store_true",
                        help="check what the run would refuse before its first update (the layout, the batch, "
                             "the GPUs, the run dir, the checkpoint to resume, the tokenizer, the shards), say "
                             "what it would do, and start nothing (slurm/pretrain.sbatch does, once per job)")
    parser.add_argument("--fill-mask", default=None, metavar="TEXT",
                        help="after training, print the top-3 fills of TEXT's <mask>")


def cmd_plan(cfg: Config, args) -> int:
    from megamlm.plan import check_budget, make_plan

    plan = make_plan(cfg, args.nodes, args.gpus_per_node, args.gpu, args.mfu, args.fill)
    print(plan.table(args.gpu_memory))
    check_budget(plan, args.gpu_memory)
    return 0


def _add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB")
    parser.add_argument("--gpu", default="H100",
                        help="whose datasheet peak FLOP/s the wall time divides by: A100, H100, H200, V100 "
                             "(default: %(default)s)")
    parser.add_argument("--mfu", type=float, default=None,
                        help="model FLOPs utilization to assume (default: what megamlm's loop measured for the "
                             "config's train.engine and train.compile on an H200, or for configs/gpu/fastest.yaml's "
                             "settings where the config has them all; the wall-time line says which)")
    parser.add_argument("--fill", type=float, default=None,
                        help="real tokens / token slots to assume (default: 0.99 packed, 0.745 padded, "
                             "measured; a run's own: the `fill` column of its log; its shards' padded: "
                             "`megamlm shards inspect`)")


def cmd_deepspeed_config(cfg: Config, args) -> int:
    import json

    from megamlm.train.engine import deepspeed_config

    print(json.dumps(deepspeed_config(cfg, args.dp), indent=2))
    return 0


def cmd_hostfile(args) -> int:
    from megamlm.launch import hostfile_text, slurm_hosts

    text = hostfile_text(args.hosts.split(",") if args.hosts else slurm_hosts(), args.slots)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


VERBS = {
    "config": (cmd_config, "print the resolved configuration (--explain: what each key means)",
               _add_config_verb_args),
    "params": (cmd_params, "build the model and print its parameter counts", None),
    "train": (cmd_train, "pretrain (or continue) the configured experiment", _add_train_args),
    "deepspeed-config": (cmd_deepspeed_config, "print the DeepSpeed JSON generated from the config",
                         lambda p: p.add_argument("--dp", type=int, default=1,
                                                  help="data-parallel size the JSON is for")),
    "plan": (cmd_plan, "layout, batch arithmetic, memory per GPU, gradient reduction dtype and wall time of a run",
             _add_plan_args),
}


class _Parser(argparse.ArgumentParser):
    """argparse without prefix matching, also in every verb's parser (they are made of this class): an
    option is its whole name, so `plan --gpus 16` is refused rather than read as --gpus-per-node 16."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})


def build_parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error (also: MEGAMLM_DEBUG=1)")
    parser = _Parser(prog="megamlm", description=__doc__, parents=[debug])
    sub = parser.add_subparsers(dest="verb", required=True)
    for name, (_, help_text, add_args) in VERBS.items():
        verb = sub.add_parser(name, help=help_text, description=help_text, parents=[debug])
        _add_config_args(verb)
        if add_args is not None:
            add_args(verb)
    add_shards_args(sub.add_parser("shards", help="build and inspect token shards", parents=[debug]))
    hostfile = sub.add_parser("hostfile", help="write a DeepSpeed hostfile (SLURM allocation or --hosts)",
                              parents=[debug])
    hostfile.add_argument("--hosts", default=None, help="comma-separated hosts (default: the SLURM allocation)")
    hostfile.add_argument("--slots", type=int, default=8, help="processes (GPUs) per host")
    hostfile.add_argument("--out", default=None, help="file to write (default: stdout)")
    fill = sub.add_parser("fill-mask", help="top-k fills of the first <mask> with a trained model", parents=[debug])
    fill.add_argument("model_dir", help="exported model folder (<run_dir>/final)")
    fill.add_argument("text", help='e.g. "The capital of China is <mask>."')
    fill.add_argument("--topk", type=int, default=5)
    add_convert_args(sub.add_parser("convert", help="convert checkpoints: fairseq, megamlm, ZeRO, "
                                                     "Hugging Face (checked on a probe batch)", parents=[debug]))
    add_glue_args(sub.add_parser("glue", help="fine-tune and evaluate on GLUE tasks (fairseq's or ELECTRA's recipe)",
                                  parents=[debug]))
    add_eval_args(sub.add_parser("eval", help="MLM perplexity (fixed masking) and length extrapolation",
                                  parents=[debug]))
    return parser


COMMANDS = {"shards": cmd_shards, "hostfile": cmd_hostfile, "fill-mask": cmd_fill_mask,
            "convert": cmd_convert, "glue": cmd_glue, "eval": cmd_eval}
"""Verbs with their own arguments; the VERBS above read a config first."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get("MEGAMLM_DEBUG", "") not in ("", "0")
    if hasattr(args, "nproc") and (problem := launch_problem(args)):
        parser.error(f"train: {problem}")
    if args.verb == "glue" and not args.merge and not (args.checkpoint and args.data_dir):
        parser.error("glue: --checkpoint and --data-dir are required (or --merge DIR)")
    # one error path for every verb: a user's mistake is one line and exit 2, a bug one line and
    # exit 1 (tracebacks with --debug), Ctrl-C outside training exit 130
    # a stop signal before the work takes it (a training's setup) is one line too; a launcher's training
    # rank (LOCAL_RANK) dies of it as before: its launcher reports. GLUE's ranks take it: rank 0 writes the
    # report of the tasks that finished
    ranks_die = "LOCAL_RANK" in os.environ and args.verb != "glue"
    with contextlib.nullcontext() if debug else warnings_as_lines(args.verb), \
            contextlib.nullcontext() if ranks_die else raising_on_stop_signals():
        return _run(parser, args, argv, debug)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str], debug: bool) -> int:
    try:
        if args.verb in COMMANDS:
            return COMMANDS[args.verb](args)
        # where each key was set, for `config --explain` (read with the config: a piped file is read once)
        cfg, args.origins = load_config_and_origins(args.config, args.overrides)
        if getattr(args, "check", False):
            return cmd_train_check(cfg, args)
        if hasattr(args, "nproc") and launches_ranks(args):
            return relaunch_with_torchrun(cfg, args, argv)
        return VERBS[args.verb][0](cfg, args)
    except KeyboardInterrupt:
        print_line(f"megamlm: {args.verb}: interrupted", sys.stderr)
        return INTERRUPTED_EXIT
    except Stopped as err:  # a training has its own handling from its first update on (it saves)
        when = " before the first update (nothing to save)" if args.verb == "train" else ""
        print_line(f"megamlm: {args.verb}: stopped: {err}{when}", sys.stderr)
        return 128 + err.signum
    except (MegamlmError, OSError) as err:
        if isinstance(err, BrokenPipeError) and stdout_reader_gone():  # `| head` has its lines: no error of ours
            return leave_quietly_for_a_gone_reader()
        if debug:
            traceback.print_exc()
        kind = "config error" if isinstance(err, ConfigError) else args.verb
        return failed(f"megamlm: {kind}: {error_line(err)}", 2)
    except Exception as err:
        if debug:
            raise
        if room_errno(err) is not None:  # a library's own error for a full disk (tokenizers': "os error 28")
            return failed(f"megamlm: {args.verb}: {error_line(err)}", 2)
        if (mark := peer_gone(err)) is not None:  # the rank that ended first has said why
            return failed(f"megamlm: {args.verb}: stopped: another rank's process ended ({mark})", PEER_GONE_EXIT)
        return failed(f"megamlm: {args.verb}: internal error: {type(err).__name__}: {error_line(err)} "
                      f"(rerun with --debug for the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
