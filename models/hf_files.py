"""File handling for Hugging Face checkpoint directories: names, paths, writes.

Shard names come from ``model.safetensors.index.json`` (or a layout built from
one) and are untrusted: these checks keep every read and write inside the
checkpoint directory. The one exception is the Hugging Face hub cache, where
``<repo>/snapshots/<revision>/<file>`` is a relative symlink into
``<repo>/blobs/``: reading through such a link stays inside the repository and
is allowed; a link anywhere else is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "check_resolves_inside",
    "check_shard_name",
    "discard",
    "hub_blob_dir",
    "resolve_checkpoint_dir",
    "write_staged",
]


def check_shard_name(directory: str, name: Any, source: str, *, reading: bool = False) -> str:
    """``name`` if it is a plain ``*.safetensors`` file name that stays inside ``directory``.

    Shard names come from ``model.safetensors.index.json`` (or a layout built
    from one), so they are untrusted: an absolute path, ``..``, a path
    separator or a symlink resolving outside ``directory`` would let a
    checkpoint read or overwrite files elsewhere. ``source`` names where the
    name came from, for the error; ``reading`` allows hub-cache blob links
    (see :func:`check_resolves_inside`).
    """
    plain = (isinstance(name, str) and name not in ("", ".", "..")
             and "/" not in name and "\\" not in name and os.sep not in name
             and (os.altsep is None or os.altsep not in name) and "\0" not in name
             and not os.path.isabs(name) and name.endswith(".safetensors"))
    if not plain:
        raise ValueError(f"{source} names shard file {name!r}: shard names must be plain "
                         "'*.safetensors' file names inside the checkpoint directory (no "
                         "absolute paths, '..' or path separators)")
    check_resolves_inside(directory, name, f"{source} names shard file {name!r}, which",
                          reading=reading)
    return name


def hub_blob_dir(directory: str) -> str | None:
    """``<repo>/blobs`` when ``directory`` is a hub snapshot ``<repo>/snapshots/<rev>``."""
    root = os.path.realpath(directory)
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return blobs if os.path.isdir(blobs) else None


def check_resolves_inside(directory: str, name: str, what: str, *, reading: bool = False) -> None:
    """Refuse ``directory/name`` when it (through symlinks) lands outside ``directory``.

    With ``reading``, a hub snapshot's link to a file directly in its own
    repository's ``blobs/`` counts as inside. Writes never follow one (a blob
    is shared by every snapshot that holds the same file).
    """
    root = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(directory, name))
    parent = os.path.dirname(target)
    if parent == root:
        return
    blobs = hub_blob_dir(directory)
    if blobs is not None and parent == os.path.realpath(blobs):
        if reading:
            return
        raise ValueError(f"{what} is a Hugging Face hub cache file (a link into {blobs}); "
                         "export into a directory of its own, not into the hub cache")
    raise ValueError(f"{what} resolves to {target}, outside the checkpoint directory "
                     f"{root} (a symlink?)")


def resolve_checkpoint_dir(path: str) -> str:
    """The checkpoint directory ``path`` names, ``~`` expanded.

    A hub cache repository directory (``models--org--name`` with ``snapshots/``
    and no ``config.json`` of its own) resolves to the snapshot ``refs/main``
    names, or to its only snapshot; several snapshots and no ``refs/main`` is
    an error listing them.
    """
    path = os.path.expanduser(os.fspath(path))
    try:
        os.stat(path)
    except OSError as e:  # a missing path is reported by the caller, with what it expected
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symlink loop (following its symlinks never reaches "
                             "a file or directory); point it, or the link on its path, at the "
                             "checkpoint directory") from None
        if os.path.islink(path):
            raise FileNotFoundError(f"{path} is a symlink to {os.readlink(path)}, which does "
                                    "not exist") from None
    snapshots = os.path.join(path, "snapshots")
    if os.path.exists(os.path.join(path, "config.json")) or not os.path.isdir(snapshots):
        return path
    ref = os.path.join(path, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            rev = f.read().strip()
        snap = os.path.join(snapshots, rev)
        if not rev or os.sep in rev or not os.path.isdir(snap):
            raise FileNotFoundError(f"{ref} names snapshot {rev!r}, which is not in {snapshots}")
        return snap
    revs = sorted(os.listdir(snapshots))
    if len(revs) == 1:
        return os.path.join(snapshots, revs[0])
    raise FileNotFoundError(f"{path} is a Hugging Face hub cache repository with "
                            f"{len(revs)} snapshots ({', '.join(revs) or 'none'}) and no "
                            "refs/main; pass the snapshot directory itself")


def write_staged(path: str, write: Callable[[str], None]) -> str:
    """``write(tmp)`` to a temporary file beside ``path``; returns ``tmp`` for a later rename.

    Nothing at ``path`` changes. A failed write (disk full, read-only) leaves
    no temporary file behind and is re-raised as an OSError naming ``path``;
    an interrupted one leaves at most the hidden ``.<name>.partial``.
    """
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.partial")
    discard([tmp])  # a leftover (or a planted symlink) is never written through
    try:
        write(tmp)
    except OSError as e:
        discard([tmp])
        msg = f"could not write {path}: {e.strerror or e}"
        raise (OSError(e.errno, msg) if e.errno else OSError(msg)) from e
    except BaseException:
        discard([tmp])
        raise
    # safetensors creates its files with mode 0600 whatever the umask; every output gets
    # the mode a plain open() gives (0666 less the umask).
    os.chmod(tmp, 0o666 & ~_umask())
    return tmp


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: the only portable read sets it for a moment
    os.umask(mask)
    return mask


def discard(paths: list[str]) -> None:
    """Remove the files at ``paths`` that exist (staged temporaries after a failure)."""
    for p in paths:
        with contextlib.suppress(OSError):
            os.remove(p)
