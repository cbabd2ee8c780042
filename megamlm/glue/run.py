"""`megamlm glue`: fine-tune one pretrained folder on GLUE tasks × seeds; JSON + markdown report.

Tasks run in sequence in this process (which may be a data-parallel world under torchrun), or in
`parallel` spawned processes of one rank each. A task whose files are missing is reported and
skipped; a run that ends early (a stop signal, Ctrl-C, a task's error) reports the tasks that finished.
Output: <out>/results.json (every epoch's metrics) and <out>/results.md (the reference's table: PPL then
best validation accuracy per task and best STS-B MSE; then GLUE's metrics).
"""

from __future__ import annotations

import json
import multiprocessing
import random
import shutil
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megamlm.config import Config, ParallelConfig
from megamlm.console import print_line
from megamlm.data.tokenizer import Tokenizer
from megamlm.errors import check_ranges, warnings_as_lines
from megamlm.glue.finetune import FinetuneOptions, SentenceClassifier, finetune
from megamlm.glue.submission import prediction_lines, write_submission
from megamlm.glue.tasks import (TASKS, GlueDataError, read_examples, read_test_examples, task_extra_dev_files,
                                task_files, task_names, task_test_files)
from megamlm.glue.metrics import best_of
from megamlm.glue.recipes import PAPER_RECIPES
from megamlm.host_memory import keep_freed_host_memory
from megamlm.model import names
from megamlm.model.folder import ModelFolder, check_model_folder, read_model_folder, write_model_folder
from megamlm.model.reshard import full_state_dict
from megamlm.objectives import encoder_from
from megamlm.parallel import init_distributed, seed_everything
from megamlm.stop_signals import Stopped, holding_stop_signals, starting_workers

TABLE_ORDER = ("MNLI", "QNLI", "QQP", "RTE", "SST-2", "MRPC", "CoLA", "STS-B")


def run_task(checkpoint: str, data_dir: str, name: str, seeds: list[int], options: FinetuneOptions,
             max_train: int | None, max_eval: int | None, out: str | None = None, ctx=None, log=print) -> dict:
    """All seeds of one task; returns {"seeds": {seed: result}, "train_rows": n, "dev_rows": n}. With
    options.save, the best seed's model at its best epoch goes to <out>/models/<TASK> ("saved": the path)."""
    task = TASKS[name]
    files = task_files(task, data_dir)
    if isinstance(files, str):
        return {"skipped": files}
    train_all, dev = read_examples(task, files[0]), read_examples(task, files[1])
    extra_dev = {suffix: read_examples(task, path) for suffix, path in task_extra_dev_files(task, data_dir).items()}
    tests = {}  # submission name -> the test file's rows
    if options.predict:
        tests = {submission: read_test_examples(task, path) for path, submission in task_test_files(task, data_dir)}
        if not tests:
            log(f"{name}: no test file ({', '.join(file for file, _ in task.test_files)}) in {Path(data_dir) / name}")
    rng = random.Random(0)  # the same subsample for every seed and variant
    train = rng.sample(train_all, max_train) if max_train and max_train < len(train_all) else train_all
    dev, *extra = [rng.sample(rows, max_eval) if max_eval and max_eval < len(rows) else rows
                   for rows in (dev, *extra_dev.values())]
    extra_dev = dict(zip(extra_dev, extra))
    ctx = ctx or init_distributed(ParallelConfig())
    keep_freed_host_memory(ctx.device.type)  # as pretraining: each update's tensors reuse the last one's memory
    result = {"train_rows": len(train), "train_rows_in_file": len(train_all), "dev_rows": len(dev),
              **{f"dev_rows_{suffix}": len(rows) for suffix, rows in extra_dev.items()}, "seeds": {}}
    saved = read_model_folder(checkpoint)
    pretrained = folder_tensors(saved)
    recipe = options.recipe_for(task, saved.cfg.model)
    for seed in seeds:
        seed_everything(seed, ctx)
        cfg, body = encoder_from(saved, checkpoint, ctx, config_overrides(replace(options, dropout=recipe.dropout)))
        tokenizer = Tokenizer.load(cfg.data.tokenizer, zero_clap=cfg.model.zero_mask)
        model = SentenceClassifier(body, task.num_classes, seed, pretrained=pretrained,
                                   dropout=recipe.classifier_dropout, name=task.head_name)
        if seed == seeds[0]:
            log(f"{name}: classifier {cfg.model.classifier} on {cfg.model.classifier_pooling} features, "
                + (f"started from {', '.join(model.pretrained)}" if model.pretrained else "drawn fresh"))
            paper = PAPER_RECIPES.get(saved.cfg.objective.name, options.recipe)
            if paper != options.recipe:  # the same recipe for every objective compares them; say so, no more
                log(f"{name}: note: the folder was pretrained with objective.name={saved.cfg.objective.name}, "
                    f"whose paper fine-tunes as --recipe {paper}; this run: --recipe {options.recipe}")
        result["seeds"][seed] = finetune(model, task, train, dev, tokenizer, options, seed, ctx, log=log, test=tests,
                                         extra_dev=extra_dev)
        predicted = result["seeds"][seed].get("test", {})
        for submission, predictions in predicted.items():
            predicted[submission] = prediction_lines(task, tests[submission], predictions)
        if options.save and best_of(task.metrics[0], result["seeds"], lambda k: result["seeds"][k]["best"]) == seed:
            kept, fine_tuned = seed, fine_tuned_folder(saved, cfg, model, task.head_name)  # at its best epoch
    if options.save and (not dist.is_initialized() or dist.get_rank() == 0):
        result["saved"] = str(write_model_folder(Path(out) / "models" / name, *fine_tuned, overwrite=True))
        log(f"{name}: saved seed {kept} at epoch {result['seeds'][kept]['best']['epoch']} to {result['saved']}")
    return result


def fine_tuned_folder(saved: ModelFolder, cfg: Config, model: SentenceClassifier, head_name: str) -> tuple:
    """write_model_folder's (cfg, full, tp, heads, source) for a fine-tuned model: the folder's tensors with
    the fine-tuned encoder's, and its classification heads with `head_name`'s, on the CPU."""
    body = {key: tensor.detach().to("cpu", copy=True) for key, tensor in full_state_dict(model.body).items()
            if key in saved.full}
    head = {f"{head_name}.{key}": param.detach().to("cpu", copy=True) for key, param in model.head.named_parameters()}
    return cfg, {**saved.full, **body}, 1, {**saved.heads, **head}, saved.source


def config_overrides(options: FinetuneOptions) -> list[str]:
    """What fine-tuning changes in the folder's config: the dropout (set: the recipe's is filled in by
    the caller), then the user's overrides."""
    return [f"model.hidden_dropout={options.dropout}", f"model.attention_dropout={options.dropout}",
            *options.overrides]


def folder_tensors(saved: ModelFolder) -> dict:
    """A model folder's tensors a classification head may start from: the model's, and its classification
    heads' as `classification_heads.<name>.*` (fairseq's names)."""
    return {**saved.full, **{names.CLASSIFICATION_HEADS + name: tensor for name, tensor in saved.heads.items()}}


def _spawned(args) -> dict:
    torch.set_num_threads(1)
    with warnings_as_lines("glue"):  # as in the parent process (cli)
        return run_task(*args, log=print_line)


def run_glue(checkpoint: str, data_dir: str, tasks: list[str], seeds: list[int], out: str,
             options: FinetuneOptions, max_train: int | None = None, max_eval: int | None = None,
             parallel: int = 1, ppl: float | None = None, log=print_line) -> dict:
    tasks = task_names(tasks)
    check_ranges([(f"--max-train-samples {max_train}", max_train, ">= 1"),
                  (f"--max-eval-samples {max_eval}", max_eval, ">= 1"), (f"--parallel {parallel}", parallel, ">= 1"),
                  (f"--ppl {ppl}", ppl, ">= 1"),  # the table's perplexity: exp of a cross-entropy, >= 1
                  *((f"seed {seed}", seed, ">= 0") for seed in seeds)], GlueDataError)
    check_model_folder(checkpoint)  # before the tasks' files: a wrong path is said first, not after them
    if not Path(data_dir).is_dir():
        raise GlueDataError(f"GLUE data dir {data_dir}: not a folder (it holds <TASK>/train.tsv and dev.tsv)")
    # a task whose files are missing is skipped (a partial download); none found is a wrong folder
    missing = {t: reason for t in tasks if isinstance(reason := task_files(TASKS[t], data_dir), str)}
    if len(missing) == len(tasks):
        raise GlueDataError(f"GLUE data dir {data_dir} holds the files of none of the tasks asked for: "
                            + "; ".join(f"{t}: {reason}" for t, reason in missing.items()))
    jobs = {t: (checkpoint, data_dir, t, seeds, options, max_train, max_eval, out) for t in tasks}
    results: dict = {}  # each task's, as it finishes

    def finished(task: str, result: dict) -> None:
        results[task] = result
        if "skipped" not in result:  # the report names those
            log(f"{task}: finished ({len(results)} of {len(tasks)} tasks)")

    try:
        if parallel > 1:
            _run_in_processes(jobs, parallel, finished)
        else:
            for t, job in jobs.items():
                finished(t, run_task(*job, log=log))
    except BaseException as stop:  # a stop signal, Ctrl-C, a task's error: the finished tasks' results stay
        ran = [t for t, result in results.items() if "skipped" not in result]
        if ran:
            with holding_stop_signals():  # a second signal waits for the report
                unfinished = {"skipped": f"not finished: {_ended(stop)}"}
                _report(checkpoint, options, max_train, max_eval, ppl,
                        {t: results[t] if t in results else dict(unfinished) for t in tasks}, out, log)
                log(f"{len(ran)} of {len(tasks)} tasks finished before {_ended(stop)}: their results are in "
                    f"{Path(out) / 'results.json'}")
        raise
    with holding_stop_signals():  # every task finished: a stop now is taken once the report is whole
        return _report(checkpoint, options, max_train, max_eval, ppl, {t: results[t] for t in tasks}, out, log)


def _run_in_processes(jobs: dict, parallel: int, finished: Callable[[str, dict], None]) -> None:
    """`jobs` (task -> run_task's arguments) in `parallel` spawned processes; `finished(task, result)` as
    each one ends. On a stop or an error the tasks not started are cancelled and the running ones'
    processes ended at once: a task may run for hours."""
    pool = ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn"))
    try:
        with starting_workers():  # no worker half-started by a stop; a Ctrl-C is this process's alone
            futures = {pool.submit(_spawned, job): task for task, job in jobs.items()}
        for future in as_completed(futures):
            finished(futures[future], future.result())
    except BaseException:
        # the executor ends its processes only once their tasks return (terminate_workers: Python 3.14)
        processes = list((pool._processes or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()
        raise
    finally:
        pool.shutdown(wait=True)


def _ended(stop: BaseException) -> str:
    """What ended a GLUE run early, for its report."""
    if isinstance(stop, Stopped):
        return f"the run was stopped ({stop})"
    if isinstance(stop, KeyboardInterrupt):
        return "the run was interrupted"
    return f"the run ended on an error ({type(stop).__name__}: {stop})"


def _report(checkpoint: str, options: FinetuneOptions, max_train: int | None, max_eval: int | None,
            ppl: float | None, results: dict, out: str, log) -> dict:
    """The report of the tasks' `results` (in the order asked for): summaries, test predictions,
    <out>/results.json and results.md (rank 0)."""
    report = {"checkpoint": checkpoint, "options": asdict(options.with_recipe()), "max_train": max_train,
              "max_eval": max_eval, "ppl": ppl, "tasks": results}
    for name, result in results.items():
        if "skipped" in result:
            log(f"{name}: skipped ({result['skipped']})")
        else:
            result["summary"] = summarize(result)
    if not dist.is_initialized() or dist.get_rank() == 0:  # data-parallel ranks hold the same results
        for name, result in results.items():
            written = write_submission(Path(out) / "test", TASKS[name], result) if "seeds" in result else {}
            for path in written.values():
                log(f"{name}: test predictions {path} (seed {result['test_seed']})")
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text(json.dumps(report, indent=1))
        (Path(out) / "results.md").write_text(markdown(report))
    return report


def merge_reports(folder: str | Path) -> dict:
    """One report from the per-task runs of a job array (<folder>/<TASK>/results.json); written to
    <folder>/results.{json,md}, and their test predictions (--predict) gathered in <folder>/test/."""
    folder = Path(folder)
    parts = sorted(folder.glob("*/results.json"))
    if not parts:
        raise FileNotFoundError(f"{folder}: no */results.json (the array tasks write <model>/glue/<TASK>/)")
    report: dict = {}
    for path in parts:
        part = json.loads(path.read_text())
        tasks = {**report.get("tasks", {}), **{k: v for k, v in part["tasks"].items() if "summary" in v}}
        report = {**part, "tasks": tasks}
    (folder / "results.json").write_text(json.dumps(report, indent=1))
    (folder / "results.md").write_text(markdown(report))
    for path in sorted(folder.glob("*/test/*.tsv")):  # each task's submission files (not the per-seed ones)
        (folder / "test").mkdir(exist_ok=True)
        shutil.copyfile(path, folder / "test" / path.name)
    return report


def summarize(result: dict) -> dict:
    """Per metric: median and spread (min, max) of the best epoch over seeds."""
    bests = [r["best"] for r in result["seeds"].values()]
    keys = [k for k in bests[0] if k not in ("epoch", "train_loss", "seconds")]
    return {k: {"median": statistics.median(b[k] for b in bests), "min": min(b[k] for b in bests),
                "max": max(b[k] for b in bests)} for k in keys}


def _cell(result: dict | None, metric: str, percent: bool) -> str:
    if not result or "summary" not in result or metric not in result["summary"]:
        return "–"
    s = result["summary"][metric]
    scale = 100 if percent else 1
    text = f"{s['median'] * scale:.1f}" if percent else f"{s['median']:.4f}"
    if s["max"] > s["min"]:
        text += f" ± {(s['max'] - s['min']) * scale / 2:.{1 if percent else 4}f}"
    return text


def markdown(report: dict) -> str:
    tasks = report["tasks"]
    seeds = {len(r["seeds"]) for r in tasks.values() if "seeds" in r}
    recipe = report.get("options", {}).get("recipe", "fairseq")  # reports before recipes: fairseq's
    lines = [f"GLUE dev results of `{report['checkpoint']}` ({recipe} recipe, median over {max(seeds, default=0)} "
             f"seed(s), ± half the range)", "",
             "| PPL↓ | " + " | ".join(t if t != "STS-B" else "STS-B↓" for t in TABLE_ORDER) + " |",
             "|" + "---|" * (len(TABLE_ORDER) + 1),
             f"| {report['ppl']:.2f} |" if report.get("ppl") else "| – |"]
    lines[-1] += "".join(f" {_cell(tasks.get(t), 'mse' if t == 'STS-B' else 'accuracy', t != 'STS-B')} |"
                         for t in TABLE_ORDER)
    lines += ["", "GLUE's own metrics (MCC for CoLA, F1 for MRPC/QQP, Pearson/Spearman for STS-B):", "",
              "| task | metric | value |", "|---|---|---|"]
    for name in TABLE_ORDER:
        result = tasks.get(name)
        if result and "summary" in result:
            for metric in TASKS[name].reported_metrics:
                lines.append(f"| {name} | {metric} | {_cell(result, metric, metric != 'mse')} |")
        elif result:
            lines.append(f"| {name} | skipped | {result['skipped']} |")
    return "\n".join(lines) + "\n"
