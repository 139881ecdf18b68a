"""Job configs: the one contract between the laptop and the machine that runs a job.

Shape (ARCHITECTURE.md): {"spillpack_config": 1, "command", "arguments", "options"}.
JSON, or TOML when the file name ends in .toml. Every default is written out, so a
config means the same job on every machine and every later version of spillpack.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import SpillpackError, UsageError
from runtime.config.options import JOB_COMMANDS, options_for
from runtime.fileio import atomic_write

CONFIG_VERSION = 1


@dataclass
class Invocation:
    """A fully resolved job: what --emit-config writes and what a job runs from."""

    command: str
    arguments: dict
    options: dict
    headless: bool = False
    debug: bool = False
    config_path: str | None = None
    extra: dict = field(default_factory=dict)
    bundle: object = None  # the runtime.bootstrap.bundle.Bundle the job runs from, else None; never in a config

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


def default_name(inv: "Invocation", uri_arg: str) -> None:
    """Name a job after its command and its main input when --name is not given:
    `tune-train` for train.jsonl, `build-data` for a folder."""
    if not inv.options.get("name"):
        last = str(inv.arguments[uri_arg]).rstrip("/").rsplit("/", 1)[-1]
        inv.options["name"] = f"{inv.command}-{Path(last).stem or 'job'}"


def read_config(path: str) -> dict:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise SpillpackError(f"cannot read config {path}: {e.strerror}", f"spillpack tune tiny data.jsonl --emit-config {path}")
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
    if not isinstance(data, dict) or data.get("spillpack_config") != CONFIG_VERSION:
        raise SpillpackError(f"{path} is not a spillpack config (no \"spillpack_config\": {CONFIG_VERSION})", f"spillpack <command> ... --emit-config {path}")
    command = data.get("command")
    if command not in JOB_COMMANDS:
        raise SpillpackError(f"{path} names an unknown command {command!r}", f"one of: {', '.join(JOB_COMMANDS)}")
    known = {o.name for o in options_for(command)}
    for section in ("arguments", "options"):
        values = data.get(section, {})
        if not isinstance(values, dict):
            raise SpillpackError(f"{path}: \"{section}\" must be a table", f"spillpack {command} ... --emit-config {path}")
        unknown = sorted(set(values) - known)
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


def resolve(command: str, given: dict, config_path: str | None, config: dict | None = None) -> tuple[dict, dict]:
    """Defaults < config file (or an already read `config`) < command line. Returns (arguments, options)."""
    from_file: dict = {}
    if config is not None:
        from_file = {**config.get("arguments", {}), **config.get("options", {})}
    if config_path:
        data = read_config(config_path)
        if data["command"] != command:
            raise UsageError(f"{config_path} is a {data['command']} config, not {command}", f"spillpack {data['command']} --config {config_path}")
        from_file = {**data.get("arguments", {}), **data.get("options", {})}
    arguments, options = {}, {}
    for opt in options_for(command):
        if not opt.in_config:
            continue
        value = given.get(opt.name, from_file.get(opt.name, opt.default))
        (arguments if opt.positional else options)[opt.name] = value
    missing = [o.name.upper() for o in options_for(command) if o.positional and arguments.get(o.name) in (None, "")]
    if missing:
        raise UsageError(f"{command} needs {' and '.join(missing)}", f"spillpack {command} --help")
    return arguments, options
