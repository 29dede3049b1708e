"""Runtime pieces that need no process group: mesh coordinates, batch shares, stage cutting, recompute,
TP plans, checkpoint selection, and the launcher's pre-start checks (nothing may start on bad input)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from fixtures.plans import make_plan, split_layers
from planner.cli.main import main as cli_main
from planner.core import ParallelDims, StratagemError
from planner.model import parse_model
from planner.plan import LayerLayout, save_plan
from runtime.executor.checkpoint import COMPLETE_MARKER, find_latest_checkpoint
from runtime.executor.data import (
    BatchSplit,
    loss_scale,
    micro_batches_per_replica,
    replica_rows,
    rows_per_replica,
    split_batch,
    synthetic_batch,
)
from runtime.executor.describe import describe_ranks
from runtime.executor.recompute import apply_ac
from runtime.executor.stage import cut_stage
from runtime.executor.tp_plan import tp_styles
from runtime.launch import LaunchOptions, build_command, build_slurm_script, command_env
from runtime.models import build_model, init_weights, layer_paths, loss_fn

GPT = parse_model("gpt:tiny")


def _model(spec=GPT):
    m = build_model(spec, device="meta")
    m.to_empty(device="cpu")
    return init_weights(m, seed=0)


def test_rank_coordinates_are_row_major_pp_dp_tp():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert dims.coords(5) == {"pp": 1, "dp": 0, "tp": 1}  # 5 = 1*4 + 0*2 + 1
    assert dims.coords(6) == {"pp": 1, "dp": 1, "tp": 0}
    assert [dims.rank_of(**dims.coords(r)) for r in range(8)] == list(range(8))


def test_uneven_batch_shares_give_whole_rows_and_full_batch_weights():
    rows = rows_per_replica(8, [0.75, 0.25], 2)
    assert rows == [6, 2] and rows_per_replica(8, None, 2) == [4, 4]
    assert replica_rows(rows, 1) == (6, 8)
    # dp-averaged scaled losses: (1.5 * L0 + 0.5 * L1) / 2 = 0.75 L0 + 0.25 L1, the full-batch mean
    assert (loss_scale(rows, 0), loss_scale(rows, 1)) == (1.5, 0.5)
    with pytest.raises(StratagemError, match="whole number"):
        rows_per_replica(8, [0.7, 0.3], 2)


def test_uneven_replicas_run_more_micro_batches_of_one_size():
    # cost model: m_j = share_j * B / micro_batch (planner/cost/validate.py replica_micro_batches)
    assert micro_batches_per_replica([6, 2], micro_batch_size=2, num_micro_batches=99) == [3, 1]
    assert micro_batches_per_replica([12, 4], micro_batch_size=1, num_micro_batches=1) == [12, 4]
    # no shares: every replica runs num_micro_batches, of rows / num_micro_batches samples
    assert micro_batches_per_replica([4, 4], micro_batch_size=None, num_micro_batches=2) == [2, 2]
    with pytest.raises(StratagemError, match="dp replica 1 gets 2 samples, not a multiple of the plan's 3-sample"):
        micro_batches_per_replica([6, 2], micro_batch_size=3, num_micro_batches=1)
    with pytest.raises(StratagemError, match="do not split into 4 micro-batches"):
        micro_batches_per_replica([6, 2], micro_batch_size=None, num_micro_batches=4)
    # make_plan: the gcd of the rows as micro-batch size, the busiest replica's count as num_micro_batches
    plan = make_plan(GPT, dp=2, batch_shares=[0.75, 0.25], num_micro_batches=5)
    assert (plan.schedule.micro_batch_size, plan.schedule.max_micro_batches) == (2, 3)
    assert split_batch(plan) == BatchSplit(rows=(6, 2), micro_batches=(3, 1))
    # without shares num_micro_batches decides, micro_batch_size is not consulted
    assert split_batch(make_plan(GPT, dp=2, num_micro_batches=2, micro_batch_size=3)).micro_batches == (2, 2)


def test_each_replica_schedule_is_checked_with_its_own_count():
    from runtime.executor.checks import check_replica_schedules

    ok = make_plan(GPT, pp=2, dp=2, schedule="1f1b", global_batch=16, batch_shares=[0.75, 0.25], micro_batch_size=2)
    assert check_replica_schedules(ok).micro_batches == (6, 2)
    # 12 and 4 rows in micro-batches of 4: replica 1 gets one micro-batch, too few for 2 1F1B stages
    few = make_plan(GPT, pp=2, dp=2, schedule="1f1b", global_batch=16, batch_shares=[0.75, 0.25])
    with pytest.raises(
        StratagemError,
        match=r"dp replica 1 trains 4 rows = 1 micro-batches of 4 samples: 1f1b "
        r"needs at least one micro-batch per stage \(2\)",
    ):
        check_replica_schedules(few)
    assert check_replica_schedules(
        few.model_copy(update={"schedule": few.schedule.model_copy(update={"kind": "gpipe"})})
    ).micro_batches == (3, 1)
    # interleaved, pp 2: 7 micro-batches run 3 rounds, which 7 does not divide
    inter = make_plan(
        GPT,
        pp=2,
        dp=2,
        schedule="interleaved_1f1b",
        virtual_stages=2,
        global_batch=8,
        batch_shares=[0.875, 0.125],
        micro_batch_size=1,
    )
    with pytest.raises(StratagemError, match="dp replica 0 trains 7 rows .* 3 rounds"):
        check_replica_schedules(inter)
    zero3 = make_plan(GPT, dp=2, zero_stage=3, batch_shares=[0.75, 0.25])
    with pytest.raises(StratagemError, match=r"ZeRO-3 .* \[3, 1\] micro-batches"):
        check_replica_schedules(zero3)
    assert check_replica_schedules(make_plan(GPT, dp=2, zero_stage=3, batch_shares=[0.5, 0.5])).micro_batches == (1, 1)


def test_impossible_share_fails_the_launch_before_starting(tmp_path, capsys, no_processes):
    bad = make_plan(GPT, dp=2, batch_shares=[0.75, 0.25], micro_batch_size=3)  # rows 6 and 2
    path = save_plan(bad, tmp_path / "bad.json")
    assert "dp replica 1 gets 2 samples, not a multiple of the plan's 3-sample micro-batch" in _launch_error(
        capsys, [str(path), "--dry-run"]
    )
    assert "dp replica 0 trains 4 rows = 1 micro-batches" in _launch_error(
        capsys,
        [
            str(
                save_plan(
                    make_plan(GPT, pp=2, dp=2, schedule="1f1b", batch_shares=[0.5, 0.5], micro_batch_size=4),
                    tmp_path / "few.json",
                )
            )
        ],
    )
    good = make_plan(GPT, dp=2, batch_shares=[0.75, 0.25])
    lines = describe_ranks(good)
    assert lines[0].endswith("batch rows 0..5 in 3 micro-batches of 2")
    assert lines[1].endswith("batch rows 6..7 in 1 micro-batch of 2")


def test_synthetic_batch_depends_on_step_only():
    a = synthetic_batch(GPT, batch=4, seq_len=8, seed=0, step=3)
    b = synthetic_batch(GPT, batch=4, seq_len=8, seed=0, step=3)
    c = synthetic_batch(GPT, batch=4, seq_len=8, seed=0, step=4)
    assert torch.equal(a.inputs, b.inputs) and not torch.equal(a.inputs, c.inputs)
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])  # next-token targets


def test_file_data_wraps_around_and_rejects_bad_files(tmp_path):
    from runtime.executor.data import FileData

    path = tmp_path / "data.pt"
    torch.save({"inputs": torch.arange(10).view(5, 2), "targets": torch.arange(5)}, path)
    batch = FileData(path).batch(batch=2, index=2)  # rows 4, 0 (5 rows, wrapping)
    assert batch.targets.tolist() == [4, 0] and batch.inputs.tolist() == [[8, 9], [0, 1]]
    torch.save({"x": torch.zeros(2)}, tmp_path / "bad.pt")
    with pytest.raises(StratagemError, match="'inputs' and 'targets'"):
        FileData(tmp_path / "bad.pt")


def test_split_layers_is_contiguous_and_complains_when_too_many_stages():
    assert split_layers(list("abcde"), 2) == [["a", "b", "c"], ["d", "e"]]
    with pytest.raises(StratagemError, match="reduce pp"):
        split_layers(list("ab"), 3)


def test_two_cut_stages_compose_to_the_full_model():
    x = synthetic_batch(GPT, batch=2, seq_len=8, seed=0, step=1).inputs
    paths = layer_paths(GPT)
    full = _model()
    first, second = cut_stage(_model(), paths[:2], paths), cut_stage(_model(), paths[2:], paths)
    assert first.layer_paths() == ["embed", "blocks.0"] and second.layer_paths() == ["blocks.1", "norm", "head"]
    assert torch.allclose(second(first(x)), full(x), rtol=0, atol=1e-6)
    assert set(dict(first.named_parameters())) | set(dict(second.named_parameters())) == set(
        dict(full.named_parameters())
    )


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_keeps_gradients(mode):
    batch = synthetic_batch(GPT, batch=2, seq_len=8, seed=0, step=1)
    ref, ac = _model(), _model()
    assert apply_ac(ac, {"blocks.0": mode, "blocks.1": "none"}) == ["blocks.0"]
    if mode == "full":  # the whole block re-runs
        assert type(ac.blocks["0"]).__name__ == "CheckpointWrapper"
        block = ac.blocks["0"]._checkpoint_wrapped_module
    else:  # only the attention core re-runs (Korthikanti et al. 2022 §5)
        block = ac.blocks["0"]
        assert block.attn.recompute_scores and not ac.blocks["1"].attn.recompute_scores
    for m in (ref, ac):
        loss_fn(GPT)(m(batch.inputs), batch.targets).backward()
    for name in ("mlp.fc1.weight", "attn.qkv.weight"):
        g_ref, g_ac = ref.blocks["0"].get_parameter(name).grad, block.get_parameter(name).grad
        assert torch.allclose(g_ref, g_ac, rtol=0, atol=1e-7), name


def test_tp_styles_follow_the_plan_layout():
    layout = {
        "blocks.0": LayerLayout(style="split"),
        "head": LayerLayout(style="split"),
        "blocks.1": LayerLayout(style="replicate"),
    }
    styles = tp_styles(GPT, layout, ["blocks.0", "blocks.1", "norm", "head"])
    # Whale replicas (blocks.1, norm) run a batch slice: R -> B is a local slice on blocks.1, norm stays on
    # the slice, and the split head all-gathers the batch inside its ColwiseParallel (B -> R).
    assert styles == {
        "blocks.0.attn.qkv": "colwise",
        "blocks.0.attn.proj": "rowwise",
        "blocks.0.mlp.fc1": "colwise",
        "blocks.0.mlp.fc2": "rowwise",
        "blocks.1": "batch_slice",
        "norm": "replica",
        "head": "colwise_sharded_output_from_batch",
    }


def test_sequence_parallel_styles_convert_at_layer_boundaries():
    # blocks.0 sequence-parallel between Whale replicas: the replicated embedding runs a batch slice (B),
    # blocks.0 turns it into a sequence shard (B -> S) and blocks.1 back into a batch slice (S -> B); inside
    # the block the norms run on the shard, the colwise Linears' parents all-gather and the rowwise Linears
    # reduce-scatter; the replicated head gathers the batch back for the loss.
    layout = {"blocks.0": LayerLayout(style="split", sequence_parallel=True)}
    styles = tp_styles(GPT, layout, layer_paths(GPT))
    assert styles == {
        "embed": "batch_slice",
        "blocks.0.ln1": "sequence_parallel",
        "blocks.0.attn": "gather_sequence",
        "blocks.0.attn.qkv": "colwise",
        "blocks.0.attn.proj": "rowwise_to_sequence",
        "blocks.0.ln2": "sequence_parallel",
        "blocks.0.mlp": "gather_sequence",
        "blocks.0.mlp.fc1": "colwise",
        "blocks.0.mlp.fc2": "rowwise_to_sequence",
        "blocks.0": "batch_to_sequence",
        "blocks.1": "batch_slice_from_sequence",
        "norm": "replica",
        "head": "gather_batch_output",
    }
    # a split head fed by a sequence-parallel norm gathers inside its own ColwiseParallel
    layout = {"norm": LayerLayout(style="split", sequence_parallel=True), "head": LayerLayout(style="split")}
    assert tp_styles(GPT, layout, ["norm", "head"]) == {
        "norm": "sequence_parallel_local",
        "head": "colwise_sharded_output_from_sequence",
    }
    with pytest.raises(StratagemError, match="no sequence dimension"):
        tp_styles(parse_model("resnet:tiny"), {"fc": LayerLayout(style="split", sequence_parallel=True)}, ["fc"])


def test_only_complete_checkpoints_are_chosen(tmp_path):
    for name, complete in [("step_000002", True), ("step_000004.tmp", True), ("step_000006", False)]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / COMPLETE_MARKER).write_text("x")
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    assert find_latest_checkpoint(tmp_path / "missing") is None


def test_dry_run_describes_every_rank():
    plan = make_plan(GPT, pp=2, tp=2, schedule="1f1b", num_micro_batches=2, split=["blocks.0", "head"])
    lines = describe_ranks(plan)
    assert len(lines) == 4
    assert lines[3].startswith("rank 3 (pp 1, dp 0, tp 1): stage 1 [norm, head]")  # 5 layers -> 3 + 2
    assert "norm=batch_slice, head=colwise_sharded_output_from_batch +loss_parallel" in lines[3]
    assert "blocks.0.attn.qkv=colwise" in lines[0]


def test_command_and_slurm_script(tmp_path):
    plan = make_plan(GPT, dp=2)
    opts = LaunchOptions(plan_path=tmp_path / "p.json", steps=3, max_restarts=1)
    cmd = build_command(plan, opts)
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert cmd[cmd.index("--max-restarts") + 1] == "1" and "runtime.executor.train" in cmd
    multi = LaunchOptions(plan_path=tmp_path / "p.json", nnodes=2, rdzv_endpoint="h:29500")
    assert build_command(plan, multi)[build_command(plan, multi).index("--nproc-per-node") + 1] == "1"
    script = build_slurm_script(plan, multi)
    assert "#SBATCH --nodes=2" in script and "--rdzv-backend c10d" in script


def test_elastic_command_names_the_store_host_and_publishes_each_round(tmp_path):
    """Elastic: the first node hosts the rendezvous store (another node on the same host must not take it and
    take it down when lost), and torch's shared store is turned off so a node joining a later round finds the
    round's address (torch publishes the shared store's only in the first round)."""
    plan = make_plan(GPT, dp=2)
    conf = {}
    for rank in (0, 1):
        opts = LaunchOptions(
            plan_path=tmp_path / "p.json",
            nnodes=2,
            node_rank=rank,
            rdzv_endpoint="h:29500",
            elastic=True,
            min_gpus=1,
            max_restarts=1,
            rejoin_timeout_s=9,
        )
        cmd = build_command(plan, opts)
        conf[rank] = dict(kv.split("=") for kv in cmd[cmd.index("--rdzv-conf") + 1].split(","))
        assert cmd[cmd.index("--nnodes") + 1] == "1:2"
        assert command_env(opts) == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert (conf[0]["is_host"], conf[1]["is_host"]) == ("1", "0")
    assert conf[0]["last_call_timeout"] == "9" and conf[0]["keep_alive_interval"] == "3"
    fixed = LaunchOptions(plan_path=tmp_path / "p.json", nnodes=2, rdzv_endpoint="h:29500")
    assert command_env(fixed) == {} and "--rdzv-conf" not in build_command(plan, fixed)


def test_slurm_script_takes_no_line_or_command_from_a_plan(tmp_path):
    """A plan file edited by hand (its hash removed) names its model with a newline and a command substitution:
    neither reaches the script as a line or as shell syntax, and the plan path is one quoted word."""
    import shlex

    plan = make_plan(GPT, dp=2)
    evil = "gpt:tiny\nrm -rf ~ # $(touch /tmp/owned) `id`"
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"name": evil})})
    path = tmp_path / "my plan $(id).json"
    script = build_slurm_script(plan, LaunchOptions(plan_path=path, nnodes=2))
    lines = script.splitlines()
    assert not any(line.startswith("rm ") for line in lines)
    job = next(line for line in lines if line.startswith("#SBATCH --job-name="))
    assert all(c.isalnum() or c in "._-" for c in job.removeprefix("#SBATCH --job-name="))
    srun = next(line for line in lines if line.startswith("srun "))
    assert shlex.quote(str(path)) in srun and "$(id)" not in srun.replace(shlex.quote(str(path)), "")


@pytest.fixture
def no_processes(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def _launch_error(capsys, argv) -> str:
    assert cli_main(["launch", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_bad_launches_fail_in_one_line_before_starting(tmp_path, capsys, no_processes):
    plan_path = save_plan(make_plan(GPT, dp=2), tmp_path / "plan.json")
    assert "plan needs 2 ranks but the launch has 4" in _launch_error(capsys, [str(plan_path), "--nproc-per-node", "4"])
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(plan_path.read_text()[:100])
    assert "not valid JSON" in _launch_error(capsys, [str(corrupt)])
    assert "no complete checkpoint" in _launch_error(
        capsys, [str(plan_path), "--resume", "--checkpoint-dir", str(tmp_path / "ck")]
    )
    other = tmp_path / "ck" / "step_000002"
    other.mkdir(parents=True)
    (other / COMPLETE_MARKER).write_text("x")
    (other / "meta.json").write_text(json.dumps({"model": "gpt:small", "world_size": 2}))
    assert "written for model gpt:small but the plan trains gpt:tiny" in _launch_error(
        capsys, [str(plan_path), "--resume", "--checkpoint-dir", str(tmp_path / "ck")]
    )
    torch.save(
        {"inputs": torch.zeros(4, 32, dtype=torch.long), "targets": torch.zeros(4, 32, dtype=torch.long)},
        tmp_path / "long.pt",
    )
    assert "samples have shape [32] but gpt:tiny at seq_len 16 takes [16]" in _launch_error(
        capsys, [str(plan_path), "--data", str(tmp_path / "long.pt")]
    )
    data = json.loads(plan_path.read_text())
    data["model"]["dims"]["layers"] = 3  # stages no longer cover the model's layers
    data.pop("content_hash")
    wrong = tmp_path / "wrong_model.json"
    wrong.write_text(json.dumps(data))
    assert "plan is for another model" in _launch_error(capsys, [str(wrong)])
    if not torch.cuda.is_available():  # a plan for a shipped GPU cluster cannot run on this CPU machine
        gpu_plan = save_plan(
            make_plan(GPT, dp=2).model_copy(update={"cluster_name": "dgx-a100-80g"}), tmp_path / "gpu_plan.json"
        )
        assert (
            "made for cluster dgx-a100-80g (NVIDIA A100-SXM4-80GB) and needs 2 GPUs on this node but it has 0"
            in _launch_error(capsys, [str(gpu_plan)])
        )


def test_unbuildable_schedules_are_rejected():
    from runtime.executor.checks import check_schedule

    with pytest.raises(StratagemError, match="at least one micro-batch per stage"):
        check_schedule("1f1b", pp=4, virtual_stages=1, num_micro_batches=2)
    with pytest.raises(StratagemError, match="virtual_stages=2"):
        check_schedule("gpipe", pp=2, virtual_stages=2, num_micro_batches=4)
    with pytest.raises(StratagemError, match="3 rounds"):  # max(1, 7 // 2) = 3 rounds; 7 % 3 != 0
        check_schedule("interleaved_1f1b", pp=2, virtual_stages=2, num_micro_batches=7)
    check_schedule("interleaved_1f1b", pp=4, virtual_stages=2, num_micro_batches=10)  # 2 rounds of 5
    check_schedule("interleaved_1f1b", pp=4, virtual_stages=2, num_micro_batches=3)  # 1 round
    check_schedule("gpipe", pp=4, virtual_stages=1, num_micro_batches=1)


def test_tied_head_and_embedding_must_share_a_layout():
    from runtime.executor.checks import check_tied

    tied = parse_model("gpt:tiny", tie_embeddings=True)
    check_tied(make_plan(tied, tp=2, split=["embed", "head"]))
    with pytest.raises(StratagemError, match="splits only head"):
        check_tied(make_plan(tied, tp=2, split=["blocks.0", "head"]))


def test_metrics_summary_compares_with_the_prediction(tmp_path):
    from planner.plan import Predictions, StagePrediction
    from runtime.executor.metrics import MetricsLog, read_metrics

    pred = Predictions(
        step_time_s=0.15,
        tokens_per_s=1.0,
        samples_per_s=1.0,
        model_tflops_per_gpu=0.0,
        hardware_tflops_per_gpu=0.0,
        mfu=0.0,
        peak_memory_bytes=100.0,
        breakdown_s={},
        stages=[
            StagePrediction(
                stage=0,
                time_breakdown_s={},
                memory_breakdown_bytes={},
                peak_memory_bytes=100.0,
                memory_capacity_bytes=1e9,
            )
        ],
    )
    log = MetricsLog(tmp_path / "m.jsonl", make_plan(GPT).model_copy(update={"predictions": pred}), attempt=0)
    for step, t in enumerate([1.0, 0.2, 0.4], start=1):
        log.step(step=step, loss=5.0 - step, step_time_s=t, tokens=128, samples=8, peak_memory_bytes=[150, 200])
    summary = log.summary()
    assert summary["measured_step_time_s"] == pytest.approx(0.3)  # median of steps 2..3 (step 1 = warm-up)
    assert summary["step_time_ratio"] == pytest.approx(2.0) and summary["memory_ratio"] == pytest.approx(2.0)
    records = read_metrics(tmp_path / "m.jsonl")
    assert records[1]["tokens_per_s"] == pytest.approx(640.0) and records[-1]["summary"] is True
    assert "peak_reserved_bytes" not in records[1]  # CPU ranks: no caching allocator, no field


def test_reserved_bytes_are_recorded_where_the_device_has_them(tmp_path):
    """CUDA ranks record ``max_memory_reserved`` beside ``max_memory_allocated``; a CPU has no such figure."""
    import torch

    from runtime.executor.metrics import MetricsLog, peak_reserved_bytes, read_metrics

    assert peak_reserved_bytes(torch.device("cpu")) is None
    log = MetricsLog(tmp_path / "m.jsonl", make_plan(GPT), attempt=0)
    log.step(step=1, loss=1.0, step_time_s=0.1, tokens=8, samples=1, peak_memory_bytes=[5], peak_reserved_bytes=[8])
    assert read_metrics(tmp_path / "m.jsonl")[-1]["peak_reserved_bytes"] == [8]


def test_dry_run_prints_command_and_starts_nothing(tmp_path, capsys, no_processes):
    plan_path = save_plan(make_plan(GPT, dp=2), tmp_path / "plan.json")
    assert cli_main(["launch", str(plan_path), "--dry-run", "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "torch.distributed.run --standalone --nproc-per-node 2" in out[0]
    assert out[1].startswith("rank 0 (pp 0, dp 0, tp 0)") and "batch rows 0..3" in out[1]


@pytest.mark.parametrize("replicated", ["norm", "embed"])
def test_a_micro_batch_the_tp_group_cannot_slice_runs_replicas_on_the_whole_batch(replicated, tmp_path):
    """A replicated layer under tp > 1 computes a batch slice when the micro-batch splits over tp; one sample over
    two ranks cannot (issue 28's crashed tp2 micro-batch-1 trials): the replica then runs on the whole micro-batch
    on both TP ranks (no batch-slice style, nothing to sum over TP), and launch accepts the plan."""
    from runtime.executor.checks import check_supported
    from runtime.executor.tp_plan import plan_tp_styles, replica_paths

    spec = parse_model("gpt:tiny")
    split = [p for p in layer_paths(spec) if p not in (replicated, "norm")]
    plan = make_plan(spec, tp=2, global_batch=4, num_micro_batches=4, schedule="1f1b", split=split)
    check_supported(plan)
    styles = plan_tp_styles(plan, layer_paths(spec))
    assert replica_paths(styles) == [] and replicated not in styles and "norm" not in styles
    assert styles["head"] == "colwise_sharded_output"  # takes the whole replica's R output
    assert cli_main(["launch", str(save_plan(plan, tmp_path / "plan.json")), "--steps", "1", "--dry-run"]) == 0
    sliced = make_plan(spec, tp=2, global_batch=4, num_micro_batches=2, schedule="1f1b", split=split)
    assert "norm" in replica_paths(plan_tp_styles(sliced, layer_paths(spec)))  # mb 2: Whale's batch slices


def test_a_whole_batch_replica_between_sequence_shards_gathers_and_scatters():
    """Sequence-parallel blocks around a replicated one at micro-batch 1 over tp 2: the replica gathers the
    sequence shard into the whole activation and scatters its output back (one combined style)."""
    from runtime.executor.tp_plan import tp_styles

    layout = {
        "embed": LayerLayout(style="split"),
        "blocks.0": LayerLayout(style="split", sequence_parallel=True),
        "blocks.1": LayerLayout(style="replicate"),
        "norm": LayerLayout(style="split", sequence_parallel=True),
        "head": LayerLayout(style="split"),
    }
    spec = parse_model("gpt:tiny")
    styles = tp_styles(spec, layout, layer_paths(spec), whole_batch_replicas=True)
    assert styles["blocks.1"] == "gather_scatter_sequence" and styles["norm"] == "sequence_parallel_local"
    assert not any(k.startswith("blocks.1.") for k in styles)


def test_a_batch_sliced_replica_ending_its_stage_hands_a_sequence_shard_on():
    """pp 2 with a replicated block ending stage 0 (micro-batch 4 over tp 2: batch slices) and a
    sequence-parallel norm opening stage 1: the replica's output goes from its batch slice straight to a sequence
    shard (one style, still a replica whose gradients are summed over TP), not overwritten by a plain scatter."""
    from runtime.executor.tp_plan import replica_paths, tp_styles

    spec = parse_model("gpt:tiny")
    layout = {
        "embed": LayerLayout(style="split"),
        "blocks.0": LayerLayout(style="split"),
        "blocks.1": LayerLayout(style="replicate"),
        "norm": LayerLayout(style="split", sequence_parallel=True),
        "head": LayerLayout(style="split"),
    }
    first = tp_styles(spec, layout, ["embed", "blocks.0", "blocks.1"])
    assert first["blocks.1"] == "batch_slice_to_sequence_output" and replica_paths(first) == ["blocks.1"]
    assert tp_styles(spec, layout, ["norm", "head"])["norm"] == "sequence_parallel_local"
