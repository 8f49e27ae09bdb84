"""``python -m megatron_paradyse.costmodel {profile,fit,report} ...``"""
from __future__ import annotations

import sys

from .. import logs
from . import calibrate, fit, profile, report

USAGE = """usage: python -m megatron_paradyse.costmodel COMMAND ...

commands:
  profile   measure one decoder layer per strategy over a sweep of lengths (JSON lines)
  fit       fit the cost model (analytic work x fitted rates) to a profile: fit PROFILE -o MODEL
  report    accuracy of a model on a held-out profile: report MODEL --profile HELDOUT
  calibrate rescale a model made on another host to this one: calibrate MODEL -o HERE.json
"""


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    logs.setup(stream="stderr")  # progress; the commands' results go to stdout
    run = {"profile": profile.main, "fit": fit.main, "report": report.main, "calibrate": calibrate.main}.get(cmd)
    if run is None:
        print(f"python -m megatron_paradyse.costmodel: error: unknown command {cmd!r} (profile, fit, report, "
              "calibrate; --help)", file=sys.stderr)
        return 2
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
