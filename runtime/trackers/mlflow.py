"""MLflow through mlflow-skinny's MlflowClient: one run per job, in a file store under the state
by default (no server, no network), or at SPILLPACK_MLFLOW_URI (a file:// URI, a path, or a
tracking server's http(s) URL).

The first process creates the run and records its id in the state; every later process logs
to that run. MLflow keeps every value it is given, so steps reach it once committed. The seams
are tags ("spillpack.seam.NNN.KIND") and lines of the run's note (its description); the run's
status says how the newest process ended (SCHEDULED: preempted, to be run again).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from runtime.base.errors import redact
from runtime.trackers import local_root, writable_dir

URI_ENV = "SPILLPACK_MLFLOW_URI"
NOTE_TAG = "mlflow.note.content"
BATCH_MAX = 1000  # MLflow's limit on the metrics of one log_batch


def tracking_uri(state_uri: str, job_name: str) -> str:
    given = os.environ.get(URI_ENV) or os.environ.get("MLFLOW_TRACKING_URI")
    if given and "://" not in given and not given.startswith(("file:", "sqlite:")):
        return Path(given).absolute().as_uri()  # a plain path: a file store there
    return given or (local_root(state_uri, job_name) / "mlruns").as_uri()


def check(state_uri: str, job_name: str, command: str) -> None:
    uri = tracking_uri(state_uri, job_name)
    if uri.startswith("file:"):
        from urllib.parse import unquote, urlparse

        writable_dir(unquote(urlparse(uri).path), "mlflow", URI_ENV, command)


def open(context: dict) -> "MLflow":
    # A server that is down must not hold the reporter for minutes (mlflow retries 7 times by default).
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # mlflow-skinny keeps the file store (the air-gapped default here) behind this switch; a
    # SQLite or server URI needs the full mlflow (SQLAlchemy) or a server.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    state = context["state"]
    record = state.tracker_run("mlflow")
    uri = os.environ.get(URI_ENV) and tracking_uri(context["state_uri"], context["job"])
    uri = uri or (record or {}).get("uri") or tracking_uri(context["state_uri"], context["job"])
    client = MlflowClient(tracking_uri=uri)
    fresh = record is None
    if fresh:
        name = os.environ.get("SPILLPACK_MLFLOW_EXPERIMENT") or context["job"]
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else client.create_experiment(name)
        run = client.create_run(experiment, run_name=context["job"], tags={"spillpack.command": context["command"],
                                                                            "spillpack.state": redact(context["state_uri"])})
        mine = {"uri": redact(uri), "experiment_id": experiment, "run_id": run.info.run_id}
        record = state.claim_tracker_run("mlflow", mine)
        if record["run_id"] != mine["run_id"]:  # another process recorded its run first: that one is the job's
            client.delete_run(mine["run_id"])
            fresh = False
    return MLflow(client, record["run_id"], fresh)


class MLflow:
    name = "mlflow"
    committed_only = True

    def __init__(self, client, run_id: str, fresh: bool):
        self.client, self.run_id, self.fresh = client, run_id, fresh
        run = client.get_run(run_id)
        self.note_text = run.data.tags.get(NOTE_TAG, "")
        self.seams = sum(1 for k in run.data.tags if k.startswith("spillpack.seam."))
        self.status = "FAILED"  # until the job says how this process ended
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")

    def params(self, params: dict) -> None:
        if self.fresh:  # a run's params are set once; what differs per process goes in the notes
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for step, values in rows for k, v in values.items()]
        for i in range(0, len(batch), BATCH_MAX):
            self.client.log_batch(self.run_id, metrics=batch[i:i + BATCH_MAX])

    def note(self, kind: str, text: str, step: int | None) -> None:
        from mlflow.entities import RunTag

        self.seams += 1
        self.note_text = (self.note_text + "\n" if self.note_text else "") + f"- {text}"
        self.client.log_batch(self.run_id, tags=[RunTag(f"spillpack.seam.{self.seams:03d}.{kind}", text), RunTag(NOTE_TAG, self.note_text)])
        if kind == "done":
            self.status = "FINISHED"
        elif kind == "interrupted":
            self.status = "SCHEDULED"  # preempted: the same command continues it

    def close(self) -> None:
        from mlflow.entities import RunStatus

        if self.status == "SCHEDULED":
            self.client.update_run(self.run_id, status="SCHEDULED")
        else:
            # set_terminated's own words, without the "View run at" lines it writes to stdout for a
            # server URI: a headless job's stdout is its events and nothing else.
            self.client._tracking_client.store.update_run_info(self.run_id, run_status=RunStatus.from_string(self.status),
                                                               end_time=int(time.time() * 1000), run_name=None)
