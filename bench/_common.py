"""Shared tail of every benchmark: record machine, command and date, write the JSON, print it."""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch


def finish(res: dict, script: str, argv: list[str] | None, out: str) -> dict:
    res.setdefault("machine", {}).update({
        "platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    })
    res["command"] = f"python bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    res["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k not in ("config", "machine")}, indent=2))
    return res
