"""Checkpoint loading never unpickles arbitrary objects: a one-rank (gloo) save/load round trip through the
restricted reader and planner, and a planted ``.metadata`` that would run code is refused."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from fixtures.plans import make_plan
from planner.core import StratagemError
from planner.model import parse_model
from runtime.executor.checkpoint import load_checkpoint, save_checkpoint


@pytest.fixture()
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_round_trip_through_the_restricted_loader(one_rank, tmp_path):
    model, opt = _model_and_optimizer(0)
    path = save_checkpoint(tmp_path / "ck", 3, [model], [opt], meta={"model": "linear", "world_size": 1})
    other, other_opt = _model_and_optimizer(1)
    other_opt.param_groups[0]["lr"] = 5.0
    assert not torch.equal(other.weight, model.weight)
    assert load_checkpoint(path, [other], [other_opt]) == 3
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert other_opt.param_groups[0]["lr"] == 1e-3  # a non-tensor entry, loaded with weights_only=True
    state = other_opt.state[other.weight]["exp_avg"]
    assert torch.equal(state, opt.state[model.weight]["exp_avg"])


def test_metadata_that_would_run_code_is_refused(one_rank, tmp_path):
    model, opt = _model_and_optimizer(0)
    path = save_checkpoint(tmp_path / "ck", 1, [model], [opt], meta={"model": "linear", "world_size": 1})
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(StratagemError, match="posix.system|os.system"):
        load_checkpoint(path, [model], [opt])


def test_launcher_refuses_planted_metadata_before_starting(tmp_path):
    from runtime.executor.checkpoint import COMPLETE_MARKER, META_FILE, check_resumable

    folder = tmp_path / "step_000002"
    folder.mkdir()
    (folder / COMPLETE_MARKER).write_text("step 2\n")
    (folder / META_FILE).write_text('{"step": 2, "model": "gpt:tiny", "world_size": 2}\n')
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    plan = make_plan(parse_model("gpt:tiny"), dp=2)
    with pytest.raises(StratagemError, match="never holds"):
        check_resumable(tmp_path, plan)


@pytest.mark.parametrize("where", ["shards", "marker"])
def test_failed_checkpoint_write_leaves_the_previous_one_intact(one_rank, tmp_path, monkeypatch, where):
    """A full disk (ENOSPC, simulated) while saving step 4: step 2 stays complete and loadable, no partial
    folder is left, and the error is one line naming the intact checkpoint."""
    import errno

    import runtime.executor.checkpoint as ck
    from runtime.executor.checkpoint import find_latest_checkpoint

    model, opt = _model_and_optimizer(0)
    meta = {"model": "linear", "world_size": 1}
    good = save_checkpoint(tmp_path / "ck", 2, [model], [opt], meta=meta)
    saved_weight = model.weight.detach().clone()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "shards":
        real_save = ck.dcp.save

        def save_then_fail(state, checkpoint_id):
            real_save(state, checkpoint_id=checkpoint_id)  # shards written, then the disk fills
            disk_full()

        monkeypatch.setattr(ck.dcp, "save", save_then_fail)
    else:
        monkeypatch.setattr(ck, "atomic_write_text", disk_full)
    with pytest.raises(StratagemError, match="No space left on device.*step_000002 is intact"):
        save_checkpoint(tmp_path / "ck", 4, [model], [opt], meta=meta)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_000002"]
    assert find_latest_checkpoint(tmp_path / "ck") == good
    assert load_checkpoint(good, [model], [opt]) == 2
    assert torch.equal(model.weight, saved_weight)


def _sliced_model_and_optimizer(seed: int):
    """Linear -> Linear whose second layer is marked as etp slice 1 of 2, behind recompute's checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from runtime.executor.etp_keys import mark_etp_slice

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    mark_etp_slice(model[1], 1, 2)
    model[1] = checkpoint_wrapper(model[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_etp_slices_are_saved_under_keys_naming_the_slice(one_rank, tmp_path):
    """The marked layer's parameters and their AdamW state are stored as ``<fqn>.etp1_of_2`` (so etp peers never
    share a key), the unmarked layer's under its FQN; loading maps them back."""
    from runtime.executor.checkpoint import SafeFileSystemReader

    model, opt = _sliced_model_and_optimizer(0)
    path = save_checkpoint(tmp_path / "ck", 2, [model], [opt], meta={"model": "mlp", "world_size": 1})
    keys = set(SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert {"model.1.weight.etp1_of_2", "model.0.weight", "optim.state.1.bias.etp1_of_2.exp_avg"} <= keys, keys
    assert "optim.param_groups.1.weight.etp1_of_2.lr" in keys and "model.1.weight" not in keys, keys
    other, other_opt = _sliced_model_and_optimizer(1)
    assert load_checkpoint(path, [other], [other_opt]) == 2
    for mine, theirs in zip(model.parameters(), other.parameters()):
        assert torch.equal(mine, theirs)
        assert torch.equal(opt.state[mine]["exp_avg_sq"], other_opt.state[theirs]["exp_avg_sq"])


def test_a_checkpoint_of_another_expert_layout_is_refused():
    from runtime.executor.checkpoint import check_expert_layout, expert_meta

    check_expert_layout("ck", expert_meta(2, 2), experts=(2, 2))
    check_expert_layout("ck", {}, experts=(4, 1))  # written before meta.json held the layout: etp 1, any ep
    for written, wanted in (((1, 2), (2, 1)), ((2, 2), (2, 4)), ((2, 1), (1, 1))):
        with pytest.raises(StratagemError, match="written with experts") as err:
            check_expert_layout("ck", expert_meta(*written), experts=wanted)
        assert "\n" not in str(err.value)
    with pytest.raises(StratagemError, match="written with experts etp=1 but the plan has ep=1 etp=2"):
        check_expert_layout("ck", {}, experts=(1, 2))
    for bad in ({"experts": 2}, {"experts": {"ep": "2", "etp": 1}}):  # an edited meta.json: one line, no traceback
        with pytest.raises(StratagemError, match="malformed 'experts' entry"):
            check_expert_layout("ck", bad, experts=(2, 1))
