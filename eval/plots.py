"""ROC plots of the evaluation tools (matplotlib, imported only when a plot is asked for)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_roc_curves(path: Path, curves: dict[str, tuple[np.ndarray, np.ndarray]], title: str,
                     log_fpr: bool = False) -> None:
    """One PNG with a ROC curve (TPR over FPR) per entry of ``curves`` (label -> (fpr, tpr))."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for label, (fpr, tpr) in curves.items():
        ax.plot(fpr, tpr, label=label)
    if log_fpr:
        ax.set_xscale("log")
        ax.set_xlim(1e-6, 1)
    else:
        ax.set_xlim(0, 1)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title=title, ylim=(0, 1.01))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
