"""File-name safety for Hugging Face checkpoint directories.

Shard names come from ``model.safetensors.index.json`` (or a layout built from
one) and are untrusted: these checks keep every read and write inside the
checkpoint directory.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["check_resolves_inside", "check_shard_name"]


def check_shard_name(directory: str, name: Any, source: str) -> str:
    """``name`` if it is a plain ``*.safetensors`` file name that stays inside ``directory``.

    Shard names come from ``model.safetensors.index.json`` (or a layout built
    from one), so they are untrusted: an absolute path, ``..``, a path
    separator or a symlink resolving outside ``directory`` would let a
    checkpoint read or overwrite files elsewhere. ``source`` names where the
    name came from, for the error.
    """
    plain = (isinstance(name, str) and name not in ("", ".", "..")
             and "/" not in name and "\\" not in name and os.sep not in name
             and (os.altsep is None or os.altsep not in name) and "\0" not in name
             and not os.path.isabs(name) and name.endswith(".safetensors"))
    if not plain:
        raise ValueError(f"{source} names shard file {name!r}: shard names must be plain "
                         "'*.safetensors' file names inside the checkpoint directory (no "
                         "absolute paths, '..' or path separators)")
    check_resolves_inside(directory, name, f"{source} names shard file {name!r}, which")
    return name


def check_resolves_inside(directory: str, name: str, what: str) -> None:
    """Refuse ``directory/name`` when it (through symlinks) lands outside ``directory``."""
    root = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(directory, name))
    if os.path.dirname(target) != root:
        raise ValueError(f"{what} resolves to {target}, outside the checkpoint directory "
                         f"{root} (a symlink?)")
