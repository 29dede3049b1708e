"""Your own ``nn.Module`` (``--model py:FILE.py:FUNCTION`` or ``module:pkg.mod:FUNCTION``).

The contract (README "Plan your own model"; a runnable example is ``examples/custom_model.py``):

- ``FUNCTION()`` takes no arguments and returns an ``nn.Module``. Stratagem calls it under
  ``torch.device("meta")``, so build the layers in ``__init__`` and do not touch parameter values there.
- Its top-level children, in registration order, are the pipeline-cuttable layers, and ``forward`` runs each of
  them once, in that order, on the previous one's output (one tensor in, one tensor out). A child that is an
  ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` contributes its entries as layers ``name.0``,
  ``name.1``, ... A returned ``nn.Sequential`` is itself such a container (layers ``blocks.i``).
- ``module.input_spec`` (a dict) declares the input and the loss: ``sample_shape`` (one sample, e.g. ``[64]``),
  ``dtype`` (``"float32"`` features or ``"int64"`` ids; ids need ``vocab``, their range) and ``num_classes``:
  the loss is the mean cross-entropy of the output's last dimension against class ids of the output's other
  dimensions (``(batch,)`` for a classifier, ``(batch, seq)`` for a language model).
- Optional ``module.tp_plan``: ``{block class name: {submodule path inside the layer: style}}`` with styles
  ``colwise`` / ``rowwise`` (Megatron's column- then row-parallel ``nn.Linear`` pair) for blocks, and
  ``vocab_embedding`` / ``colwise_sharded_output`` for an ``nn.Embedding`` / output ``nn.Linear``. Without it
  tensor parallelism is not searched and the plan says so.
- Optional ``module.tp_divides``: ``{name: count}`` of sizes every TP degree must divide (``{"heads": 32}``:
  a block that reshapes its projections into 32 heads); degrees that do not divide one are never profiled or
  planned. Without it the degrees are still bounded by a meta-device forward of each split layer's shard
  (:mod:`runtime.models.external`), which a degree the reshapes cannot take fails.

Anything else is a one-line :class:`StratagemError` naming the function and the rule it broke.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from planner.core import StratagemError
from planner.model import ModelSpec
from runtime.models.layered import LayeredModel

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
STYLES = ("colwise", "rowwise", "vocab_embedding", "colwise_sharded_output")
INPUT_DTYPES = {"float32": torch.float32, "int64": torch.long}


@dataclass(frozen=True, kw_only=True, slots=True)
class InputSpec:
    """One sample's shape and dtype, the id range of integer inputs, and the classes of the output."""

    sample_shape: tuple[int, ...]
    dtype: str
    vocab: int
    num_classes: int


def _load_function(spec: ModelSpec):
    kind, _, rest = (spec.source or "").partition(":")
    target, _, name = rest.rpartition(":")
    if kind == "py":
        path = Path(target)
        if not path.is_file():
            raise StratagemError(
                f"model file {path} does not exist here; copy it to that path or re-plan with "
                f"--model py:NEW_PATH:{name}"
            )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if (spec.config or {}).get("sha256") not in (None, digest):
            raise StratagemError(
                f"{path} changed since the plan was made (sha256 differs); re-plan with --model py:{path}:{name}"
            )
        mod_name = "stratagem_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:8]
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        try:
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:  # the user's file: any error is theirs to fix
            raise StratagemError(f"importing {path} failed: {type(exc).__name__}: {exc}; fix the file") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise StratagemError(
                f"cannot import module {target!r} ({type(exc).__name__}: {exc}); check the name "
                f"and that it is on PYTHONPATH"
            ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise StratagemError(
            f"{spec.source}: {target} defines no function {name!r}; name a function that returns an nn.Module"
        )
    return fn


def call_user_function(spec: ModelSpec) -> nn.Module:
    """Call FUNCTION() on the meta device and check it returned an ``nn.Module``."""
    fn = _load_function(spec)
    try:
        with torch.device("meta"):
            module = fn()
    except Exception as exc:
        raise StratagemError(
            f"{spec.source} raised {type(exc).__name__}: {exc}; the function must build the model with no arguments"
        ) from None
    if not isinstance(module, nn.Module):
        raise StratagemError(f"{spec.source} returned {type(module).__name__}, not an nn.Module; return the model")
    return module


def read_input_spec(module: nn.Module, source: str) -> InputSpec:
    raw = getattr(module, "input_spec", None)
    if not isinstance(raw, dict):
        raise StratagemError(
            f"{source}: the model has no input_spec dict; set e.g. model.input_spec = "
            f"{{'sample_shape': [64], 'dtype': 'float32', 'num_classes': 10}}"
        )
    shape, dtype = raw.get("sample_shape"), raw.get("dtype", "float32")
    classes, vocab = raw.get("num_classes"), raw.get("vocab", 0)
    ok_shape = isinstance(shape, (list, tuple)) and all(isinstance(d, int) and d > 0 for d in shape)
    if not ok_shape or dtype not in INPUT_DTYPES or not isinstance(classes, int) or classes < 1:
        raise StratagemError(
            f"{source}: input_spec {raw} needs sample_shape (positive ints), dtype "
            f"({' or '.join(INPUT_DTYPES)}) and num_classes (a positive int)"
        )
    if dtype == "int64" and not (isinstance(vocab, int) and vocab > 0):
        raise StratagemError(f"{source}: input_spec with int64 inputs needs vocab (the id range), e.g. 'vocab': 256")
    return InputSpec(
        sample_shape=tuple(cast("list[int] | tuple[int, ...]", shape)),
        dtype=dtype,
        vocab=int(vocab),
        num_classes=classes,
    )


def _layers(module: nn.Module, source: str) -> dict[str, nn.Module]:
    """Top-level layers: children, containers turned into ModuleDicts keyed "0", "1", ..."""
    if isinstance(module, CONTAINERS):
        module = nn.ModuleDict({"blocks": module})
    layers: dict[str, nn.Module] = {}
    for name, child in module.named_children():
        if isinstance(child, CONTAINERS):
            items = child.items() if isinstance(child, nn.ModuleDict) else enumerate(child)
            layers[name] = nn.ModuleDict({str(k): v for k, v in items})
        else:
            layers[name] = child
    if not layers:
        raise StratagemError(
            f"{source} returned a model with no child modules; its children are the layers a pipeline stage holds"
        )
    return layers


def _check_order(user: nn.Module, layered: LayeredModel, x: torch.Tensor, source: str) -> None:
    """The user's forward must call every layer once, in registration order (checked on meta)."""
    paths = layered.layer_paths()
    calls: list[str] = []
    handles = [layered.get_submodule(p).register_forward_pre_hook(lambda _m, _a, p=p: calls.append(p)) for p in paths]
    try:
        with torch.no_grad():
            user(x)
    except Exception as exc:
        raise StratagemError(
            f"{source}: the model's forward failed on its input_spec input "
            f"({type(exc).__name__}: {exc}); make input_spec match the model"
        ) from None
    finally:
        for h in handles:
            h.remove()
    if calls != paths:
        shown = lambda names: ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")  # noqa: E731
        raise StratagemError(
            f"{source}: forward calls its layers as [{shown(calls)}] but the children are "
            f"[{shown(paths)}]; each child must run once, in registration order"
        )


@functools.lru_cache(maxsize=8)
def _template(spec_json: str) -> tuple[LayeredModel, InputSpec, dict]:
    spec = ModelSpec.model_validate_json(spec_json)
    source = spec.source or "custom model"
    user = call_user_function(spec)
    inputs = read_input_spec(user, source)
    tp_plan = getattr(user, "tp_plan", None) or {}
    if not isinstance(tp_plan, dict) or not all(isinstance(v, dict) for v in tp_plan.values()):
        raise StratagemError(
            f"{source}: tp_plan must be {{block class name: {{submodule path: style}}}}, "
            f"e.g. {{'Block': {{'fc1': 'colwise', 'fc2': 'rowwise'}}}}"
        )
    divides = getattr(user, "tp_divides", None) or {}
    if not isinstance(divides, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0 for k, v in divides.items()
    ):
        raise StratagemError(
            f"{source}: tp_divides must be {{name: positive int}} of sizes the TP degree must divide, "
            f"e.g. {{'heads': 32}}"
        )
    layered = LayeredModel(_layers(user, source))
    object.__setattr__(layered, "tp_divides", dict(divides))
    x = torch.zeros((1, *inputs.sample_shape), dtype=INPUT_DTYPES[inputs.dtype], device="meta")
    _check_order(user, layered, x, source)
    return layered, inputs, tp_plan


def custom_template(spec: ModelSpec) -> tuple[LayeredModel, InputSpec, dict]:
    """(the meta-device LayeredModel, its InputSpec, its tp_plan) — built once per spec."""
    return _template(json.dumps(spec.model_dump(mode="json"), sort_keys=True))
