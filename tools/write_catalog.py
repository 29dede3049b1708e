"""Write the shipped cluster profiles (``planner.profile.hardware_catalog``) to ``profiles/hardware``.

python -m tools.write_catalog [--out profiles/hardware]
"""

from __future__ import annotations

import argparse
import datetime as _dt
from pathlib import Path

from planner.profile.hardware_catalog import write_catalog


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the shipped cluster profiles.")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "profiles" / "hardware"))
    args = parser.parse_args(argv)
    created_utc = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    for path in write_catalog(args.out, created_utc):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
