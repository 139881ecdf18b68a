"""The state named at launch: SPILLPACK_STATE overrides a bundle's baked --state (one bundle,
many runs), and scheduler files for machines whose disk dies with them need an S3 state."""

import pytest

from conftest import clean_env, events_of
from test_pack import JOB, adapter, data, new_home, pack, run_bundle  # noqa: F401


def test_bundle_state_from_the_environment_is_used_and_nothing_else(phome, data, tmp_path, tiny_home):
    baked = tmp_path / "baked-state"
    r = pack(["tune", "tiny", str(data), *JOB, "--state", str(baked), "-o", str(tmp_path / "b")])
    assert r.returncode == 0, r.stderr
    home = new_home(tmp_path, tiny_home, "node")
    launch = tmp_path / "launch-state"
    r = run_bundle(tmp_path / "b", env=clean_env(home, {"SPILLPACK_STATE": str(launch)}))
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert start["state"] == str(launch)
    assert (launch / "job.json").is_file() and adapter(launch)
    assert not baked.exists() and not (home / "jobs").exists()
    # --state on run.sh's own command line still wins over the environment.
    other = tmp_path / "given-state"
    r = run_bundle(tmp_path / "b", ["--state", str(other)], env=clean_env(home, {"SPILLPACK_STATE": str(launch)}))
    assert r.returncode == 0, r.stderr
    assert (other / "job.json").is_file()


@pytest.mark.parametrize("kind", ["skypilot", "kubernetes"])
def test_spot_schedulers_refuse_a_local_state(phome, data, tmp_path, kind):
    for state in ([], ["--state", str(tmp_path / "s")]):
        r = pack(["tune", "tiny", str(data), *JOB, *state, "-o", str(tmp_path / "b"), "--scheduler", kind])
        assert r.returncode == 1, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith(f"spillpack: --scheduler {kind} needs the job's state on S3")
        assert "--state s3://" in line and "SPILLPACK_STATE" in line
        assert not (tmp_path / "b").exists()


def test_slurm_keeps_a_note_for_a_path_state(phome, data, tmp_path):
    r = pack(["tune", "tiny", str(data), *JOB, "--state", str(tmp_path / "s"), "-o", str(tmp_path / "b"), "--scheduler", "slurm"])
    assert r.returncode == 0, r.stderr
    assert "is a path; on a cluster it must be on storage every node" in r.stderr
