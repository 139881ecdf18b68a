"""`spillpack status URI [--plot FILE.png]` on the laptop: the runtime's status
(runtime/commands/status.py), plus the loss curve with the interruptions marked, or a build's
before/after scores, drawn into FILE.png (spillpack/commands/plot.py, matplotlib)."""

from runtime.commands import status


def add_arguments(parser) -> None:
    status.add_arguments(parser)
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the loss curve (interruptions marked) or a build's scores "
                                                           "into FILE.png (needs matplotlib: pip install spillpack[plot])")


def main(ns: dict, events) -> int:
    told = status.states(ns["uri"])
    if ns.get("plot"):
        from spillpack.commands.plot import plot  # matplotlib: imported only when asked for

        plot(told, ns["plot"])
    code = status.main(ns, events, told)
    if ns.get("plot"):
        events.say(f"wrote {ns['plot']}")
    return code
