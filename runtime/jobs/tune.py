"""`spillpack tune`: LoRA fine-tuning that survives preemption and resumes exactly.

The step loop: check for a stop request, run forward/backward as an abandonable
quantum, apply the optimizer update (never interrupted), report, commit every
--ckpt-every steps. A checkpoint holds the LoRA tensors and the AdamW moments; the
losses go to the state's append-only log, each checkpoint adding the steps since the one
before; the data cursor is the step itself, since the batch order is a pure function of
(seed, epoch, step). A loss that is not finite stops the job before its update is applied,
so the committed checkpoints stay good.
"""

import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
from safetensors.numpy import save as st_save
from safetensors.numpy import save_file as st_save_file

from runtime.models import gguf_write
from runtime.models.lora import LoraSpec, base_record, init_tensors, save_adapter
from runtime.jobs import init_adapter
from runtime.data.train import BatchOrder, collate, load_train_data, rank_rows
from runtime.data.validation import load_split
from runtime.jobs.tune_val import Validation
from runtime.engines import OptimSpec
from runtime.engines.registry import dtype_fields, get_engine, sharded_session
from runtime.core.job import Job, Outcome, state_uri
from runtime.engines.hardware import choose_engine, engine_rate
from runtime.models.ref import resolve_model
from runtime.base.signals import Abandon
from runtime.base.errors import SpillpackError
from runtime.jobs import estimate
from runtime.jobs.sizing import plan_shards
from runtime.state.uri import check_output, open_store
from runtime.models.tokenizer import Tokenizer
from runtime.base.threads import start_fields
from runtime.base.allotment import cpus

from runtime.jobs import tune_checkpoint
from runtime.jobs.tune_checkpoint import CHECKPOINT_META, CHECKPOINT_TENSORS  # noqa: F401 (the checkpoint's file names)


def learning_rate(step: int, total: int, peak: float, warmup: int, schedule: str) -> float:
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def prepare(inv):
    """Everything a tune decides before its state is opened or a weight is loaded."""
    a, o = inv.arguments, inv.options
    model_dir = resolve_model(a["model"], o.get("weights"))
    tokenizer = Tokenizer.from_dir(model_dir.path)
    val_data = None
    if o.get("val_fraction"):
        data, val_data = load_split(a["data"], tokenizer, o["max_seq"], o["val_fraction"], o["seed"], bundle=inv.bundle)
    else:
        data = load_train_data(a["data"], tokenizer, o["max_seq"], bundle=inv.bundle)
        if o.get("val"):
            val_data = load_train_data(o["val"], tokenizer, o["max_seq"], bundle=inv.bundle, what="validation data")
    init = None
    if o.get("init_adapter"):
        # Checked against the base and the options before any state is touched; the job's rank,
        # alpha and targets become the adapter's (so --emit-config and resume carry them).
        init = init_adapter.load(o["init_adapter"], model_dir, o, own_state=state_uri(o))
        o.update(rank=init.spec.rank, alpha=init.spec.alpha, targets=init.targets)
    spec = LoraSpec(rank=o["rank"], alpha=float(o["alpha"]), targets=tuple(t.strip() for t in o["targets"].split(",") if t.strip()),
                    dropout=o["dropout"])
    if init is not None:
        tensors = init.tensors
    else:
        tensors = init_tensors(model_dir.config, spec, o["seed"])  # validates --targets before any state is touched
    if o.get("out"):
        check_output(o["out"], directory=True)
    if o.get("gguf"):  # checked before training: an architecture or file GGUF cannot take fails now, not after the last step
        gguf_write.gguf_arch(model_dir.config)
        gguf_write.check_gguf_output(o["gguf"], "--gguf", replace=True)
    order = BatchOrder([len(e.ids) for e in data.examples], o["batch"], o["grad_accum"], o["seed"])
    total = order.steps_for(o.get("steps"), o.get("epochs"))
    engine_name, reason = choose_engine(o.get("engine"))
    engine = _engine(engine_name, o, model_dir)
    engine_rate(engine_name, engine.describe()["dtype"])  # measured (once per machine) before the engine counts its peak memory
    # Sized before the state is opened: a job refused here leaves no state behind that would
    # refuse the corrected command (a shorter --max-seq is another job).
    plan = plan_shards(engine_name, engine, model_dir, spec, data, order, total, o)
    return model_dir, tokenizer, data, spec, tensors, order, total, engine, plan, val_data, init


def _engine(name: str, o: dict, model_dir, kept: str | None = None):
    return get_engine(name, o.get("dtype"), width=model_dir.config.get("hidden_size"), kept=kept, training=True,
                      quantize=o.get("quantize"), max_mem_gb=o.get("max_mem_gb"))


def plan_only(inv, events) -> Outcome:
    """`spillpack tune ... --plan`: the memory plan, without running."""
    model_dir, _, data, _, _, _, total, engine, plan, _, _ = prepare(inv)
    if events.headless:
        events.engine = engine.name
        events.emit("plan", steps=total, message=plan.describe(), candidates=plan.candidates(), **plan.to_dict())
    else:
        e = plan.estimate
        print(f"tune {inv.arguments['model']} on {engine.name}: {total} steps of {inv.options['batch']}x{inv.options['grad_accum']}\n"
              f"plan: {plan.describe()}\n"
              f"  weights {e.weights_gb:.2f} GB, LoRA + AdamW {e.lora_gb:.3f} GB, activations kept {e.activations_gb:.2f} GB, "
              f"backward {e.backward_gb:.2f} GB, runtime {e.runtime_gb:.2f} GB\n"
              + "\n".join(f"  candidate: micro-batch {c['micro_batch']}, checkpointing {'on' if c['grad_checkpoint'] else 'off'}: "
                          f"{c['estimated_peak_gb']} GB" for c in plan.candidates()))
    return Outcome(0, False, plan.to_dict())


def main(inv, events) -> Outcome:
    a, o = inv.arguments, inv.options
    model_dir, tokenizer, data, spec, tensors, order, total, engine, plan, val_data, init = prepare(inv)
    identity = {
        "command": "tune",
        "model": model_dir.fingerprint(),
        "data_sha256": data.sha256,
        "steps": total,
        "effective_batch": o["batch"] * o["grad_accum"],  # the micro-batch size is not the job: a plan may split it
        **{k: o[k] for k in ("rank", "alpha", "targets", "dropout", "lr", "schedule", "warmup", "weight_decay",
                             "max_seq", "seed", "quantize")},
    }
    if init is not None:  # the adapter it starts from is part of the job (its tensors' hash)
        identity["init_adapter"] = init.sha256
    if val_data is not None:  # only then: a state written without validation keeps its identity
        identity["val"] = {"sha256": val_data.sha256 if o.get("val") else None, "fraction": o.get("val_fraction"),
                           "eval_every": o["eval_every"], "early_stop": o.get("early_stop")}
    with Job.open(inv, identity, events, upgrade=tune_checkpoint.upgrade_identity) as job:
        if job.engine_dtype(o.get("dtype"))[0] not in (None, engine.describe()["dtype"]):
            # A resume of a job begun on another dtype than the policy picks now: it keeps its own.
            engine = _engine(job.engine_name, o, model_dir, job.kept_dtype)
            plan = plan_shards(job.engine_name, engine, model_dir, spec, data, order, total, o)
        if job.writer:
            job.state.log("plan", **plan.to_dict())
        job.open_engine(engine, width=model_dir.config.get("hidden_size"), splits_rows=True)
        latest = job.state.checkpoints.latest(lambda c: tune_checkpoint.agrees(job.state, c)) if job.writer else None
        restored, abandoned = None, False
        resume = init_adapter.resume_of(init, identity) if init is not None and latest is None and job.writer else None
        try:
            with job.preemption.setup():
                opt = OptimSpec(weight_decay=o["weight_decay"])  # with --shard-base, the base split across the ranks:
                session = (sharded_session(engine, job.group, model_dir, spec, tensors, opt, o["seed"]) if plan.shards > 1
                           else engine.train_session(model_dir, spec, tensors, opt, o["seed"]))
                session.grad_checkpoint = plan.grad_checkpoint
                session.pad_id = tokenizer.pad_token_id or 0
                if latest is not None:
                    restored = tune_checkpoint.read(job.state, latest)
        except Abandon:
            abandoned = True
        if job.agree(abandoned):
            return job.preempted(latest.step if latest else 0, abandoned_quantum=True)
        if resume is not None and restored is None:
            restored = {**resume, "from_init": True}  # SRC is a state of this same job: continue from its newest checkpoint
        if job.group is not None:  # only rank 0 reads the state: the others start from its checkpoint
            restored = job.group.from_writer(restored)
        val = None
        if val_data is not None:
            val = Validation(val_data, o["eval_every"], o.get("early_stop"), plan.micro_batch, session.pad_id)
        work = TuneWork(job, engine, session, data, order, total, o, identity, plan.micro_batch, val)
        if restored is not None:
            session.load(restored["tensors"], restored["step"])
            work.restore(restored["step"], restored["losses"])
            if restored.get("from_init"):
                work.committed = 0  # this state has none of it yet: its first commit writes it all, losses from step 1
            if val is not None:
                val.restore(restored.get("val"), restored["tensors"])
            job.restored(restored["step"], restored["uri"])

        tokens_per_step = sum(len(data.examples[i].ids) for i in order.step_examples(0))
        rate = engine_rate(job.engine_name, engine.describe()["dtype"])
        est = engine_estimate(model_dir.config, tokens_per_step * max(0, total - work.done), rate["matmul_gflops"])
        events.emit("start", step=work.done, job=o["name"], model=a["model"], placement=f"{job.engine_name}: {job.engine_reason}",
                    state=job.state_uri, estimated_seconds=est, steps=total, **start_fields(job.engine_name, cpus().count), **dtype_fields(engine), rate_gflops=rate["matmul_gflops"], rate_dtype=rate.get("matmul_dtype"),
                    estimated_peak_gb=round(plan.estimate.peak_gb, 3), memory_gb=round(plan.available_gb, 3), memory_plan=plan.to_dict(),
                    memory_from=plan.available_from, micro_batch=plan.micro_batch, grad_checkpoint=plan.grad_checkpoint,
                    shard_base=plan.shards > 1, shard_reason=plan.shard_why, base_quantized=plan.quantized, weights_why=plan.base_why,
                    message=f"tune {a['model']} on {a['data']}: {total} steps of {o['batch']}x{o['grad_accum']} "
                            f"({len(data.examples)} examples, {data.dropped_long} longer than --max-seq dropped) on {job.engine_name}, "
                            f"about {_fmt(est)}; {plan.describe()}; state at {job.state_uri}")
        stopped = job.run(work, o.get("stop_after"))
        if stopped is not None:
            return stopped
        losses = work.losses
        stopped_early = val is not None and val.stopped_early
        complete = work.done >= total or stopped_early
        summary = {"steps": work.done, "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None}
        if val is not None:
            summary.update(best_step=val.best_step, best_val_loss=val.best_loss, evals=len(val.evals))
        if complete and job.writer:
            summary["adapter"] = write_outputs(job, session, spec, model_dir, a["model"], losses, o, val)
            if val is not None and val.best is not None:
                summary["best_adapter"] = summary["adapter"].rstrip("/") + "/best"
            if o.get("gguf"):
                summary["gguf"] = o["gguf"]
        return job.done(work.done, complete, stopped_early=stopped_early if val is not None else None, **summary)


class TuneWork:
    """The tune loop's quanta: one optimizer step each. A checkpoint holds the LoRA tensors, the
    AdamW moments and the losses so far; the data cursor is the step itself."""

    def __init__(self, job, engine, session, data, order, total: int, o: dict, identity: dict, micro_batch: int, val=None):
        self.job, self.engine, self.session = job, engine, session
        self.val = val  # a Validation, or None: its held-out pass is a quantum of its own, after the step that made it due
        self._eval = False  # the quantum in flight is the held-out pass
        self._val_dirty = False  # an eval settled since the last commit
        self.data, self.order, self.total, self.o, self.identity = data, order, total, o, identity
        self.micro_batch = micro_batch  # rows per forward/backward, from the memory plan
        self.lockstep = getattr(session, "lockstep", False)  # its quanta hold collectives (a sharded base's gathers)
        self.done = self.committed = 0
        self.losses: list[float] = []
        self._t0, self._result, self._targets = 0.0, None, 0
        self._times: list[float] = []  # recent step times, for eta_s

    def restore(self, step: int, losses: list[float]) -> None:
        self.done = self.committed = step
        self.losses = list(losses)

    def remaining(self) -> bool:
        if self.val is not None:
            return (self.done < self.total or self.val.pending) and not self.val.stopped_early
        return self.done < self.total

    def quantum(self) -> None:
        self._t0 = time.perf_counter()
        self._eval = self.val is not None and self.val.pending
        if self._eval:
            self.val.run(self.session)
            return
        step = self.order.micro_batches(self.done, self.micro_batch)
        examples = self.data.examples
        # Every rank divides by the whole step's target count, so the ranks' gradients sum to the step's.
        self._targets = sum(sum(examples[i].mask[1:]) for mb in step for i in mb)
        group = self.job.group
        rank, world = (group.rank, group.world) if group is not None else (0, 1)
        mine = rank_rows(step, rank, world)
        batches = [(*collate([examples[i] for i in mb], self.session.pad_id), np.array(places)) for mb, places in mine]
        if self.lockstep:  # as many passes on every rank (a sharded base gathers in each)
            batches += [None] * (max(len(rank_rows(step, r, world)) for r in range(world)) - len(batches))
        self._result = self.session.forward_backward(batches, self._targets, self.done)

    def discard(self) -> None:
        if self._eval:
            self._eval = False  # still pending: it runs again after the resume
            return
        self.session.discard()

    def settle(self) -> None:
        if self._eval:
            self._eval, self._val_dirty = False, True
            fields = self.val.settle(self.done, self.session)
            self.job.events.emit("eval", step=self.done, val_loss=round(fields["val_loss"], 6), tokens=fields["tokens"],
                                 seconds=fields["seconds"], best_step=fields["best_step"],
                                 best_val_loss=round(fields["best_val_loss"], 6), bad_evals=fields["bad_evals"],
                                 stopped_early=fields["stopped_early"])
            if self.job.writer:
                self.job.state.log("eval", step=self.done, val_loss=fields["val_loss"], tokens=fields["tokens"],
                                   seconds=fields["seconds"], best_step=fields["best_step"])
            return
        o = self.o
        loss_sum, tokens = self._result
        if self.job.group is not None:
            loss_sum, tokens = self.job.group.sum_gradients(self.session, loss_sum, tokens)
        loss = loss_sum / self._targets
        if not math.isfinite(loss):
            raise SpillpackError(
                f"training diverged: the loss of step {self.done + 1} is {loss}, so the job stops before applying it; "
                f"the state keeps its last good checkpoint (step {self.committed})",
                f"a smaller --lr than {o['lr']:g} (or a larger --warmup) with a new --state",
            )
        lr = learning_rate(self.done, self.total, o["lr"], o["warmup"], o["schedule"])
        self.session.apply(lr)
        self.done += 1
        self.losses.append(loss)
        dt = time.perf_counter() - self._t0
        self._times = (self._times + [dt])[-10:]
        eta = (sum(self._times) / len(self._times)) * (self.total - self.done)
        self.job.events.emit("step", step=self.done, steps=self.total, step_s=round(dt, 4), loss=round(loss, 6), lr=lr,
                             tokens_per_s=round(tokens / dt, 1), peak_mem_gb=round(self.engine.peak_mem_gb(), 3), eta_s=round(eta, 1))
        if self.val is not None and self.val.due(self.done, self.total):
            self.val.pending = True

    def commit_due(self) -> bool:
        if self.val is not None:
            if self.val.pending:  # commit after the pass, with its result
                return False
            if self.val.stopped_early:
                return True
        return self.done % self.o["ckpt_every"] == 0 or self.done == self.total

    def commit(self) -> None:
        if (self.done == self.committed and not self._val_dirty) or not self.job.writer:
            return
        tensors = self.session.export()
        meta = {"step": self.done, "hyper": self.identity}
        if self.val is not None:
            tensors.update(self.val.tensors())
            meta["val"] = self.val.to_meta()
        blob = st_save(tensors)
        meta = orjson.dumps(meta)
        log = b"".join(orjson.dumps({"step": i + 1, "loss": self.losses[i]}) + b"\n" for i in range(self.committed, self.done))
        c, seconds = self.job.state.checkpoints.commit(self.done, {CHECKPOINT_TENSORS: blob, CHECKPOINT_META: meta}, log=log)
        self.committed, self._val_dirty = self.done, False
        self.job.checkpointed(self.done, self.job.state.commit_uri(c), seconds)


def write_outputs(job, session, spec, model_dir, model_ref, losses, o, val=None) -> str:
    """The adapter (PEFT + mlx-lm layouts), train_log.jsonl and, with --merge, merged weights:
    under the state's adapter/ and in --out. With validation also best/ (the adapter of the
    lowest held-out loss, the same two layouts) and val_log.jsonl (every eval)."""
    with tempfile.TemporaryDirectory(prefix="spillpack-adapter-") as tmp:
        out = Path(tmp) / "adapter"
        save_adapter(out, session.adapter(), spec, model_ref, model_dir.config["num_hidden_layers"], base_record(model_dir))
        (out / "train_log.jsonl").write_bytes(b"".join(orjson.dumps({"step": i + 1, "loss": l}) + b"\n" for i, l in enumerate(losses)))
        if val is not None:
            (out / "val_log.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in val.evals))
            if val.best is not None:
                save_adapter(out / "best", val.best, spec, model_ref, model_dir.config["num_hidden_layers"], base_record(model_dir))
        if o.get("merge") or o.get("gguf"):
            weights = session.merged_weights()
            if o.get("merge"):
                write_merged(out / "merged", session, model_dir, weights)
            if o.get("gguf"):
                write_gguf(job, weights, model_dir, o)
        store = job.state.store
        for f in sorted(p for p in out.rglob("*") if p.is_file()):
            store.put_file("adapter/" + str(f.relative_to(out)), f)
        where = store.child_uri("adapter")
        if o.get("out"):
            dest = open_store(o["out"])
            for f in sorted(p for p in out.rglob("*") if p.is_file()):
                dest.put_file(str(f.relative_to(out)), f)
            where = o["out"]
    return where


def write_merged(dest: Path, session, model_dir, weights: dict | None = None) -> None:
    """`weights`: the session's merged weights when the caller has them already (--gguf too)."""
    dest.mkdir(parents=True)
    weights = session.merged_weights() if weights is None else weights
    if model_dir.config.get("tie_word_embeddings"):
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    st_save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if model_dir.is_gguf:  # its config and tokenizer written out as a Hugging Face directory's files
        from runtime.models.gguf.model import hf_files

        for name, data in hf_files(model_dir.path).items():
            (dest / name).write_bytes(data)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "special_tokens_map.json"):
        if (model_dir.path / name).exists():
            shutil.copyfile(model_dir.path / name, dest / name)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def write_gguf(job, weights: dict, model_dir, o: dict) -> None:
    """--gguf: the merged model as one GGUF file, and the two lines that make it an Ollama model."""
    info = {}
    gguf_write.deliver(o["gguf"], lambda p: info.update(gguf_write.write_model(p, weights, model_dir.config, model_dir.path,
                                                                                o["gguf_type"], name=o["name"])))
    lines = gguf_write.ollama_lines(o["gguf"], o["name"])
    job.events.say(f"wrote {o['gguf']} ({info['architecture']}, {info['type']}); to run it in Ollama: " + " && ".join(lines))


# The share of the measured matmul rate a LoRA step reaches: attention, norms, the optimizer and
# small matmuls run below the big square one doctor times.
STEP_EFFICIENCY = 0.5


def engine_estimate(config: dict, tokens: int, gflops: float) -> float:
    """Seconds for `tokens` trained tokens at half the engine's measured matmul rate in
    its own dtype (runtime.engines.hardware.engine_rate). A first guess; the step events'
    eta_s replaces it with the job's own step times."""
    return estimate.training_seconds(config, tokens, STEP_EFFICIENCY * gflops * 1e9)


def _fmt(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f} min"
