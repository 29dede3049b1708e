"""What makes `stratagem launch` fast (issue 23): fused SDPA attention chosen by the plan, bf16 per layout, the
optimizer kernel, torch.compile per block, and the operator tables that show which attention ran."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from runtime_helpers import resume_runs, tail, torchrun

from fixtures.plans import make_plan
from planner.model import parse_model
from planner.plan import save_plan
from runtime.executor.master_adamw import MasterAdamW
from runtime.executor.metrics import final_step_losses, read_metrics
from runtime.executor.speed import build_optimizer, precision_scheme, resolve_compile
from runtime.launch import LaunchOptions, train_args
from runtime.models import build_model, init_weights
from runtime.models.attention import apply_attention, attend

ALL_SPLIT = ["embed", "blocks.0", "blocks.1", "head"]


def _model(name: str, *, fused: bool, seed: int = 0):
    model = build_model(parse_model(name), device="meta")
    model.to_empty(device="cpu")
    init_weights(model, seed=seed)
    apply_attention(model, fused=fused)
    return model


@pytest.mark.parametrize("name", ["gpt:tiny", "llama:tiny", "moe:tiny"])
def test_sdpa_and_math_attention_agree_in_fp32(name):
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    fused, math = (_model(name, fused=f).eval() for f in (True, False))
    assert torch.allclose(fused(ids), math(ids), rtol=1e-5, atol=1e-5)


def test_attend_with_a_visibility_mask_matches_math_for_gqa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8, generator=gen), torch.randn(2, 2, 12, 8, generator=gen), torch.randn(2, 2, 12, 8)
    visible = torch.arange(12)[None, :] <= torch.tensor([0, 1, 2, 9, 10, 11])[:, None]  # a cp rank's two chunks
    fused = attend(q, k, v, fused=True, scale=0.3, visible=visible)
    math = attend(q, k, v, fused=False, scale=0.3, visible=visible)
    assert torch.allclose(fused, math, rtol=1e-5, atol=1e-6)


def test_apply_attention_sets_every_attention_module_once():
    model = _model("llama:tiny", fused=False)
    assert apply_attention(model, fused=True) == ["blocks.0.attn", "blocks.1.attn"]
    assert all(m.fused_attention for m in model.modules() if "fused_attention" in vars(m))


@pytest.mark.parametrize(
    ("layout", "dtype", "scheme"),
    [
        (dict(dp=2), "fp32", "fp32"),
        (dict(dp=2, zero_stage=3), "bf16", "fsdp-bf16"),
        (dict(dp=2, zero_stage=1), "bf16", "fsdp-bf16"),
        (dict(dp=2), "bf16", "autocast"),  # ZeRO 0: replicate keeps the weights' dtype
        (dict(tp=2, split=ALL_SPLIT), "bf16", "autocast"),
        (dict(dp=1), "bf16", "bf16-master"),  # one rank: bf16 weights, fp32 masters in the optimizer
    ],
)
def test_precision_scheme_per_layout(layout, dtype, scheme):
    assert precision_scheme(make_plan(parse_model("gpt:tiny"), dtype=dtype, **layout)) == scheme


def test_master_adamw_follows_torch_adamw_on_fp32_weights():
    """Same arithmetic as torch.optim.AdamW (decoupled decay, bias corrections): exact on fp32 weights."""
    gen = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(300, generator=gen)), torch.nn.Parameter(torch.randn(7, 5, generator=gen))]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    master_opt = MasterAdamW(mine, lr=1e-2, weight_decay=0.1, kernel="torch")
    for _ in range(4):
        for a, b in zip(ref, mine):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        torch_opt.step()
        master_opt.step()
    for a, b in zip(ref, mine):
        assert torch.equal(a, b)


def test_master_adamw_keeps_fp32_masters_of_bf16_weights():
    """bf16 weights: the fp32 master follows AdamW on fp32 weights fed the same (bf16) gradients, the weight is the
    master rounded to bf16, and the master travels in the optimizer's state dict (so DCP checkpoints carry it)."""
    gen = torch.Generator().manual_seed(1)
    ref = torch.nn.Parameter(torch.randn(1000, generator=gen).bfloat16().float())
    weight = torch.nn.Parameter(ref.detach().bfloat16())
    torch_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1)
    master_opt = MasterAdamW([weight], lr=1e-3, weight_decay=0.1)
    for _ in range(5):
        weight.grad = torch.randn(1000, generator=gen).bfloat16()
        ref.grad = weight.grad.float()
        torch_opt.step()
        master_opt.step()
    master = master_opt.state[weight]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, ref.detach())
    assert torch.equal(weight.detach(), master.bfloat16())
    assert not torch.equal(master, weight.detach().float())  # the updates bf16 would lose are kept
    assert set(master_opt.state_dict()["state"][0]) == {"master", "exp_avg", "exp_avg_sq", "step"}


def test_moe_bf16_keeps_autocast_under_zero3():  # the experts stay outside the FSDP units
    plan = make_plan(parse_model("moe:tiny"), dp=2, zero_stage=3, dtype="bf16")
    assert precision_scheme(plan) == "autocast"


def test_optimizer_kernel_and_mixed_parameter_groups():
    model = _model("gpt:tiny", fused=True)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, device=torch.device("cpu"))
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
    assert len(opt.param_groups) == 1


def test_compile_defaults_off_on_cpu_and_warns_without_a_compiler(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert resolve_compile("auto", cpu) is False and resolve_compile("off", cpu) is False
    monkeypatch.setattr("runtime.executor.speed.shutil.which", lambda _: None)
    with caplog.at_level(logging.WARNING):
        assert resolve_compile("on", cpu) is False
    assert "no C++ compiler" in caplog.text and "uncompiled" in caplog.text


@pytest.mark.parametrize(("flag", "value"), [(None, "auto"), (True, "on"), (False, "off")])
def test_launch_passes_compile_to_every_rank(tmp_path, flag, value):
    opts = LaunchOptions(plan_path=tmp_path / "p.json", compile={None: "auto", True: "on", False: "off"}[flag])
    args = train_args(opts)
    assert args[args.index("--compile") + 1] == value


# --- launched on CPU ranks ---------------------------------------------------------------------------------------

BF16_STEPS = 20
BF16_LAYOUTS = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2, split=ALL_SPLIT),
    "pp2": dict(pp=2, schedule="1f1b", num_micro_batches=2),
    "zero3": dict(dp=2, zero_stage=3),
}
# each layout once, on one of the two tiny families (both families x every layout took 44 s of the suite; gpt:small
# instead of gpt:tiny 17 s more: bf16 matmuls run at ~1 GFLOP/s on this CPU)
BF16_FAMILY = {"dp2": "gpt:tiny", "tp2": "llama:tiny", "pp2": "gpt:tiny", "zero3": "llama:tiny"}


def test_one_rank_bf16_master_launch_ends_within_2_percent_of_fp32(tmp_path):
    """One rank (bf16 weights, fp32 masters in MasterAdamW): gpt:tiny and llama:tiny, step 20's loss against fp32;
    the layout report names the scheme and the parameters really are bf16."""
    args, runs = ["--steps", str(BF16_STEPS), "--timeout-s", "120"], {}
    for family in ("gpt:tiny", "llama:tiny"):
        for dtype in ("fp32", "bf16"):
            plan = make_plan(parse_model(family), global_batch=8, seq_len=32, dtype=dtype, lr=3e-3)
            name = f"{family.split(':')[0]}_{dtype}"
            path = save_plan(plan.model_copy(update={"flash_attention": True}), tmp_path / f"{name}.json")
            args += ["--plan", str(path), "--metrics", str(tmp_path / f"{name}.jsonl")]
            args += ["--layout-report", str(tmp_path / name)]
            runs[name] = tmp_path / f"{name}.jsonl"
    proc = torchrun(1, args, timeout_s=300)
    assert proc.returncode == 0, tail(proc)
    for family in ("gpt", "llama"):
        fp32, bf16 = (final_step_losses(read_metrics(runs[f"{family}_{d}"])) for d in ("fp32", "bf16"))
        assert bf16[BF16_STEPS] == pytest.approx(fp32[BF16_STEPS], rel=0.02), (family, fp32, bf16)
        assert bf16[BF16_STEPS] != fp32[BF16_STEPS]
        report = json.loads((tmp_path / f"{family}_bf16" / "rank0.json").read_text())
        assert report["chunks"][0]["precision"] == "bf16-master"
        dtypes = {p["dtype"] for p in report["chunks"][0]["params"].values()}
        assert dtypes == {"torch.bfloat16"}, dtypes


@pytest.mark.slow
def test_bf16_launches_end_within_2_percent_of_fp32(tmp_path):
    """gpt:tiny (dp2, pp2) and llama:tiny (tp2, ZeRO-3), fused attention, 2 ranks: bf16 (autocast, or FSDP2's
    bf16 policy under ZeRO-3) against fp32, step 20's loss."""
    args, runs = ["--steps", str(BF16_STEPS), "--timeout-s", "120"], {}
    for layout, cfg in BF16_LAYOUTS.items():
        family = BF16_FAMILY[layout]
        for dtype in ("fp32", "bf16"):
            plan = make_plan(parse_model(family), global_batch=8, seq_len=32, dtype=dtype, lr=3e-3, **cfg)
            plan = plan.model_copy(update={"flash_attention": True})
            name = f"{layout}_{dtype}"
            path = save_plan(plan, tmp_path / f"{name}.json")
            args += ["--plan", str(path), "--metrics", str(tmp_path / f"{name}.jsonl")]
            args += ["--layout-report", str(tmp_path / name)]
            runs[name] = tmp_path / f"{name}.jsonl"
    proc = torchrun(2, args, timeout_s=420)
    assert proc.returncode == 0, tail(proc)
    for layout in BF16_LAYOUTS:
        fp32, bf16 = (final_step_losses(read_metrics(runs[f"{layout}_{d}"])) for d in ("fp32", "bf16"))
        assert bf16[BF16_STEPS] == pytest.approx(fp32[BF16_STEPS], rel=0.02), (layout, fp32, bf16)
        assert bf16[BF16_STEPS] != fp32[BF16_STEPS]  # bf16 really ran in bf16
        report = json.loads((tmp_path / f"{layout}_bf16" / "rank0.json").read_text())
        assert report["chunks"][0]["precision"] == ("fsdp-bf16" if layout == "zero3" else "autocast")
        assert report["chunks"][0]["attention"] == "sdpa"


def _score_sized(op: dict, seq: int) -> bool:
    return any(isinstance(s, list) and len(s) >= 2 and s[-2:] == [seq, seq] for s in op["input_shapes"])


@pytest.mark.slow
def test_operator_tables_show_the_plans_attention(tmp_path):
    """STRATAGEM_TORCH_PROFILE tables of launched steps: fused plans run SDPA and no (s x s) matmul or softmax;
    a plan with flash_attention false runs the math path."""
    seq, names, args = 40, [], ["--steps", "3", "--timeout-s", "120"]
    for family in ("gpt:tiny", "llama:tiny", "moe:tiny"):
        for fused in (True, False):
            plan = make_plan(parse_model(family), global_batch=2, seq_len=seq).model_copy(
                update={"flash_attention": fused}
            )
            names.append(f"{family.split(':')[0]}_{'sdpa' if fused else 'math'}")
            args += ["--plan", str(save_plan(plan, tmp_path / f"{names[-1]}.json"))]
    # one process trains the six plans in turn; each plan's tables carry its index (train.run_plan profile_tag)
    proc = torchrun(1, args, timeout_s=240, env={"STRATAGEM_TORCH_PROFILE": str(tmp_path / "prof")})
    assert proc.returncode == 0, tail(proc)
    for i, name in enumerate(names):
        ops = json.loads((tmp_path / "prof" / f"rank0_step3_plan{i}.json").read_text())["ops"]
        op_names = {op["name"] for op in ops}
        sdpa = {n for n in op_names if "scaled_dot_product" in n}
        score_ops = [
            op["name"] for op in ops if op["name"] in ("aten::bmm", "aten::_softmax") and _score_sized(op, seq)
        ]
        if name.endswith("sdpa"):
            assert sdpa and not score_ops, (name, sorted(sdpa), score_ops)
        else:
            assert not sdpa and "aten::_softmax" in score_ops, (name, sorted(sdpa), score_ops)


def test_flash_attention_without_the_cuda_kernel_warns(monkeypatch, caplog):
    from runtime.executor.speed import check_attention_kernel

    plan = make_plan(parse_model("gpt:tiny")).model_copy(update={"flash_attention": True})
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert "memory-efficient or math kernel" in check_attention_kernel(plan, torch.device("cuda"))
    assert check_attention_kernel(plan, torch.device("cpu")) is None  # CPU SDPA: its own flash kernel


def test_hf_model_outside_the_attention_interface_warns(tmp_path, monkeypatch, caplog):
    import transformers
    from hf_helpers import write_config

    from runtime.models.hf import _build_causal_lm

    spec = parse_model(f"hf:{write_config(tmp_path, 'llama')}")
    monkeypatch.setattr(transformers.LlamaForCausalLM, "_supports_attention_backend", False)
    with caplog.at_level(logging.WARNING):
        _build_causal_lm(spec)
    assert "not through transformers' attention interface" in caplog.text and "its own attention runs" in caplog.text


def test_estimate_defaults_to_fused_attention_on_gpu_clusters(capsys):
    from planner.cli.main import main

    base = ["estimate", "--model", "gpt:gpt2", "--global-batch", "8", "--seq", "1024", "--json"]
    for cluster, fused in (("dgx-h100", True), ("local-cpu-2core", False)):
        assert main([*base, "--cluster", cluster, "--gpus", "1"]) == 0
        default = json.loads(capsys.readouterr().out)["step_time_s"]
        flag = "--flash-attention" if fused else "--no-flash-attention"
        assert main([*base, "--cluster", cluster, "--gpus", "1", flag, "--causal-skip"]) == 0
        assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(default, rel=1e-12), cluster


def test_lm_head_pads_an_unaligned_vocabulary_without_changing_values_or_gradients():
    """LMHead pads the weight to a multiple of 64 rows for the matmul (CUDA; forced on CPU here) and slices the
    logits back: same logits, same gradients, same parameter shape."""
    from runtime.models.layered import LMHead

    gen = torch.Generator().manual_seed(0)
    plain, padded = LMHead(16, 50, bias=False), LMHead(16, 50, bias=False)
    padded.weight = torch.nn.Parameter(plain.weight.detach().clone())
    padded.pad_on = ("cpu",)
    x = torch.randn(3, 5, 16, generator=gen)
    outs = [m(x) for m in (plain, padded)]
    assert outs[1].shape == (3, 5, 50) and torch.allclose(outs[0], outs[1], atol=1e-6)
    for out in outs:
        out.square().sum().backward()
    assert padded.weight.shape == (50, 16) and torch.allclose(plain.weight.grad, padded.weight.grad, atol=1e-5)


def test_compile_mode_is_cuda_graphs_on_one_cuda_rank_and_the_knob_overrides(monkeypatch):
    from planner.core import StratagemError
    from runtime.executor.speed import COMPILE_MODE_ENV, compile_mode

    one, two = (make_plan(parse_model("gpt:tiny"), dp=dp) for dp in (1, 2))
    accumulating = make_plan(parse_model("gpt:tiny"), num_micro_batches=2)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(COMPILE_MODE_ENV, raising=False)
    assert compile_mode(one, cuda) == "reduce-overhead"
    assert compile_mode(two, cuda) is None and compile_mode(one, cpu) is None
    assert compile_mode(accumulating, cuda) is None
    monkeypatch.setenv(COMPILE_MODE_ENV, "default")
    assert compile_mode(one, cuda) is None
    monkeypatch.setenv(COMPILE_MODE_ENV, "fastest")
    with pytest.raises(StratagemError, match="reduce-overhead"):
        compile_mode(one, cuda)


def test_master_adamw_triton_kernels_in_the_interpreter(monkeypatch):
    """Where Triton is installed (the GPU machines; not the CPU CI), its interpreter runs the multi-tensor and
    per-tensor kernels on CPU tensors: the masters match the torch update."""
    pytest.importorskip("triton")
    import runtime.executor.master_adamw as ma

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ma, "_KERNEL", None)
    gen = torch.Generator().manual_seed(0)
    masters = {}
    for kernel in ("torch", "triton"):
        gen.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in ((3000,), (17, 5), (1,))]
        opt = MasterAdamW(params, lr=1e-2, weight_decay=0.1, kernel=kernel)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = None if (step == 1 and i == 2) else torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        masters[kernel] = [opt.state[p]["master"] for p in params]
    for a, b in zip(masters["torch"], masters["triton"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(ma, "_KERNEL", None)  # the next user compiles for its own device


def test_master_adamw_state_dict_round_trip_keeps_fp32_masters():
    """torch's Optimizer.load_state_dict casts floating state to the parameter's dtype (bf16 here); MasterAdamW
    puts the saved fp32 masters and moments back, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(64, generator=gen).bfloat16())
    opt = MasterAdamW([weight], lr=1e-3)
    for _ in range(3):
        weight.grad = torch.randn(64, generator=gen).bfloat16()
        opt.step()
    saved = {k: v.clone() for k, v in opt.state[weight].items()}
    fresh = MasterAdamW([weight], lr=1e-3)
    fresh.load_state_dict(opt.state_dict())
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert fresh.state[weight][key].dtype == torch.float32 and torch.equal(fresh.state[weight][key], saved[key])


def test_one_rank_bf16_master_resume_continues_the_same_losses(tmp_path):
    """A DCP checkpoint of a bf16-master launch carries the fp32 masters: resuming at step 3 gives steps 4-6 of
    the uninterrupted run exactly."""
    plan = make_plan(parse_model("gpt:tiny"), global_batch=4, seq_len=32, dtype="bf16", lr=3e-3)
    path = str(save_plan(plan, tmp_path / "plan.json"))
    resume_runs(1, tmp_path, [path], first=3, last=6, full=True, timeout_s=240)  # one launch, three runs
    full, rest = (final_step_losses(read_metrics(tmp_path / f"plan.{n}.jsonl")) for n in ("full", "run2"))
    assert sorted(rest) == [4, 5, 6] and all(rest[s] == full[s] for s in rest), (full, rest)
