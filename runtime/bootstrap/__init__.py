"""The bundle's start-up side, shiv's bootstrap to the packer's builder (spillpack/pack/).

manifest.py   the Manifest type: the packer writes it, the runtime reads it
platforms.py  wheel platform tags; the zipapp's compiled packages for this machine
wheels.py     first-start install of carried torch/mlx wheels
bundle.py     Bundle: root + manifest; localize, check_read, verify
start.py      the zipapp's entry point (what run.sh starts, once shiv has unpacked it)
early.py      the zipapp's first code (copied to its root): records a stop while shiv unpacks

Standard library only (tests/test_layout.py holds it to that): it runs before sys.path is
complete, and the packer imports it. Of the rest of runtime/ it imports only runtime.base.errors and
runtime.base.fileio (both stdlib-only), and hands over to runtime.cli once the path is complete.
"""
