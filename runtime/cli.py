"""The command line of the job commands, shared by `spillpack` and the bundle's zipapp.

The laptop side (`spillpack/cli.py`) adds `pack` and `models` through `extra`; the
zipapp runs this module alone. Errors are caught in one place: one line, exit code
from the error, traceback only with --debug.
"""

import argparse
import difflib
import importlib
import os
import sys
import traceback
from pathlib import Path

from runtime import __version__
from runtime.core import launch
from runtime.config.commands import COMMANDS, options_for
from runtime.config.invocation import Invocation, resolve, write_config
from runtime.base import progress, ranks
from runtime.core.events import Events, headless_wanted
from runtime.base.threads import quiet_openmp
from runtime.base.signals import Abandon, install_process_handler
from runtime.base.errors import EXIT_PREEMPTED, SpillpackError, UsageError, from_os_error, redact

# command -> (module, help, example). Imported only when the command runs: --help stays fast. The
# examples are docs/commands.md's, which run as written on `tiny` from the repository's root.
OTHER_COMMANDS = {
    "doctor": ("runtime.commands.doctor", "this machine: Python, engines, memory, disk", "spillpack doctor --no-measure"),
    "export": ("runtime.commands.export", "a tune's result as GGUF: the merged model (llama.cpp, Ollama) or the LoRA adapter",
               "spillpack export mine --gguf mine.gguf --type q8_0 --gguf-adapter mine-lora.gguf"),
    "resume": ("runtime.commands.resume", "continue an interrupted job from its state, bundle or config", "spillpack resume mine"),
    "status": ("runtime.commands.status", "the story of a job from its state: processes, checkpoints, interruptions",
               "spillpack status mine"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints a usage block and exits 2; we want one line
        raise UsageError(message, f"{self.prog} --help")


def _add_option(p: argparse.ArgumentParser, opt) -> None:
    if opt.positional:
        p.add_argument(opt.name, nargs="?", default=argparse.SUPPRESS, help=opt.help, metavar=opt.name.upper())
    elif opt.flag:
        p.add_argument(opt.flag_name, dest=opt.name, action="store_true", default=argparse.SUPPRESS, help=opt.help)
    elif opt.repeat:
        p.add_argument(opt.flag_name, dest=opt.name, action="append", default=argparse.SUPPRESS, metavar=opt.metavar, help=opt.help)
    else:
        default = "" if opt.default is None else f" (default: {opt.default})"
        p.add_argument(opt.flag_name, dest=opt.name, type=opt.type, choices=opt.choices, default=argparse.SUPPRESS,
                       metavar=opt.metavar, help=opt.help + ("" if "default" in opt.help else default))


def build_parser(extra: dict | None = None) -> argparse.ArgumentParser:
    others = {**OTHER_COMMANDS, **(extra or {})}
    examples = {**{name: spec.example for name, spec in COMMANDS.items()}, **{name: o[2] for name, o in others.items()}}
    parser = _Parser(prog="spillpack", description="Pack an LLM job into one directory that runs anywhere and survives preemption.",
                     epilog="examples:\n" + "\n".join(f"  {line}" for line in examples.values())
                     + "\n\n`spillpack COMMAND --help` lists a command's options.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"spillpack {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {examples[name]}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    for name, spec in COMMANDS.items():
        p = command(name, spec.help)
        for opt in options_for(name):
            _add_option(p, opt)
    for name, (module, help_, _) in others.items():
        p = command(name, help_)
        importlib.import_module(module).add_arguments(p)
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        p.add_argument("--headless", action="store_true", help="JSON on stdout")
    return parser


def main(argv: list[str] | None = None, extra: dict | None = None, bundle=None) -> int:
    """`bundle`: the runtime.bootstrap.Bundle this process runs from (run.sh), else None."""
    handler = install_process_handler()  # the entry points did already, before their imports; a library caller gets it here
    quiet_openmp()  # the console script and the zipapp reach torch only through here
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    command = next((a for a in argv if not a.startswith("-")), None)
    events = _events(argv)
    try:
        handler.start_up()  # a stop before a job opens its state abandons whatever start-up is doing: 75 at once
        parser = build_parser(extra)
        if not argv:
            parser.print_help(sys.stderr)
            return 2
        ns = vars(parser.parse_args(argv))
        command = ns.pop("command")
        events.command = command
        if command in COMMANDS:
            return _run_job(command, ns, events, bundle, argv)
        module = {**OTHER_COMMANDS, **(extra or {})}[command][0]
        return importlib.import_module(module).main(ns, events)
    except UsageError as e:
        if command and e.try_ == "spillpack --help":  # argparse reports a subcommand's errors at the top
            known = [*COMMANDS, *OTHER_COMMANDS, *(extra or {})]
            near = command if command in known else next(iter(difflib.get_close_matches(command, known, n=1)), None)
            e = UsageError(e.what, f"spillpack {near} --help" if near else "spillpack --help")
        return _fail(e, events, debug)
    except SpillpackError as e:
        return _fail(e, events, debug)
    except Abandon:  # stopped before anything needed saving (start-up, staging, loading)
        return _stopped_early(events)
    except BrokenPipeError:  # the reader went away (`status ... | head`): nothing left to tell it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # the machine refused a file operation (a full disk, a read-only file system): say which
        return _fail(from_os_error(e), events, debug)
    except KeyboardInterrupt:
        return _fail(SpillpackError("interrupted", f"spillpack {command or ''} ... again"), events, debug)
    except Exception as e:  # the one place an unexpected error becomes one line
        err = SpillpackError(f"unexpected {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": "),
                             f"spillpack {' '.join(argv)}{'' if '--debug' in argv else ' --debug'}, and report the traceback")
        return _fail(err, events, debug)
    finally:
        handler.started()  # the command is over: a stop now leaves its exit code alone


def invocation(command: str, ns: dict, headless: bool = False, bundle=None) -> Invocation:
    """The fully resolved job from parsed arguments (and --config): what runs, what is emitted, what is packed."""
    config_path = ns.pop("config", None)
    debug = ns.pop("debug", False)
    ns.pop("headless", None)
    return resolve(command, ns, config_path, headless=headless, debug=debug, bundle=bundle)


def _run_job(command: str, ns: dict, events: Events, bundle=None, argv: list[str] | None = None) -> int:
    emit_path = ns.pop("emit_config", None)
    force = ns.pop("force", False)
    debug = bool(ns.get("debug"))
    plan = ns.pop("plan", False)
    if bundle is not None and "state" not in ns and os.environ.get("SPILLPACK_STATE"):
        # One bundle, many runs: the launch names the state; --state on run.sh's command line still wins.
        ns["state"] = os.environ["SPILLPACK_STATE"]
    if emit_path:
        check_emit_path(command, emit_path, force)
    inv = invocation(command, ns, events.headless, bundle)  # a bundle's files/job.json is checked against its manifest as it is read
    inv.force = bool(force)
    if emit_path:
        from runtime.models.ref import check_model_tags

        check_model_tags(inv.arguments, inv.options)  # an unknown tag fails here, not on the cluster
        pin_store_weights(inv, events)
        write_config(inv, emit_path)
        events.say(f"wrote {emit_path}; run it with: spillpack {command} --config {emit_path}")
        return 0
    install_process_handler().check()  # stopped while starting: nothing is written
    group = None if plan else launch.wanted(command, inv.options)  # a plan is one process's, whatever --nproc says
    if group is not None:  # each worker runs this same command line as one rank
        from runtime.engines.hardware import choose_engine

        return launch.launch(argv or [], *group, engine=choose_engine(inv.options.get("engine"))[0], name=inv.options["name"],
                             debug=debug)
    if bundle is not None:  # its files/... paths become absolute; readers check bundled bytes through it
        inv.bundle = bundle
        inv.arguments, inv.options = bundle.localize(inv.arguments), bundle.localize(inv.options)
    module = importlib.import_module(COMMANDS[command].module)
    return (module.plan_only(inv, events) if plan else module.main(inv, events)).code


def check_emit_path(command: str, path: str, force: bool) -> None:
    """--emit-config never replaces a file unless --force (it could be the job's own data), and
    never writes into a directory's name."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--emit-config {path} is a directory; it takes the name of the config file to write",
                         f"spillpack {command} ... --emit-config {path.rstrip('/')}/job.json")
    if p.exists() and not force:
        raise UsageError(f"{path} already exists; --emit-config never overwrites a file",
                         f"spillpack {command} ... --emit-config {path} --force, or another file name")


def pin_store_weights(inv: Invocation, events: Events) -> None:
    """A model only the local Ollama store holds: its verified GGUF blob becomes the config's --weights,
    so the config names the file it was resolved to (and pack can carry it, or refuse to leave it behind)."""
    from runtime.models.ref import store_weights

    pinned = store_weights(inv.arguments, inv.options)
    if pinned is not None:
        _, tag, found = pinned
        inv.options["weights"] = str(found.blob)
        events.say(f"{tag}: the GGUF of {found.qualified} in the local Ollama store, {found.blob} (SHA-256 checked), "
                   "recorded as --weights")


def _events(argv: list[str]) -> Events:
    headless = headless_wanted("--headless" in argv)
    progress.set_headless(headless)
    command = next((a for a in argv if not a.startswith("-")), None)
    return Events(command or "spillpack", headless, quiet=ranks.quiet())


def stopped_while_starting(argv: list[str]) -> int:
    """A stop before main() ran (a bundle's first start unpacking its wheels): told as any stop
    before the state is opened is, a `preempted` event, and 75."""
    return _stopped_early(_events(argv))


def _stopped_early(events: Events) -> int:
    handler = install_process_handler()
    handler.stand_down()
    events.emit("preempted", signal=handler.signal_name or "SIGTERM", abandoned_quantum=True)
    return EXIT_PREEMPTED


def exit_process(code: int) -> None:
    """Exit with `code`. After a preemption nothing is left to save, and a download abandoned
    mid-way may still hold transfer threads that the interpreter would wait for at exit:
    leave at once so the exit lands within the grace period."""
    if code == EXIT_PREEMPTED:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def _fail(err: SpillpackError, events: Events, debug: bool) -> int:
    if debug:  # redacted like every other line we print: an endpoint URL may carry credentials
        sys.stderr.write(redact(traceback.format_exc()))
    if events.headless:
        events.emit("error", message=err.line())
    events.say(err.line())
    return err.exit_code


def entry() -> None:
    exit_process(main())
