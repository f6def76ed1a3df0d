"""Where results live and how their paths are written: atomic writes, and paths that hold no machine's
absolute location.

Its reasoning: docs/ledger.md, "vitexp/ledger/paths.py".
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

#: The source checkout (:data:`vitexp.PROJECT_ROOT`), found without importing the package (whose
#: models import the ledger: no import cycle).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def default_results_dir() -> Path:
    """``$VITEXP_RESULTS`` if set, else ``results/`` in the source checkout."""
    return Path(os.environ.get("VITEXP_RESULTS", PROJECT_ROOT / "results"))


def _umask() -> int:
    """The process's umask (read by setting it, then restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path | str, content: str | bytes | Callable[[str], Any]) -> Path:
    """The one way vitexp writes a file: into a temporary file beside ``path``, fsync'ed, then
    ``os.replace``d over it (atomic on POSIX), so a killed process never leaves half a file.
    ``content`` is text, bytes, or a function that writes the temporary path it is given
    (``torch.save``, ``savefig``, a Lightning checkpoint). The file gets the mode ``open`` would give
    it (0666 less the umask), not ``mkstemp``'s 0600, so a shared results folder stays readable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            if not callable(content):
                fh.write(content.encode() if isinstance(content, str) else content)
        if callable(content):
            content(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def json_default(obj: Any) -> Any:
    """JSON for what ``json`` cannot write: tensors and numpy scalars by value, anything else as text."""
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def atomic_write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON through :func:`atomic_write`."""
    atomic_write(path, json.dumps(payload, indent=2, sort_keys=False, default=json_default) + "\n")


#: A path outside the checkout and the results root, named with its machine: ``file://<host>/<path>``.
MACHINE_PREFIX = "file://"


def machine_path(path: Path | str, host: str | None = None) -> str:
    """``path`` (absolute) named as a path of the machine ``host`` (default: this one)."""
    return f"{MACHINE_PREFIX}{host or platform.node()}{os.path.normpath(str(path))}"


def portable_path(
    path: Path | str | None, results_dir: Path | str | None = None, host: str | None = None
) -> str | None:
    """``path`` relative to the project root when it lies inside the checkout, else relative to the
    results root when it lies inside that or shares a folder with it (``../scratch/run1``), else named
    with its machine (:func:`machine_path`: ``file://<host>/<path>``; a ``..`` path up to ``/``, such as
    ``../../../usr/share/x``, would mean something at one depth of the tree only).
    ``..`` and ``file:///`` paths are read as the ledger wrote them (relative to the results root; this
    machine's); any other relative path and a path already named with its machine are returned as
    given. ``offline:<dir>`` (an offline W&B run) keeps its prefix."""
    if path is None:
        return None
    text = str(path)
    prefix = ""
    if text.startswith("offline:"):
        prefix, text = "offline:", text[len("offline:") :]
    results = Path(results_dir) if results_dir else default_results_dir()
    if text.startswith("file:///"):
        text = text[len("file://") :]
    elif text == ".." or text.startswith("../"):
        text = os.path.normpath(os.path.join(os.path.realpath(results), text))
    p = Path(text)
    if not p.is_absolute():
        return prefix + text
    resolved = Path(os.path.realpath(p)) if host is None else Path(os.path.normpath(p))
    for root in (PROJECT_ROOT, results):
        try:
            return prefix + str(resolved.relative_to(Path(os.path.realpath(root))))
        except ValueError:
            continue
    here = os.path.realpath(results)
    if os.path.commonpath([str(resolved), here]) != os.sep:  # beside the results root: ../run1 moves with it
        return prefix + os.path.relpath(resolved, here)
    return prefix + machine_path(resolved, host)


def portable_paths(value: Any, results_dir: Path | str | None = None, host: str | None = None) -> Any:
    """``value`` (a ledger record, or any part of one) with every string that is a path of one
    machine (absolute, ``..``, ``file:///``) made :func:`portable_path`, at any depth, every error
    text made :func:`portable_text`, and a ``file:///`` URL quoted in any text named with its
    machine. ``host``: whose paths they are (default: this machine's, resolved here)."""
    if isinstance(value, dict):
        run_dir = value.get("output_dir") if isinstance(value.get("output_dir"), (str, Path)) else None
        run_dirs = (
            (local_path(str(run_dir), results_dir),) if run_dir and host is None else ()
        )  # an error may quote the run's folder
        return {
            k: (
                portable_text(v, results_dir, run_dirs, host)
                if k == "error" and isinstance(v, str)
                else portable_paths(v, results_dir, host)
            )
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [portable_paths(v, results_dir, host) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        bare = value.removeprefix("offline:")
        if bare.startswith(("/", "../", "file:///")) or bare == "..":
            return portable_path(value, results_dir, host)
        if "file:///" in value:
            return value.replace("file:///", f"{MACHINE_PREFIX}{host or platform.node()}/")
    return value


#: An absolute path quoted in a text: a slash not after a word, a path or a placeholder (``<run dir>/wandb``),
#: then characters that are not a space or a quote.
_QUOTED_PATH = re.compile(r"(?<![\w.~:/>])/[^\s'\"`,;:()\[\]{}<>]+")


def portable_text(
    text: str | None,
    results_dir: Path | str | None = None,
    run_dirs: Iterable[Path | str | None] = (),
    host: str | None = None,
) -> str | None:
    """``text`` (an error message) with every absolute path it quotes that lies in the checkout, the
    results root or one of ``run_dirs`` (the run's own folder, wherever it is) made
    :func:`portable_path`, and every ``file:///`` URL named with its machine; any other path (a system
    file, a placeholder such as ``/path/to/dataset``) is left as written: it names no folder of this
    machine's runs."""
    if not text:
        return text
    results = Path(results_dir) if results_dir else default_results_dir()
    roots = [os.path.realpath(r) for r in (PROJECT_ROOT, results, *run_dirs) if r]

    def rewrite(match: re.Match) -> str:
        where = os.path.realpath(match.group(0))
        inside = any(where == r or where.startswith(r.rstrip("/") + "/") for r in roots)
        return (portable_path(match.group(0), results) or match.group(0)) if inside else match.group(0)

    text = text.replace("file:///", f"{MACHINE_PREFIX}{host or platform.node()}/")
    return _QUOTED_PATH.sub(rewrite, text) if host is None else text


def local_path(path: str | None, results_dir: Path | str | None = None) -> Path | None:
    """A stored path on this machine: absolute as given (``file://<host>/<path>``: ``/<path>``), else
    under the project root or the results root (the first that exists; the project root's when neither
    does)."""
    if not path:
        return None
    if path.startswith(MACHINE_PREFIX):  # file://<host>/<path>: the same path here
        host_and_path = path[len(MACHINE_PREFIX) :]
        return Path("/" + host_and_path.partition("/")[2])
    p = Path(path)
    if p.is_absolute():
        return p
    results = Path(results_dir) if results_dir else default_results_dir()
    candidates = [PROJECT_ROOT / p, results / p]
    found = next((c for c in candidates if c.exists()), None)
    if found is None and str(p).startswith(".."):  # stored relative to the results root from outside it
        return Path(os.path.normpath(results / p))
    return found if found is not None else candidates[0]
