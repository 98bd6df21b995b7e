"""Variant: one point of a family's search space, frozen, with a canonical JSON form.

The canonical JSON (sorted keys, no spaces) is what the tuning database stores and what
rendering hashes, so two equal Variants always name the same kernel.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, TypeVar

V = TypeVar("V", bound="Variant")


@dataclasses.dataclass(frozen=True)
class Variant:
    """Base of every family's Variant dataclass; subclasses add the knobs their template varies."""

    family: ClassVar[str] = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The canonical JSON form: sorted keys, no whitespace."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls: type[V], text: str | dict[str, Any]) -> V:
        """Rebuild a Variant from its JSON (or dict), rejecting unknown or missing knobs."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown knobs {unknown}; expected a subset of {sorted(names)}")
        return cls(**data)

    def replace(self: V, **changes: Any) -> V:
        return dataclasses.replace(self, **changes)
