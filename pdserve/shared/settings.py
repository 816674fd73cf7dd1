"""One settings base for every service, and the ``pdserve`` command's flags generated from it.

A service's settings are written once, as fields of a ``ServiceSettings`` subclass: a type, a default and a
``description`` (the flag's help). ``settings_options(cls)`` turns every field into the click option of the same
name (``max_num_seqs`` -> ``--max-num-seqs``, a bool -> ``--x/--no-x``, a ``Literal`` -> a choice, ``ge``/``gt``/
``le`` bounds -> a range), whose help ends with the environment variable and the default. Options default to
``None``, so that ``given(flags)`` passes only what the user typed and ``PDSERVE_*`` variables fill in the rest
(pydantic-settings reads them). pydantic validates what click cannot.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable

import annotated_types
import click
from pydantic import AliasChoices, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "PDSERVE_"


class ServiceSettings(BaseSettings):
    """The base of every service's settings: ``--max-body-bytes`` <-> ``PDSERVE_MAX_BODY_BYTES`` and so on."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, populate_by_name=True, extra="ignore")


def env_names(name: str, field: FieldInfo) -> list[str]:
    """The environment variables a field is read from (its alias choices in capitals, else ``PDSERVE_NAME``)."""
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [c for c in alias.choices if isinstance(c, str) and c.isupper()]
    return [alias] if isinstance(alias, str) else [ENV_PREFIX + name.upper()]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(annotation) -> object:
    """``int | None`` -> ``int``; ``SecretStr`` -> ``str``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    return str if annotation is SecretStr else annotation


def _click_type(annotation, field: FieldInfo) -> click.ParamType | type:
    kind = _value_type(annotation)
    if typing.get_origin(kind) is typing.Literal:
        return click.Choice([str(v) for v in typing.get_args(kind)])
    if kind not in (int, float):
        return kind if kind in (str, bool) else str
    bounds: dict = {}
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            bounds["min"] = m.ge
        elif isinstance(m, annotated_types.Gt):
            bounds.update(min=m.gt, min_open=True)
        elif isinstance(m, annotated_types.Le):
            bounds["max"] = m.le
    if not bounds:
        return kind
    if kind is int and bounds.pop("min_open", False):  # an integer > n is one >= n + 1
        bounds["min"] += 1
    return (click.IntRange if kind is int else click.FloatRange)(**bounds)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def field_help(name: str, field: FieldInfo) -> str:
    """The description, then ``[PDSERVE_NAME, default D]`` (no default shown for ``None`` or a computed one)."""
    where = " or ".join(env_names(name, field))
    default = field.default
    if default is not None and default is not PydanticUndefined and field.default_factory is None:
        where += f", default {_shown(default)}"
    return f"{field.description or ''} [{where}]".strip()


def cli_option(settings_cls: type[BaseSettings], name: str, **overrides) -> Callable:
    """The click option for one field of ``settings_cls`` (``overrides``: click keywords to replace, e.g.
    ``callback``)."""
    field = settings_cls.model_fields[name]
    kind = _click_type(field.annotation, field)
    decls = [f"{flag_name(name)}/--no-{name.replace('_', '-')}" if kind is bool else flag_name(name), name]
    kwargs = {"default": None, "help": field_help(name, field)}
    if kind is not bool:
        kwargs["type"] = kind
    kwargs.update(overrides)
    return click.option(*decls, **kwargs)


def settings_options(settings_cls: type[BaseSettings], exclude: Iterable[str] = ()) -> Callable:
    """A decorator adding one click option per field of ``settings_cls`` (but ``exclude``), in field order."""
    names = [n for n in settings_cls.model_fields if n not in set(exclude)]

    def decorate(fn: Callable) -> Callable:
        for name in reversed(names):
            fn = cli_option(settings_cls, name)(fn)
        return fn

    return decorate


def given(flags: dict) -> dict:
    """Only the flags the user set, so ``PDSERVE_*`` variables fill in the rest."""
    return {k: v for k, v in flags.items() if v is not None}


def load_settings(settings_cls: type[BaseSettings], **flags):
    """``settings_cls(**flags)`` (``PDSERVE_*`` fill in the rest); raises ``click.ClickException`` with one line per
    bad field: a validator's own sentence, else ``field: message``."""
    from pydantic import ValidationError

    try:
        return settings_cls(**flags)
    except ValidationError as e:
        lines = [str(err["ctx"]["error"]) if err["type"] == "value_error" and "ctx" in err
                 else f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise click.ClickException("; ".join(lines)) from None
