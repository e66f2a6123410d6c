"""What every benchmark shares: repeated timing with warm-up, the markdown table, the JSON file.

Every figure a benchmark reports is the median of ``repeats`` timed runs after ``warmup`` untimed ones,
with the spread given as (min, max) so a noisy machine shows up in the table instead of hiding in a mean.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median of the timed repeats, and their min and max."""

    median: float
    low: float
    high: float
    repeats: int

    def as_dict(self) -> dict[str, float]:
        return {"median_s": self.median, "min_s": self.low, "max_s": self.high, "repeats": self.repeats}


def time_call(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
              sync: Callable[[], None] | None = None) -> Timing:
    """Time ``fn()`` ``repeats`` times after ``warmup`` calls; ``sync`` (e.g. cuda.synchronize) runs around each."""
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        samples.append(time.perf_counter() - start)
    return Timing(statistics.median(samples), min(samples), max(samples), repeats)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """This process's resident set size now, from /proc (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are printed with 4 significant digits."""
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` (plus the machine description) to ``path`` when one is given."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), **payload}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
