"""The public API is typed and documented: every function, class and public method named in a family's ``__all__``
(and fastdist's own) has annotations on its parameters and return, and a Google-style docstring (an ``Args:``
section when it takes parameters, or every parameter named in a one-line docstring, which Google style allows for
simple functions; a class's docstring documents its ``__init__``, a base's an override without one).

Gaps in files owned elsewhere are listed in KNOWN_GAPS, file by file, for their owners to close; the test fails
on any gap that is not listed there, so the list only shrinks."""
import enum
import importlib
import inspect
import os
import re
import types

import fastdist
import pytest

FAMILIES = ("fastdist", *(f"fastdist.{name}" for name in fastdist._SUBMODULES), "fastdist.ops")
PACKAGE = os.path.dirname(os.path.abspath(fastdist.__file__))

# file (relative to python/fastdist) -> "qualified name: what is missing", for files whose owners have yet to add
# them. Remove an entry when its gap is closed.
KNOWN_GAPS: dict[str, set[str]] = {}


def _public_objects():
    """(module name, qualified name, object) for everything in the families' ``__all__``, submodules named there
    included, each object once."""
    seen, found = set(), []

    def visit(module):
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                if obj.__name__.startswith("fastdist.") and obj.__name__ not in seen:
                    seen.add(obj.__name__)
                    visit(obj)
                continue
            if id(obj) in seen or not (inspect.isclass(obj) or callable(obj)):
                continue  # constants
            seen.add(id(obj))
            found.append((module.__name__, f"{module.__name__}.{name}", obj))

    for family in FAMILIES:
        seen.add(family)
        visit(importlib.import_module(family))
    return found


def _source_file(obj):
    try:
        path = inspect.getsourcefile(inspect.unwrap(obj))
    except TypeError:
        return None  # built-in: torch ops and the like
    return os.path.relpath(path, PACKAGE) if path and path.startswith(PACKAGE) else None


def _documents(doc, params):
    """Whether ``doc`` documents ``params``: an Args: section, or (Google style's one-line docstring, for functions
    whose signature says enough) every parameter named in it."""
    if any(line.strip() in ("Args:", "Arguments:") for line in doc.splitlines()):
        return True
    return all(re.search(rf"\b{re.escape(p.name)}\b", doc) for p in params)


def _inherited_doc(cls, attr):
    """The docstring of ``attr`` on ``cls`` or, for an override without one, on the nearest base that has one (as
    help() and Sphinx show it)."""
    for base in cls.__mro__:
        member = base.__dict__.get(attr)
        member = getattr(member, "__func__", member)
        if member is not None and getattr(member, "__doc__", None):
            return member.__doc__
    return None


def _function_gaps(fn, name, is_method=False, doc=None):
    """What ``fn`` lacks: parameter or return annotations, a docstring (``doc`` when given: the class's for
    ``__init__``, a base's for an override), its parameters documented."""
    gaps = []
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return gaps  # no signature to check (a C function)
    params = list(signature.parameters.values())
    if is_method and params and params[0].name in ("self", "cls"):
        params = params[1:]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if missing:
        gaps.append(f"{name}: parameters {', '.join(missing)} not annotated")
    if signature.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
        gaps.append(f"{name}: return not annotated")
    doc = fn.__doc__ if doc is None else doc
    if not (doc and doc.strip()):
        gaps.append(f"{name}: no docstring")
    elif not _documents(doc, params):
        gaps.append(f"{name}: parameters not documented (no Args: section)")
    return gaps


def _generated(cls, attr):
    """Methods Python writes itself (dataclass and enum machinery): typed from the fields, documented by the
    class."""
    fn = getattr(cls.__dict__[attr], "__func__", cls.__dict__[attr])
    code = getattr(fn, "__code__", None)
    return (code is not None and code.co_filename.startswith("<")) or (issubclass(cls, enum.Enum) and
                                                                        attr == "__init__")


def _class_gaps(cls, name):
    gaps = []
    if not (cls.__doc__ and cls.__doc__.strip()):
        gaps.append(f"{name}: no docstring")
    for attr, member in vars(cls).items():
        if attr.startswith("_") and attr not in ("__init__", "__call__"):
            continue
        if attr == "__init__" and (_generated(cls, attr) or not inspect.isfunction(member)):
            continue
        if isinstance(member, property):
            if member.fget is not None and inspect.signature(member.fget).return_annotation is \
                    inspect.Signature.empty:
                gaps.append(f"{name}.{attr}: return not annotated")
            if member.fget is not None and not (_inherited_doc(cls, attr) or "").strip():
                gaps.append(f"{name}.{attr}: no docstring")
            continue
        if isinstance(member, (staticmethod, classmethod)):
            fn, is_method = member.__func__, isinstance(member, classmethod)
        elif inspect.isfunction(member):
            fn, is_method = member, True
        else:
            continue
        if _generated(cls, attr):
            continue
        doc = cls.__doc__ if attr == "__init__" else _inherited_doc(cls, attr)
        gaps += _function_gaps(fn, f"{name}.{attr}", is_method, doc=doc or "")
    return gaps


def public_api_gaps() -> dict[str, set[str]]:
    """Every gap of the public API, by the file (relative to the package) that defines the object."""
    by_file: dict[str, set[str]] = {}
    for _, name, obj in _public_objects():
        source = _source_file(obj)
        if source is None:
            continue
        if inspect.isclass(obj):
            gaps = _class_gaps(obj, name)
        else:
            gaps = _function_gaps(obj, name)
        if gaps:
            by_file.setdefault(source, set()).update(gaps)
    return by_file


def test_the_checker_finds_a_missing_annotation_and_a_missing_args_section():
    def untyped(x, y: int):
        """Adds."""
        return x + y

    gaps = _function_gaps(untyped, "untyped")
    assert "untyped: parameters x not annotated" in gaps and "untyped: return not annotated" in gaps
    assert "untyped: parameters not documented (no Args: section)" in gaps


def test_the_families_are_all_visited():
    modules = {module for module, _, _ in _public_objects()}
    assert {"fastdist.moe", "fastdist.tp", "fastdist.memory", "fastdist.compress", "fastdist.graph",
            "fastdist.distributed", "fastdist.parallel", "fastdist.embedding"} <= modules


def test_every_public_callable_is_annotated_and_documented_beyond_the_known_gaps():
    new = {f: sorted(g - KNOWN_GAPS.get(f, set())) for f, g in public_api_gaps().items()}
    new = {f: g for f, g in new.items() if g}
    assert not new, "public API without type hints or Google-style docstrings:\n" + "\n".join(
        f"{f}:\n  " + "\n  ".join(g) for f, g in sorted(new.items()))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_imports_with_an_all(family):
    assert isinstance(getattr(importlib.import_module(family), "__all__", None), list)
