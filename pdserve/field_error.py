"""FieldError: a configuration value out of range, with the field it belongs to kept apart.

A frozen config dataclass raises it from __post_init__ under its own field name
("kv_dtype must be one of float32, float16, bfloat16, got 'int8'"); a front end that composed the
dataclass from a file or flags names the field as its user wrote it instead
(deploy/config.py: "cache.kv_dtype (--kv-dtype) must be one of ..."). It is a ValueError, so every
caller that catches those keeps working.
"""

from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    def __init__(self, field: str, requirement: str, value: Any) -> None:
        self.field, self.requirement, self.value = field, requirement, value
        super().__init__(self.named(field))

    def named(self, name: str) -> str:
        """The message with the field called `name`."""
        return f"{name} {self.requirement}, got {self.value!r}"
