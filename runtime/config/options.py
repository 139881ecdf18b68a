"""The options of every command, as data.

One table drives the argument parser, `--emit-config` (every default written out)
and `--config` (options given next to it win), so the three cannot drift apart.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Opt:
    name: str  # python name; the flag is --name-with-dashes
    default: object = None
    type: object = str
    help: str = ""
    choices: tuple | None = None
    positional: bool = False
    flag: bool = False  # store_true
    in_config: bool = True  # presentation options (--debug, --headless) are not part of a job
    metavar: str | None = None

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_nonneg_int.__name__ = "non-negative integer"


def _stop_after(text: str) -> int | str:
    """N for steps or rows; build also takes STAGE or STAGE:N."""
    return int(text) if str(text).isdigit() else str(text)


_stop_after.__name__ = "N or STAGE[:N]"

ENGINES = ("auto", "mlx", "torch-cuda", "torch-cpu")

# Options every job command takes (ARCHITECTURE.md, Commands).
SHARED = (
    Opt("config", None, help="load the job from a config file written by --emit-config", in_config=False, metavar="FILE"),
    Opt("emit_config", None, help="write the fully resolved job to FILE (.json or .toml) and exit", in_config=False, metavar="FILE"),
    Opt("name", None, help="the job's name (default: derived from the command and its data)"),
    Opt("state", None, help="where the job keeps its state: a path, file:// or s3:// URI (default: SPILLPACK_HOME/jobs/NAME)", metavar="URI"),
    Opt("weights", None, help="where the model's weights are: a path, file:// or s3:// URI", metavar="URI"),
    Opt("engine", "auto", choices=ENGINES, help="mlx, torch-cuda or torch-cpu (default: chosen for this machine)"),
    Opt("preemption_notice", "auto", choices=("auto", "aws", "gcp", "off"),
        help="also stop (checkpoint, exit 75) on a cloud's spot notice in the instance metadata; auto finds AWS or GCP, if any"),
    Opt("stop_after", None, _stop_after, help="stop cleanly (exit 0) after N steps or rows", metavar="N"),
    Opt("headless", False, flag=True, in_config=False, help="JSON-line events on stdout (automatic when stdout is not a terminal)"),
    Opt("debug", False, flag=True, in_config=False, help="show tracebacks"),
)

TUNE = (
    Opt("model", positional=True, help="a model directory, a tag such as qwen2.5:0.5b, or tiny"),
    Opt("data", positional=True, help="training data: JSONL of {messages} or {prompt, completion} rows"),
    Opt("steps", None, _nonneg_int, help="optimizer steps (default: one epoch)"),
    Opt("epochs", None, float, help="epochs, when --steps is not given"),
    Opt("rank", 16, int, help="LoRA rank"),
    Opt("alpha", None, float, help="LoRA alpha (default: 2 x rank)"),
    Opt("targets", "q_proj,k_proj,v_proj,o_proj", help="comma-separated linear layers to adapt"),
    Opt("dropout", 0.0, float, help="LoRA dropout"),
    Opt("lr", 1e-4, float, help="peak learning rate"),
    Opt("schedule", "cosine", choices=("cosine", "constant"), help="learning-rate schedule after warmup"),
    Opt("warmup", 0, _nonneg_int, help="warmup steps"),
    Opt("weight_decay", 0.0, float, help="AdamW weight decay"),
    Opt("batch", 4, int, help="sequences per micro-batch"),
    Opt("grad_accum", 1, int, help="micro-batches per optimizer step"),
    Opt("max_seq", 2048, int, help="longest sequence; longer ones are dropped and counted"),
    Opt("seed", 0, int, help="seed for LoRA init and batch order"),
    Opt("ckpt_every", 50, int, help="commit a checkpoint every N steps"),
    Opt("out", None, help="also write the adapter here", metavar="DIR"),
    Opt("merge", False, flag=True, help="also write merged full weights as a Hugging Face model directory"),
)

_ROW_COMMON = (
    Opt("adapter", None, help="a LoRA adapter directory or URI to apply", metavar="URI"),
    Opt("out", None, help="also write the results file here", metavar="FILE"),
    Opt("max_tokens", 256, int, help="default max new tokens per row"),
    Opt("temperature", 0.0, float, help="default sampling temperature (0 = greedy)"),
    Opt("top_p", 1.0, float, help="default nucleus sampling threshold"),
    Opt("seed", 0, int, help="sampling seed"),
    Opt("batch", 8, int, help="rows generated at once"),
    Opt("commit_rows", 32, int, help="commit finished rows at least every N rows"),
    Opt("commit_seconds", 30.0, float, help="... and at least every T seconds"),
)

RUN = (
    Opt("model", positional=True, help="a model directory, a tag, or tiny"),
    Opt("input", positional=True, help="OpenAI batch JSONL: {custom_id, body: {messages, ...}} or {custom_id, prompt}"),
) + _ROW_COMMON

EVAL = (
    Opt("model", positional=True, help="a model directory, a tag, or tiny"),
    Opt("evals", positional=True, help="JSONL rows with the expected answer"),
    Opt("metric", "exact_match", choices=("exact_match", "contains", "regex", "json_field"), help="how an answer is scored"),
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
    Opt("metric", "exact_match", choices=("exact_match", "contains", "regex", "json_field"), help="how eval answers are scored"),
    Opt("field", None, help="the JSON field compared by --metric json_field"),
    Opt("max_tokens", 256, int, help="default max new tokens for eval and distill rows"),
    Opt("batch", 8, int, help="rows generated at once"),
    Opt("steps", None, _nonneg_int, help="tune steps (default: --epochs)"),
    Opt("epochs", 8.0, float, help="tune epochs, when --steps is not given"),
    Opt("rank", 16, int, help="LoRA rank"),
    Opt("lr", 2e-3, float, help="peak learning rate"),
    Opt("warmup", 20, _nonneg_int, help="warmup steps"),
    Opt("targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", help="comma-separated linear layers to adapt"),
    Opt("seed", 0, int, help="seed"),
)

JOB_COMMANDS = {
    "tune": ("LoRA fine-tune a model on chat data; survives preemption", TUNE),
    "run": ("batch inference over OpenAI batch JSONL; every row done once", RUN),
    "eval": ("score a model on rows with expected answers", EVAL),
    "distill": ("a teacher answers prompts; the output is training data for tune", DISTILL),
    "build": ("a folder: eval, distill, tune, eval, with a table of scores", BUILD),
}


def options_for(command: str) -> tuple[Opt, ...]:
    return JOB_COMMANDS[command][1] + SHARED
