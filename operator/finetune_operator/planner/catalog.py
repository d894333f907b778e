"""The model catalog: real Hugging Face architectures by hub id or short name.

The numbers live in `data/catalog.json`, copied from the team's measured configs with the
source of every record kept next to it, so a reviewer can re-check any entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from finetune_operator.api.spec import ModelArchitecture


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    architecture: ModelArchitecture
    parameters: int
    active_parameters: int | None
    source: str


def _normalise(name: str) -> str:
    return name.strip().lower()


@cache
def load_catalog() -> dict[str, CatalogEntry]:
    """All entries keyed by every accepted spelling (hub id and the name after the slash)."""
    raw: dict[str, Any] = json.loads(
        resources.files("finetune_operator.planner").joinpath("data/catalog.json").read_text()
    )
    index: dict[str, CatalogEntry] = {}
    for rec in raw["models"]:
        entry = CatalogEntry(
            name=rec["name"],
            architecture=ModelArchitecture.model_validate(rec["architecture"]),
            parameters=int(rec["parameters"]),
            active_parameters=rec.get("activeParameters"),
            source=rec["source"],
        )
        index[_normalise(entry.name)] = entry
        # Short names ("Llama-3.1-8B") are unique across the catalog's organisations.
        index.setdefault(_normalise(entry.name.rsplit("/", 1)[-1]), entry)
    return index


def catalog_entries() -> list[CatalogEntry]:
    """Each model once, in catalog order."""
    seen: dict[str, CatalogEntry] = {}
    for entry in load_catalog().values():
        seen.setdefault(entry.name, entry)
    return list(seen.values())


def lookup(name: str) -> CatalogEntry | None:
    return load_catalog().get(_normalise(name))
