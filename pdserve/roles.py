"""The names of roles, each tuple declared once.

A worker's role (prefill or decode) decides which services it serves and which requests the router
sends it; a chat message's role (system, user or assistant) is the chat template's.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
CHAT_ROLES = ("system", "user", "assistant")
