"""The options of every job command, as data, with the rules their values obey.

One table drives the argument parser, `--emit-config` (every default written out),
`--config` (options given next to it win) and validation: a value is checked by the same
rule whether it came from the command line, a config file or a job's saved invocation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from runtime.core.notices import MODES as NOTICE_MODES
from runtime.base.signals import GRACE_MAX_S
from runtime.core.launch import NPROC_MAX
from runtime.engines.hardware import ENGINE_NAMES
from runtime.engines.registry import DTYPES as BASE_DTYPES
from runtime.base.errors import SpillpackError
from runtime import trackers

# eval's scoring rules (runtime/jobs/metrics.py scores each): named here, where --metric is checked.
METRICS = ("exact_match", "contains", "regex", "json_field")

ENGINES = ("auto", *ENGINE_NAMES)
DTYPES = ("auto", *BASE_DTYPES)  # the frozen base's (runtime/engines/registry.py resolves auto)
GRAD_CHECKPOINT = ("auto", "on", "off")
# A job name is one path component (it names SPILLPACK_HOME/jobs/NAME) from a safe alphabet.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# A whole number a job counts with is at most this, unless its option says otherwise: the
# state's records (JSON through orjson) and numpy/torch counters hold 64-bit integers.
INT_MAX = 2**63 - 1
# The most shards a job splits into: one worker each, and Kubernetes' limit on an Indexed Job's completions.
SHARDS_MAX = 100_000
SEED_MAX = 2**64 - 1  # a seed is any unsigned 64-bit value (torch.manual_seed's range)


@dataclass(frozen=True)
class Opt:
    name: str  # python name; the flag is --name-with-dashes
    default: object = None
    type: object = str  # str, int, float, or a converter from text (its __name__ says what it takes)
    help: str = ""
    choices: tuple | None = None
    positional: bool = False
    flag: bool = False  # store_true
    in_config: bool = True  # presentation options (--debug, --headless) are not part of a job
    per_run: bool = False  # how this process runs, not what the job is: `resume` does not replay it
    metavar: str | None = None
    min: float | None = None  # inclusive bounds
    max: float | None = None
    above: float | None = None  # exclusive bounds
    below: float | None = None
    repeat: bool = False  # may be given more than once: the values are joined with commas

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    def example(self) -> str:
        """A valid value to suggest in an error line."""
        if self.default is not None and not self.flag:
            return str(self.default)
        return {"stop_after": "10", "steps": "100", "epochs": "1", "alpha": "32", "shard": "0"}.get(self.name, "...")


def _stop_after(text: str) -> int | str:
    """N for steps or rows; build also takes STAGE or STAGE:N."""
    return int(text) if str(text).isdigit() else str(text)


_stop_after.__name__ = "N or STAGE[:N]"


def _bad(command: str, opt: Opt, what: str) -> SpillpackError:
    return SpillpackError(f"{opt.flag_name} {what}", f"spillpack {command} ... {opt.flag_name} {opt.example()}")


def check_value(command: str, opt: Opt, value):
    """The value if it obeys the option's rule; otherwise one line naming the rule. Values from a
    config file arrive as JSON/TOML types, so the type is checked too (true is not a step count)."""
    if value is None:
        if opt.positional:
            return value  # reported as missing by resolve
        if opt.default is None:
            return None
        raise _bad(command, opt, f"needs a value (default {opt.default})")
    if opt.repeat and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if opt.flag:
        if not isinstance(value, bool):
            raise _bad(command, opt, f"is true or false, not {value!r}")
        return value
    if opt.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(command, opt, f"takes a whole number, not {value!r}")
    elif opt.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(command, opt, f"takes a number, not {value!r}")
        try:
            value = float(value)
        except OverflowError:  # a whole number from a config file too large for a float
            value = math.inf
        if not math.isfinite(value):
            raise _bad(command, opt, f"must be a finite number, not {value}")
    elif opt.type is _stop_after:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _bad(command, opt, f"takes N or STAGE[:N], not {value!r}")
        if isinstance(value, int) and value < 0:
            raise _bad(command, opt, f"must be 0 or more, not {value}")
        if isinstance(value, int) and value > INT_MAX:
            raise _bad(command, opt, f"must be at most {INT_MAX}, not {_num(value)}")
    elif not isinstance(value, str):
        raise _bad(command, opt, f"takes text, not {value!r}")
    if opt.choices is not None and value not in opt.choices:
        raise _bad(command, opt, f"is one of {', '.join(map(str, opt.choices))}, not {value!r}")
    if opt.type is int and opt.max is None and value > INT_MAX:
        raise _bad(command, opt, f"must be at most {INT_MAX} (a 64-bit count), not {_num(value)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if opt.min is not None and value < opt.min:
            rule = {0: "must be 0 or more", 1: "must be positive"}.get(opt.min, f"must be at least {_num(opt.min)}")
            raise _bad(command, opt, f"{rule}, not {_num(value)}")
        if opt.above is not None and value <= opt.above:
            rule = "must be positive" if opt.above == 0 else f"must be more than {_num(opt.above)}"
            raise _bad(command, opt, f"{rule}, not {_num(value)}")
        if opt.max is not None and value > opt.max:
            raise _bad(command, opt, f"must be at most {_num(opt.max)}, not {_num(value)}")
        if opt.below is not None and value >= opt.below:
            raise _bad(command, opt, f"must be less than {_num(opt.below)}, not {_num(value)}")
    if opt.name == "report_to":
        value = ",".join(trackers.parse(value, command)) or "none"  # an unknown tracker is a usage error (exit 2)
    if opt.name == "name" and not NAME_RE.match(value):
        raise SpillpackError(f"--name {value!r} is not a job name: letters, digits, '.', '_' and '-', starting with a letter or digit, "
                             f"at most 100 characters", f"spillpack {command} ... --name {safe_name(value)}")
    return value


def safe_name(text: str) -> str:
    """The nearest valid job name to `text` (used for names derived from file names)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-.")[:100]
    return name if name and NAME_RE.match(name) else "job"


def _num(x) -> str:
    if isinstance(x, int):  # any size: a 5000-digit number is shown by its size, not printed
        return str(x) if x.bit_length() <= 128 else f"a number of about 2^{x.bit_length() - 1}"
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# Options every job command takes (docs/commands.md).
SHARED = (
    Opt("config", None, help="load the job from a config file written by --emit-config", in_config=False, metavar="FILE"),
    Opt("emit_config", None, help="write the fully resolved job to FILE (.json or .toml) and exit; an existing FILE is refused "
                                  "unless --force", in_config=False, metavar="FILE"),
    Opt("force", False, flag=True, in_config=False, help="with --emit-config: replace FILE when it exists; for run, eval and distill: "
                                                              "add rows in a --dtype other than the one the state's rows were made in"),
    Opt("name", None, help="the job's name (default: derived from the command and its data)"),
    Opt("state", None, help="where the job keeps its state: a path, file:// or s3:// URI (default: SPILLPACK_HOME/jobs/NAME)", metavar="URI"),
    Opt("weights", None, help="where the model's weights are: a path, file:// or s3:// URI", metavar="URI"),
    Opt("engine", "auto", choices=ENGINES, per_run=True, help="mlx, torch-cuda or torch-cpu (default: chosen for this machine)"),
    Opt("dtype", "auto", choices=DTYPES, per_run=True,
        help="the frozen base's dtype: auto (SPILLPACK_DTYPE if set, else what this job ran before, else, on a CPU that "
             "multiplies bfloat16 natively (AMX, AVX512-BF16) and a model 512 or more wide, bfloat16 for a tune and for "
             "generation whichever of the two a decode step of the model measures faster there; bfloat16 on a GPU that "
             "has it, float16 with loss scaling on older GPUs, float32 otherwise), float32, or bfloat16"),
    Opt("preemption_notice", "auto", choices=NOTICE_MODES, per_run=True,
        help="also stop (checkpoint, exit 75) on a cloud's spot notice in the instance metadata; auto finds AWS, GCP or Azure, if any"),
    Opt("grace_s", None, float, per_run=True, above=0, max=GRACE_MAX_S, metavar="SECONDS",
        help="the platform's grace period between SIGTERM and SIGKILL: the checkpoint is committed and the job exits within it "
             "(default: SPILLPACK_GRACE_S, else 30)"),
    Opt("stop_after", None, _stop_after, per_run=True, help="stop cleanly (exit 0) after N steps or rows", metavar="N"),
    Opt("max_stalled_starts", 3, int, per_run=True, min=0, metavar="N",
        help="stop with exit 1 (not 75) when N starts in a row made no progress past the last checkpoint (0: never)"),
    Opt("report_to", None, repeat=True, metavar="TRACKERS",
        help="also log the job to tensorboard, mlflow and/or wandb (comma-separated, repeatable; default: SPILLPACK_REPORT_TO, "
             "else none): one tracker run for the whole job, across its preemptions (docs/trackers.md)"),
    Opt("headless", False, flag=True, in_config=False, help="JSON-line events on stdout (automatic when stdout is not a terminal)"),
    Opt("debug", False, flag=True, in_config=False, help="show tracebacks"),
)

# --quantize (runtime/models/quantize.py): part of the job, its outputs differ
QUANTIZE = Opt("quantize", None, choices=("int8", "int4"), metavar="int8|int4",
               help="quantize a Hugging Face directory's float weights at load, weights only (int8: Q8_0, int4: Q4_1 "
                    "blocks of 32), and keep them so on torch-cpu")

TUNE = (
    Opt("model", positional=True, help="a model directory, a tag such as qwen2.5:0.5b, or tiny"),
    Opt("data", positional=True, help="training data: JSONL of {messages} or {prompt, completion} rows"),
    Opt("steps", None, int, help="optimizer steps (default: one epoch)", min=1),
    Opt("epochs", None, float, help="epochs, when --steps is not given", above=0),
    # None until derived (runtime/config/commands.py): 16, 2 x rank and the attention projections, or --init-adapter's
    Opt("rank", None, int, help="LoRA rank (default 16, or --init-adapter's)", min=1),
    Opt("alpha", None, float, help="LoRA alpha (default: 2 x rank, or --init-adapter's)", above=0),
    Opt("targets", None, help="comma-separated linear layers to adapt (default q_proj,k_proj,v_proj,o_proj, or --init-adapter's)"),
    Opt("dropout", 0.0, float, help="LoRA dropout", min=0, below=1),
    Opt("lr", 1e-4, float, help="peak learning rate", above=0),
    Opt("schedule", "cosine", choices=("cosine", "constant"), help="learning-rate schedule after warmup"),
    Opt("warmup", 0, int, help="warmup steps", min=0),
    Opt("weight_decay", 0.0, float, help="AdamW weight decay", min=0),
    Opt("batch", 4, int, help="sequences per micro-batch (may be split to fit memory; --batch x --grad-accum is kept)", min=1),
    Opt("grad_accum", 1, int, help="micro-batches per optimizer step", min=1),
    QUANTIZE,
    Opt("grad_checkpoint", "auto", choices=GRAD_CHECKPOINT, per_run=True,
        help="recompute each decoder layer's activations in backward instead of keeping them; auto: only when the plan needs it"),
    Opt("max_mem_gb", None, float, per_run=True, above=0, metavar="N",
        help="plan the step for at most N GB (default: the memory this machine's engine has free)"),
    Opt("plan", False, flag=True, in_config=False, help="print the memory plan (micro-batch, checkpointing, peak) and exit"),
    Opt("max_seq", 2048, int, help="longest sequence; longer ones are dropped and counted", min=2),
    Opt("seed", 0, int, help="seed for LoRA init and batch order", min=0, max=SEED_MAX),
    Opt("ckpt_every", 50, int, help="commit a checkpoint every N steps", min=1),
    Opt("init_adapter", None, metavar="SRC",
        help="start from this LoRA adapter (a PEFT or mlx-lm adapter directory, a LoRA adapter GGUF, or a spillpack state: "
             "path or s3://); "
             "its rank, alpha and targets are the job's"),
    Opt("val", None, metavar="FILE", help="held-out rows (same format as the data) for a validation loss"),
    Opt("val_fraction", None, float, above=0, below=1, metavar="F",
        help="hold out this fraction of the data's rows for a validation loss (a seeded hash of each row)"),
    Opt("eval_every", None, int, min=1, metavar="N", help="the held-out loss every N steps and after the last (default: --ckpt-every)"),
    Opt("early_stop", None, int, min=1, metavar="PATIENCE",
        help="stop after PATIENCE evals in a row without a lower held-out loss (needs --val or --val-fraction)"),
    Opt("out", None, help="also write the adapter here", metavar="DIR"),
    Opt("merge", False, flag=True, help="also write merged full weights as a Hugging Face model directory"),
    Opt("gguf", None, help="also write the merged model (base + LoRA) as one GGUF file here, for llama.cpp and Ollama",
        metavar="FILE"),
    Opt("gguf_type", "f16", choices=("f32", "f16", "q8_0"), help="the --gguf file's tensor type"),
    Opt("nproc", None, int, per_run=True, min=1, max=NPROC_MAX,
        help="data-parallel processes on this machine, one per GPU (default: SPILLPACK_NPROC, else 1); started through torchrun's launcher"),
    Opt("shard_base", "auto", choices=("off", "on", "auto"), per_run=True,
        help="split the frozen base across the ranks (FSDP2) so each holds a share; auto: when the whole base "
             "does not fit one rank's memory"),
)

# Sharding (docs/commands.md, "Shards"): N is part of the job, I is which part this process does.
SHARDING = (
    Opt("shards", 1, int, help="split the rows into N contiguous shards, one worker each; the last to finish merges", min=1,
        max=SHARDS_MAX, metavar="N"),
    Opt("shard", None, int, per_run=True, min=0, metavar="I",
        help="the shard this process does (default: SPILLPACK_SHARD, else the scheduler's array index: SLURM_ARRAY_TASK_ID "
             "- SLURM_ARRAY_TASK_MIN, JOB_COMPLETION_INDEX, SKYPILOT_NODE_RANK); none: only complete the merge"),
)

_ROW_COMMON = (
    QUANTIZE,
    Opt("adapter", None, repeat=True, metavar="[NAME=]SRC",
        help="a LoRA adapter to answer with (a PEFT or mlx-lm adapter directory, a LoRA adapter GGUF or a tune's state: "
             "path or s3://); "
             "NAME=SRC, repeatable, serves many in one batch, each row choosing by its body.model (the base by the model's name; "
             "four adapters' rows: examples/data/adapters.jsonl)"),
    Opt("out", None, help="also write the results file here", metavar="FILE"),
    Opt("max_tokens", 256, int, help="default max new tokens per row", min=1),
    Opt("temperature", 0.0, float, help="default sampling temperature (0 = greedy)", min=0, max=2),
    Opt("top_p", 1.0, float, help="default nucleus sampling threshold", above=0, max=1),
    Opt("seed", 0, int, help="sampling seed", min=0, max=SEED_MAX),
    Opt("batch", 8, int, help="rows generated at once", min=1),
    Opt("commit_rows", 32, int, help="commit finished rows at least every N rows", min=1),
    Opt("commit_seconds", 30.0, float, help="... and at least every T seconds", above=0),
    Opt("max_mem_gb", None, float, per_run=True, above=0, metavar="N",
        help="use at most N GB (default: the memory this machine, or its cgroup, leaves free): weights that do not fit "
             "with the rows are streamed from the model's file"),
    *SHARDING,
)

RUN = (
    Opt("model", positional=True, help="a model directory, a tag, or tiny"),
    Opt("input", positional=True, help="OpenAI batch JSONL: {custom_id, body: {messages, ...}} or {custom_id, prompt}"),
) + _ROW_COMMON

EVAL = (
    Opt("model", positional=True, help="a model directory, a tag, or tiny"),
    Opt("evals", positional=True, help="JSONL rows with the expected answer"),
    Opt("metric", "exact_match", choices=METRICS, help="how an answer is scored"),
    Opt("field", None, help="the JSON field compared by --metric json_field"),
) + _ROW_COMMON

DISTILL = (
    Opt("teacher", positional=True, help="the teacher model"),
    Opt("prompts", positional=True, help="JSONL prompts"),
) + _ROW_COMMON

BUILD = (
    Opt("folder", positional=True, help="a folder with evals.jsonl and train.jsonl and/or prompts.jsonl"),
    Opt("student", "tiny", help="the model that is evaluated and tuned"),
    Opt("teacher", None, help="the teacher that answers prompts.jsonl (distill runs only with a teacher or --teacher-adapter)"),
    Opt("teacher_adapter", None, help="a LoRA adapter the teacher answers with", metavar="URI"),
    Opt("metric", "exact_match", choices=METRICS, help="how eval answers are scored"),
    Opt("field", None, help="the JSON field compared by --metric json_field"),
    Opt("max_tokens", 256, int, help="default max new tokens for eval and distill rows", min=1),
    Opt("batch", 8, int, help="rows generated at once", min=1),
    Opt("steps", None, int, help="tune steps (default: --epochs)", min=1),
    Opt("epochs", 8.0, float, help="tune epochs, when --steps is not given", above=0),
    Opt("rank", 16, int, help="LoRA rank", min=1),
    Opt("lr", 2e-3, float, help="peak learning rate", above=0),
    Opt("warmup", 20, int, help="warmup steps", min=0),
    Opt("targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", help="comma-separated linear layers to adapt"),
    Opt("val_fraction", None, float, above=0, below=1, metavar="F",
        help="the tune stage holds out this fraction of its rows; the eval stage then scores the best adapter by held-out loss"),
    Opt("early_stop", None, int, min=1, metavar="PATIENCE", help="the tune stage's --early-stop (needs --val-fraction)"),
    Opt("seed", 0, int, help="seed", min=0, max=SEED_MAX),
    # distill and eval stages split into N shards; tune runs in shard 0 (runtime/jobs/build.py)
    *SHARDING,
)
