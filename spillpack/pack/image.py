"""The bundle's Containerfile: `podman build -t REF BUNDLE` (or `docker build`) gives an image
that runs the bundle on the matching spillpack image (docs/containers.md), so a cluster pulls
the job like any image: no copy pod, no volume for the bundle itself.

FROM spillpack:FLAVOR (the project's images, `make image`), of the bundle's Python: its
python3 has torch (the CPU or the CUDA build), and run.sh exec's it, so the job is PID 1.
The image's own spillpack is never on the bundle's path before the zipapp's (docs/containers.md).
"""

from __future__ import annotations

from spillpack import quoting

TEXT = """\
# The bundle {name} as an image, on the spillpack image of its Python ({python}). Written by `spillpack pack`:
#   podman build -t REF --build-arg FLAVOR=cpu|cuda .      (docker build works the same)
# FLAVOR picks spillpack:cpu (torch's CPU build) or spillpack:cuda (torch's CUDA build; on the CPU where
# no GPU is visible); SPILLPACK_IMAGE names where your spillpack images are (a registry of yours).
ARG SPILLPACK_IMAGE=spillpack
ARG FLAVOR={flavor}
FROM ${{SPILLPACK_IMAGE}}:${{FLAVOR}}
# Read-only for the job (run.sh's first-start files go to SPILLPACK_HOME, /data); nothing here is root-only.
COPY . /bundle
ENTRYPOINT ["sh", "/bundle/run.sh"]
CMD []
"""


def containerfile(name: str, python: str, engine: str | None, with_torch: str | None) -> bytes:
    flavor = "cpu" if engine == "torch-cpu" or with_torch == "cpu" else "cuda"
    return TEXT.format(name=quoting.comment(name), python=quoting.comment(python), flavor=flavor).encode()
