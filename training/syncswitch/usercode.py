"""A job's user code: where it comes from, how every node imports it, and the check before a run.

A job names user code in one of two ways (docs/bring-your-own-model.md):

- ``usr_dir``, as tensor2tensor's ``--t2t_usr_dir``: a package folder (its ``__init__.py`` imports its
  modules; a folder without one has each of its ``*.py`` imported), a single ``.py`` file, or the
  dotted name of an importable module. Importing it runs its ``@register_*`` decorators;
- installed packages that declare entry points (syncswitch.registry): nothing to name, their names
  are simply there.

    load(usr_dir)                      import it into this process (idempotent)
    describe_names(job)                {usr_dir, digest, packages}: what state.json, the report and
                                       the history record keep; the digest changes with any file
    pack(usr_dir) / unpack(...)        the folder as a tarball in the run's bucket folder, for nodes
                                       on other hosts (nothing is installed on them by hand)
    requirements_path(usr_dir)         its requirements.txt, the packages it needs on every node
                                       (a package folder's only; "" for none)
    activate(spec, cache_dir)          what a node or launcher does first: the shipped copy, or the path
    check(job, cache_dir)              import, build, one batch, one forward/backward pass on CPU:
                                       bad user code fails here, before anything is provisioned,
                                       naming the user's file, line and registered name
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import os
import shutil
import sys
import tarfile
import tempfile
import traceback
from typing import Any

from syncswitch import storage
from syncswitch.errors import SpecError

FIELD = "usr_dir"
# A package folder's own dependencies: installed with the runtime where the backend installs it.
REQUIREMENTS_FILE = "requirements.txt"
_SKIPPED_PARTS = ("__pycache__", ".git", ".ipynb_checkpoints")
# Frames in these packages are the runtime's or a library's, never the user's.
_LIBRARY_MARKERS = (
    f"{os.sep}syncswitch{os.sep}",
    f"{os.sep}tensorflow{os.sep}",
    f"{os.sep}keras{os.sep}",
    f"{os.sep}importlib{os.sep}",
    f"{os.sep}absl{os.sep}",
    "<frozen ",
)


class UserCodeError(SpecError):
    """User code that cannot be used. The message names the registered name (or usr_dir), the
    user's file and line where the error was raised, and what was being done."""


# ---- where it is --------------------------------------------------------------------------------


def kind_of(usr_dir: str) -> str:
    """'folder', 'file' or 'module' (a dotted name); UserCodeError when none fits."""
    if os.path.isdir(usr_dir):
        return "folder"
    if usr_dir.endswith(".py"):
        if not os.path.isfile(usr_dir):
            raise UserCodeError(FIELD, f"{usr_dir!r}: no such file")
        return "file"
    if all(part.isidentifier() for part in usr_dir.split(".")):
        if importlib.util.find_spec(usr_dir.split(".")[0]) is None:
            raise UserCodeError(
                FIELD,
                f"{usr_dir!r} is neither a folder, a .py file nor an importable module (cwd {os.getcwd()})",
            )
        return "module"
    raise UserCodeError(FIELD, f"{usr_dir!r}: no such folder or .py file (cwd {os.getcwd()})")


def _files(folder: str) -> list[str]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_PARTS)
        found.extend(os.path.join(root, n) for n in sorted(names) if not n.endswith((".pyc", ".pyo")))
    return found


def _module_files(name: str) -> list[str]:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return []
    if spec.submodule_search_locations:
        return [f for loc in spec.submodule_search_locations for f in _files(loc)]
    return [spec.origin]


def beside(params: dict[str, Any], folder: str) -> dict[str, Any]:
    """``params`` with a relative ``usr_dir`` that exists beside a file in ``folder`` made absolute: a
    job or sweep file's user code sits beside it, whatever folder Airflow parses it from (or the CLI
    runs in)."""
    usr_dir = params.get("usr_dir")
    if isinstance(usr_dir, str) and usr_dir and not os.path.isabs(usr_dir):
        path = os.path.realpath(os.path.join(folder, usr_dir))
        if os.path.exists(path):
            return {**params, "usr_dir": path}
    return params


def requirements_path(usr_dir: str) -> str:
    """The ``requirements.txt`` of a package folder ``usr_dir`` ("" where it has none). A single file or a
    module has none: a file beside one may be anyone's (a repository's own), so only the folder that is
    the user code speaks for it."""
    if not usr_dir or not os.path.isdir(usr_dir):
        return ""
    path = os.path.join(usr_dir, REQUIREMENTS_FILE)
    return path if os.path.isfile(path) else ""


def requirements_text(usr_dir: str) -> str:
    """The text of ``usr_dir``'s requirements.txt ("" without one)."""
    path = requirements_path(usr_dir)
    if not path:
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def digest(usr_dir: str) -> str:
    """sha256 (16 hex digits) over the user code's files: names relative to its root, and contents."""
    if not usr_dir:
        return ""
    kind = kind_of(usr_dir)
    if kind == "folder":
        root, files = usr_dir, _files(usr_dir)
    elif kind == "file":
        root, files = os.path.dirname(usr_dir), [usr_dir]
    else:
        files = _module_files(usr_dir)
        root = os.path.commonpath(files) if files else ""
    hasher = hashlib.sha256()
    for path in files:
        hasher.update(os.path.relpath(path, root or os.sep).encode())
        hasher.update(b"\0")
        with open(path, "rb") as f:
            hasher.update(f.read())
        hasher.update(b"\0")
    return hasher.hexdigest()[:16]


def describe_names(job: Any) -> dict[str, Any]:
    """What identifies a job's user code: ``usr_dir`` and the digest of its files, and the installed
    packages (with versions) whose entry points registered the job's model, problem or hparam set.
    state.json, the report and the history record keep it, and the offline policy's fingerprint
    includes it, so a changed model restarts the switch-point search. {} for built-ins alone."""
    from syncswitch.registry import REGISTRY

    packages = {}
    if not job.usr_dir:
        for kind, name in (("model", job.model), ("problem", job.problem), ("hparams", job.hparam_set)):
            source = REGISTRY.entry(kind, name).source
            if source.startswith("entry point of "):
                dist, _, version = source.removeprefix("entry point of ").rpartition(" ")
                packages[dist] = version
    if not job.usr_dir and not packages:
        return {}
    return {"usr_dir": job.usr_dir, "digest": digest(job.usr_dir), "packages": dict(sorted(packages.items()))}


def identity(user_code: dict[str, Any]) -> str:
    """One string for fingerprints: the usr_dir digest and the packages' versions ("" for none)."""
    packages = ",".join(f"{k}=={v}" for k, v in sorted(user_code.get("packages", {}).items()))
    return ";".join(part for part in (user_code.get("digest", ""), packages) if part)


# ---- importing ------------------------------------------------------------------------------------


def load(usr_dir: str) -> str:
    """Import ``usr_dir`` (registering its names) and return its module name. Importing again is a
    no-op. Raises UserCodeError naming the user's file and line."""
    if not usr_dir:
        return ""
    kind = kind_of(usr_dir)
    try:
        if kind == "module":
            importlib.import_module(usr_dir)
            return usr_dir
        if kind == "file":
            return _load_file(os.path.abspath(usr_dir))
        return _load_folder(os.path.abspath(usr_dir))
    except UserCodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any error in user code becomes one clear message
        raise user_error(f"usr_dir {usr_dir!r}", "importing it", exc, usr_dir) from exc


def _load_file(path: str) -> str:
    name = f"syncswitch_usr_{os.path.splitext(os.path.basename(path))[0]}"
    if name in sys.modules:
        return name
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return name


def _load_folder(path: str) -> str:
    """A package folder, imported by its name with its parent on sys.path (as t2t_usr_dir is)."""
    parent, name = os.path.split(path.rstrip(os.sep))
    if not name.isidentifier():
        raise UserCodeError(FIELD, f"{path!r}: a package folder's name must be a Python identifier")
    if parent not in sys.path:
        sys.path.insert(0, parent)
    module = importlib.import_module(name)
    if getattr(module, "__file__", None) is None:  # no __init__.py: import each module of the folder
        for entry in sorted(os.listdir(path)):
            if entry.endswith(".py") and entry[:-3].isidentifier():
                importlib.import_module(f"{name}.{entry[:-3]}")
    return name


# ---- shipping to other hosts ----------------------------------------------------------------------


def pack(usr_dir: str) -> bytes:
    """A gzipped tarball of a folder or file usr_dir, its top entry named as it imports."""
    kind = kind_of(usr_dir)
    if kind == "module":
        raise UserCodeError(
            FIELD,
            f"{usr_dir!r} is a module name: it cannot be shipped to the cluster's hosts; give the "
            "folder or file, or install the package on every host",
        )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        base = os.path.abspath(usr_dir).rstrip(os.sep)
        files = _files(base) if kind == "folder" else [base]
        top = os.path.dirname(base)
        for path in files:
            info = tar.gettarinfo(path, arcname=os.path.relpath(path, top))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


def upload(usr_dir: str, uri: str) -> None:
    storage.write_bytes(uri, pack(usr_dir))


def unpack(uri: str, usr_dir: str, cache_dir: str, code_digest: str) -> str:
    """The shipped copy of ``usr_dir`` under ``cache_dir`` (downloaded once per digest, renamed into
    place so that concurrent nodes on one host never see half of it); returns its local path."""
    target = os.path.join(cache_dir, f"usercode-{code_digest}")
    local = os.path.join(target, os.path.basename(os.path.abspath(usr_dir).rstrip(os.sep)))
    if os.path.isdir(target):
        return local
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(dir=cache_dir, prefix=".usercode-")
    try:
        with tarfile.open(fileobj=io.BytesIO(storage.read_bytes(uri)), mode="r:gz") as tar:
            _extract(tar, staging)
        os.rename(staging, target)
    except OSError:
        if not os.path.isdir(target):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


def _extract(tar: tarfile.TarFile, into: str) -> None:
    """Every member of ``tar`` under ``into``, refusing what would land elsewhere: with tarfile's "data"
    filter where this Python has it (3.11.4 on), else by hand as that filter does (a node's venv may
    be of Debian 12's Python 3.11.2): only files and folders, each inside ``into``."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, filter="data")
        return
    root = os.path.realpath(into)
    for member in tar.getmembers():
        path = os.path.realpath(os.path.join(root, member.name))
        if not (member.isfile() or member.isdir()) or os.path.commonpath([root, path]) != root:
            raise UserCodeError(
                FIELD,
                f"the shipped user code has a member that is no file or folder inside it: {member.name!r}",
            )
    tar.extractall(into)


def activate(spec: Any, cache_dir: str) -> str:
    """Import the segment's user code: the copy shipped through the bucket when the spec names one
    (hosts, gce), else ``usr_dir`` as it is (local). Returns the local usr_dir ("" without one)."""
    usr_dir = getattr(spec, "usr_dir", "")
    if not usr_dir:
        return ""
    uri = getattr(spec, "usr_code_uri", "")
    local = unpack(uri, usr_dir, cache_dir, spec.usr_code_digest) if uri else usr_dir
    load(local)
    return local


# ---- errors that point at the user's code -------------------------------------------------------


def user_frame(exc: BaseException, usr_dir: str = "") -> tuple[str, int] | None:
    """(file, line) where the user's code raised ``exc``: the innermost frame under usr_dir, else the
    innermost frame outside the runtime and the libraries. A SyntaxError names its own line."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno or 0
    frames = traceback.extract_tb(exc.__traceback__)
    root = os.path.abspath(usr_dir) if usr_dir and os.path.exists(usr_dir) else ""
    if root:
        mine = [f for f in frames if os.path.abspath(f.filename).startswith(root)]
        if mine:
            return mine[-1].filename, mine[-1].lineno or 0
    outside = [f for f in frames if not any(m in f.filename for m in _LIBRARY_MARKERS)]
    outside = [f for f in outside if "site-packages" not in f.filename or "syncswitch" not in f.filename]
    if outside and not outside[-1].filename.startswith(sys.prefix):
        return outside[-1].filename, outside[-1].lineno or 0
    cause = exc.__cause__ or exc.__context__
    return user_frame(cause, usr_dir) if cause is not None and cause is not exc else None


def definition(obj: Any) -> tuple[str, int] | None:
    """(file, line) where a registered function or class is defined."""
    import inspect

    try:
        target = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
        return inspect.getsourcefile(target) or "?", inspect.getsourcelines(target)[1]
    except (OSError, TypeError):
        return None


def user_error(
    what: str, doing: str, exc: BaseException, usr_dir: str = "", defined_by: Any = None
) -> UserCodeError:
    """One message: ``<what> (<file>:<line>): <doing> failed: <Error>: <message>``. The place is where
    the user's code raised; when the error came from a library alone (a shape mismatch found by
    Keras while the runtime calls the model), where the registered builder or class is defined."""
    where = user_frame(exc, usr_dir) or (definition(defined_by) if defined_by is not None else None)
    place = f" ({where[0]}:{where[1]})" if where else ""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    detail = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    field, _, name = what.partition(" ")
    return UserCodeError(field, f"{name}{place}: {doing} failed: {detail}")
