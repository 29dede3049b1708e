"""Check Megatron-LM launch arguments with Megatron-LM's own parser: ``parse_args`` + ``validate_args``.

    python tools/check_megatron_export.py MEGATRON_LM_DIR ARGS_FILE [ARGS_FILE ...]

``MEGATRON_LM_DIR``: a checkout of Megatron-LM (the folder holding ``megatron/``; not on the package index, so
not part of CI). ``ARGS_FILE``: the arguments ``stratagem export --framework megatron`` writes (one launch line,
shell-quoted; a line of the form ``torchrun ... pretrain_gpt.py ARGS`` or ``ARGS`` alone). Each file prints
``PASS`` or ``FAIL: <Megatron's message>``; exit status 1 when any fails.

This machine has no GPU and no Megatron GPU packages, so the check runs the parser as a CPU process would see it
on a Hopper node: modules Megatron imports only for kernels (``triton``, ``transformer_engine``, ``apex``, ...)
are stand-ins that accept any attribute, ``torch.cuda`` answers as an 8-GPU H100 node (capability 9.0), and
``RANK``/``WORLD_SIZE`` describe rank 0 of the export's world (``WORLD_SIZE_GPUS``); the data flags an export
leaves to the user are ``--mock-data --tokenizer-type NullTokenizer``; the file's ``export NAME=VALUE`` lines set
the environment. Nothing else of Megatron's is changed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import types
import typing
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_stubs import install_stubs


def exported_env(text: str) -> dict[str, str]:
    """``export NAME=VALUE`` lines of an export (the environment its launch needs)."""
    env = {}
    for line in text.splitlines():
        if not line.startswith("export "):
            continue
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            env[name] = value
    return env


def megatron_args(text: str) -> tuple[list[str], int | None]:
    """(arguments, world size) of an export: its ``MEGATRON_ARGS="..."`` block and ``WORLD_SIZE_GPUS=N`` line,
    or a launch line's words after its ``.py`` entry point (world size unknown)."""
    world = None
    for line in text.splitlines():
        if line.startswith("WORLD_SIZE_GPUS="):
            world = int(line.split("=", 1)[1])
    if 'MEGATRON_ARGS="' in text:
        block = text.split('MEGATRON_ARGS="', 1)[1].split('"', 1)[0]
        return shlex.split(block), world
    words = shlex.split(text, comments=True)
    for i, word in enumerate(words):
        if word.endswith(".py"):
            return words[i + 1 :], world
    return words, world


def check(args: list[str], world: int) -> str | None:
    """None when Megatron's parse_args + validate_args accept ``args`` on ``world`` ranks, else its message."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world))
    sys.argv = ["pretrain_gpt.py", *args]
    import torch

    hopper = {
        "get_device_capability": (9, 0),
        "get_device_name": "NVIDIA H100 80GB HBM3",
        "is_available": True,
        "device_count": 8,
        "current_device": 0,
        "get_device_properties": types.SimpleNamespace(
            major=9, minor=0, name="NVIDIA H100 80GB HBM3", total_memory=85_520_809_984, multi_processor_count=132
        ),
    }
    with contextlib.ExitStack() as stack:
        for name, value in hopper.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, return_value=value))
        from megatron.training.arguments import parse_args, validate_args

        try:
            parsed = parse_args()
            validate_args(parsed)
        except (AssertionError, ValueError, RuntimeError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        except SystemExit as exc:
            return f"argparse exit {exc.code}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    megatron_dir = Path(argv[0])
    if not (megatron_dir / "megatron" / "training" / "arguments.py").is_file():
        print(
            f"error: {megatron_dir} holds no megatron/training/arguments.py; give a Megatron-LM checkout",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(megatron_dir))
    install_stubs()
    if not hasattr(typing, "override"):  # Python < 3.12: Megatron imports typing.override (a no-op decorator)
        typing.override = lambda f: f
    failed = 0
    for name in argv[1:]:
        text = Path(name).read_text(encoding="utf-8")
        args, world = megatron_args(text)
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        os.environ.update(exported_env(text))
        args += ["--mock-data", "--tokenizer-type", "NullTokenizer"]  # the data flags an export leaves to the user
        problem = check(args, world or 8)
        failed += problem is not None
        print(f"{name}: {'PASS' if problem is None else 'FAIL: ' + problem}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
