"""Declaring a config field once: its command-line spelling (``cli``) beside its default, bounds and description,
and a field that passes another config's setting on (``like``) instead of restating it; :class:`Settings`, the base
of every config a stage takes (its nested settings too), which refuses a number that is not finite."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict

SEED_MAX = 2**32 - 1  # the largest seed every generator takes (NumPy's, scikit-learn's folds)


class Settings(BaseModel):
    """The base of every stage config and of the settings nested in one (backbone, readout, BM25, training): a number
    that is not finite (NaN, +-inf, as a float or as the text ``nan`` / ``inf``) is refused, in a list too, before
    anything is written. Each numeric field declares its range on itself (``ge``, ``gt``, ``le``, ``lt``).

    >>> class S(Settings):
    ...     w: list[float] = [1.0]
    >>> S(w=[0.5, 1]).w
    [0.5, 1.0]
    >>> try:
    ...     S(w=[float("nan")])
    ... except ValueError as e:
    ...     print(e.errors()[0]["msg"])
    Input should be a finite number
    """

    model_config = ConfigDict(allow_inf_nan=False)


def cli(**declared: Any) -> dict[str, Any]:
    """A field's command-line declarations (``json_schema_extra=cli(flag="--split", short="-d")``; see
    flows/commands.py): the command is generated from the config.

    >>> cli(short="-d")
    {'cli': {'short': '-d'}}
    """
    return {"cli": declared}


def like(model: type[BaseModel], name: str, **overrides: Any) -> Any:
    """A field declared as ``model``'s field ``name`` (its default, bounds, description and command-line
    declarations), with ``overrides``: a config that passes a setting on to a stage declares it once, there.

    >>> from pydantic import Field
    >>> class A(BaseModel):
    ...     n: int = Field(default=3, ge=1, description="How many.")
    >>> class B(BaseModel):
    ...     n: int = like(A, "n", default=5)
    >>> B.model_fields["n"].description, B().n
    ('How many.', 5)
    """
    info = copy.deepcopy(model.model_fields[name])
    origin = origin_of(info) or f"{model.__qualname__}.{name}"
    for key, value in overrides.items():
        if key == "default":
            info.default, info.default_factory = value, None
        else:  # json_schema_extra (the command-line declarations) included: replaced, not merged
            setattr(info, key, value)
    extra = dict(info.json_schema_extra) if isinstance(info.json_schema_extra, dict) else {}
    info.json_schema_extra = {**extra, "like": origin}
    return info


def origin_of(info: Any) -> str | None:
    """The field a ``like`` field passes on, as ``"Config.field"`` (the first declaration, through chains of
    ``like``); None for a field declared where it is.

    >>> from pydantic import Field
    >>> class A(BaseModel):
    ...     n: int = Field(default=3)
    >>> class B(BaseModel):
    ...     m: int = like(A, "n")
    >>> origin_of(B.model_fields["m"]), origin_of(A.model_fields["n"])
    ('A.n', None)
    """
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return extra.get("like")
