"""`spillpack resume FOLDER|URI [--state URI]`: continue an interrupted job from what it left behind.

FOLDER|URI is a job's state (it holds invocation.json, the resolved config of its newest run),
a bundle folder (MANIFEST.json and files/job.json: its files/... paths are made absolute and
checked through the same Bundle that run.sh hands to the CLI) or a config file. --state
names the state when it is not the first argument, or moves the job to another state.
"""

import importlib

import orjson

from runtime.core import launch
from runtime.bootstrap.bundle import Bundle
from runtime.config.commands import COMMANDS, options_for
from runtime.config.options import SHARED
from runtime.config.invocation import check_config, read_config, resolve
from runtime.base.errors import SpillpackError, UsageError
from runtime.state.store import local_file
from runtime.state.uri import open_store


# How this process runs, not what the job is: never replayed from the saved config, and
# taken from resume's own command line instead (docs/commands.md, resume). A row job's --shard
# is one of them: `resume STATE --shard I` continues shard I, `resume STATE` only merges.
PER_RUN = list({o.name: o for o in [*SHARED, *(o for c in COMMANDS.values() for o in c.options)] if o.per_run}.values())


def add_arguments(parser) -> None:
    parser.add_argument("target", metavar="FOLDER|URI", help="a job's state, a bundle folder or a config file")
    parser.add_argument("--state", metavar="URI", help="the state to continue (default: the one FOLDER|URI names)")
    for opt in PER_RUN:
        parser.add_argument(opt.flag_name, dest=opt.name, type=opt.type, choices=opt.choices, default=None, metavar=opt.metavar,
                            help=opt.help)


def find_config(target: str, state: str | None) -> tuple[dict, Bundle | None, str | None]:
    """(config, the bundle it comes from, the state it names) for the job that `target` names."""
    for uri in filter(None, (state, target)):
        raw = open_store(uri).read("invocation.json")  # a store that cannot be read says so: never "not a state"
        if raw:
            try:
                return check_config(orjson.loads(raw), f"{uri}/invocation.json"), None, uri
            except orjson.JSONDecodeError:
                raise SpillpackError(f"{uri}/invocation.json is damaged", f"spillpack <command> ... --state {uri}")
    path = local_file(target)
    if path is not None and (path / "files" / "job.json").is_file():  # a bundle: its manifest must be there too
        bundle = Bundle.open(path)
        return read_config(str(bundle.root / "files" / "job.json")), bundle, None
    if path is not None and path.is_file():
        return read_config(str(path)), None, None
    raise SpillpackError(f"{target} is neither a job's state (no invocation.json), a bundle folder nor a config file",
                         f"spillpack status {target}, or spillpack <command> ... --state {target}")


def main(ns: dict, events) -> int:
    config, bundle, state = find_config(ns["target"], ns.get("state"))
    command = config["command"]
    # The state it was given is the one it continues, wherever it was moved or copied to.
    given = {"state": ns.get("state") or state} if (ns.get("state") or state) else {}
    given.update({o.name: ns[o.name] for o in PER_RUN if ns.get(o.name) is not None})
    known = {o.name for o in options_for(command)}
    foreign = [o.flag_name for o in PER_RUN if ns.get(o.name) is not None and o.name not in known]
    if foreign:
        raise UsageError(f"{foreign[0]} is not an option of {command}", f"spillpack resume {ns['target']} without {foreign[0]}")
    inv = resolve(command, given, config=config, replay_per_run=False, headless=events.headless, debug=bool(ns.get("debug")),
                  bundle=bundle)
    events.command = command
    if bundle is not None:
        inv.arguments, inv.options = bundle.localize(inv.arguments), bundle.localize(inv.options)
    group = launch.wanted(command, inv.options)
    if group is not None:  # SPILLPACK_NPROC or a scheduler's nodes: each rank runs this same resume
        from runtime.engines.hardware import choose_engine

        return launch.launch(_argv(ns, events.headless), *group, engine=choose_engine(inv.options.get("engine"))[0],
                             name=inv.options["name"], debug=bool(ns.get("debug")))
    events.say(f"resuming {command} {inv.options.get('name')} from {inv.options.get('state') or 'its default state'}")
    return importlib.import_module(COMMANDS[command].module).main(inv, events).code


def _argv(ns: dict, headless: bool) -> list[str]:
    """This resume's command line, for the ranks a data-parallel resume starts."""
    argv = ["resume", ns["target"]] + (["--state", ns["state"]] if ns.get("state") else [])
    for o in PER_RUN:
        if ns.get(o.name) is not None:
            argv += [o.flag_name, str(ns[o.name])]
    return argv + ["--headless"] * headless + ["--debug"] * bool(ns.get("debug"))
