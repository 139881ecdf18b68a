"""Hostile files: files that lie about themselves (a model's config.json, its chat
template, its safetensors headers), outputs that would replace what exists, an edited bundle,
run.sh through a link, and pack under SIGTERM or on a full disk. Real files, the tiny model,
the CLI in subprocesses; the model checks also in-process where a subprocess adds nothing."""

import json
import os
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, events_of, run_cli, one_line
from tests.support.jobproc import start
from runtime.base.errors import SpillpackError

CHAT = [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("yes", "no", "maybe", "never", "always", "soon")]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    return str(path)


@pytest.fixture
def model(home, tmp_path) -> Path:
    """A copy of tiny to edit."""
    d = tmp_path / "model"
    shutil.copytree(home / "models" / "tiny", d)
    return d


def edit_json(path: Path, fn) -> None:
    value = json.loads(path.read_text())
    fn(value)
    path.write_text(json.dumps(value))


def edit_header(path: Path, fn) -> None:
    """Rewrite a safetensors file's header with fn(header) applied, the data bytes unchanged."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


# -- config.json: every field the engines read -----------------------------------------------------------


@pytest.mark.parametrize("key,value,expect", [
    ("hidden_size", "64", "\"hidden_size\" must be a whole number, not '64'"),
    ("num_hidden_layers", 4.0, "\"num_hidden_layers\" must be a whole number"),
    ("vocab_size", 0, "\"vocab_size\" must be a whole number from 1"),
    ("intermediate_size", 2**40, "\"intermediate_size\" must be a whole number from 1 to 2147483647"),
    ("num_attention_heads", 3, "\"num_attention_heads\" must be a divisor of hidden_size 128"),
    ("num_key_value_heads", 3, "\"num_key_value_heads\" must be a divisor of num_attention_heads 4"),
    ("rms_norm_eps", -1e-6, "\"rms_norm_eps\" must be more than 0"),
    ("rope_theta", "10000", "\"rope_theta\" must be a finite number"),
    ("tie_word_embeddings", "yes", "\"tie_word_embeddings\" must be true or false"),
    ("rope_scaling", [1], "\"rope_scaling\" must be an object"),
    ("rope_scaling", {"rope_type": "linear"}, "does not describe a model spillpack can build (KeyError"),
    ("eos_token_id", "</s>", "\"eos_token_id\" must be a token id"),
    ("layer_types", ["full_attention"], "\"layer_types\" must be one entry per layer (4)"),
    ("max_position_embeddings", True, "\"max_position_embeddings\" must be a whole number"),
])
def test_a_wrong_type_range_or_inconsistency_in_config_json_is_one_line_naming_the_field(model, key, value, expect):
    from runtime.models.ref import validate

    edit_json(model / "config.json", lambda c: c.__setitem__(key, value))
    with pytest.raises(SpillpackError) as e:
        validate(model)
    line = e.value.line()
    assert "\n" not in line and str(model / "config.json") in line and expect in line, line


def test_a_string_where_config_json_has_a_number_is_one_line_from_the_cli(model, data, tmp_path):
    edit_json(model / "config.json", lambda c: c.__setitem__("hidden_size", "64"))
    one_line(run_cli(["tune", str(model), data, "--steps", "1", "--state", str(tmp_path / "s")]),
             "config.json: \"hidden_size\" must be a whole number")
    assert not (tmp_path / "s").exists()


# -- chat templates: bounded work ----------------------------------------------------------------------------


@pytest.mark.parametrize("template", [
    "{% for i in range(100000000) %}x{% endfor %}",
    "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 1000000000000 }}",
    "{% for i in range(60000) %}{{ 'y' * 2000 }}{% endfor %}",
    "{{ ((10 ** 64) ** 64) ** 64 }}",  # each power within bounds, the result not
    "{% set n = namespace(x=10 ** 60) %}{% for i in range(40) %}{% set n.x = n.x * n.x %}{% endfor %}{{ n.x % 7 }}",
    "{{ 10.0 ** 400 }}",
])
def test_a_chat_template_with_unbounded_work_is_the_one_line_refusal(model, template):
    from runtime.models.tokenizer import Tokenizer

    edit_json(model / "tokenizer_config.json", lambda c: c.__setitem__("chat_template", template))
    tok = Tokenizer.from_dir(model)
    with pytest.raises(SpillpackError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert f"the chat template of {model} refused the conversation" in e.value.line()


def test_a_chat_template_that_loops_past_its_bound_is_one_line_from_the_cli(model, data, tmp_path):
    edit_json(model / "tokenizer_config.json",
              lambda c: c.__setitem__("chat_template", "{% for i in range(100000000) %}{{ messages[0].content }}{% endfor %}"))
    one_line(run_cli(["tune", str(model), data, "--steps", "1", "--state", str(tmp_path / "s")]),
             "refused the conversation", "range() calls ask for more than")


def test_real_templates_render_as_before_under_the_bounds(home):
    from runtime.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(home / "models" / "tiny")
    messages = [{"role": "user", "content": "hi " * 1000}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(messages)
    assert text.count("hi ") == 1000 and "yo" in text


# -- safetensors headers, checked against the file ------------------------------------------------------------


def test_a_float_tensor_labelled_as_integers_is_refused_before_any_step(model, data, tmp_path):
    edit_header(model / "model.safetensors", lambda h: h["model.embed_tokens.weight"].__setitem__("dtype", "I32"))
    r = run_cli(["tune", str(model), data, "--steps", "1", "--state", str(tmp_path / "s")])
    one_line(r, "model.safetensors", "model.embed_tokens.weight has dtype 'I32', not a float type")
    assert not [e for e in events_of(r.stdout) if e["event"] == "step"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    one_line(run_cli(["run", str(model), str(rows), "--state", str(tmp_path / "r")]), "has dtype 'I32'")
    assert not (tmp_path / "r" / "results.jsonl").exists()


def test_a_header_claiming_more_bytes_than_the_file_holds_is_refused_by_its_size(model, data, tmp_path):
    def huge(h):
        e = h["model.embed_tokens.weight"]
        e["shape"], e["data_offsets"] = [2**20, 2**28], [e["data_offsets"][0], e["data_offsets"][0] + 2**50]

    edit_header(model / "model.safetensors", huge)
    line = one_line(run_cli(["tune", str(model), data, "--steps", "1", "--state", str(tmp_path / "s")]),
                    "model.embed_tokens.weight ends at byte 1125899906842624 of data, past the file's")
    assert "GB" not in line


@pytest.mark.parametrize("entry,expect", [
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}, "claims 8 bytes, but F32 of shape [2, 2] is 16"),
    ({"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}, "has shape [-2, 2]"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}, "has data offsets [16, 0]"),
    ({"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}, "has dtype 'BOOL'"),
    ("F32", "has no dtype, shape and offsets"),
])
def test_a_header_entry_that_lies_about_its_tensor_is_refused(tmp_path, entry, expect):
    from runtime.models.weights import read_safetensors_header

    header = json.dumps({"w": entry}).encode()
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(SpillpackError) as e:
        read_safetensors_header(f)
    assert expect in e.value.line()


# -- --emit-config never replaces a file unless --force ------------------------------------------------------


def test_emit_config_refuses_to_overwrite_the_jobs_own_data(home, data, tmp_path):
    before = Path(data).read_bytes()
    r = run_cli(["tune", "tiny", data, "--emit-config", data])
    one_line(r, f"{data} already exists", "--force", code=2)
    assert Path(data).read_bytes() == before


def test_emit_config_replaces_an_existing_file_with_force(home, data, tmp_path):
    cfg = tmp_path / "job.json"
    cfg.write_text("old")
    r = run_cli(["tune", "tiny", data, "--steps", "3", "--emit-config", str(cfg), "--force"])
    assert r.returncode == 0, r.stderr
    assert json.loads(cfg.read_text())["options"]["steps"] == 3


def test_emit_config_naming_a_directory_is_one_line_and_writes_nothing_there(home, data, tmp_path):
    d = tmp_path / "cfgdir"
    d.mkdir()
    one_line(run_cli(["tune", "tiny", data, "--emit-config", str(d)]), f"--emit-config {d} is a directory", code=2)
    assert list(d.iterdir()) == []


# -- a packed bundle: files/job.json against the manifest, run.sh through a link ----------------------------------


@pytest.fixture
def bundle(phome, data, tmp_path) -> Path:
    cfg = tmp_path / "tune.json"
    assert run_cli(["tune", "tiny", data, "--steps", "3", "--name", "b", "--emit-config", str(cfg)]).returncode == 0
    r = run_cli(["pack", str(cfg), "-o", str(tmp_path / "b")], timeout=600)
    assert r.returncode == 0, r.stderr
    return tmp_path / "b"


def test_a_bundle_whose_job_json_was_edited_refuses_to_run_it(bundle, phome, tmp_path):
    job = bundle / "files" / "job.json"
    text = job.read_text()
    assert '"steps": 3' in text
    job.write_text(text.replace('"steps": 3', '"steps": 2'))  # the same size: only the digest tells
    node = tmp_path / "node"
    r = subprocess.run([str(bundle / "run.sh")], env=clean_env(node), capture_output=True, text=True, timeout=600)
    one_line(r, "bundled file files/job.json does not match its SHA-256 in MANIFEST.json", "./run.sh --verify")
    assert not (node / "jobs").exists()
    r = run_cli(["resume", str(bundle)])
    one_line(r, "files/job.json does not match")


def test_run_sh_through_a_symlink_finds_its_bundle(bundle, phome, tmp_path):
    links = tmp_path / "elsewhere"
    links.mkdir()
    (links / "job").symlink_to(bundle / "run.sh")
    (links / "job2").symlink_to(links / "job")  # a chain, and a relative one
    (tmp_path / "rel").symlink_to(Path("elsewhere") / "job2")
    for link in (links / "job", links / "job2", tmp_path / "rel"):
        r = subprocess.run([str(link), "--verify"], env=clean_env(phome), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        assert "missing" not in r.stderr
    node = tmp_path / "node"
    r = subprocess.run([str(links / "job2")], env=clean_env(node), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert events_of(r.stdout)[-1]["steps"] == 3


# -- pack: SIGTERM, and a full disk -------------------------------------------------------------------------------


def test_pack_stops_at_once_on_sigterm_and_leaves_nothing_at_o(phome, tmp_path):
    # 30 MB of rows: the bundle is being written (its staging folder .b.* exists) for a second
    # or more, and the SIGTERM lands then, not before the pack began writing or after it ended.
    data = tmp_path / "train.jsonl"
    row = json.dumps({"messages": [{"role": "user", "content": "hi " * 200}, {"role": "assistant", "content": "yo " * 200}]})
    data.write_text((row + "\n") * 24000)
    out = tmp_path / "b"
    p = start(["pack", "tune", "tiny", str(data), "--steps", "3", "-o", str(out)])
    t0 = time.monotonic()
    while not [q for q in tmp_path.iterdir() if q.name.startswith(".b.")] and p.poll() is None and time.monotonic() - t0 < 300:
        time.sleep(0.005)
    assert p.poll() is None, p.stderr.read()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=90)
    err = p.stderr.read()
    assert rc == 75, err
    assert "Traceback" not in err
    assert not out.exists() and not [q for q in tmp_path.iterdir() if q.name.startswith(".b.")]


needs_mounts = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a tmpfs")


@needs_mounts
def test_pack_on_a_full_disk_names_the_file_it_could_not_write(phome, data, tmp_path):
    import sys

    full = tmp_path / "full"
    full.mkdir()
    script = f'mount -t tmpfs -o size=2m tmpfs {full} && {sys.executable} -m spillpack pack tune tiny {data} -o {full}/b'
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True, text=True,
                       env={**os.environ, "SPILLPACK_HEADLESS": "1"}, timeout=600, cwd=REPO)
    line = one_line(r, "no space left on the disk of", str(full))
    assert "of a file" not in line


def test_a_carried_wheel_that_does_not_match_the_manifest_leaves_nothing_installed(tmp_path):
    import zipfile

    from runtime.bootstrap.bundle import Bundle
    from runtime.bootstrap.manifest import FileEntry, Manifest
    from runtime.bootstrap.wheels import install_wheels
    from runtime.base.fileio import sha256_file

    wheels = tmp_path / "wheels" / "tag"
    wheels.mkdir(parents=True)
    whl = wheels / "alpha-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("alpha/__init__.py", "NAME = 'alpha'\n")
    entry = FileEntry(whl.stat().st_size, sha256_file(whl), "test")
    manifest = Manifest(packer="t", command="tune", name="x", python="3.11", platforms=["tag"], zipapp={}, with_torch="cpu",
                        files={"wheels/tag/" + whl.name: entry})
    bundle = Bundle(tmp_path, manifest)
    check = lambda w: bundle.check_file(f"wheels/tag/{w.name}")
    install_wheels(wheels, tmp_path / "ok", check)  # the packed wheel installs
    assert (tmp_path / "ok" / "alpha" / "__init__.py").exists()
    with zipfile.ZipFile(whl, "w") as z:  # the same name, other bytes
        z.writestr("alpha/__init__.py", "import os; os.system('touch PWNED')\n")
    with pytest.raises(SpillpackError) as e:
        install_wheels(wheels, tmp_path / "bad", check)
    assert "bundled file wheels/tag/alpha-1.0-py3-none-any.whl" in e.value.line() and "the bundle is damaged" in e.value.line()
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.*"))
