"""File I/O shared by every file the project writes: atomic writes, JSON loading, content hashes."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from planner.errors import StratagemError

M = TypeVar("M", bound=BaseModel)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` so that readers see either the old file or the whole new one.

    The text goes to a temporary file in the same folder, is fsync'ed, then renamed over ``path``.
    A missing parent folder is created; an unwritable one is a :class:`StratagemError`.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise StratagemError(
            f"cannot write {path}: {exc.strerror or exc}; choose a writable --out path"
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the form content hashes are taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def content_hash(data: dict[str, Any], *, exclude: tuple[str, ...] = ("content_hash",)) -> str:
    """``sha256:<hex>`` of a document's canonical JSON, leaving out the fields in ``exclude``."""
    body = {k: v for k, v in data.items() if k not in exclude}
    return "sha256:" + hashlib.sha256(canonical_json(body).encode()).hexdigest()


def read_json(path: str | os.PathLike, *, what: str) -> dict[str, Any]:
    """Read a JSON object from ``path``; ``what`` names the file kind in error messages."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StratagemError(f"{what} file {path} does not exist; check the path") from None
    except OSError as exc:
        raise StratagemError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StratagemError(
            f"{what} file {path} is not valid JSON (line {exc.lineno}: {exc.msg}); "
            f"regenerate it or restore it from version control"
        ) from None
    if not isinstance(data, dict):
        raise StratagemError(f"{what} file {path} holds a {type(data).__name__}, not a JSON object")
    return data


def validate_document(model: type[M], data: dict[str, Any], *, source: str, what: str,
                      schema_version: int) -> M:
    """Check a document's ``schema_version`` and hash, then validate it into ``model``.

    Errors name the first offending field, so a corrupt file fails with a field-level message.
    """
    found = data.get("schema_version")
    if found != schema_version:
        raise StratagemError(
            f"{what} {source} has schema_version {found!r} but this Stratagem reads version "
            f"{schema_version}; regenerate it with this version of stratagem"
        )
    try:
        doc = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise StratagemError(
            f"{what} {source} is invalid at '{loc}': {err['msg']} "
            f"({exc.error_count()} problem(s)); regenerate the file"
        ) from None
    stored = data.get("content_hash")
    if stored is not None and stored != content_hash(data):
        raise StratagemError(
            f"{what} {source} was modified after it was written (content_hash mismatch); "
            f"regenerate it, or delete its content_hash field if the edit was deliberate"
        )
    return doc


def load_document(model: type[M], path: str | os.PathLike, *, what: str, schema_version: int) -> M:
    """Load and validate a versioned JSON document (profile or plan) from ``path``."""
    data = read_json(path, what=what)
    return validate_document(model, data, source=str(path), what=what, schema_version=schema_version)


def save_document(doc: BaseModel, path: str | os.PathLike) -> Path:
    """Write a pydantic document with a fresh ``content_hash``, atomically."""
    data = doc.model_dump(mode="json")
    if "content_hash" in data:
        data["content_hash"] = content_hash(data)
    return atomic_write_text(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def with_hash(doc: M) -> M:
    """Return ``doc`` with its ``content_hash`` field filled in."""
    data = doc.model_dump(mode="json")
    return doc.model_copy(update={"content_hash": content_hash(data)})
