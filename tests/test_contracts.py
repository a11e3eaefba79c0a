"""docs/CONTRACTS.md names exactly the members of the EngineClient Protocol and the frames of the engine-core seam,
so the page cannot drift from the code: a check of names. What each member does, as the page says it, is checked by
behaviour against real engine cores in tests/engine/serving/test_client_contract.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from pagegate.engine.serving.engine_client import EngineClient
from pagegate.engine.serving.frames import Frame, ToCore, ToGateway

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


def test_the_engine_section_names_exactly_the_frames_of_each_direction() -> None:
    line = next(line for line in engine_section().split("\n- ") if line.startswith("The frames"))
    to_core, to_gateway = line.split("to the core")[1].split("to the gateway")
    assert re.findall(r"`(\w+)`", to_core) == [kind.__name__ for kind in get_args(ToCore)]
    named = [name for name in re.findall(r"`(\w+)`", to_gateway) if name != "RequestDelta"]  # what Outputs holds
    assert named == [kind.__name__ for kind in get_args(ToGateway)]
    assert {kind.__name__ for kind in Frame.__subclasses__()} == set(named) | set(re.findall(r"`(\w+)`", to_core))
