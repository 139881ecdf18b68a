"""One module per laptop-only subcommand: add_arguments(parser) and main(ns, events) -> exit code."""
