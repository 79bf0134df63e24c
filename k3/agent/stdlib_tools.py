"""The stdlib lookup tools: `signature(name)`, `doc(name)` and `find(name)`, answered live by `inspect`.

Names resolve only inside `MODULES`, a fixed list of plain standard-library modules (importing any module
a model names could run code with side effects: `antigravity` opens a browser, `this` prints). A tool
that cannot answer returns a line starting with "error:" (the model reads it like any result).

    signature("textwrap.indent") -> "(text, prefix, predicate=None)"
    doc("textwrap.indent")       -> "Adds 'prefix' to the beginning of selected lines in 'text'."
    find("dedent")               -> "textwrap"     (every module of MODULES that defines it, ", "-joined)
"""

from __future__ import annotations

import importlib
import inspect
import json
import warnings
from functools import cache

MODULES = tuple(
    "abc argparse ast base64 binascii bisect bz2 calendar cmd code codecs codeop colorsys configparser "
    "contextlib copy csv dataclasses datetime decimal difflib dis enum filecmp fileinput fnmatch fractions "
    "ftplib functools getopt gettext glob graphlib gzip hashlib heapq hmac html imaplib inspect ipaddress "
    "itertools json keyword linecache locale logging lzma mailbox mimetypes netrc numbers operator optparse "
    "pathlib pickletools platform plistlib poplib posixpath pprint queue quopri random re reprlib sched "
    "secrets selectors shlex shutil smtplib socketserver statistics string struct subprocess sysconfig "
    "tarfile tempfile textwrap threading timeit tokenize trace traceback types typing uuid warnings wave "
    "weakref zipfile zipimport zoneinfo".split()
)


def _tool(name: str, description: str, arg: str) -> dict:
    params = {"type": "object", "properties": {"name": {"type": "string", "description": arg}},
              "required": ["name"]}  # fmt: skip
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS = [
    _tool("signature", "Call signature of a stdlib function or class", "dotted name, e.g. textwrap.dedent"),
    _tool("doc", "First line of the docstring of a stdlib function or class", "dotted name"),
    _tool("find", "Modules that define a name", "bare name, e.g. dedent"),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)


@cache
def module(name: str):
    """The imported module `name` of MODULES (ValueError for any other name)."""
    if name not in MODULES:
        raise ValueError(f"module {name!r} is not one of the lookup modules")
    return importlib.import_module(name)


def resolve(dotted: str):
    """ "module.attr[.attr...]" -> the object (ValueError when it does not name one in MODULES)."""
    parts = dotted.split(".") if isinstance(dotted, str) else []
    if len(parts) < 2 or parts[0] not in MODULES:
        raise ValueError(f"{dotted!r} is not a dotted name in a lookup module")
    obj = module(parts[0])
    for p in parts[1:]:
        if p.startswith("_") or not hasattr(obj, p):
            raise ValueError(f"{dotted!r} does not exist")
        obj = getattr(obj, p)
    return obj


def signature(name: str) -> str:
    try:
        return str(inspect.signature(resolve(name)))
    except ValueError as e:
        return f"error: {e}"
    except TypeError:
        return f"error: {name!r} has no signature"


def doc(name: str) -> str:
    try:
        text = inspect.getdoc(resolve(name)) or ""
    except ValueError as e:
        return f"error: {e}"
    return text.strip().split("\n")[0] or f"error: {name!r} has no docstring"


def defined_in(mod: str, name: str) -> bool:
    obj = getattr(module(mod), name, None)
    return obj is not None and getattr(obj, "__module__", None) == mod


def find(name: str) -> str:
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        return f"error: {name!r} is not a bare public name"
    found = [m for m in MODULES if defined_in(m, name)]
    return ", ".join(found) if found else f"error: no lookup module defines {name!r}"


def _quiet(fn):
    """A tool that does not print the DeprecationWarnings of the old names it may touch."""

    def tool(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(name)

    tool.__name__ = fn.__name__
    return tool


signature, doc, find = _quiet(signature), _quiet(doc), _quiet(find)
FUNCTIONS = {"signature": signature, "doc": doc, "find": find}


def call_tool(name: str, arguments: str | dict) -> str:
    """Run one tool call as the model wrote it (arguments: a JSON object or its text) -> the result text."""
    if name not in FUNCTIONS:
        return f"error: unknown tool {name!r} (one of {', '.join(TOOL_NAMES)})"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return "error: the arguments are not valid JSON"
    if not isinstance(arguments, dict) or set(arguments) != {"name"}:
        return 'error: the arguments must be {"name": ...}'
    return FUNCTIONS[name](arguments["name"])
