from runtime.base.signals import install_process_handler

install_process_handler()  # before the CLI's imports: a stop during start-up exits 75, not 143

from .cli import main  # noqa: E402

main()
