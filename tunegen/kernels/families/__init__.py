"""Kernel families: each has one template, one Variant space, one launcher and one reference."""

from tunegen.kernels.families import backward, decode, prefill
from tunegen.kernels.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (prefill.FAMILY, decode.FAMILY, backward.FAMILY)}


def get(name: str) -> Family:
    """The family called `name`."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {name!r}") from None


__all__ = ["FAMILIES", "Family", "get"]
