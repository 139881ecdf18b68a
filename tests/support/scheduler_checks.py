"""Checks for what the schedulers' own validators let through. Each returns a list of
problems (empty = fine), so a test can show that a broken file is caught."""

K8S_ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}
K8S_OPERATORS = {"In", "NotIn"}
JOB_RECOVERY_KEYS = {"strategy", "max_restarts_on_errors", "recover_on_exit_codes"}


def skypilot_problems(raw: dict, parsed: dict, bundle: str) -> list[str]:
    """raw: the YAML as loaded; parsed: what tests/support/sky_parse.py reports from sky.Task.from_yaml."""
    out = []
    jr = (raw.get("resources") or {}).get("job_recovery")
    if not isinstance(jr, dict):
        return ["resources.job_recovery must be a mapping with recover_on_exit_codes"]
    unknown = set(jr) - JOB_RECOVERY_KEYS
    if unknown:
        out.append(f"unknown keys in job_recovery: {sorted(unknown)}")
    if str(jr.get("strategy", "")).lower() not in parsed["strategies"]:
        out.append(f"job_recovery.strategy {jr.get('strategy')!r} is not one of {parsed['strategies']}")
    codes = jr.get("recover_on_exit_codes")
    if 75 not in (codes if isinstance(codes, list) else [codes]):
        out.append("exit code 75 is not in recover_on_exit_codes")
    res = parsed["resources"]
    if not all(r["use_spot"] for r in res):
        out.append("not every resource option is spot")
    accs = {a for r in res for a in (r["accelerators"] or {})}
    if not {"H100", "A100", "L4", "A10G"} <= accs:
        out.append(f"any_of lacks some of H100, A100, L4, A10G: {sorted(accs)}")
    if not any(r["accelerators"] is None for r in res):
        out.append("any_of has no CPU-only option")
    if parsed["workdir"].rstrip("/") not in (bundle, f"./{bundle}"):
        out.append(f"workdir is {parsed['workdir']!r}, not the bundle {bundle}")
    if "chmod +x run.sh" not in (parsed["setup"] or ""):
        out.append("setup does not restore run.sh's run bit")
    if "./run.sh" not in (parsed["run"] or ""):
        out.append("run does not start ./run.sh")
    creds = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    if not creds <= set(parsed["secret_refs"]):
        out.append("AWS credentials are not secrets given at launch")
    if creds & set(parsed["envs"]) or parsed["secrets"]:
        out.append("a credential value is written in the file")
    return out


def kubernetes_problems(doc: dict) -> list[str]:
    """Rules of the Job API that the OpenAPI schema does not express, and our own contract."""
    out = []
    if doc.get("kind") in ("PersistentVolumeClaim", "Service"):
        return out
    spec = doc["spec"]
    pod = spec["template"]["spec"]
    containers = {c["name"] for c in pod["containers"]}
    pfp = spec.get("podFailurePolicy")
    if pfp:
        if pod.get("restartPolicy") != "Never":
            out.append("podFailurePolicy requires restartPolicy Never")
        if spec.get("podReplacementPolicy", "Failed") != "Failed":
            out.append("podFailurePolicy allows only podReplacementPolicy Failed")
        ignored_75 = ignored_disruption = False
        for i, rule in enumerate(pfp.get("rules", [])):
            if rule.get("action") not in K8S_ACTIONS:
                out.append(f"rule {i}: action {rule.get('action')!r} is not one of {sorted(K8S_ACTIONS)}")
            if ("onExitCodes" in rule) == ("onPodConditions" in rule):
                out.append(f"rule {i}: exactly one of onExitCodes and onPodConditions")
            ec = rule.get("onExitCodes")
            if ec:
                if ec.get("operator") not in K8S_OPERATORS:
                    out.append(f"rule {i}: operator {ec.get('operator')!r} is not In or NotIn")
                if ec.get("containerName") and ec["containerName"] not in containers:
                    out.append(f"rule {i}: containerName {ec['containerName']!r} names no container")
                if ec.get("operator") == "In" and 0 in ec.get("values", []):
                    out.append(f"rule {i}: exit code 0 cannot be used with In")
                if rule.get("action") == "Ignore" and ec.get("operator") == "In" and 75 in ec.get("values", []):
                    ignored_75 = True
            for cond in rule.get("onPodConditions") or []:
                if cond.get("type") == "DisruptionTarget" and rule.get("action") == "Ignore":
                    ignored_disruption = True
        if not ignored_75:
            out.append("exit 75 is not treated as 'run me again' (Ignore on exit code 75)")
        if not ignored_disruption:
            out.append("a DisruptionTarget (eviction, preemption) is not ignored")
    elif pod.get("restartPolicy") != "OnFailure":
        out.append("without a podFailurePolicy, exit 75 needs restartPolicy OnFailure to run again")
    if "spillpack/shards" in (doc.get("metadata") or {}).get("labels", {}):  # a sharded row job (a group has its own rules)
        out += _indexed_problems(spec)
    elif spec.get("completionMode") != "Indexed" and (
            "backoffLimitPerIndex" in spec or any(r.get("action") == "FailIndex" for r in (pfp or {}).get("rules", []))):
        out.append("backoffLimitPerIndex and FailIndex need completionMode Indexed")
    if pod.get("terminationGracePeriodSeconds", 30) <= 30:
        out.append("terminationGracePeriodSeconds must be above the 30 s checkpoint promise")
    return out


def _indexed_problems(spec: dict) -> list[str]:
    """A sharded row job as an Indexed Job: every shard a pod at once, retried per index."""
    out = []
    if spec.get("completionMode") != "Indexed":
        return ["a sharded row job needs completionMode Indexed: one pod per shard, with its JOB_COMPLETION_INDEX"]
    n = spec.get("completions")
    if not isinstance(n, int) or n < 1:
        out.append("an Indexed Job needs completions (the shard count)")
    if spec.get("parallelism", 1) != n:
        out.append(f"parallelism {spec.get('parallelism', 1)} is not completions {n}: some shards would wait for others")
    if "backoffLimitPerIndex" not in spec:
        out.append("no backoffLimitPerIndex: one shard's real errors would fail every shard")
    if "backoffLimit" in spec:
        out.append("backoffLimit with backoffLimitPerIndex counts every index's failures together")
    if any(r.get("action") == "FailJob" for r in (spec.get("podFailurePolicy") or {}).get("rules", [])):
        out.append("FailJob ends every shard for one index's failure: use FailIndex")
    for c in spec["template"]["spec"]["containers"]:
        if any(e.get("name") in ("JOB_COMPLETION_INDEX", "SPILLPACK_SHARD") for e in c.get("env", [])):
            out.append(f"container {c['name']} sets its own shard index instead of the Job's")
    return out
