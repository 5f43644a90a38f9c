"""Saving the trained policy as a Hugging Face folder without touching anything the run did not write.

An export folder carries a marker file, ``rllight_export.json``, saying what wrote it. A later run may
replace a folder that holds that marker (it was an earlier export); a folder with any other content is
refused before training starts (``check_export_dir``), and again at export time, when the new export is
kept in a sibling folder and the error names it: the trained weights are never lost.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tempfile

from rllight.errors import ComponentError, RecipeError

log = logging.getLogger(__name__)

MARKER = "rllight_export.json"
"""The file that marks a folder as an rllight export (what wrote it, when, after how many steps)."""


def check_export_dir(path: str, key: str = "model.export_dir") -> None:
    """Refuse an export target that holds anything but an earlier rllight export.

    Allowed: a path that does not exist yet, an empty folder, a folder holding ``rllight_export.json``.
    Refused, with one line naming ``key``: an existing file, a folder with other content.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise RecipeError(f"{key}: '{path}' is a file, not a folder; give a new or empty folder for the export")
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        if entries and MARKER not in entries:
            raise RecipeError(
                f"{key}: '{path}' already holds {len(entries)} entries that are not an rllight export "
                f"(e.g. '{entries[0]}'); give a new or empty folder, the export never overwrites other files"
            )


def overlaps(export_dir: str, other: str) -> bool:
    """Whether ``export_dir`` is ``other`` or a folder above it (replacing the export would take ``other``
    with it)."""
    a, b = os.path.realpath(export_dir), os.path.realpath(other)
    return b == a or b.startswith(a.rstrip(os.sep) + os.sep)


def _merged(policy):
    """A plain model with LoRA adapters merged in; the live (training) model is left untouched."""
    try:
        from peft import PeftModel
    except ImportError:
        return policy
    if isinstance(policy, PeftModel):
        import copy

        return copy.deepcopy(policy).merge_and_unload()
    return policy


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (threads may be creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _usual_permissions(folder: str) -> None:
    """Give ``folder`` and everything in it the permissions a plain ``mkdir`` and ``open`` would (0o755 and
    0o644 under the usual umask 022): ``tempfile.mkdtemp`` creates the folder 0o700, which a serving process
    running as another user could not read."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _write_export(policy, tokenizer, folder: str, info: dict | None) -> None:
    """The export's files in ``folder``: the policy (LoRA merged), the tokenizer, the marker file."""
    from rllight import __version__

    _merged(policy).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    marker = {
        "written_by": f"rllight {__version__}",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **(info or {}),
    }
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(marker, f, indent=2)
    _usual_permissions(folder)


def export_policy(policy, tokenizer, path: str, info: dict | None = None, key: str = "model.export_dir") -> str:
    """Save ``policy`` (LoRA merged) and ``tokenizer`` as a Hugging Face folder at ``path``; returns ``path``.

    Written aside in a sibling folder first, with the marker file; then moved in place: onto a new or empty
    path directly, over an earlier export by renaming the old one aside, moving the new one in and only
    then deleting the old copy. If ``path`` meanwhile holds other files the new export stays in its sibling
    folder and a ``RecipeError`` names it.
    """
    path = path.rstrip(os.sep) or os.sep
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    name = os.path.basename(os.path.abspath(path))
    new = tempfile.mkdtemp(prefix=f"{name}.new-", dir=parent)
    try:
        _write_export(policy, tokenizer, new, info)
    except Exception as err:  # a full disk: an OSError, or whatever a writer makes of it
        from rllight.checkpoint import free_space

        shutil.rmtree(new, ignore_errors=True)
        raise ComponentError(f"{key}: could not write the export to '{path}' ({err}; {free_space(new)}); nothing "
                             "of it was left behind, the run's last checkpoint holds the trained weights: free space "
                             "and export again by resuming from it") from err
    try:
        check_export_dir(path, key)
    except RecipeError as err:
        raise RecipeError(f"{err}; the trained policy was saved in '{new}' instead") from None
    if os.path.isdir(path) and os.listdir(path):  # an earlier export: swap, then drop the old copy
        old = tempfile.mkdtemp(prefix=f"{name}.old-", dir=parent)
        os.rmdir(old)  # only its unique name is needed
        os.rename(path, old)
        try:
            os.rename(new, path)
        except OSError:
            os.rename(old, path)  # put the earlier export back; the new one stays aside
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:  # new, or an empty folder (rename replaces an empty directory)
        os.replace(new, path)
    log.info("exported the policy to %s", path)
    return path
