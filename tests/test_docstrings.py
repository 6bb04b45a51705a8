"""Every public name of the API reference has a docstring (issue 34), found with ``inspect``.

Public: the names in the ``__all__`` of ``minicomm``, ``minicomm.ps`` and ``minicomm.torch``, the
names of ``minicomm.schedule`` that do not start with ``_`` and are defined there, and
``minicomm.window.Window`` (what ``comm.window`` returns); of each public class, every public
method and property, inherited ones included where minicomm defines them (``Communicator``'s
come from its mixins). Data constants (``mc.SUM``, ``ps.ENV_NUM_SERVERS``...) hold no docstring
of their own: the module docstrings describe them. The Google-style ``Args:`` sections, which
mkdocstrings renders as the parameters table, must name the parameters of the signature.
"""
import dataclasses
import importlib
import inspect
import re

import pytest

MODULES = ("minicomm", "minicomm.ps", "minicomm.torch", "minicomm.schedule")
EXTRA = (("minicomm.window", "Window"),)
MIN_CHARS = 20          # shorter than this is a placeholder, not documentation
SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Returns|Yields|Raises|Example|Examples|"
                     r"Attributes|Note|Notes|Warning|See Also|Todo):\s*$")


def public_names(module):
    if hasattr(module, "__all__") and module.__name__ != "minicomm.schedule":
        return list(module.__all__)
    return [n for n, v in vars(module).items() if not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__
            and (inspect.isfunction(v) or inspect.isclass(v))]


def members(cls):
    """(name, object) of the public methods and properties of ``cls`` that minicomm defines."""
    out = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not owner.__module__.startswith("minicomm"):
            continue
        raw = vars(owner)[name]
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if inspect.isfunction(raw) or isinstance(raw, property):
            out.append((f"{cls.__module__}.{cls.__qualname__}.{name}", raw))
    return out


def public_api():
    """(qualified name, object) of every function, class, method and property documented."""
    seen, out = set(), []

    def add(qual, obj):
        if qual not in seen:
            seen.add(qual)
            out.append((qual, obj))
    classes = []
    for modname in MODULES:
        module = importlib.import_module(modname)
        for name in public_names(module):
            obj = getattr(module, name)
            if inspect.isclass(obj):
                add(f"{modname}.{name}", obj)
                classes.append(obj)
            elif callable(obj):
                add(f"{modname}.{name}", obj)
    for modname, name in EXTRA:
        cls = getattr(importlib.import_module(modname), name)
        add(f"{modname}.{name}", cls)
        classes.append(cls)
    for cls in classes:
        for qual, obj in members(cls):
            add(qual, obj)
    return out


def own_doc(obj):
    """The object's own docstring: None for a dataclass's generated one or an inherited one."""
    doc = obj.__doc__ if isinstance(obj, property) else vars(obj).get("__doc__") \
        if inspect.isclass(obj) else obj.__doc__
    if doc and inspect.isclass(obj) and dataclasses.is_dataclass(obj) \
            and doc.startswith(obj.__name__ + "("):
        return None                   # the signature dataclasses writes when there is none
    return inspect.cleandoc(doc) if doc else None


def args_section(doc):
    """The parameter names an ``Args:`` section documents (Google style: ``name (type): text``,
    continuation lines indented deeper)."""
    lines = doc.splitlines()
    names, inside, indent = [], False, None
    for line in lines:
        m = SECTION.match(line)
        if m:
            inside = m.group(2) in ("Args", "Arguments", "Parameters")
            indent = None
            continue
        if not inside or not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:
            inside = False
        elif width == indent:
            m = re.match(r"\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:", line)
            assert m, f"not a Google-style Args entry: {line.strip()!r}"
            names.append(m.group(1).lstrip("*"))
    return names


def signature_params(obj):
    fn = obj.fget if isinstance(obj, property) else obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return [p for p in params if p not in ("self", "cls")]


API = public_api()


def test_the_walk_finds_the_api():
    names = {q for q, _ in API}
    # an independent spot check that the walk reaches mixins, properties and every module
    for expected in ("minicomm.spawn", "minicomm.communicator.core.Communicator.allreduce",
                     "minicomm.communicator.core.Communicator.split",
                     "minicomm.communicator.core.Communicator.link_model",
                     "minicomm.communicator.lifecycle.Work.wait", "minicomm.window.Window.fence",
                     "minicomm.ps.start", "minicomm.ps.worker.Worker.pushpull",
                     "minicomm.torch.MinicommProcessGroup", "minicomm.schedule.ScheduleBuilder",
                     "minicomm.schedule.Schedule.comm_steps"):
        assert expected in names, expected
    assert len(API) > 100


def test_every_public_name_has_a_docstring():
    missing = [q for q, obj in API if len(own_doc(obj) or "") < MIN_CHARS]
    assert not missing, f"{len(missing)} public names without a docstring:\n" + "\n".join(missing)


def test_args_sections_name_real_parameters():
    wrong = []
    for qual, obj in API:
        doc = own_doc(obj)
        params = signature_params(obj)
        if not doc or params is None:
            continue
        for name in args_section(doc):
            if name not in params:
                wrong.append(f"{qual}: Args documents {name!r}, not in {params}")
    assert not wrong, "\n".join(wrong)


COMMUNICATOR_METHODS = [(q, o) for q, o in API
                        if q.startswith("minicomm.communicator.core.Communicator.")
                        and inspect.isfunction(o)]


@pytest.mark.parametrize("qual,method", COMMUNICATOR_METHODS,
                         ids=[q.rsplit(".", 1)[1] for q, _ in COMMUNICATOR_METHODS])
def test_communicator_methods_document_every_parameter(qual, method):
    doc = own_doc(method)
    assert doc, qual
    params = signature_params(method)
    documented = args_section(doc)
    assert sorted(documented) == sorted(params), (qual, documented, params)
    for section in ("Returns:", "Examples:"):     # Raises: where the method raises
        assert re.search(rf"^{section}\s*$", doc, re.M), f"{qual}: no {section} section"
