"""Job configs: the one contract between the laptop and the machine that runs a job.

Shape (docs/config.md): {"spillpack_config": 1, "command", "arguments", "options"}.
JSON, or TOML when the file name ends in .toml. Every default is written out, so a
config means the same job on every machine and every later version of spillpack.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.config.commands import COMMANDS, default_name, options_for
from runtime.config.options import check_value
from runtime.base.errors import SpillpackError, UsageError
from runtime.base.fileio import atomic_write

CONFIG_VERSION = 1
TOP_KEYS = ("spillpack_config", "command", "arguments", "options")


@dataclass
class Invocation:
    """A fully resolved job: what --emit-config writes and what a job runs from."""

    command: str
    arguments: dict
    options: dict
    headless: bool = False
    debug: bool = False
    config_path: str | None = None
    bundle: object = None  # the runtime.bootstrap Bundle this process runs from, if any
    force: bool = False  # --force: this process's, never in a config (a row job's state may mix dtypes)

    def to_config(self) -> dict:
        return {
            "spillpack_config": CONFIG_VERSION,
            "command": self.command,
            "arguments": dict(self.arguments),
            "options": dict(self.options),
        }

    def get(self, name: str):
        if name in self.arguments:
            return self.arguments[name]
        return self.options.get(name)


def read_config(path: str, bundle=None) -> dict:
    """The config at `path`, checked; `bundle`: the bundle it was packed into, whose manifest its
    bytes must match before anything is taken from them (the job description is read first)."""
    p = Path(path)
    if p.exists() and not p.is_file():  # a FIFO would block forever, a device never end
        raise SpillpackError(f"config {path} is not a regular file", f"spillpack tune tiny data.jsonl --emit-config job.json")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise SpillpackError(f"cannot read config {path}: {e.strerror}", f"spillpack tune tiny data.jsonl --emit-config {path}")
    if bundle is not None:
        bundle.check_read(p, raw)
    try:
        if p.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib

            data = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise SpillpackError(f"config {path} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'} ({e})", f"spillpack <command> ... --emit-config {path}")
    return check_config(data, path)


def check_config(data, path: str) -> dict:
    """The checks of a config's shape, wherever it was read from (a file, a job's state)."""
    if not isinstance(data, dict) or "spillpack_config" not in data:
        raise SpillpackError(f"{path} is not a spillpack config (no \"spillpack_config\" key)", f"spillpack <command> ... --emit-config {path}")
    if data["spillpack_config"] != CONFIG_VERSION:
        raise SpillpackError(f"{path} is a spillpack config of version {data['spillpack_config']!r}; this spillpack reads version {CONFIG_VERSION}",
                             f"spillpack <command> ... --emit-config {path} with this spillpack")
    command = data.get("command")
    if command not in COMMANDS:
        raise SpillpackError(f"{path} names an unknown command {command!r}", f"one of: {', '.join(COMMANDS)}")
    extra = sorted(set(data) - set(TOP_KEYS), key=str)
    if extra:
        raise SpillpackError(f"{path}: unknown key {extra[0]!r} (a config has only {', '.join(TOP_KEYS)})",
                             f"spillpack {command} ... --emit-config {path}")
    # Each section names only what a job is: the command's arguments, then its options, never
    # how one process runs (--config, --emit-config, --headless, --debug).
    known = {"arguments": {o.name for o in options_for(command) if o.positional},
             "options": {o.name for o in options_for(command) if o.in_config and not o.positional}}
    for section in ("arguments", "options"):
        values = data.get(section, {})
        if not isinstance(values, dict):
            raise SpillpackError(f"{path}: \"{section}\" must be a table", f"spillpack {command} ... --emit-config {path}")
        unknown = sorted(set(values) - known[section], key=str)
        if unknown:
            raise SpillpackError(f"{path}: unknown {section[:-1]} {unknown[0]!r} for {command}", f"spillpack {command} --help")
    return data


def write_config(inv: Invocation, path: str) -> None:
    """Write atomically so a crash never leaves half a config behind."""
    data = inv.to_config()
    p = Path(path)
    if p.suffix == ".toml":
        import tomli_w

        # TOML has no null: options left unset are simply absent and read back as defaults.
        data = {k: ({kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v) for k, v in data.items()}
        text = tomli_w.dumps(data)
    else:
        text = json.dumps(data, indent=2) + "\n"
    atomic_write(p, text.encode())


def resolve(command: str, given: dict, config_path: str | None = None, config: dict | None = None, *,
            replay_per_run: bool = True, headless: bool = False, debug: bool = False, bundle=None) -> Invocation:
    """The one path from values to a job: defaults < config file (or an already read `config`)
    < `given` (the command line). Every value is checked by its option's rule, derived defaults
    are filled in, and rules across options are checked, so what comes out is a valid, fully
    resolved job. `replay_per_run=False` leaves out a saved config's per-run options
    (--stop-after, --engine, ...): `resume` continues the job, not that process."""
    spec = COMMANDS[command]
    from_file: dict = {}
    if config_path:
        config = read_config(config_path, bundle)
        if config["command"] != command:
            raise UsageError(f"{config_path} is a {config['command']} config, not {command}", f"spillpack {config['command']} --config {config_path}")
    if config is not None:
        from_file = {**config.get("arguments", {}), **config.get("options", {})}
    values, positional = {}, []
    for opt in options_for(command):
        if not opt.in_config:
            continue
        if opt.name in given:
            value = given[opt.name]
        elif opt.name in from_file and (replay_per_run or not opt.per_run):
            value = from_file[opt.name]
        else:
            value = opt.default
        values[opt.name] = check_value(command, opt, value)
        if opt.positional:
            positional.append(opt.name)
    missing = [n.upper() for n in positional if values.get(n) in (None, "")]
    if missing:
        raise UsageError(f"{command} needs {' and '.join(missing)}", f"spillpack {command} --help")
    if not values.get("name"):
        values["name"] = default_name(command, values[spec.main_input])
    spec.derive(values)
    spec.check(values)
    arguments = {k: v for k, v in values.items() if k in positional}
    options = {k: v for k, v in values.items() if k not in positional}
    return Invocation(command, arguments, options, headless=headless, debug=debug, config_path=config_path, bundle=bundle)
