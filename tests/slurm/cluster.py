"""A real single-node Slurm cluster for the tests, from Debian's packages, without systemd.

    python tests/slurm/cluster.py install   # apt-get the packages when missing (root)
    python tests/slurm/cluster.py start     # munged, slurmctld -D, slurmd -D; waits for the node
    python tests/slurm/cluster.py stop      # cancels jobs, then stops the daemons by pid
    python tests/slurm/cluster.py env       # the SLURM_CONF line to export

Everything lives under one run directory (SPILLPACK_SLURM_DIR, default
/tmp/spillpack-slurm): config, munge key and socket, state, logs, pid files. Nothing under
/etc is changed, so the clients find the cluster through SLURM_CONF.

Two partitions on the one node make real preemption possible: a job in `high`
(PriorityTier 10) preempts one in `low`, which Slurm requeues (PreemptMode=REQUEUE).
The settings below are the ones that work in a container without systemd or cgroups:
linuxproc process tracking, no task plugin, no accounting, and short credential and
scheduler intervals so that a requeued job runs again within seconds, not two minutes.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("slurmd", "slurmctld", "munged")  # stop order
POLICY_RC = Path("/usr/sbin/policy-rc.d")


def run_dir() -> Path:
    return Path(os.environ.get("SPILLPACK_SLURM_DIR", "/tmp/spillpack-slurm"))


def conf_path() -> Path:
    return run_dir() / "slurm.conf"


def env() -> dict:
    """What a client (sbatch, squeue, the job's own scontrol) needs to find this cluster."""
    return {**os.environ, "SLURM_CONF": str(conf_path())}


def missing() -> list[str]:
    return [p for p in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(p) is None]


def why_unavailable() -> str | None:
    """None when a cluster can be started here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "the Slurm daemons must run as root here, and this is not root"
    if missing():
        return f"Debian's Slurm packages are not installed (missing {', '.join(missing())}); run: python tests/slurm/cluster.py install"
    return None


def install(quiet: bool = True) -> None:
    """apt-get the packages when missing. A policy-rc.d that exits 101 keeps the packages
    from starting their own daemons (there is no systemd to start them anyway)."""
    if not missing():
        return
    own_policy = not POLICY_RC.exists()
    if own_policy:
        POLICY_RC.write_text("#!/bin/sh\n# spillpack tests: packages must not start daemons\nexit 101\n")
        POLICY_RC.chmod(0o755)
    out = subprocess.DEVNULL if quiet else None
    apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, stdout=out, env=apt_env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], check=True, stdout=out, env=apt_env)
    finally:
        if own_policy:
            POLICY_RC.unlink()


def node_line() -> str:
    """`slurmd -C` describes this machine; the node is reached on loopback."""
    first = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    return first + " NodeAddr=127.0.0.1 State=UNKNOWN"


def write_config(d: Path) -> str:
    node = node_line()
    name = node.split()[0].split("=", 1)[1]
    text = f"""# written by tests/slurm/cluster.py
ClusterName=spillpack
SlurmctldHost={name}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket.2,cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
KillWait=30
{node}
PartitionName=low Nodes={name} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=0 MaxTime=INFINITE State=UP
PartitionName=high Nodes={name} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
"""
    (d / "slurm.conf").write_text(text)
    return name


def _pid(d: Path, daemon: str) -> int | None:
    try:
        pid = int((d / f"{daemon}.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if this process started it and it has ended
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def running() -> bool:
    d = run_dir()
    return all(_pid(d, n) for n in DAEMONS) and _node_state() in ("idle", "mixed", "allocated")


def _node_state() -> str | None:
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env(), timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.split()[0].rstrip("*~#") if r.returncode == 0 and r.stdout.split() else None


def _spawn(d: Path, daemon: str, argv: list[str]) -> None:
    log = open(d / f"{daemon}.out", "ab")
    p = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True, env=env())
    (d / f"{daemon}.pid").write_text(f"{p.pid}\n")


def start(timeout: float = 60.0) -> None:
    reason = why_unavailable()
    if reason:
        raise RuntimeError(reason)
    d = run_dir()
    if running():
        return
    stop()
    if d.exists():
        shutil.rmtree(d)
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir(parents=True)
    (d / "munge").chmod(0o755)  # clients other than root must reach the socket
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    write_config(d)
    # munged refuses root without --force; -F keeps it in the foreground so its pid is ours.
    _spawn(d, "munged", ["munged", "-F", "--force", f"--socket={d}/munge/munge.socket.2", f"--key-file={key}",
                         f"--seed-file={d}/munge.seed", f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pidfile"])
    _wait(lambda: (d / "munge" / "munge.socket.2").exists(), timeout, "munged did not create its socket", d)
    _spawn(d, "slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(d / "slurm.conf")])
    _wait(lambda: _port_open(6817), timeout, "slurmctld did not start listening", d)
    _spawn(d, "slurmd", ["slurmd", "-D", "-f", str(d / "slurm.conf")])
    _wait(lambda: _node_state() == "idle", timeout, "the node did not become idle", d)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(pred, timeout: float, what: str, d: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-1500:] for p in sorted(d.glob("*.log")) + sorted(d.glob("*.out")))
    raise RuntimeError(f"{what} within {timeout:.0f} s\n{logs}")


def stop() -> None:
    """Cancel every job first (slurmd must be up to kill them), then the daemons by pid."""
    d = run_dir()
    if not d.exists():
        return
    if _pid(d, "slurmctld") and shutil.which("squeue"):
        subprocess.run(["scancel", "--full", "--user", "root"], env=env(), capture_output=True, timeout=30)
        end = time.monotonic() + 40
        while time.monotonic() < end:
            r = subprocess.run(["squeue", "-h", "-o", "%i"], env=env(), capture_output=True, text=True, timeout=30)
            if r.returncode != 0 or not r.stdout.strip():
                break
            time.sleep(0.5)
    for daemon in DAEMONS:
        pid = _pid(d, daemon)
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 20
        while time.monotonic() < end and _pid(d, daemon):
            time.sleep(0.1)
        if _pid(d, daemon):
            os.kill(pid, signal.SIGKILL)
        (d / f"{daemon}.pid").unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "status"
    if what == "install":
        install()
    elif what == "start":
        start()
        print(f"slurm up; export SLURM_CONF={conf_path()}")
    elif what == "stop":
        stop()
    elif what == "env":
        print(f"export SLURM_CONF={conf_path()}")
    elif what == "status":
        print("running" if running() else (why_unavailable() or "stopped"))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
