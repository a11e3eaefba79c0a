"""docs/CONTRACTS.md names exactly the members of the EngineClient Protocol, so the page cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

from pagegate.engine.serving.engine_client import EngineClient

CONTRACTS = Path(__file__).resolve().parents[1] / "docs" / "CONTRACTS.md"


def protocol_members() -> set[str]:
    names = {name for name in vars(EngineClient) if not name.startswith("_")}
    return names | set(EngineClient.__annotations__)


def engine_section() -> str:
    text = CONTRACTS.read_text()
    return text[text.index("## engine (pagegate.engine)"):text.index("## gateway (pagegate.gateway)")]


def test_the_engine_section_names_every_member_of_the_protocol() -> None:
    named = set(re.findall(r"`(?:async )?(\w+)", engine_section()))
    assert sorted(protocol_members() - named) == []


def test_the_engine_section_names_no_member_the_protocol_lacks() -> None:
    members = set(re.findall(r"`(?:async )?(\w+)\(", engine_section()))  # the calls it lists
    assert sorted(members - protocol_members()) == []
