"""Before anything is built: every rank checks the config's paths, and the ranks agree on the outcome."""
from __future__ import annotations

from utils.config import Config, check_paths
from utils.distributed import all_gather_sizes, collective_device
from utils.logging_setup import one_line
from utils.wandb_run import check_installed


def check_on_every_rank(cfg: Config, rank: int) -> None:
    """``check_paths`` on every rank (and, on rank 0, that wandb is installed when ``using_wandb``), agreed: each
    node may read its own copy of the data (a local disk), so one node's paths may be wrong while another's are
    right. A rank that finds a problem raises its own ``ValueError``; every other rank raises one naming those
    ranks, so that no rank goes on to wait in a collective for ranks that have stopped. One all-gather of a flag
    per rank."""
    try:
        check_paths(cfg)
        if rank == 0:
            check_installed(cfg)
        problem = None
    except ValueError as exc:
        problem = exc
    except OSError as exc:  # a folder on the way that this user may not read
        problem = ValueError(f"cannot check the config's paths (rec, init_backbone, resume): {one_line(exc)}")
    failed = [r for r, (flag,) in enumerate(all_gather_sizes([int(problem is not None)], collective_device())) if flag]
    if problem is not None:
        raise problem
    if failed:
        ranks = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        raise ValueError(f"{ranks} cannot use the paths in the config (rec, init_backbone or resume) or lack a "
                         f"package on their node; their node's output names it: every node needs the same dataset "
                         f"path")
