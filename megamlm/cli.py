"""`megamlm <verb>`: the command-line entry point. Every verb takes `--config FILE` (repeatable,
merged in order) and dotted overrides (`model.position=alibi`)."""

from __future__ import annotations

import argparse
import sys

import yaml

from megamlm.config import Config, ConfigError, load_config


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML experiment file (repeatable; later files win)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted overrides applied after the files, e.g. model.position=alibi")


def cmd_config(cfg: Config, args) -> int:
    print(yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False), end="")
    return 0


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


def cmd_params(cfg: Config, args) -> int:
    from megamlm.model import MaskedLM
    from megamlm.parallel import destroy_distributed, init_distributed

    ctx = init_distributed(cfg.parallel)
    model = MaskedLM(cfg.model, ctx, seed=cfg.train.seed)
    m = cfg.model
    embedding = m.vocab_size * m.hidden_size
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:
        total = model.parameter_count()
        print(f"{'layers x hidden x heads x ffn':<32}{m.num_layers} x {m.hidden_size} x "
              f"{m.num_attention_heads} x {m.ffn_hidden_size}")
        print(f"{'token embedding (tied)':<32}{embedding:>14,}")
        print(f"{'everything else':<32}{total - embedding:>14,}")
        print(f"{'total':<32}{total:>14,}  ({total / 1e6:.1f}M)")
        print(f"{'padded vocabulary at TP=' + str(ctx.tp_size):<32}{model.padded_vocab_size:>14,}")
    destroy_distributed()
    return 0


def cmd_smoke(cfg: Config, args) -> int:
    from megamlm.parallel import destroy_distributed, init_distributed
    from megamlm.smoke import run_smoke

    ctx = init_distributed(cfg.parallel)
    is_logger = ctx.tp_rank == 0 and ctx.dp_rank == 0
    result = run_smoke(cfg, ctx, log=print if is_logger else (lambda *_: None))
    destroy_distributed()
    if result["last"] >= result["first"]:
        print("smoke: the loss did not decrease", file=sys.stderr)
        return 1
    return 0


VERBS = {
    "config": (cmd_config, "print the resolved configuration"),
    "params": (cmd_params, "build the model and print its parameter counts"),
    "smoke": (cmd_smoke, "forward/backward/optimizer smoke run of the configured model"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megamlm", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    for name, (_, help_text) in VERBS.items():
        _add_config_args(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        return VERBS[args.verb][0](cfg, args)
    except ConfigError as err:
        print(f"megamlm: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
