"""The zipapp's very first code: its __main__ calls `main()` here, before shiv unpacks its
site-packages (a second or more on a machine's first start) and before anything of runtime/
is importable. A stop (SIGTERM, SIGHUP, SIGINT) meanwhile is only recorded; the process's
real handler (runtime.base.signals.install_process_handler) takes it over once the job's
code is on the path, so it exits 75 with nothing written instead of the default 143.

The packer copies this file to the archive's root as `_spillpack_early.py` (spillpack/pack/
zipapp.py). Standard library only, and only what runs before the path is complete.
"""

import signal

MODULE = "_spillpack_early"  # its name at the archive's root, where the real handler looks for it
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
stopped: list[str] = []  # the signals received before the real handler was installed


def _record(signum, frame) -> None:
    stopped.append(signal.Signals(signum).name)


def main() -> None:
    for sig in SIGNALS:
        signal.signal(sig, _record)
    import _bootstrap  # shiv's: unpack site-packages once, put it on sys.path, call runtime.entry:bundle

    _bootstrap.bootstrap()
