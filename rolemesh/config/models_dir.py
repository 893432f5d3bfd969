"""The models folder (``models_dir``): every GGUF in it is a model.

Two halves, as elsewhere: :func:`scan` is pure -- a listing in (relative
paths, each with what reading its first bytes said), model records and
one-line notes out -- so hypothesis can hammer the naming rules; and
:func:`list_dir` / :func:`discover` do the I/O (list the folder and one level
of sub-folders, read each candidate's 4-byte magic).

The rules:

- a model id is the file name without ``.gguf`` (any case) and, for a model
  split in parts (``name-00001-of-00003.gguf``), without the part suffix;
- a split model is one model, served from its first part (llama-server
  finds the others), and only when every part is there;
- ``mmproj-*`` files (multimodal projectors) are never models: each is
  paired with the one model in its folder, or, among several, with the one
  whose id its name (after ``mmproj-``) starts with (the longest such id);
  unpaired, it is one note;
- a file that does not end in ``.gguf``, is not a GGUF inside, or cannot be
  read is one note, never a failed start; hidden files (``.name``) are
  skipped silently (partial downloads, editor files);
- an id found twice (in two folders, or in a file and a sub-folder) is
  served from the first in sorted order, with a note for the other.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import attr

#: ``name-00001-of-00003.gguf`` (llama.cpp's gguf-split naming).
SPLIT = re.compile(r"^(?P<name>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})$")
MMPROJ_PREFIX = "mmproj"
GGUF_MAGIC = b"GGUF"


@attr.s(auto_attribs=True, frozen=True)
class ListedFile:
    """One file of a models folder: its path relative to the folder
    (``/``-separated, at most one folder deep) and why it cannot be used
    (None: readable, and a GGUF inside)."""

    path: str
    problem: Optional[str] = None


@attr.s(auto_attribs=True, frozen=True)
class FoundModel:
    """A model found in a models folder (paths relative to that folder)."""

    model_id: str
    #: The file llama-server is given (the first part of a split model).
    path: str
    #: The multimodal projector paired with it, if any (``--mmproj``).
    mmproj: Optional[str] = None
    #: Every file of the model (one, or each part of a split model).
    parts: Tuple[str, ...] = ()


def _stem(name: str) -> Optional[str]:
    """The name without ``.gguf``, or None when it does not end so."""
    if len(name) > 5 and name.lower().endswith(".gguf"):
        return name[:-5]
    return None


def model_id_of(name: str) -> Optional[str]:
    """A GGUF file name's model id (without ``.gguf`` and without a split
    suffix), or None for a name that is no model's file."""
    stem = _stem(name)
    if stem is None:
        return None
    split = SPLIT.match(stem)
    return split.group("name") if split else stem


def is_mmproj(name: str) -> bool:
    return name.lower().startswith(MMPROJ_PREFIX)


def scan(listing: Iterable[ListedFile]) -> Tuple[Tuple[FoundModel, ...], Tuple[str, ...]]:
    """The models in a folder's ``listing`` and one note per file left out (pure)."""
    notes: List[str] = []
    files = sorted(set(listing), key=lambda f: f.path)
    # Per folder: model id -> {part number: path, ...}, and the mmproj files.
    groups: Dict[Tuple[str, str], Dict[int, str]] = {}
    counts: Dict[Tuple[str, str], int] = {}
    projectors: Dict[str, List[str]] = {}
    for f in files:
        folder, _, name = f.path.rpartition("/")
        if name.startswith(".") or any(part.startswith(".") for part in folder.split("/") if part):
            continue
        stem = _stem(name)
        if f.problem is not None:
            notes.append(f"{f.path}: {f.problem}; not served")
            continue
        if stem is None:
            notes.append(f"{f.path}: not a .gguf file; not served")
            continue
        if is_mmproj(name):
            projectors.setdefault(folder, []).append(f.path)
            continue
        split = SPLIT.match(stem)
        if split:
            model_key = (folder, split.group("name"))
            part, count = int(split.group("part")), int(split.group("count"))
            if part < 1 or count < 1 or part > count or counts.setdefault(model_key, count) != count:
                notes.append(f"{f.path}: a part number that does not fit its model's other parts; not served")
                continue
            groups.setdefault(model_key, {})[part] = f.path
        else:
            model_key = (folder, stem)
            if model_key in groups:
                notes.append(f"{f.path}: the model {stem} is also a split model here; not served")
                continue
            counts[model_key] = 0
            groups[model_key] = {0: f.path}
    found: List[FoundModel] = []
    taken: Dict[str, str] = {}
    for (folder, model_id), parts in sorted(groups.items()):
        count = counts[(folder, model_id)]
        first = parts.get(1 if count else 0)
        if count and sorted(parts) != list(range(1, count + 1)):
            missing = [str(n) for n in range(1, count + 1) if n not in parts]
            notes.append(f"{'/'.join(filter(None, (folder, model_id)))}: split model without part(s) "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} of {count}; not served")
            continue
        assert first is not None
        if model_id in taken:
            notes.append(f"{first}: model id {model_id} is already {taken[model_id]}; not served")
            continue
        taken[model_id] = first
        found.append(FoundModel(model_id, first, None, tuple(parts[n] for n in sorted(parts))))
    return _pair(found, projectors, notes)


def _pair(found: List[FoundModel], projectors: Dict[str, List[str]], notes: List[str]
          ) -> Tuple[Tuple[FoundModel, ...], Tuple[str, ...]]:
    """Each mmproj file paired with the one model of its folder, or the
    model whose id its name starts with (after ``mmproj-``)."""
    by_folder: Dict[str, List[int]] = {}
    for i, model in enumerate(found):
        by_folder.setdefault(model.path.rpartition("/")[0], []).append(i)
    for folder, paths in sorted(projectors.items()):
        candidates = by_folder.get(folder, [])
        for path in paths:
            rest = path.rpartition("/")[2][len(MMPROJ_PREFIX):].lstrip("-_.").lower()
            if len(candidates) == 1:
                chosen: Optional[int] = candidates[0]
            else:
                named = [i for i in candidates if rest.startswith(found[i].model_id.lower())]
                chosen = max(named, key=lambda i: len(found[i].model_id)) if named else None
            if chosen is None:
                notes.append(f"{path}: a multimodal projector with no model to pair with (put it in one "
                             "model's folder, or name it mmproj-<model id>...); not served")
            elif found[chosen].mmproj is not None:
                notes.append(f"{path}: {found[chosen].model_id} already has {found[chosen].mmproj}; not used")
            else:
                found[chosen] = attr.evolve(found[chosen], mmproj=path)
    return tuple(found), tuple(notes)


# --------------------------------------------------------------------------
# The I/O half


def _problem(path: str) -> Optional[str]:
    """Why ``path`` is no usable GGUF file (None: its magic says GGUF)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None if magic == GGUF_MAGIC else "not a GGUF file (bad magic)"


def list_dir(folder: str) -> Tuple[List[ListedFile], List[str]]:
    """The files of ``folder`` and of its sub-folders (one level), each
    checked for the GGUF magic if it is named ``.gguf``; and one note per
    folder that cannot be listed."""
    listing: List[ListedFile] = []
    notes: List[str] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        return [], [f"{folder}: cannot list the models folder ({e.strerror or e})"]
    for name in names:
        full = os.path.join(folder, name)
        if os.path.isdir(full):
            if name.startswith("."):
                continue
            try:
                inner = sorted(os.listdir(full))
            except OSError as e:
                notes.append(f"{name}: cannot list this folder ({e.strerror or e})")
                continue
            for sub in inner:
                path = os.path.join(full, sub)
                if os.path.isfile(path):
                    listing.append(ListedFile(f"{name}/{sub}", _problem(path) if _stem(sub) else None))
        elif os.path.isfile(full):
            listing.append(ListedFile(name, _problem(full) if _stem(name) else None))
    return listing, notes


def discover(folders: Sequence[str]) -> Tuple[Tuple[FoundModel, ...], Tuple[str, ...]]:
    """The models of every folder in ``folders`` (absolute paths) and the
    notes, each prefixed with its folder; an id already found in an earlier
    folder is a note."""
    models: List[FoundModel] = []
    notes: List[str] = []
    taken: Dict[str, str] = {}
    for folder in folders:
        listing, listed_notes = list_dir(folder)
        found, found_notes = scan(listing)
        notes += [f"models_dir {folder}: {n}" for n in listed_notes + list(found_notes)]
        for model in found:
            full = attr.evolve(
                model, path=os.path.join(folder, model.path),
                mmproj=os.path.join(folder, model.mmproj) if model.mmproj else None,
                parts=tuple(os.path.join(folder, p) for p in model.parts))
            if model.model_id in taken:
                notes.append(f"models_dir {folder}: {model.path}: model id {model.model_id} is already "
                             f"{taken[model.model_id]}; not served")
                continue
            taken[model.model_id] = full.path
            models.append(full)
    return tuple(models), tuple(notes)


# --------------------------------------------------------------------------
# Folding what was found into the configuration's models


def merge(entries: Sequence[object], found: Sequence[FoundModel]) -> Tuple[List[object], Tuple[str, ...]]:
    """The ``models`` entries with the folder's models folded in (pure):
    an entry with a found model's ``model_id`` and no ``path`` refines it
    (gets its path, and its mmproj unless it sets one); an entry with a
    ``path`` of its own wins over the file; every other found model is an
    entry of its own.  An entry with no ``path`` whose id no file has is left
    out, with a note (its file is gone: it leaves, as a removed entry would)."""
    by_id = {m.model_id: m for m in found}
    names: Set[object] = set()
    for entry in entries:
        if isinstance(entry, dict):
            names.update(entry[k] for k in ("model_id", "alias") if isinstance(entry.get(k), str))
    out: List[object] = []
    notes: List[str] = []
    refined = set()
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and entry.get("path") is None and isinstance(entry.get("model_id"), str):
            model = by_id.get(entry["model_id"])
            if model is None:
                notes.append(f"models[{i}]: no file in models_dir for model_id {entry['model_id']!r} and no "
                             "path; not served")
                continue
            refined.add(model.model_id)
            entry = {**entry, "path": model.path}
            if model.mmproj is not None and entry.get("mmproj") is None:
                entry["mmproj"] = model.mmproj
        out.append(entry)
    for model in found:
        if model.model_id in refined:
            continue
        if model.model_id in names:
            if not any(isinstance(e, dict) and e.get("model_id") == model.model_id for e in entries):
                notes.append(f"{model.path}: model id {model.model_id!r} is an alias of a models entry; "
                             "not served from models_dir")
            continue  # an entry with its own path and this id: the entry wins
        entry = {"model_id": model.model_id, "path": model.path}
        if model.mmproj is not None:
            entry["mmproj"] = model.mmproj
        out.append(entry)
    return out, tuple(notes)


def folders(value: object) -> Tuple[str, ...]:
    """``models_dir`` as absolute folder paths (``~`` expanded; relative to
    the working directory)."""
    items = [value] if isinstance(value, str) else list(value)  # type: ignore[call-overload]
    return tuple(os.path.abspath(os.path.expanduser(str(v))) for v in items)


def apply(raw: Dict[str, object], check: object) -> Tuple[Dict[str, object], Tuple[str, ...]]:
    """``raw`` config data with ``models_dir`` scanned and folded into
    ``models``, and every note (one line per file left out); ``check`` is
    the config's own check of the key (a one-line ConfigError)."""
    value = raw.get("models_dir")
    if value is None:
        return raw, ()
    check("models_dir", value)  # type: ignore[operator]
    found, notes = discover(folders(value))
    entries = raw.get("models") or []
    if not isinstance(entries, list):
        return raw, notes  # parse() says what is wrong with it
    models, merge_notes = merge(entries, found)
    return {**raw, "models": models}, notes + merge_notes
