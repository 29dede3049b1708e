"""File I/O shared by every file the project writes: atomic writes, JSON loading, content hashes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from planner.core.errors import StratagemError

M = TypeVar("M", bound=BaseModel)


# Inputs larger than this are refused before they are parsed: a profile of a 1,000-layer model is a few MiB,
# and an endless input (/dev/zero, /dev/urandom, a runaway pipe) must not fill the memory.
MAX_INPUT_BYTES = 256 * 2**20
# POSIX NAME_MAX / PATH_MAX on Linux (limits.h): longer names fail with ENAMETOOLONG deep inside a write.
NAME_MAX = 255
# Largest magnitude a number in a profile or plan may have (planner.profile.load / planner.plan.schema validators).
MAX_MAGNITUDE = 1e24
PATH_MAX = 4096


def check_output_path(
    path: str | os.PathLike, *, flag: str = "--out", inputs: dict[str, str | os.PathLike | None] | None = None
) -> Path:
    """Check that ``path`` can be (re)written as a regular file, before any work; returns it as a Path.

    Refused with a one-line :class:`StratagemError`: an empty string; a name ending in ``/`` (a folder);
    a name over the file-system limits; an existing path that is not a regular file (a device, FIFO,
    socket or folder: an atomic rename would replace it); the same file as one of ``inputs`` (flag -> path:
    writing would destroy the input); a nearest existing parent that is not a writable folder.

    >>> check_output_path("")
    Traceback (most recent call last):
    ...
    planner.core.errors.StratagemError: --out is empty; give a file path such as plan.json
    """
    text = os.fspath(path)
    if not str(text).strip():
        raise StratagemError(f"{flag} is empty; give a file path such as plan.json")
    text = str(text)
    if text.endswith(("/", os.sep)) or text.endswith(("/.", "/..")) or text in (".", ".."):
        raise StratagemError(f"{flag} {text} names a folder; give a file path such as {text.rstrip('/')}/out.json")
    if "\0" in text:
        raise StratagemError(f"{flag} {text!r} holds a NUL byte; give a plain file path")
    out = Path(text)
    name_bytes, path_bytes = len(out.name.encode(errors="surrogateescape")), len(text.encode(errors="surrogateescape"))
    if name_bytes > NAME_MAX or path_bytes > PATH_MAX:
        raise StratagemError(
            f"{flag} {text[:40]}... is longer than the file system allows ({NAME_MAX} bytes a "
            f"name, {PATH_MAX} a path); choose a shorter name"
        )
    try:
        st = os.stat(out)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as exc:
        raise StratagemError(f"cannot use {flag} {out}: {exc.strerror or exc}; choose another path") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise StratagemError(
            f"{flag} {out} exists and is {_kind(st.st_mode)}, not a regular file; it is never "
            f"replaced: choose a file path"
        )
    for in_flag, in_path in (inputs or {}).items():
        if in_path is not None and str(in_path) and _same_file(out, Path(in_path)):
            raise StratagemError(
                f"{flag} {out} is the same file as the input {in_flag} {in_path}; writing would "
                f"destroy the input: choose another {flag} path"
            )
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise StratagemError(f"cannot write {out}: {parent} is not a writable folder; choose a writable {flag} path")
    return out


def check_output_folder(path: str | os.PathLike, *, flag: str) -> Path:
    """A folder to write files into: an existing folder, or a name that can be created as one."""
    text = os.fspath(path)
    if not str(text).strip():
        raise StratagemError(f"{flag} is empty; give a folder path")
    folder = Path(text)
    if any(len(part.encode(errors="surrogateescape")) > NAME_MAX for part in folder.parts):
        raise StratagemError(
            f"{flag} {str(text)[:40]}... has a name longer than the file system allows "
            f"({NAME_MAX} bytes); choose a shorter name"
        )
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return folder
    except OSError as exc:
        raise StratagemError(f"cannot use {flag} {folder}: {exc.strerror or exc}; choose another folder") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StratagemError(f"{flag} {folder} exists and is {_kind(st.st_mode)}, not a folder; give a folder path")
    return folder


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare the paths they would name
        return os.path.realpath(a) == os.path.realpath(b)


def atomic_write_text(path: str | os.PathLike, text: str, *, flag: str = "--out") -> Path:
    """Write ``text`` to ``path`` so that readers see either the old file or the whole new one.

    The text goes to a temporary file in the same folder, is fsync'ed, then renamed over ``path``.
    A missing parent folder is created; an unwritable one, or a ``path`` that exists and is not a regular
    file (a device, FIFO, folder: never replaced), is a :class:`StratagemError`.
    """
    return atomic_write_bytes(path, text.encode("utf-8"), flag=flag)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, flag: str = "--out") -> Path:
    """Binary form of :func:`atomic_write_text`; the file gets the usual permissions (0666 less the umask)."""
    path = check_output_path(path, flag=flag)
    target = Path(os.path.realpath(path))  # through a symlink: the link stays, its file is replaced
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:200]}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise StratagemError(f"cannot write {path}: {exc.strerror or exc}; choose a writable {flag} path") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        check_output_path(target, flag=flag)  # the path may have become a device or folder meanwhile
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise StratagemError(
            f"cannot write {path}: {exc.strerror or exc}; the previous file is unchanged, "
            f"free space or choose another {flag} path"
        ) from None
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


def _refuse_pipe(path: Path, what: str) -> None:
    """A named pipe or socket would block ``open`` until some other process writes: refuse it in one line."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # open() says what is wrong
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        kind = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket"
        raise StratagemError(f"{what} file {path} is {kind}, not a file; give a regular file")


def read_text(path: str | os.PathLike, *, what: str, limit_bytes: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of an input file, at most ``limit_bytes`` read (endless inputs are refused)."""
    path = Path(path)
    if not str(path).strip():
        raise StratagemError(f"the {what} path is empty; give a file path")
    _refuse_pipe(path, what)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit_bytes + 1)
    except FileNotFoundError:
        raise StratagemError(f"{what} file {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise StratagemError(f"{what} file {path} is a folder; give the file inside it") from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise StratagemError(f"cannot read {what} file {path}: {reason}; check the path") from None
    if len(raw) > limit_bytes:
        raise StratagemError(
            f"{what} file {path} is larger than {limit_bytes // 2**20} MiB (or endless); give the right file"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StratagemError(
            f"{what} file {path} is not UTF-8 text (byte {exc.start}); give a JSON file "
            f"written by stratagem, or convert it to UTF-8"
        ) from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(
    text: str, *, source: str, what: str, fix: str = "regenerate it or restore it from version control"
) -> Any:
    """``json.loads`` with one-line errors; NaN, Infinity and nesting deeper than Python's stack refused."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise StratagemError(f"{what} {source} is not valid JSON (line {exc.lineno}: {exc.msg}); {fix}") from None
    except RecursionError:
        raise StratagemError(f"{what} {source} is nested too deeply to be a stratagem file; regenerate it") from None
    except ValueError as exc:  # NaN/Infinity, or an integer with more digits than Python converts
        raise StratagemError(
            f"{what} {source} holds a value that is not a finite number ({exc}); regenerate it"
        ) from None


def read_json(path: str | os.PathLike, *, what: str) -> dict[str, Any]:
    """Read a JSON object from ``path``; ``what`` names the file kind in error messages."""
    data = parse_json(read_text(path, what=what), source=f"file {path}", what=what)
    if not isinstance(data, dict):
        raise StratagemError(
            f"{what} file {path} holds a {type(data).__name__}, not a JSON object; give a file written by stratagem"
        )
    return data


def validate_document(model: type[M], data: dict[str, Any], *, source: str, what: str, schema_version: int) -> M:
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
        msg = " ".join(str(err["msg"]).split())[:300]
        raise StratagemError(
            f"{what} {source} is invalid at '{loc}': {msg} ({exc.error_count()} problem(s)); regenerate the file"
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
    try:
        text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    except ValueError:
        raise StratagemError(
            f"refusing to write {path}: the document holds NaN or infinity (a bug or a bad "
            f"input upstream); check the inputs' numbers"
        ) from None
    return atomic_write_text(path, text)


def with_hash(doc: M) -> M:
    """Return ``doc`` with its ``content_hash`` field filled in."""
    data = doc.model_dump(mode="json")
    return doc.model_copy(update={"content_hash": content_hash(data)})
