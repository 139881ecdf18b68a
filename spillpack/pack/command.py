"""`spillpack pack (CONFIG | COMMAND ARGS...) -o DIR`: the command; the pieces are beside it.

inputs.py decides what goes where, wheels.py fetches the runtime's dependencies for each
target, zipapp.py builds spillpack.pyz, bundle.py writes the directory.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from runtime import __version__
from runtime.bootstrap.manifest import Manifest
from runtime.config.invocation import read_config
from runtime.base.progress import ByteProgress
from runtime.base.errors import SpillpackError, UsageError
from runtime.base.fileio import naming
from runtime.config.commands import COMMANDS as JOB_COMMANDS
from runtime.jobs.inputs import check_inputs

from spillpack.schedulers import files as schedulers
from . import engines, image, inputs, trackers, wheels, zipapp
from .bundle import Writer, run_sh


def _pack_options(p: argparse.ArgumentParser) -> None:
    # Only -o, no --output: a job's --out must never be taken for an abbreviation of it.
    p.add_argument("-o", dest="output", metavar="DIR", help="the bundle directory to create (must not exist)")
    p.add_argument("--platform", action="append", metavar="TAG",
                   help="target platform, repeatable: manylinux_2_17_x86_64, manylinux_2_17_aarch64, macosx_11_0_arm64 "
                        "(default: this machine's)")
    p.add_argument("--python", metavar="3.X", help="the target's Python (default: this one's)")
    p.add_argument("--with-torch", choices=("cpu", "cuda"), help="also carry torch as wheels, installed on first start")
    p.add_argument("--with-mlx", action="store_true",
                   help="also carry mlx as wheels for the Apple silicon targets (macosx_*_arm64), installed on first start")
    p.add_argument("--with-tracker", action="append", metavar="NAME", choices=("tensorboard", "mlflow", "wandb"),
                   help="also carry this tracker's wheels (repeatable; the job's --report-to trackers are carried anyway, "
                        "but wandb only when named here)")
    p.add_argument("--include-weights", action="store_true", help="also bundle local model weights")
    p.add_argument("--scheduler", action="append", choices=schedulers.KINDS,
                   help="also write the job's file for skypilot, slurm or kubernetes beside the bundle (repeatable)")
    p.add_argument("--image", metavar="REF",
                   help="scheduler files: the bundle's image as you pushed it (podman build -t REF:cpu|cuda BUNDLE); "
                        "Kubernetes runs REF:cpu or REF:cuda (default spillpack-NAME)")
    p.add_argument("--nodes", type=int, metavar="N", help="scheduler files: a data-parallel tune on N nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="scheduler files: G data-parallel processes per node, one per GPU (CPU processes for --engine torch-cpu; default 1)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    _pack_options(p)
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="CONFIG | COMMAND ARGS",
                   help="a config written by --emit-config, or a job command line such as: tune tiny train.jsonl --epochs 3")


def split_args(ns: dict) -> tuple[dict, list[str]]:
    """Pack options may come after the job's arguments too (`pack tune tiny d.jsonl -o out`)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _pack_options(p)
    p.add_argument("--debug", action="store_true")
    p.add_argument("--headless", action="store_true")
    later, rest = p.parse_known_args(ns.get("job") or [])
    merged = dict(ns)
    for k, v in vars(later).items():
        if k in ("platform", "scheduler", "with_tracker"):
            merged[k] = (ns.get(k) or []) + (v or [])
        elif v is not None and v is not False:  # 0 is a value (refused by its own rule), not "not given"
            merged[k] = v
    return merged, rest


def job_invocation(rest: list[str]):
    from runtime.cli import build_parser, invocation

    if not rest:
        raise UsageError("pack needs a config file or a job command line", "spillpack pack tune.json -o out/mine")
    if rest[0] in JOB_COMMANDS:
        ns = vars(build_parser().parse_args(rest))
        command = ns.pop("command")
        ns.pop("emit_config", None)
        return invocation(command, ns)
    if len(rest) > 1:
        raise UsageError(f"unexpected {' '.join(rest[1:])} after the config {rest[0]}", f"spillpack pack {rest[0]} -o DIR")
    path = rest[0]
    if not Path(path).is_file():
        raise SpillpackError(f"config {path} does not exist (and {path!r} is not a job command)",
                             f"spillpack tune ... --emit-config {path}, or spillpack pack tune MODEL DATA -o DIR")
    command = read_config(path)["command"]
    return invocation(command, {"config": path})


def _python(version: str | None) -> str:
    have = "%d.%d" % sys.version_info[:2]
    version = version or have
    m = re.fullmatch(r"3\.(\d+)", version)
    if not m or int(m.group(1)) < 10:
        raise UsageError(f"--python {version}: the runtime needs Python 3.10 or newer, written 3.X", f"--python {have}")
    return version


def _fmt_size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _check_state_outlives(kinds: list[str], state: str | None) -> None:
    """A spot VM's or a pod's disk goes with it: there the state must be on S3. (Slurm keeps a
    note instead: a shared file system is the normal place for it.)"""
    for kind in kinds:
        if kind in ("skypilot", "kubernetes") and not str(state or "").startswith("s3://"):
            where = state or "the default SPILLPACK_HOME/jobs/NAME"
            raise SpillpackError(f"--scheduler {kind} needs the job's state on S3: {where} is a path on the "
                                 f"{'VM' if kind == 'skypilot' else 'pod'}, whose disk does not outlive a preemption",
                                 "spillpack pack ... --state s3://bucket/prefix, or pack without --scheduler and give each run "
                                 "SPILLPACK_STATE=s3://... in its environment")


def main(ns: dict, events) -> int:
    ns, rest = split_args(ns)
    if not ns.get("output"):
        raise UsageError("pack needs -o DIR, the bundle directory to create", "spillpack pack tune.json -o out/mine")
    out = Path(ns["output"]).expanduser().absolute()
    if out.exists():
        raise UsageError(f"{ns['output']} already exists; pack never overwrites", f"spillpack pack ... -o {ns['output']}-2, or rm -r {ns['output']}")
    kinds = sorted(set(ns.get("scheduler") or []))
    for kind in kinds:
        for fname in schedulers.file_names(kind, out.name).values():
            if (out.parent / fname).exists():
                raise UsageError(f"{out.parent / fname} already exists; pack never overwrites", f"spillpack pack ... -o {ns['output']}-2")
    inv = job_invocation(rest)
    nodes, per_node = schedulers.check_group(ns.get("nodes"), ns.get("gpus_per_node"), inv.command, inv.options.get("engine"), kinds)
    _check_state_outlives(kinds, inv.options.get("state"))
    python = _python(ns.get("python"))
    platforms = sorted({wheels.check_tag(t) for t in ns.get("platform") or [wheels.host_tag()]})
    with_torch, with_mlx = ns.get("with_torch"), bool(ns.get("with_mlx"))
    engines.check(platforms, with_torch, with_mlx)
    tracker_names = trackers.chosen(inv.options.get("report_to"), ns.get("with_tracker"), inv.command)

    values = {**inv.arguments, **inv.options}
    plan = inputs.plan(values, ns.get("include_weights", False))
    check_inputs(inv)  # the data as the runtime will parse it: never pack a job it would refuse
    config = inv.to_config()
    for section in ("arguments", "options"):
        for k in config[section]:
            if k in plan.rewrites:
                config[section][k] = plan.rewrites[k]

    reqs = wheels.requirements(inputs.uses_s3(values))
    per_platform = {t: wheels.fetch(t, python, reqs) for t in platforms}
    carried = engines.carried(platforms, python, with_torch, with_mlx)
    for t in platforms:
        extra = trackers.carried(tracker_names, t, python, per_platform[t])
        if extra:
            carried[t] = carried.get(t, []) + extra
    usable = {t: engines.usable(t, with_torch, with_mlx) for t in platforms}

    with Writer(out) as w:
        data_bytes = 0
        progress = ByteProgress(f"packing {len(plan.files)} data files", sum(Path(src).stat().st_size for src in plan.files.values()))
        copied = 0

        def advance(n: int) -> None:
            nonlocal copied
            copied += n
            progress.update(copied)

        for rel, src in sorted(plan.files.items()):
            w.copy(rel, src, advance)
            data_bytes += w.entries[rel].size
        progress.close()
        w.write("files/job.json", (json.dumps(config, indent=2) + "\n").encode(),
                origin=str(Path(inv.config_path).absolute()) if inv.config_path else "command line")
        with naming(w.tmp / "spillpack.pyz"):
            zipapp.build(per_platform, w.tmp / "spillpack.pyz", wheels.cache_root().parent / "pyz")
        w.add_existing("spillpack.pyz", "built by spillpack pack")
        for tag, ws in carried.items():
            for whl in ws:
                w.copy(f"wheels/{tag}/{whl.name}", whl)
        name = inv.options.get("name") or inv.command
        w.write("Containerfile", image.containerfile(name, python, inv.options.get("engine"), with_torch),
                origin="written by spillpack pack")
        w.write("run.sh", run_sh(inv.command, name, f"spillpack {__version__}", python, platforms),
                origin="written by spillpack pack", mode=0o755)
        carries = zipapp.carries(per_platform)
        manifest = Manifest(packer=f"spillpack {__version__}", command=inv.command, name=name, python=python,
                            platforms=platforms, zipapp={"entry_point": zipapp.ENTRY_POINT, "carries": carries},
                            with_torch=with_torch, with_mlx=with_mlx, engines=usable, trackers=tracker_names)
        total = sum(e.size for e in w.entries.values())
        w.finish(manifest)

    sched_files = []
    if kinds:
        values = schedulers.values_for(config, out, python, bool(with_torch), nodes, per_node, ns.get("image") or "")
        for kind in kinds:
            sched_files += schedulers.write(kind, values, out.parent)
        if not values.s3:
            events.say(f"note: the state {values.state} is a path; on a cluster it must be on storage every node "
                       "and every retry sees (a shared file system, the pod's volume), or use --state s3://...")

    n_data = len(plan.files)
    deps = ", ".join(carries["common"] + sorted({d for t in platforms for d in carries[t]}))
    on_target = "; ".join(f"{t}: {', '.join(e)}" for t, e in usable.items())
    run = shlex.quote(str(Path(ns["output"]) / "run.sh"))
    line = (f"packed {inv.command} job {name} into {ns['output']}: {n_data} data file{'s' if n_data != 1 else ''} "
            f"({_fmt_size(data_bytes)}), {_fmt_size(total)} in all; spillpack.pyz carries the runtime with {deps} "
            f"for {', '.join(platforms)} (Python {python}); engines on the target: {on_target}. Run it: {run}")
    for item in plan.not_bundled:
        events.say(f"note: {item} is not in the bundle and must exist on the target (pack with --include-weights to carry it)")
    if events.headless:
        events.emit("done", complete=True, stopped_early=False, out=str(out), data_files=n_data, bytes=total,
                    platforms=platforms, python=python, engines=usable, run=str(out / "run.sh"),
                    scheduler_files=[str(p) for p in sched_files])
    events.say(line)
    for path in sched_files:
        events.say(f"wrote {path}")
    return 0
