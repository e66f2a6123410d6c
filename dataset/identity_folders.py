"""The one rule of "a folder of identity folders": which folders are identities and which files are theirs.

``root/<identity>/<image>``: every folder directly under ``root`` is an identity, and every image under it,
in sub-folders too (``alice/2020/2.jpg`` is alice's), is that identity's. Hidden entries (names starting with
a dot: ``.ipynb_checkpoints``, ``.DS_Store``, ``._x.jpg``) and the folders and files operating systems and
NAS boxes leave (``__MACOSX``, ``@eaDir``, ``Thumbs.db``, ``desktop.ini``, ...) are no identity and no image:
they are left out unlooked-into and named once (``IdentityFolders.ignored_note``). Which files are images is
the caller's suffix set (training decodes JPEG/PNG; ``photos`` takes every format Pillow reads), and, for a
caller that passes ``sniff``, the content of a file whose suffix is not in it. An identity
folder without an image is no class. Training's image-folder dataset, ``make_rec --images``, ``rec_info``'s
folder check, ``prepare_faces`` and (through the dataset) ``overlap`` all list folders with
``identity_folders``. See docs/data.md.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from utils.files import path_problem

# Compared case-insensitively (Windows and macOS file systems are), besides every name starting with a dot.
SYSTEM_NAMES = frozenset(name.lower() for name in (
    "__MACOSX", "@eaDir", "#recycle", "#snapshot", "$RECYCLE.BIN", "System Volume Information", "lost+found",
    "Thumbs.db", "ehthumbs.db", "desktop.ini", "Icon\r"))


def is_ignored(name: str) -> bool:
    """Whether an entry called ``name`` is hidden or left by a system, never an identity or an image."""
    return name.startswith(".") or name.lower() in SYSTEM_NAMES


def holds_identity_folders(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder with a folder in it that would be an identity."""
    path = Path(path)
    return path.is_dir() and any(d.is_dir() and not is_ignored(d.name) for d in path.iterdir())


def names_shown(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, comma-separated, with `` ...`` when there are more."""
    return ", ".join(names[:shown]) + (" ..." if len(names) > shown else "")


@dataclass(frozen=True)
class IdentityFolders:
    """What ``identity_folders`` found under ``root`` (names relative to it, ``/``-separated)."""

    root: Path
    identities: tuple[str, ...]  # every identity folder, sorted by name, those without an image included
    files: dict[str, list[Path]]  # identity -> its images, by name relative to root
    ignored: list[str]  # hidden and system entries, left out (a folder's content not listed)
    loose: list[str]  # files directly in root, in no identity
    other_files: list[str]  # files in identity folders that are not images (no suffix of the set, not sniffed)
    unlisted: list[str]  # "folder: why" of folders that could not be listed

    @property
    def classes(self) -> list[str]:
        """The identities holding an image, sorted: class id ``k`` is ``classes[k]``."""
        return [name for name in self.identities if self.files[name]]

    @property
    def empty(self) -> list[str]:
        """The identity folders without an image: no class."""
        return [name for name in self.identities if not self.files[name]]

    def samples(self) -> list[tuple[Path, int]]:
        """Every image with its class id, by class, then by name."""
        return [(path, label) for label, name in enumerate(self.classes) for path in self.files[name]]

    def ignored_note(self) -> str | None:
        """The one line naming what was ignored; None when nothing was."""
        if not self.ignored:
            return None
        return (f"{len(self.ignored)} hidden or system {'entry' if len(self.ignored) == 1 else 'entries'} in "
                f"{self.root} ignored (no identity, no image): {names_shown(self.ignored)}")

    def check_listed(self) -> None:
        """``OSError`` naming the first folder that could not be listed, for readers that cannot go without it."""
        if self.unlisted:
            raise OSError(f"cannot list {self.unlisted[0]}" + (f" (and {len(self.unlisted) - 1} more folders)"
                                                               if len(self.unlisted) > 1 else ""))


def identity_folders(root: str | os.PathLike, suffixes: Sequence[str],
                     sniff: Callable[[Path], bool] | None = None) -> IdentityFolders:
    """The identity folders of ``root`` and their files with one of ``suffixes`` (lower case, with the dot;
    matched case-insensitively), and those without one for which ``sniff(path)`` says the content is an image.
    ``FileNotFoundError`` when ``root`` is not a folder."""
    root = Path(root)
    if (problem := path_problem(root, folder=True)) is not None:
        raise FileNotFoundError(f"image folder {root} {'does not exist' if problem == 'not found' else problem}")
    suffixes = tuple(s.lower() for s in suffixes)
    identities, ignored, loose = [], [], []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if is_ignored(entry.name):
            ignored.append(entry.name)
        elif entry.is_dir():
            identities.append(entry.name)
        else:
            loose.append(entry.name)
    files: dict[str, list[Path]] = {}
    other_files: list[str] = []
    unlisted: list[str] = []
    for name in identities:
        found = []

        def refused(exc: OSError) -> None:
            unlisted.append(f"{exc.filename}: {exc.strerror or exc}")

        for folder, dirs, names in os.walk(root / name, onerror=refused):
            ignored += sorted(_relative(root, folder, d) for d in dirs if is_ignored(d))
            dirs[:] = [d for d in dirs if not is_ignored(d)]  # os.walk descends only into what is left
            for file in names:
                relative = _relative(root, folder, file)
                if is_ignored(file):
                    ignored.append(relative)
                elif os.path.splitext(file)[1].lower() in suffixes or (sniff is not None and sniff(root / relative)):
                    found.append(relative)
                else:
                    other_files.append(relative)
        files[name] = [root / relative for relative in sorted(found)]
    return IdentityFolders(root, tuple(identities), files, sorted(ignored), loose, sorted(other_files), unlisted)


def _relative(root: Path, folder: str, name: str) -> str:
    return Path(folder, name).relative_to(root).as_posix()
