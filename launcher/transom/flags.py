"""Command-line flags derived from a settings model: a setting's type, bounds, default and
help are written once, on its pydantic field, and `transom run` / `transom launch` read
them from there (launch/config.py). The parser only collects the words; the model checks
them, and its refusals are worded for the command line here (`--timeout must be at most
2,592,000 seconds, got 1e+300`).

A flag is the field's name in kebab case without the `_s` of seconds (`collective_timeout_s`
is `--collective-timeout`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)


def seconds(default: float, high: float, help_: str = "", zero: bool = False) -> Any:
    """A settings field of seconds: finite, above 0 (or 0 too), at most `high`."""
    if zero:
        return Field(default, ge=0, le=high, allow_inf_nan=False, description=help_)
    return Field(default, gt=0, le=high, allow_inf_nan=False, description=help_)


def flag_of(name: str, renamed: Mapping[str, str] | None = None) -> str:
    """The flag of field `name`, unless `renamed` gives it another (`num_replicas`: `--replicas`)."""
    return (renamed or {}).get(name) or "--" + name.removesuffix("_s").replace("_", "-")


def add(parser: argparse.ArgumentParser, model: type[BaseModel], names: Iterable[str],
        required: Iterable[str] = (), renamed: Mapping[str, str] | None = None) -> None:
    """One flag per field in `names`; its default is left to the model (what is not given is
    not passed), so `--help` shows the model's."""
    must = set(required)
    for name in names:
        flag = flag_of(name, renamed)
        info = model.model_fields[name]
        help_ = info.description or ""
        if not info.is_required() and info.default is not None and info.default != "":
            help_ = f"{help_} (default: {info.default})".strip()
        if info.annotation is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=help_)
            continue
        parser.add_argument(flag, dest=name, required=name in must, default=argparse.SUPPRESS,
                            metavar=_metavar(name, info), help=help_)


def build(model: type[M], args: argparse.Namespace, names: Iterable[str], renamed: Mapping[str, str] | None = None,
          **values: Any) -> M:
    """`model` from the flags in `names` that were given, and `values`; ValueError naming the
    flags whose words the model refused."""
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    try:
        return model(**given, **values)
    except ValidationError as e:
        raise ValueError("; ".join(_explain(err, model, renamed) for err in e.errors())) from None


def _metavar(name: str, info: FieldInfo) -> str:
    if name.endswith("_s"):
        return "SECONDS"
    return "N" if info.annotation in (int, int | None) else name.upper()


def _explain(err: Any, model: type[BaseModel], renamed: Mapping[str, str] | None) -> str:
    """One refusal, worded for the command line."""
    field = str(err["loc"][0]) if err["loc"] else ""
    if field not in model.model_fields:  # a check of the whole model: its message says it all
        return str(err.get("ctx", {}).get("error", err["msg"]))
    seconds = " seconds" if field.endswith("_s") else ""
    ctx, kind = err.get("ctx", {}), err["type"]
    if kind == "greater_than_equal":
        said = f"must be at least {_number(ctx['ge'])}{seconds}"
    elif kind == "less_than_equal":
        said = f"must be at most {_number(ctx['le'])}{seconds}"
    elif kind == "greater_than" and ctx.get("gt") == 0:
        said = "must be a positive, finite number" + (" of seconds" if seconds else "")
    elif kind == "finite_number":
        said = "must be a finite number" + (" of seconds" if seconds else "")
    elif kind == "value_error":  # the field's own check: its message names what is wrong
        said = str(ctx.get("error", err["msg"]))
        if not said.startswith("must "):
            return said
    elif kind in ("int_parsing", "int_parsing_size", "int_from_float"):
        said = "is not an integer"
    elif kind == "float_parsing":
        said = "is not a number" + (" of seconds" if seconds else "")
    else:
        said = err["msg"][0].lower() + err["msg"][1:]
    shown = str(err.get("input"))
    return f"{flag_of(field, renamed)} {said}, got {shown[:40]!r}"


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"
