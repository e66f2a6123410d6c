"""``python -m eval.ijb``, a second name for ``scripts/ijb.py`` that users' commands and docs use.

Run as a module it runs that script with the same arguments (by its path: a library module imports no tool);
imported, it defines nothing. The protocol is ``eval.ijb_protocol``.
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv[0] = str(Path(__file__).resolve().parents[1] / "scripts" / "ijb.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
