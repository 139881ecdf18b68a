"""`spillpack models`: the tags spillpack knows, and the models on this machine."""

import json

from runtime.models import ollama
from runtime.models.ref import TAGS, tag_dirname
from runtime.base.paths import spillpack_home


def add_arguments(p) -> None:
    pass


def rows() -> list[dict]:
    models = spillpack_home() / "models"
    out = [{"name": "tiny", "arch": "qwen2", "source": "built in, created on first use",
            "here": str(models / "tiny") if (models / "tiny" / "config.json").exists() else None}]
    for tag, t in TAGS.items():
        local = models / tag_dirname(tag)
        out.append({"name": tag, "arch": t.arch, "hf_repo": t.hf_repo, "source": f"--weights URI holding {t.hf_repo}",
                    "here": str(local) if (local / "config.json").exists() else None})
    # The local Ollama store (OLLAMA_MODELS, else ~/.ollama/models): a tag it holds is here as its GGUF blob.
    by_name = {r["name"]: r for r in out}
    for m in ollama.list_models():
        short = ollama.short_name(m.manifest)
        row = by_name.get(short)
        if row is not None and row["here"] is None:
            row.update(here=str(m.blob), ollama=m.qualified)
        elif row is None:
            out.append({"name": short, "arch": m.family or "gguf", "source": f"the local Ollama store ({m.file_type or 'GGUF'})",
                        "here": str(m.blob), "ollama": m.qualified})
    known = {tag_dirname(r["name"]) for r in out}
    if models.is_dir():
        for d in sorted(models.iterdir()):
            if d.name not in known and (d / "config.json").exists():
                arch = json.loads((d / "config.json").read_text()).get("model_type")
                out.append({"name": str(d), "arch": arch, "source": "a local directory", "here": str(d)})
    return out


def main(ns: dict, events) -> int:
    table = rows()
    if events.headless:
        for r in table:
            events.emit("model", **r)
        return 0
    width = max(len(r["name"]) for r in table)
    arch_width = max(len(str(r["arch"])) for r in table)
    for r in table:
        where = r["here"] or "not on this machine"
        if r.get("ollama"):
            where = f"{where} (Ollama: {r['ollama']})"
        print(f"{r['name']:<{width}}  {str(r['arch']):<{arch_width}}  {where}  ({r['source']})")
    return 0
