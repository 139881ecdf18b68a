"""What run.sh starts (the zipapp's entry point, `runtime.entry:bundle`): the bootstrap prepares the
bundle (runtime/bootstrap/start.py), then the CLI runs the job. It sits on top of both so the
bootstrap never imports the layers above it. The CLI is imported only once the bundle is prepared:
its imports need the platform's compiled packages that prepare() activates.
"""

from __future__ import annotations

import sys

from runtime.base.errors import SpillpackError
from runtime.base.signals import Abandon, install_process_handler
from runtime.base.threads import quiet_openmp
from runtime.bootstrap.start import prepare


def bundle() -> None:
    install_process_handler()  # first: a stop while the bundle starts (wheels, imports) exits 75, not 143
    quiet_openmp()  # before the job's imports load torch's OpenMP runtime
    argv = sys.argv[1:]
    try:
        bundle = prepare(argv)
    except SpillpackError as e:
        sys.stderr.write(e.line() + "\n")
        sys.exit(e.exit_code)
    except Abandon:  # stopped while the first start unpacked its wheels: nothing of the job was written
        from runtime.cli import exit_process, stopped_while_starting

        exit_process(stopped_while_starting(argv))
    if isinstance(bundle, int):
        sys.exit(bundle)
    from runtime.cli import exit_process, main

    exit_process(main(argv, bundle=bundle))
