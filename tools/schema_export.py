"""Write the JSON Schemas of the project's files from their pydantic models.

``python -m tools.schema_export`` regenerates ``profiles/schema/{model-profile,cluster-profile,plan}.schema.json``
(pydantic ``model_json_schema()``); ``python -m tools.schema_export --check`` exits 1 if any is stale.
Editors and other tools can validate profile and plan files against them; Stratagem itself validates with
the pydantic models (``load_model_profile``, ``load_cluster_profile``, ``load_plan``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pydantic import BaseModel

from planner.core import atomic_write_text
from planner.plan import Plan
from planner.profile import ClusterProfile, ModelProfile

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "profiles" / "schema"
SCHEMAS: dict[str, type[BaseModel]] = {
    "model-profile.schema.json": ModelProfile,
    "cluster-profile.schema.json": ClusterProfile,
    "plan.schema.json": Plan,
}
log = logging.getLogger(__name__)


def render_schema(model: type[BaseModel]) -> str:
    """The JSON Schema text of ``model`` (draft 2020-12, as pydantic emits it), with a trailing newline."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **model.model_json_schema()}
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def stale_schemas(schema_dir: Path = SCHEMA_DIR) -> list[Path]:
    """Schema files that are missing or differ from what the models generate now."""
    stale = []
    for name, model in SCHEMAS.items():
        path = schema_dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != render_schema(model):
            stale.append(path)
    return stale


def export_schemas(schema_dir: Path = SCHEMA_DIR) -> list[Path]:
    """Write every schema file (atomically) and return their paths."""
    written = []
    for name, model in SCHEMAS.items():
        written.append(atomic_write_text(schema_dir / name, render_schema(model)))
        log.info("wrote %s", written[-1])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a schema file is stale; write nothing")
    parser.add_argument("--dir", type=Path, default=SCHEMA_DIR, help="schema folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        stale = stale_schemas(args.dir)
        for path in stale:
            log.error("stale: %s; run python -m tools.schema_export", path)
        return 1 if stale else 0
    export_schemas(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
