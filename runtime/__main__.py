from runtime.cli import entry

entry()
