"""What the JSON dumps of :mod:`solver.serialize` share with their decoder
(:mod:`solver.decode`): the schema tag, the spelling of non-finite floats,
JSON paths in error messages, the error type and the bundle of a problem with
its solution. Both modules import this one, so neither imports the other."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from .problem import Problem, Solution

SCHEMA = "autoparallel.solver/1"

# The strings a dump writes for the floats JSON cannot spell.
NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def json_key(path: str, key: str) -> str:
    """``path.key``, or ``path["key"]`` where the key is not an identifier."""
    return f"{path}.{key}" if _IDENT.match(key) else f"{path}[{json.dumps(key)}]"


class DumpError(ValueError):
    """A dump is malformed; the message gives the JSON path of the fault."""


@dataclass
class Bundle:
    """A problem together with a solution of it (one dump file)."""

    problem: Problem
    solution: Solution
