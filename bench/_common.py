"""Shared tail of every benchmark: record machine, command and date, write the JSON, print it."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

import torch


def finish(res: dict, script: str, argv: list[str] | None, out: str) -> dict:
    res.setdefault("machine", {}).update({
        "platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        # other work on the machine skews timings: the 1/5/15-minute load averages at the end of the run
        "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
    })
    res["command"] = f"python bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    res["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k not in ("config", "machine")}, indent=2))
    return res


def peak_rss_mb() -> float:
    """Peak resident memory of this process, in MB (``VmHWM``; unlike ``ru_maxrss`` it starts afresh
    in a spawned process instead of inheriting the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
