"""Ids that arrive from the outside (request ids, instance ids, session ids) are checked
here before they become log fields, metric labels or metadata: length and charset."""

from __future__ import annotations

import re

from pdserve.errors import InvalidRequestError

ID_CHARS = "[A-Za-z0-9_.:-]"
MAX_ID_CHARS = 128
ID_RE = re.compile(f"{ID_CHARS}{{1,{MAX_ID_CHARS}}}")
ID_RULE = f"1-{MAX_ID_CHARS} characters of A-Z a-z 0-9 _ . : -"


def is_valid_id(value: str) -> bool:
    return bool(ID_RE.fullmatch(value))


def check_id(field: str, value: str, *, required: bool = True) -> str:
    """`value` if it is a valid id (or empty and not required); InvalidRequestError naming
    `field` otherwise. The bad value is not echoed (it may be huge or binary)."""
    if not value and not required:
        return value
    if not is_valid_id(value):
        raise InvalidRequestError(field, f"must be {ID_RULE} (got {len(value)} characters)")
    return value
