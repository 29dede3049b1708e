"""Write planner/export/data/megatron_flags.txt: every command-line flag a Megatron-LM checkout accepts.

    python tools/megatron_flags.py /path/to/Megatron-LM > planner/export/data/megatron_flags.txt

Megatron-LM's parser (megatron/training/arguments.py) adds flags two ways: ``add_argument('--x', ...)``
and ``ArgumentGroupFactory(SomeConfig)``, which turns each dataclass field ``foo_bar`` into ``--foo-bar``
(and ``--no-foo-bar`` / ``--disable-foo-bar`` for booleans that default to True;
megatron/training/argument_utils.py ``_format_arg_name``). This reads both from the source text; it does
not import Megatron. The importer (planner/export/megatron.py) rejects a flag outside this list.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CONFIG_FILES = [
    "megatron/training/arguments.py",
    "megatron/training/config/*.py",
    "megatron/core/model_parallel_config.py",
    "megatron/core/transformer/transformer_config.py",
    "megatron/core/distributed/distributed_data_parallel_config.py",
    "megatron/core/optimizer/optimizer_config.py",
]


def flags_of(root: Path) -> set[str]:
    flags: set[str] = set()
    for pattern in CONFIG_FILES:
        for path in sorted(root.glob(pattern)):
            text = path.read_text(encoding="utf-8")
            flags.update(re.findall(r"""['"](--[a-z0-9][a-z0-9-]*)['"]""", text))
            for name, annotation in re.findall(r"^    ([a-z][a-z0-9_]*): ([^=\n]+)", text, flags=re.M):
                flag = "--" + name.replace("_", "-")
                flags.add(flag)
                if annotation.strip().startswith("bool"):
                    flags.update({"--no-" + flag[2:], "--disable-" + flag[2:]})
    return flags


def main() -> int:
    root = Path(sys.argv[1])
    print(f"# Megatron-LM flags from {root.name} (tools/megatron_flags.py); one per line")
    for flag in sorted(flags_of(root)):
        print(flag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
