from runtime.base.signals import install_process_handler

install_process_handler()  # before the CLI's imports: a stop during start-up exits 75, not 143
from runtime.base.threads import quiet_openmp  # noqa: E402

quiet_openmp()  # before anything loads torch's OpenMP runtime

from runtime.cli import entry  # noqa: E402

entry()
