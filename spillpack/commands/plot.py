"""`spillpack status --plot FILE.png`: the loss curve by step with each interruption marked
(a dashed line at the step where a signal stopped it, a dotted one where a hard kill did),
and for a build the accuracy before and after tuning.

matplotlib is the laptop's: a bundle never carries it, and without it this is one error line.
"""

from __future__ import annotations

from runtime.commands.story import annotations, losses
from runtime.base.errors import SpillpackError


def plot(told, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpillpackError("status --plot needs matplotlib, which is not installed here (a bundle never carries it)",
                             "pip install 'spillpack[plot]' on your laptop and run spillpack status there") from None
    curves = []  # (label, losses, [(step, kind)])
    scores = None
    for stage, state in told:
        command = (state.invocation() or {}).get("command")
        if command == "tune":
            story = annotations(state)
            marks = [(a.get("step") if a["kind"] == "interrupted" else a.get("reached"), a["kind"])
                     for a in story if a["kind"] in ("interrupted", "hard_kill")]
            curves.append((stage or "tune", losses(state), [(s, k) for s, k in marks if s],
                           [(a["step"], a["val_loss"]) for a in story if a["kind"] == "eval"]))
        if command == "build" and stage is None:
            scores = {m.meta["stage"]: m.meta["score"] for m in state.markers("stage")}
    evals = {k: v for k, v in (scores or {}).items() if "accuracy" in v}
    if not curves and not evals:
        raise SpillpackError("nothing to plot: no tune steps or build scores committed yet", "spillpack status URI (without --plot)")
    fig, axes = plt.subplots(1, bool(curves) + bool(evals), figsize=(6.5 * (bool(curves) + bool(evals)), 4), squeeze=False)
    if curves:
        ax = axes[0][0]
        for label, ys, marks, val in curves:
            ax.plot(range(1, len(ys) + 1), ys, label=f"{label} loss")
            if val:  # the held-out loss at each eval
                ax.plot([s for s, _ in val], [v for _, v in val], marker="o", label=f"{label} held-out loss")
            for step, kind in marks:
                ax.axvline(step, color="tab:red", linestyle="--" if kind == "interrupted" else ":", linewidth=1)
        for kind, style in (("interrupted", "--"), ("hard_kill", ":")):
            if any(k == kind for _, _, m, _ in curves for _, k in m):
                ax.plot([], [], color="tab:red", linestyle=style, label=kind.replace("_", " "))
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.set_title("training loss")
    if evals:
        ax = axes[0][-1]
        names = list(evals)
        acc = [evals[k]["accuracy"] for k in names]
        err = [[a - evals[k]["ci95"][0] for k, a in zip(names, acc)], [evals[k]["ci95"][1] - a for k, a in zip(names, acc)]]
        ax.bar(names, acc, yerr=err, capsize=6, color=["tab:gray", "tab:green"][: len(names)])
        ax.set_ylim(0, 1)
        ax.set_ylabel("accuracy (95% interval)")
        ax.set_title("before / after tuning")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise SpillpackError(f"cannot write {path}: {e.strerror}", "spillpack status URI --plot a/writable/file.png") from None
    finally:
        plt.close(fig)
