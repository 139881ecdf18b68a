"""Scheduler files for a bundle: SkyPilot, Slurm, Kubernetes, filled in for one job (render()).

The templates in templates/ are the one source of truth: `spillpack pack --scheduler KIND`
renders them for the packed job (this module), and examples/schedulers/ holds them rendered
for the example jobs (spillpack/schedulers/examples.py); a test keeps the two equal, and
`python -m spillpack.schedulers` rewrites the examples after a template changes.

Every value in a template goes through a filter of spillpack.quoting (`| sh`, `| yaml`,
`| comment`, `| word`); rendering refuses a value that did not, so a bundle name or a
state path holding a newline, quotes or `$(...)` can never become YAML keys or commands.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import jinja2

from spillpack import quoting

KINDS = ("skypilot", "slurm", "kubernetes")
TEMPLATES = Path(__file__).parent / "templates"
GPUS = ("H100", "A100", "L4", "A10G")  # SkyPilot's names; any one is enough for a LoRA tune
# A stock image with Python 3.11 and torch; the CPU variant uses it too (no GPU requested).
IMAGE = "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"
IMAGE_PYTHON = "3.11"


def image_for(python: str, with_torch: bool) -> str:
    """The stock torch image when it has the bundle's Python and the bundle brings no torch;
    otherwise the official Python image of that version (torch then comes from the bundle's
    wheels, or is installed when the container starts)."""
    return IMAGE if python == IMAGE_PYTHON and not with_torch else f"python:{python}-slim"


@dataclass(frozen=True)
class Values:
    """What a scheduler file needs to know about one bundle."""

    name: str  # the job's name, as scheduler objects may spell it (a DNS label)
    bundle: str  # the bundle directory's name; the files sit beside it
    state: str
    weights: str | None = None
    python: str = "3.11"
    torch: str = "2.13.0"
    with_torch: bool = False
    cpus: int = 8
    memory_gb: int = 32
    gpus: tuple = GPUS
    job: str = "a LoRA tune"  # what the bundle runs, for the files' comments
    time_limit: str = "24:00:00"
    signal_lead_s: int = 120  # Slurm's warning before the time limit: enough for a step and a commit
    grace_s: int = 60  # Kubernetes: above the 30 s checkpoint promise
    volume_gb: int = 50
    nodes: int = 1  # a data-parallel tune: nodes x gpus_per_node ranks
    gpus_per_node: int = 1
    shards: int = 1  # a row job split with --shards N: a Slurm array, an Indexed Job, N managed jobs
    image: str = ""  # Kubernetes: the bundle's image as pushed (`pack --image REF`); the variant is its tag

    @property
    def distributed(self) -> bool:
        return self.nodes * self.gpus_per_node > 1

    @property
    def stock_image(self) -> str:
        return image_for(self.python, self.with_torch)

    @property
    def torch_at_start(self) -> bool:
        """The container installs torch before run.sh: an image without it, a bundle without it."""
        return not self.with_torch and self.stock_image != IMAGE

    @property
    def image_ref(self) -> str:
        """The bundle image's reference up to its variant: REF: (or REF:TAG-) + cpu|cuda."""
        ref = self.image or f"spillpack-{self.name}"
        return f"{ref}-" if ":" in ref.rsplit("/", 1)[-1] else f"{ref}:"

    @property
    def s3(self) -> bool:
        return any(str(u or "").startswith("s3://") for u in (self.state, self.weights))


JOBS = {"build": "a folder build: distill (with a teacher), tune, eval before and after", "tune": "a LoRA tune",
        "run": "a batch run", "eval": "an eval", "distill": "a distillation"}


# template -> the suffix of the file written beside the bundle (BUNDLE.SUFFIX), per scheduler,
# for each shape of job; "#cuda" / "#cpu" render one template twice. A data-parallel tune has
# its own templates (multi-node launch, shared volume); a sharded row job gets the scheduler's
# fan-out: a Slurm array, a Kubernetes Indexed Job, one SkyPilot managed job per shard
# (examples/schedulers/skypilot/README.md says why). Pods that may land on any node share a
# ReadWriteMany volume.
FILES = {
    "one": {"skypilot": {"skypilot.yaml.j2": "sky.yaml"},
            "slurm": {"slurm.sbatch.j2": "sbatch"},
            "kubernetes": {"kubernetes-pvc.yaml.j2": "k8s-pvc.yaml", "kubernetes-job.yaml.j2#cuda": "k8s-cuda.yaml",
                           "kubernetes-job.yaml.j2#cpu": "k8s-cpu.yaml"}},
    "group": {"skypilot": {"skypilot-dist.yaml.j2": "sky.yaml"},
              "slurm": {"slurm-dist.sbatch.j2": "sbatch"},
              "kubernetes": {"kubernetes-shared-pvc.yaml.j2": "k8s-pvc.yaml", "kubernetes-indexed.yaml.j2#cuda": "k8s-cuda.yaml",
                             "kubernetes-indexed.yaml.j2#cpu": "k8s-cpu.yaml"}},
    "shards": {"skypilot": {"skypilot-shards.yaml.j2": "sky.yaml"},
               "slurm": {"slurm-array.sbatch.j2": "sbatch"},
               "kubernetes": {"kubernetes-shared-pvc.yaml.j2": "k8s-pvc.yaml", "kubernetes-shards.yaml.j2#cuda": "k8s-cuda.yaml",
                              "kubernetes-shards.yaml.j2#cpu": "k8s-cpu.yaml"}},
}


def file_names(kind: str, bundle: str, distributed: bool = False, shards: int = 1) -> dict[str, str]:
    """template -> the file written beside the bundle (the same names for every shape of job)."""
    shape = "shards" if shards > 1 else "group" if distributed else "one"
    return {template: f"{bundle}.{suffix}" for template, suffix in FILES[shape][kind].items()}


def _only_quoted(value):
    """Jinja's finalize: every {{ ... }} output must have gone through a quoting filter (ints cannot inject)."""
    if isinstance(value, quoting.Quoted) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise jinja2.TemplateError(f"a value reached a scheduler file unquoted ({value!r}); use | sh, | yaml, | comment or | word")


_env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=True, autoescape=False, finalize=_only_quoted)
_env.filters.update(sh=quoting.sh, yaml=quoting.yaml, comment=quoting.comment, word=quoting.word)


def render(kind: str, values: Values) -> dict[str, str]:
    """file name -> text, for one scheduler."""
    names = file_names(kind, values.bundle, values.distributed, values.shards)
    files = {"pvc": f"{values.bundle}.k8s-pvc.yaml" if kind == "kubernetes" else None}
    out = {}
    for key, fname in names.items():
        template, _, variant = key.partition("#")
        ctx = {**asdict(values), "s3": values.s3, "state_on_volume": not values.s3, "file": fname,
               "files": files, "variant": variant, "image": values.stock_image, "image_ref": values.image_ref,
               "torch_at_start": values.torch_at_start}
        out[fname] = _env.get_template(template).render(**ctx)
    return out


def dns_label(text: str) -> str:
    """Kubernetes and SkyPilot names: lower-case letters, digits and '-', at most 40 here
    (a Job name leaves room for its pods' suffixes)."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40].strip("-")
    return label or "job"


def check_group(nodes: int | None, per_node: int | None, command: str, engine: str | None, kinds: list[str]) -> tuple[int, int]:
    """`pack --nodes N --gpus-per-node G`: (N, G), or one line saying why not."""
    from runtime.base.errors import SpillpackError

    nodes, per_node = 1 if nodes is None else nodes, 1 if per_node is None else per_node
    for flag, n in (("--nodes", nodes), ("--gpus-per-node", per_node)):
        if n < 1:
            raise SpillpackError(f"{flag} must be positive, not {n}", f"spillpack pack ... {flag} 1")
    if nodes * per_node == 1:
        return nodes, per_node
    if not kinds:
        raise SpillpackError("--nodes and --gpus-per-node shape the scheduler files, and none was asked for",
                             "spillpack pack ... --scheduler slurm|skypilot|kubernetes --nodes N --gpus-per-node G")
    if command != "tune":
        raise SpillpackError(f"{command} runs as one process; only tune is data-parallel across GPUs and nodes",
                             f"spillpack pack {command} ... without --nodes and --gpus-per-node")
    if engine == "mlx":
        raise SpillpackError("the mlx engine runs one process, not a data-parallel group",
                             "spillpack pack ... --engine torch-cuda (or torch-cpu) with --nodes/--gpus-per-node")
    return nodes, per_node


def values_for(config: dict, bundle_dir: Path, python: str, with_torch: bool, nodes: int = 1, gpus_per_node: int = 1,
               image: str = "") -> Values:
    """Values for a packed job: its frozen config (files/job.json) and the bundle's place."""
    import importlib.metadata

    o = config["options"]
    name = o.get("name") or config["command"]
    state = o.get("state") or f"$SPILLPACK_HOME/jobs/{name}"
    try:
        torch = importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        torch = Values.torch
    engine = o.get("engine") or "auto"
    gpus = () if engine == "torch-cpu" else GPUS
    return Values(name=dns_label(name), bundle=bundle_dir.name, state=state, weights=o.get("weights"),
                  python=python, torch=torch, with_torch=with_torch, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node,
                  shards=o.get("shards") or 1, job=JOBS.get(config["command"], config["command"]), image=image)


def write(kind: str, values: Values, where: Path) -> list[Path]:
    written = []
    for fname, text in render(kind, values).items():
        path = where / fname
        path.write_text(text)
        if fname.endswith(".sbatch"):
            path.chmod(0o755)
        written.append(path)
    return written
