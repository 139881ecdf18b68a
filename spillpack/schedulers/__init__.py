"""Scheduler files for a bundle (files.py: SkyPilot, Slurm, Kubernetes rendered from templates/),
and the rendered examples in the repository's examples/schedulers/ (examples.py)."""
