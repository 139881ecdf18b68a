"""The bottom layer: standard-library-only process and machine helpers that every other folder,
the bootstrap included, may import (errors, atomic files, paths, signals, progress, the CPUs and
memory a job is allotted and the CPU threads it runs, where a process runs, which rank it is)."""
