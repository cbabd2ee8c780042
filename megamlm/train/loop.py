"""The training loop, top to bottom.

    megamlm train --config configs/demo.yaml [--resume auto] [section.key=value ...]
    torchrun --nproc-per-node 2 -m megamlm train --config configs/demo.yaml parallel.tensor_parallel=2

One update = `accumulation` micro-batches per data-parallel rank. What is trained is the config's
objective (megamlm/objectives/: model, corruption, loss); the loss is fairseq's: the sum over every
loss term of the update (all ranks, all micro-batches; MLM: the masked tokens) divided by their
number, so results do not depend on how the global batch is split.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megamlm.config import Config
from megamlm.data.shards import other_build
from megamlm.data.loader import loader_deaths_explained
from megamlm.data.stream import MaskedBatches, advance
from megamlm.files import RUN_FINAL
from megamlm.host_memory import keep_freed_host_memory
from megamlm.model import names
from megamlm.model.folder import export_pretrained, read_model_folder
from megamlm.model.reshard import load_full_state_dict
from megamlm.objectives import LossTotals, Objective, ReducedTotals, get_objective
from megamlm.parallel import ParallelContext, ToHost, barrier, host_to_device, init_distributed, seed_everything
from megamlm.train.checkpoint import Checkpoints, TrainState, checkpoint_bytes
from megamlm.train.elastic import Layout
from megamlm.train.engine import build_engine
from megamlm.train.flops import PeakRate
from megamlm.train.guard import SpikeGuard
from megamlm.train.layers import apply_activation_checkpointing, compile_head, compile_layers, records_cuda_graphs
from megamlm.train.log import Log, LogWindow, train_line
from megamlm.train.preflight import check_before_work, check_same_architecture, prepare_run_dir
from megamlm.train.profiling import UpdateProfiler, phase
from megamlm.train.restart import load_resumed, resume_tag, roll_back
from megamlm.train.run_data import compiles, prepare_data, train_batches, train_stream, valid_stream
from megamlm.train.signals import Preemption


@torch.no_grad()
def evaluate(objective: Objective, model, stream: MaskedBatches, max_batches: int, ctx: ParallelContext) -> dict:
    """Validation loss (nats per loss term, all DP ranks) and the objective's metric."""
    was_training = model.training
    model.eval()
    totals = LossTotals(objective)
    for i, batch in enumerate(stream):
        if i == max_batches:
            break
        totals.add(objective.loss(model, batch.to(ctx.device)))
    model.train(was_training)
    result = totals.reduce(ctx.dp_group)
    result["tokens"] = result.pop("units")
    return result


def init_from_folder(model, cfg: Config, folder: str, objective: Objective) -> list[str]:
    """Start from a model folder's weights (checked: same architecture as the run's config); the
    objective's own heads come from the folder's classification heads where it keeps them
    (`Objective.heads_from_folder`: BERT's NSP head), and those it lacks (`Objective.fresh_head`, and the MLM
    head of a folder without one) keep their initialization. Returns what the run's log should warn about."""
    source = read_model_folder(folder)
    check_same_architecture(cfg, objective, Path(folder), source.cfg, set(source.full))
    full = {**objective.heads_from_folder(source.heads), **source.full}
    lm_head = {n for n, _ in model.named_parameters() if n.startswith(names.LM_HEAD_PREFIX)}
    new_head = lm_head.isdisjoint(full)  # a classifier's or a bare encoder's folder
    keep = {n for n, _ in model.named_parameters() if objective.fresh_head(n)} | (lm_head if new_head else set())
    load_full_state_dict(model, full, keep=keep)
    return [f"train.init_from={folder} holds no masked-LM head (read from a *ForSequenceClassification or a bare "
            f"*Model): the run starts a new one"] if new_head and lm_head else []


def train(cfg: Config, resume: str | None = None, loss_hook=None, overwrite: bool = False,
          allow_batch_change: bool = False) -> dict:
    """Run (or continue) the experiment; returns the summary. `loss_hook(step, loss) -> loss` lets
    tests inject spikes. `overwrite` starts over in a run dir that holds a run (moved aside).
    A resumed run may have another layout (TP, DP, ZeRO stage, micro-batch x accumulation: the
    checkpoint is resharded) but the same global batch, unless `allow_batch_change`."""
    with loader_deaths_explained(cfg.data.loader_workers):
        return _train(cfg, resume, loss_hook, overwrite, allow_batch_change)


def _train(cfg: Config, resume: str | None, loss_hook, overwrite: bool, allow_batch_change: bool) -> dict:
    # ---- setup -----------------------------------------------------------------------------
    ctx = init_distributed(cfg.parallel)
    keep_freed_host_memory(ctx.device.type)  # on a CPU each step's large tensors reuse the last step's memory
    rank0 = dist.get_rank() == 0
    run_dir = Path(cfg.train.run_dir)
    objective = get_objective(cfg)
    check_before_work(cfg, objective)
    moved_aside = prepare_run_dir(run_dir, resume, overwrite, dist.get_rank())
    barrier()  # rank 0 may have moved the old run aside
    log = Log(run_dir, rank0)
    if moved_aside is not None:
        log.event("overwrite", 0, moved_aside)
    seed_everything(cfg.train.seed, ctx)
    accumulation = cfg.train.accumulation_steps(ctx.dp_size)
    data = prepare_data(cfg, ctx, objective)
    model = objective.build_model(ctx)
    notes = init_from_folder(model, cfg, cfg.train.init_from, objective) if cfg.train.init_from else []
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.train.compile:
        if cfg.train.activation_checkpointing and ctx.tp_size > 1:
            warnings.warn("train.compile with train.activation_checkpointing at TP > 1: the layers run uncompiled "
                          "(torch.compile cannot replay each TP rank's dropout stream; megamlm/train/layers.py)")
        compile_layers(model, cfg.train.compile_mode)
    if cfg.train.compile_head:
        compile_head(model)
    graphs = cfg.train.compile and records_cuda_graphs(cfg.train.compile_mode)
    parameters = model.parameter_count()  # before ZeRO-3 partitions the tensors
    checkpoints = Checkpoints(run_dir, cfg.train.keep_last, allow_batch_change)
    if rank0:
        notes += [checkpoints.room_warning(checkpoint_bytes(cfg, parameters, ctx.dp_size)), other_build(cfg.data)]
    for line in filter(None, notes):  # what the run's log should warn about
        log.event("warning", 0, f"warning: {line}", message=line)
    tag = None if resume is None else resume_tag(checkpoints, resume, log)
    # resumed on its layout: the stage that wrote the checkpoint (ZeRO-1 at DP=1 before the stage-0 rule)
    stage = cfg.train.engine_zero_stage(ctx.dp_size) if tag is None else checkpoints.resume_stage(tag, cfg, ctx.dp_size)
    engine, optimizer, schedule = build_engine(model, cfg, ctx, stage)
    state = TrainState(data_seed=cfg.train.seed)
    if tag is not None:
        state = load_resumed(cfg, ctx, checkpoints, engine, schedule, tag, log)

    stream = train_stream(cfg, ctx, data, state)
    batches = train_batches(cfg, ctx, stream)
    valid = valid_stream(cfg, ctx, data)
    guard = SpikeGuard(cfg.train.spike_factor, cfg.train.spike_patience, cfg.train.spike_window)
    preemption = Preemption()
    profiler = UpdateProfiler(cfg.train.profile_updates, state.step, cfg.train.steps, ctx.device,
                              run_dir / "profile.txt", enabled=rank0)
    # only rank 0 logs MFU; on a CPU the other ranks' timing would be wasted, and would load the cores rank 0 times
    peak = PeakRate(ctx.device, cfg.train.precision, ctx.tp_size * ctx.dp_size, timed=rank0)
    update = (f"{stream.units_per_micro} micro x {accumulation} accumulation x {ctx.dp_size} DP = "
              + (f"{stream.global_batch} packed rows of {stream.budget} tokens" if stream.packed
                 else f"{stream.global_batch} sequences of <= {cfg.data.seq_length} tokens"))
    engine_name = Layout.of(cfg, ctx.dp_size, engine.zero_optimization_stage()).engine_name
    gradients = ", fp32 gradient sums" if cfg.train.fp32_grad_accumulation else \
        "" if cfg.train.grad_reduce_in_fp32 else f", gradients reduced in {cfg.train.precision}"
    log.event("start", state.step,
              f"{parameters / 1e6:.1f}M parameters | TP={ctx.tp_size} DP={ctx.dp_size} | update = {update}"
              f" | {engine_name} {cfg.train.precision}{gradients} | peak {peak} | "
              f"{stream.batches_per_epoch()} micro-batches per rank per epoch")
    if rank0:  # beside the log's first lines (a run that failed before them left no files: train/log.py)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())

    def validate(tag: str) -> dict | None:
        if valid is None:
            return None
        result = evaluate(objective, engine.module, valid, cfg.train.eval_batches, ctx)
        metric = objective.metric
        log.event("valid", state.step, f"valid @ {state.step} ({tag}): loss {result['loss']:.4f} | "
                  f"{metric} {result[metric]:.2f} | {result['tokens']:,} masked tokens", **result)
        return result

    first_valid = validate("before training" if state.step == 0 else "resumed")
    losses: list[float] = []
    window = LogWindow()
    run_start, start_step = time.perf_counter(), state.step
    corrupt = torch.zeros((), dtype=torch.float64, device=ctx.device)  # samples skipped as damaged

    # ---- updates ---------------------------------------------------------------------------
    # An update's results (its loss, the preemption flag) reach the host while the next update's work
    # is queued: the GPU need not wait for the host between updates. Updates after which the loop reads
    # the model or the optimizer (log lines, evaluation, checkpoints) are read at once (`_reads_state`).
    pending: Finished | None = None
    stop = False  # a stop signal reached some rank: save and exit
    while state.step < cfg.train.steps:
        state.restore_rng()  # after a resume or rollback: exactly the streams of the saved run
        fetch_start = time.perf_counter()
        with phase("data"):
            micro_batches = [next(batches) for _ in range(accumulation)]
        window.data_wait += time.perf_counter() - fetch_start  # time the step waited for data
        # units of each loss term (MLM: masked tokens) and corrupt samples (replaced by the loader)
        # of the update, all DP ranks
        units = [sum(column) for column in zip(*(objective.count(b) for b in micro_batches))]
        totals = host_to_device(torch.tensor([*units, sum(b.corrupt for b in micro_batches)],
                                             dtype=torch.float64), ctx.device)
        dist.all_reduce(totals, group=ctx.dp_group)
        counts = totals[:-1].clamp(min=1.0)
        corrupt += totals[-1]
        # stays on the device (no sync before the forward); DeepSpeed averages over DP and accumulation
        weight = (ctx.dp_size * accumulation / counts).float()
        update_totals = LossTotals(objective, counts)
        for batch in micro_batches:
            if graphs:  # each micro-batch a new step of Inductor's CUDA graphs; DeepSpeed's engine hid the
                # boundary (H200: "accessing tensor output of CUDAGraphs that has been overwritten")
                torch.compiler.cudagraph_mark_step_begin()
            with phase("forward"):
                out = objective.loss(engine, batch.to(ctx.device))
            with phase("backward"):
                engine.backward((out.loss_sum * weight).sum())
            with phase("engine step"):
                engine.step()
            update_totals.add(out)
            window.tokens += batch.real_tokens() * ctx.dp_size
            window.slots += batch.inputs.numel() * ctx.dp_size
        state.step += 1
        for batch in micro_batches:
            state.position = advance(state.position, batch, stream.batches_per_epoch(batch.epoch))
        finished = Finished(state.step, update_totals.start_reduce(ctx.dp_group), preemption.start_check(ctx.device))

        # the previous update's results, then this one's if the loop reads the state after it
        rolled_back, in_flight, pending = False, [u for u in (pending, finished) if u is not None], None
        for update in in_flight:
            if update is finished and not (stop or _reads_state(cfg, update.step, start_step)):
                pending = update
                break
            with phase("loss read"):  # waits for this update only
                result = update.totals.result()
                stop = stop or bool(update.stop.get().item())
            loss = result.pop("loss")
            if loss_hook is not None:
                loss = loss_hook(update.step, loss)
            reason = guard.check(loss) or _engine_fault(engine, update.step)
            if reason is not None:  # the update after it (in flight) is discarded with the rest
                state = roll_back(cfg, ctx, engine, schedule, checkpoints, state, update.step, log, reason)
                stream = train_stream(cfg, ctx, data, state)
                batches = train_batches(cfg, ctx, stream)
                guard.reset()
                rolled_back = True
                break
            losses.append(loss)
        if rolled_back:  # (pending is None: a rollback leaves the loop before `finished` is kept)
            window = LogWindow()  # the next line: the updates after the rollback, not its reload
            continue
        profiler.update_done(state.step, log)  # train.profile_updates: records a few updates after warm-up
        if pending is not None:
            continue

        # ---- nothing in flight: the model and optimizer are those after update state.step ----
        if state.step == start_step + 1 and compiles(cfg):  # once per run: what compilation costs
            first = time.perf_counter() - run_start
            log.event("compile", state.step, f"compile: the first update took {_duration(first)} "
                      f"({first:.1f} s), compilation included; later updates show the compiled speed",
                      first_update_s=first)
        if cfg.train.logs_after(state.step):
            elapsed = window.elapsed()
            tokens_per_s = window.tokens / elapsed
            utilization = peak.mfu(objective.flops_per_token(cfg.data.seq_length), tokens_per_s)
            if peak.retimed:
                log.event("peak", state.step, peak.retimed, peak_flops=peak.peak)
                peak.retimed = None
            done = state.step - start_step
            eta = (time.perf_counter() - run_start) / done * (cfg.train.steps - state.step)
            values = {"loss": loss, objective.metric: result[objective.metric], "lr": schedule.get_last_lr()[0],
                      "grad_norm": _float(engine.get_global_grad_norm()),
                      "loss_scale": _loss_scale(engine, optimizer),
                      "tokens_per_s": tokens_per_s, "mfu": utilization, "data_wait": window.data_wait / elapsed,
                      "fill": window.tokens / window.slots, "corrupt_samples": int(corrupt.item()),
                      "skipped_updates": int(engine.skipped_steps)}  # inf/NaN gradients (bf16, fp16)
            extra = {**{k: v for k, v in result.items() if k not in (objective.metric, "units")},
                     **objective.log_values(engine.module)}
            values.update(extra)
            log.event("train", state.step, train_line(state.step, cfg.train.steps, objective.metric, values, extra,
                                                      _duration(eta)), **values)
            window = LogWindow()

        with window.paused():  # evaluations and checkpoints: not in the next line's tokens/s and MFU
            if state.step % cfg.train.eval_interval == 0 and state.step < cfg.train.steps:
                validate("periodic")
            if stop:
                checkpoints.save(engine, state, cfg)
                log.event("preempted", state.step, f"signal received: saved update {state.step} "
                          f"({preemption.signal}); continue with --resume auto", signal=preemption.signal)
                log.close()
                return {"preempted": True, "signal": preemption.signal, "step": state.step, "losses": losses}
            if state.step % cfg.train.save_interval == 0 and state.step < cfg.train.steps:
                checkpoints.save(engine, state, cfg)

    # ---- end of run ------------------------------------------------------------------------
    final_valid = validate("end of training")
    checkpoints.save(engine, state, cfg)
    final_dir = export_pretrained(engine.module, cfg, run_dir / RUN_FINAL, engine.zero_optimization_stage(),
                                  objective.exported)
    summary = {"steps": state.step, "rollbacks": state.rollbacks, "losses": losses,
               "valid_before": first_valid, "valid_after": final_valid, "model_dir": str(final_dir),
               "minutes": (time.perf_counter() - run_start) / 60, "corrupt_samples": int(corrupt.item())}
    text = (f"done: {state.step} updates in {summary['minutes']:.1f} min, {state.rollbacks} rollbacks, "
            f"{summary['corrupt_samples']} corrupt samples skipped")
    if first_valid and final_valid:
        text += (f" | valid ppl {first_valid['ppl']:.1f} -> {final_valid['ppl']:.1f}")
    log.event("summary", state.step, text + f" | model: {final_dir}",
              rollbacks=state.rollbacks, minutes=summary["minutes"], corrupt_samples=summary["corrupt_samples"])
    log.close()
    return summary


@dataclass
class Finished:
    """An update whose results are on their way to the host."""

    step: int
    totals: ReducedTotals
    stop: ToHost
    """1 when a stop signal reached any rank (`Preemption.start_check`)."""


def _reads_state(cfg: Config, step: int, start_step: int) -> bool:
    """Whether the loop reads the model, optimizer or RNG state after update `step` (a log line, an
    evaluation, a checkpoint, the end; the first update's time), so that the next update must wait."""
    return (step == start_step + 1 or cfg.train.logs_after(step)
            or any(step % interval == 0 for interval in (cfg.train.eval_interval, cfg.train.save_interval)))


def _engine_fault(engine, step: int) -> str | None:
    """Why the engine cannot train on from update `step` (the flat engine says; DeepSpeed raises)."""
    fault = getattr(engine, "fault", None)
    return fault(step) if fault is not None else None


def _loss_scale(engine, optimizer) -> float:
    """fp16's current loss scale (1 otherwise): the flat engine's, or DeepSpeed's optimizer's (ZeRO's and
    the stage-0 fp16 optimizers' `loss_scale`)."""
    scaler = getattr(engine, "scaler", None)
    return float(scaler.scale.item() if scaler is not None else getattr(optimizer, "loss_scale", 1.0) or 1.0)


def _float(value) -> float:
    if value is None:
        return float("nan")
    return float(value.item() if torch.is_tensor(value) else value)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"
