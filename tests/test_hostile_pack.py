"""The pack side tried as a hostile user would.

A bundle is a program someone else's cluster executes, so every value written into run.sh,
the sbatch script and the YAML goes through a real quoting function, `pack build` copies only
the files a build reads, `--verify` trusts nothing the manifest says, and credentials in a URL
are never shown. Each test runs the real thing (pack, run.sh, bash, PyYAML and the schedulers'
validators) and checks that nothing injected ever executes: no file named PWNED appears.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, clean_env, run_cli
from tests.support.scheduler_checks import kubernetes_problems, skypilot_problems

# Everything that ends a comment, a quoted string or a command, in one name (no '/': it is a file name).
HOSTILE = "evil\ntouch PWNED\n$(touch PWNED)`touch PWNED`;touch PWNED;'q\" #x: y\r\n- z"


def pwned(root: Path) -> list[Path]:
    """Injected `touch PWNED` runs in the working directory: every process here runs in `root`."""
    return list(root.rglob("PWNED")) + [p for p in (REPO / "PWNED",) if p.exists()]


def one_error_line(stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("spillpack: ") and ". Try: " in lines[0], stderr
    return lines[0]


def train_rows(n=12) -> str:
    return "\n".join((REPO / "examples/data/train.jsonl").read_text().splitlines()[:n]) + "\n"


# -- 1, 2: run.sh, sbatch and YAML -----------------------------------------------------------


def test_run_sh_runs_a_hostile_name_as_text(tmp_path):
    """The job name (by default the data file's name) lands in run.sh's comment; run.sh runs
    to its last line, hands the right arguments to Python, and runs nothing else."""
    from spillpack.pack.bundle import run_sh

    b = tmp_path / "b"
    (b / "files").mkdir(parents=True)
    for f in ("spillpack.pyz", "MANIFEST.json", "files/job.json"):
        (b / f).write_text("")
    (b / "run.sh").write_bytes(run_sh("tune", HOSTILE, "spillpack 0", "3.11", ["manylinux_2_17_x86_64"]))
    assert subprocess.run(["sh", "-n", str(b / "run.sh")]).returncode == 0
    stub = tmp_path / "python"  # answers run.sh's version probe, then records what it was started with
    stub.write_text('#!/bin/sh\nif [ "$1" = "-S" ]; then echo 3.11; exit 0; fi\n'
                    'printf "%s\\0" "$@" > "$ARGS_FILE"\n')
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "SPILLPACK_PYTHON": str(stub), "ARGS_FILE": str(tmp_path / "args"), "TMPDIR": str(tmp_path)}
    r = subprocess.run(["sh", str(b / "run.sh"), "--stop-after", HOSTILE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "args").read_bytes().decode().split("\0")[:-1]
    assert args == [f"{b}/spillpack.pyz", "tune", "--config", f"{b}/files/job.json", "--stop-after", HOSTILE]
    assert pwned(tmp_path) == []


def test_a_template_value_without_a_quoting_filter_is_refused():
    """The class, not the instance: scheduler templates cannot paste a value unquoted."""
    import jinja2

    from spillpack.schedulers.files import _env

    with pytest.raises(jinja2.TemplateError, match="unquoted"):
        _env.from_string("name: {{ name }}\n").render(name=HOSTILE)
    assert yaml.safe_load(_env.from_string("name: {{ name | yaml }}\n").render(name=HOSTILE)) == {"name": HOSTILE}


@pytest.mark.slow
def test_hostile_names_survive_in_run_sh_sbatch_and_yaml_and_nothing_executes(phome, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = src / f"{HOSTILE}.jsonl"  # the job's default name comes from this
    data.write_text(train_rows())
    out = tmp_path / "out"
    bundle = out / f"{HOSTILE}-bundle"
    state = f"s3://bucket/{HOSTILE}-state"  # SkyPilot and Kubernetes refuse a state on the pod's own disk
    r = run_cli(["pack", "tune", "tiny", str(data), "--steps", "1", "--state", state, "-o", str(bundle),
                 "--scheduler", "skypilot", "--scheduler", "slurm", "--scheduler", "kubernetes"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job = json.loads((bundle / "files" / "job.json").read_text())
    assert job["arguments"]["data"] == f"files/data/{HOSTILE}.jsonl" and job["options"]["state"] == str(state)

    run_sh = bundle / "run.sh"
    assert subprocess.run(["sh", "-n", str(run_sh)]).returncode == 0
    home = phome.parent / "node" / "home"
    v = subprocess.run([str(run_sh), "--verify"], env=clean_env(home), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert v.returncode == 0 and "match MANIFEST.json" in v.stderr, v.stderr
    h = subprocess.run([str(run_sh), "--help"], env=clean_env(home), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert h.returncode == 0 and "usage: spillpack tune" in h.stdout, h.stderr

    # The sbatch script, run by bash as Slurm would (its arguments go to run.sh).
    sbatch = out / f"{bundle.name}.sbatch"
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    s = subprocess.run(["bash", str(sbatch), "--verify"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=clean_env(home, {"SLURM_SUBMIT_DIR": str(out), "SLURM_JOB_ID": "7"}))
    assert s.returncode == 0 and "match MANIFEST.json" in s.stderr, s.stderr
    text = sbatch.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:TERM@120" in text  # #SBATCH parsing not cut short
    head = text.split("\n\n")[0].splitlines()
    assert all(l.startswith("#") for l in head), head  # nothing but comments and directives before the code

    # Kubernetes: strict schema validation and our checks; the container is the bundle's image.
    kv = pytest.importorskip("kubernetes_validate")
    for kind in ("k8s-cpu", "k8s-cuda", "k8s-pvc"):
        doc = yaml.safe_load((out / f"{bundle.name}.{kind}.yaml").read_text())
        kv.validate(doc, "1.31.0", strict=True)
        assert kubernetes_problems(doc) == []
        if kind != "k8s-pvc":
            c = doc["spec"]["template"]["spec"]["containers"][0]
            # the bundle's own image, whose entrypoint is its run.sh (docs/containers.md)
            assert "command" not in c and "args" not in c and c["image"].rsplit(":", 1)[1] == kind.split("-")[1], c

    assert pwned(tmp_path) == []

    # SkyPilot: PyYAML, SkyPilot's own parser and our checks; the workdir is the bundle, no key injected.
    sky_path = out / f"{bundle.name}.sky.yaml"
    sky = yaml.safe_load(sky_path.read_text())
    assert set(sky) == {"name", "workdir", "resources", "envs", "secrets", "setup", "run"}
    assert sky["workdir"] == f"./{bundle.name}" and sky["run"] == "./run.sh\n"
    from test_scheduler_files import sky_parse

    assert skypilot_problems(sky, sky_parse(sky_path), bundle.name) == []
    assert pwned(tmp_path) == []


# -- 18: run.sh checks its own files -----------------------------------------------------------


@pytest.mark.slow
def test_run_sh_names_a_missing_zipapp_in_one_line(phome, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text(train_rows())
    assert run_cli(["pack", "tune", "tiny", str(src), "-o", str(tmp_path / "b")]).returncode == 0
    (tmp_path / "b" / "spillpack.pyz").unlink()
    for args in ([], ["--verify"]):
        r = subprocess.run([str(tmp_path / "b" / "run.sh"), *args], env=clean_env(phome), capture_output=True, text=True)
        assert r.returncode == 1
        assert "spillpack.pyz is missing" in one_error_line(r.stderr) and "Traceback" not in r.stderr


# -- 3: pack build FOLDER ---------------------------------------------------------------------


SECRET = "AKIAHOSTILESECRET0000"


def build_folder(root: Path) -> Path:
    f = root / "proj"
    f.mkdir(parents=True)
    for name in ("evals.jsonl", "train.jsonl", "prompts.jsonl"):
        shutil.copy(REPO / "examples" / "data" / name, f / name)
    (f / ".env").write_text(f"AWS_SECRET_ACCESS_KEY={SECRET}\n")
    (f / ".aws").mkdir()
    (f / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {SECRET}\n")
    (f / ".git").mkdir()
    (f / ".git" / "config").write_text(f"[remote]\n url = https://user:{SECRET}@example.com/x\n")
    old = f / "old-bundle"  # an earlier bundle packed into the folder
    (old / "files").mkdir(parents=True)
    (old / "MANIFEST.json").write_text("{}")
    (old / "run.sh").write_text(f"#!/bin/sh\n# {SECRET}\n")
    (old / "files" / "job.json").write_text("{}")
    (f / "notes.txt").write_text(SECRET)
    (f / "passwd.jsonl").symlink_to("/etc/passwd")
    return f


@pytest.mark.slow
def test_pack_build_packs_only_the_builds_own_files(phome, tmp_path):
    folder = build_folder(tmp_path)
    r = run_cli(["pack", "build", str(folder), "-o", str(tmp_path / "b")])
    assert r.returncode == 0, r.stderr
    b = tmp_path / "b"
    packed = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert packed == ["Containerfile", "MANIFEST.json", "files/data/evals.jsonl", "files/data/prompts.jsonl", "files/data/train.jsonl",
                      "files/job.json", "run.sh", "spillpack.pyz"]
    manifest = json.loads((b / "MANIFEST.json").read_text())
    assert sorted(manifest["files"]) == [p for p in packed if p != "MANIFEST.json"]
    for p in b.rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes() and b"root:x:0:0" not in p.read_bytes(), p


@pytest.mark.slow
def test_pack_build_refuses_a_link_out_of_the_folder(phome, tmp_path):
    folder = build_folder(tmp_path)
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(train_rows())
    (folder / "train.jsonl").unlink()
    (folder / "train.jsonl").symlink_to(outside)
    r = run_cli(["pack", "build", str(folder), "-o", str(tmp_path / "b")])
    assert r.returncode == 1
    assert "outside the folder" in one_error_line(r.stderr)
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))


# -- 5: --verify trusts nothing the manifest says ----------------------------------------------


@pytest.fixture
def packed(phome, tmp_path):
    src = tmp_path / "src" / "train.jsonl"
    src.parent.mkdir()
    src.write_text(train_rows())
    assert run_cli(["pack", "tune", "tiny", str(src), "--steps", "1", "-o", str(tmp_path / "b")]).returncode == 0
    return tmp_path / "b"


def _edit_manifest(bundle: Path, fn) -> None:
    m = json.loads((bundle / "MANIFEST.json").read_text())
    fn(m["files"])
    (bundle / "MANIFEST.json").write_text(json.dumps(m))


@pytest.mark.slow
def test_verify_holds_the_manifest_to_the_bundles_own_files(packed, phome, tmp_path):
    entry = {"size": 1, "sha256": "0" * 64, "origin": "forged"}
    cases = {
        "climbs out": (lambda b: _edit_manifest(b, lambda f: f.update({"../../../../etc/passwd": entry})), "../../../../etc/passwd"),
        "absolute": (lambda b: _edit_manifest(b, lambda f: f.update({"/etc/passwd": entry})), "/etc/passwd"),
        "unlisted file": (lambda b: (b / "files" / "extra.sh").write_text("touch PWNED\n"), "files/extra.sh"),
        "entry removed, data changed": (lambda b: (_edit_manifest(b, lambda f: f.pop("files/data/train.jsonl")),
                                                   (b / "files/data/train.jsonl").write_text("{}\n")), "files/data/train.jsonl"),
    }
    for what, (damage, named) in cases.items():
        b = tmp_path / what.replace(" ", "-").replace(",", "")
        shutil.copytree(packed, b, symlinks=True)
        damage(b)
        # Starting the job refuses a forged manifest too; a file nothing reads only --verify reports.
        for args in (["--verify"], ["--stop-after", "1"]) if what != "unlisted file" else (["--verify"],):
            r = subprocess.run([str(b / "run.sh"), *args], env=clean_env(phome), capture_output=True, text=True, timeout=300)
            assert r.returncode == 1, (what, r.stderr)
            line = one_error_line(r.stderr)
            assert named in line, (what, line)
            assert "bytes" not in line, (what, line)  # nothing read from outside, no size leaked
    assert pwned(tmp_path) == []


# -- 6: credentials in AWS_ENDPOINT_URL ---------------------------------------------------------


def test_credentials_in_the_endpoint_url_are_never_shown_or_stored(home, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(train_rows(4))
    status = tmp_path / "status.json"
    env = {"AWS_ENDPOINT_URL": "http://spill:s3cr3t-pw@127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1", "SPILLPACK_STATUS": str(status)}
    r = run_cli(["tune", "tiny", str(data), "--steps", "1", "--state", "s3://bkt/x"], env=env, timeout=120)
    assert r.returncode == 1
    line = one_error_line(r.stderr)
    assert "http://***@127.0.0.1:9" in line  # the endpoint is still named, without its userinfo
    for shown in (r.stdout, r.stderr, status.read_text()):
        assert "s3cr3t-pw" not in shown and "spill:" not in shown


def test_redact_takes_the_userinfo_of_every_url():
    from runtime.base.errors import SpillpackError, redact

    assert redact("at http://u:p@ss@h:9/b/k and HTTPS://tok@h2 but s3://bkt/a@b") == \
        "at http://***@h:9/b/k and HTTPS://***@h2 but s3://bkt/a@b"
    assert "p@ss" not in SpillpackError("x http://u:p@ss@h", "curl http://u:p@ss@h").line()
