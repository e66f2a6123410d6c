"""``python -m eval.verify``, a second name for ``scripts/verify.py`` that users' commands and docs use.

Run as a module it runs that script with the same arguments (by its path: a library module imports no tool);
imported, it defines nothing. The protocol is ``eval.verification``.
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv[0] = str(Path(__file__).resolve().parents[1] / "scripts" / "verify.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
