"""Cut a pipeline stage out of a full model by module paths.

The zoo's models keep their blocks in an ``nn.ModuleDict`` named ``blocks`` (keys ``"0".."N-1"``) and
their other top-level modules as attributes; ``forward`` skips absent modules and accepts the previous
stage's activation when its first module is absent. Cutting a stage is therefore deleting every
top-level module the stage does not hold. Parameter names (FQNs) are unchanged, so a stage's state dict
keys are a subset of the full model's: checkpoints and the per-path seeded init line up across plans.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from planner.core import StratagemError


def cut_stage(model: nn.Module, keep_paths: Sequence[str], all_paths: Iterable[str]) -> nn.Module:
    """Delete, in place, every top-level module in ``all_paths`` that is not in ``keep_paths``.

    ``all_paths`` is the model's ordered list of top-level module paths (``layer_paths(spec)``), e.g.
    ``["embed", "blocks.0", "blocks.1", "norm", "head"]``. Returns ``model`` for chaining.
    """
    all_paths = list(all_paths)
    unknown = [p for p in keep_paths if p not in all_paths]
    if unknown:
        raise StratagemError(
            f"plan places modules {unknown} that model has no such top-level module (it has "
            f"{all_paths[0]}..{all_paths[-1]}); the plan was made for another model, re-plan"
        )
    keep = set(keep_paths)
    for path in all_paths:
        if path not in keep:
            _delete(model, path)
    return model


def _delete(model: nn.Module, path: str) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if isinstance(parent, nn.ModuleDict):
        del parent[name]
    else:
        setattr(parent, name, None)


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` where the module at ``path`` was (used to wrap a module for recompute)."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if isinstance(parent, nn.ModuleDict):
        parent[name] = new
    else:
        setattr(parent, name, new)


def present_paths(model: nn.Module, paths: Iterable[str]) -> list[str]:
    """The paths from ``paths`` that still name a module in ``model`` (what a cut stage holds)."""
    out = []
    for path in paths:
        try:
            sub = model.get_submodule(path)
        except AttributeError:
            continue
        if sub is not None:
            out.append(path)
    return out
