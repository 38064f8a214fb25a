"""Every patch of another library is a row of a table.

A `Patch` names its target as "package.module:Owner.attr" (an attribute of a class or of any object
reached from the module), "package.module:attr" (a module attribute) or "package.module:Owner[key]"
(an entry of a mapping), a factory `replace(original) -> replacement`, the parameter names of the
original it was written against and the library versions it was written for. A `PatchTable` holds
one library's rows (vLLM: vexact_vllm/vllm_patches.py; verl: model_patches/trainers/verl_hooks.py;
VeOmni: model_patches/trainers/veomni_hooks.py) and drives them:

- `install()` checks each row before it touches anything: the target must exist and its parameter
  names must be the expected ones, else a `PatchError` that names the target, what differs, the
  versions the row was written for and the version installed; a failing row undoes the rows
  installed before it (all or nothing). Idempotent.
- `uninstall()` puts every original back, by identity (a class attribute that was inherited is
  deleted again; a mapping entry is deleted and the original put back only if what shows through
  is not it), and undoes the entries the replacements wrote later through `set_item`.
- `is_installed()`, and `installed()`, a context manager that restores the previous state.

Replacements get `__wrapped__` (the original) and `_vexact = True`. A property target is checked by
its getter's parameters and replaced by a `PatchedProperty`. This module imports no library it
patches: each target is imported when its table is installed.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

MISSING = object()  # the value of an absent attribute or mapping entry


class PatchedProperty(property):
    """The replacement of a property target (a property that takes `__wrapped__` and `_vexact`)."""


class PatchError(RuntimeError):
    """A patch target is missing, or no longer has the signature its row was written against."""


@dataclass(frozen=True)
class Patch:
    target: str  # "package.module:Owner.attr", "package.module:attr" or "package.module:Owner[key]"
    replace: Callable[[Any], Any]  # original -> replacement
    params: tuple[str, ...]  # parameter names of the original (inspect.signature), checked at install
    written_for: str  # the library versions this row was written against, e.g. "verl 0.9.1"


@dataclass
class _Applied:
    owner: Any
    name: str
    is_item: bool
    original: Any
    inherited: bool  # attribute found on a base class, not in the owner's own __dict__
    replacement: Any


def lookup(mapping, key):
    """mapping[key], or MISSING when the mapping has no such key."""
    try:
        return mapping[key]
    except (KeyError, ValueError):  # VeOmni's Registry raises ValueError for an unknown key
        return MISSING


def installed_version(library: str) -> str:
    module = sys.modules.get(library)
    if module is None:
        try:
            module = importlib.import_module(library)
        except ImportError:
            return "not installed"
    version = getattr(module, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version(library)
        except PackageNotFoundError:
            version = "unknown version"
    return str(version)


class PatchTable:
    """One library's patches (see the module docstring)."""

    def __init__(self, library: str, rows: tuple[Patch, ...]):
        self.library = library  # import name, for the installed version in error messages
        self.rows = tuple(rows)
        self._applied: dict[str, _Applied] = {}  # target -> what install() replaced
        self._writes: dict[tuple[int, Any], tuple[Any, Any, Any, Any]] = {}  # (id(mapping), key) -> entry

    def _error(self, row: Patch, problem: str) -> PatchError:
        return PatchError(
            f"vexact-vllm cannot patch {row.target}: {problem}. This patch was written for "
            f"{row.written_for}; installed: {self.library} {installed_version(self.library)}. "
            f"Install a {self.library} version the patch supports ({row.written_for}), or update the row."
        )

    def locate(self, row: Patch) -> tuple[Any, str, bool]:
        """(owner, attribute or key, is a mapping entry) of a row's target; imports its module."""
        module_name, _, path = row.target.partition(":")
        is_item = path.endswith("]")
        if is_item:
            path, _, key = path[:-1].partition("[")
        else:
            path, _, key = path.rpartition(".")
        try:
            owner = importlib.import_module(module_name)
        except ImportError as e:
            raise self._error(row, f"module {module_name} cannot be imported ({e})") from None
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, MISSING)
            if owner is MISSING:
                raise self._error(row, f"{module_name} has no {path}")
        return owner, key, is_item

    def _apply(self, row: Patch) -> _Applied:
        owner, name, is_item = self.locate(row)
        inherited = False
        if is_item:
            original = lookup(owner, name)
        else:
            original = vars(owner).get(name, MISSING) if hasattr(owner, "__dict__") else MISSING
            if original is MISSING:
                original = getattr(owner, name, MISSING)
                inherited = original is not MISSING
        if original is MISSING:
            raise self._error(row, "the target does not exist")
        if getattr(original, "_vexact", False):
            raise self._error(row, "it is patched already, by another copy of this table")
        try:
            params = tuple(inspect.signature(original.fget if isinstance(original, property) else original).parameters)
        except (TypeError, ValueError):
            raise self._error(row, f"the target is not a function with a signature ({original!r})") from None
        if params != row.params:
            raise self._error(
                row, f"its parameters are ({', '.join(params)}), the patch expects ({', '.join(row.params)})"
            )
        replacement = row.replace(original)
        replacement.__wrapped__ = original
        replacement._vexact = True
        if is_item:
            owner[name] = replacement
        else:
            setattr(owner, name, replacement)
        return _Applied(owner, name, is_item, original, inherited, replacement)

    def install(self) -> None:
        """Apply every row (idempotent; all or nothing)."""
        try:
            for row in self.rows:
                if row.target not in self._applied:
                    self._applied[row.target] = self._apply(row)
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        """Put every original back and undo the entries written through `set_item`."""
        for target in reversed(list(self._applied)):
            a = self._applied.pop(target)
            current = lookup(a.owner, a.name) if a.is_item else getattr(a.owner, a.name, MISSING)
            if current is not a.replacement:
                warnings.warn(
                    f"{target} was replaced again after vexact-vllm patched it; leaving it as it is",
                    stacklevel=2,
                )
            elif a.is_item:
                del a.owner[a.name]
                if lookup(a.owner, a.name) is not a.original:
                    a.owner[a.name] = a.original
            elif a.inherited:
                delattr(a.owner, a.name)
            else:
                setattr(a.owner, a.name, a.original)
        for mapping, key, previous, value in reversed(list(self._writes.values())):
            if lookup(mapping, key) is value:  # still ours: someone else's later write stays
                if previous is MISSING:
                    del mapping[key]
                else:
                    mapping[key] = previous
        self._writes.clear()

    def is_installed(self) -> bool:
        return len(self._applied) == len(self.rows)

    @contextmanager
    def installed(self):
        was = self.is_installed()
        self.install()
        try:
            yield self
        finally:
            if not was:
                self.uninstall()

    def set_item(self, mapping, key, value) -> None:
        """`mapping[key] = value`, written by a replacement at run time; `uninstall()` undoes it."""
        slot, current = (id(mapping), key), lookup(mapping, key)
        entry = self._writes.get(slot)
        previous = entry[2] if entry is not None and current is entry[3] else current
        self._writes[slot] = (mapping, key, previous, value)
        mapping[key] = value
