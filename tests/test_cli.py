"""The CLI contract: help, doctor, headless output, one-line errors, exit codes."""

import json

from conftest import events_of, run_cli


def test_help_lists_the_job_commands():
    r = run_cli(["--help"])
    assert r.returncode == 0
    for cmd in ("tune", "run", "eval", "distill", "build", "doctor"):
        assert f"    {cmd} " in r.stdout


def test_doctor_is_truthful(home):
    r = run_cli(["doctor"])
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    import torch

    assert report["engines"]["torch-cpu"]["usable"] is True
    assert torch.__version__ in report["engines"]["torch-cpu"]["detail"]
    assert report["engines"]["torch-cuda"]["usable"] is torch.cuda.is_available()
    assert report["engine"] == ("torch-cuda" if torch.cuda.is_available() else "torch-cpu")
    assert report["memory_gb"] > 0 and report["disk_free_gb"] > 0


def test_doctor_human(home):
    r = run_cli(["doctor"], env={"SPILLPACK_HEADLESS": "0"})
    assert r.returncode == 0
    assert "a job here would use torch-cpu" in r.stdout


def test_usage_error_is_one_line_exit_2():
    r = run_cli(["tune", "--bogus"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["spillpack: unrecognized arguments: --bogus. Try: spillpack tune --help"]
    ev = events_of(r.stdout)
    assert ev[0]["event"] == "error" and ev[0]["message"].startswith("spillpack: unrecognized")


def test_missing_positionals():
    r = run_cli(["tune"])
    assert r.returncode == 2 and "tune needs MODEL and DATA" in r.stderr


def test_unknown_model_and_tag_without_weights(home, tmp_path):
    data = "examples/data/train.jsonl"
    r = run_cli(["tune", "nosuchmodel:1b", data])
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = run_cli(["tune", "qwen2.5:0.5b", data])
    assert r.returncode == 1 and "--weights" in r.stderr


def test_engine_not_usable_is_one_line(home):
    import torch

    if torch.cuda.is_available():
        return
    r = run_cli(["tune", "tiny", "examples/data/train.jsonl", "--steps", "1", "--engine", "torch-cuda"])
    assert r.returncode == 1
    assert r.stderr.strip() == "spillpack: engine torch-cuda is not usable here: this torch has no CUDA support. Try: spillpack doctor"


def test_debug_shows_the_traceback(home, tmp_path):
    r = run_cli(["tune", "tiny", str(tmp_path / "missing.jsonl"), "--debug"])
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"spillpack_config": 1, "command": "tune", "arguments": {}, "options": {"nope": 1}}')
    r = run_cli(["tune", "--config", str(cfg)])
    assert r.returncode == 1 and "unknown option 'nope' for tune" in r.stderr
    cfg.write_text("{not json")
    r = run_cli(["tune", "--config", str(cfg)])
    assert r.returncode == 1 and "is not valid JSON" in r.stderr


def test_models_lists_tags_and_tiny(home):
    r = run_cli(["models"])
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in events_of(r.stdout)}
    assert rows["tiny"]["here"] == str(home / "models" / "tiny")
    assert rows["qwen2.5:0.5b"]["arch"] == "qwen2" and rows["qwen2.5:0.5b"]["here"] is None


def test_a_mistyped_command_suggests_the_nearest():
    r = run_cli(["tnue", "tiny", "x.jsonl"])
    assert r.returncode == 2
    assert r.stderr.strip().endswith("Try: spillpack tune --help")
