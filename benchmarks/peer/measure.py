"""`dflash train` in this process, with its peak RSS written at exit (the peer launcher's twin).

    python -m benchmarks.peer.measure REPORT.json -- <dflash train flags>

The process reads its own VmHWM at exit, as benchmarks.peer.launch does for speculators, so
both trainers' peaks are measured the same way (ru_maxrss of a child would carry the parent's
peak across fork + exec on Linux). Training tokens and seconds come from the run's log.jsonl.
"""

import atexit
import json
import sys
import time
from pathlib import Path

from benchmarks.peer.launch import peak_rss_kb


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit("usage: python -m benchmarks.peer.measure REPORT.json -- <flags>")
    report, flags = Path(sys.argv[1]), sys.argv[3:]
    start = time.perf_counter()

    def write() -> None:
        report.write_text(json.dumps({"wall_seconds": time.perf_counter() - start,
                                      "peak_rss_kb": peak_rss_kb(), "argv": flags}) + "\n")

    atexit.register(write)
    from dflash_train.cli import main as dflash

    sys.argv = ["dflash", "train", *flags]
    dflash()


if __name__ == "__main__":
    main()
