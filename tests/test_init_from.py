"""``launch --init-from DIR``: training starts from a transformers-saved (or zoo) safetensors checkpoint.

Tiny instances (``runtime.models.fidelity.tiny_config``: the config's structure, sizes shrunk) of each model type
are built by transformers with seeded random weights and saved with ``save_pretrained``; one launch of
``tests/init_from_worker.py`` on 2 ranks trains one step of each under DP2 and under PP2 (1F1B, 2 micro-batches),
Llama, Qwen2, OPT and NanoChat also under TP2, from those folders. Step 1's loss is computed before any update, so
it must equal the loss transformers' own model computes on the same synthetic batch, within 1e-5 (fp32; dropout
off, as in transformers' eval mode): a weight left at its random init, read from the wrong tensor or sliced wrongly
moves it far more (another seed's weights score more than 1e-3 away here, test_the_loss_check_can_fail).
"""

from __future__ import annotations

import struct

import pytest
import torch
from runtime_helpers import REPO, spawn_ranks, tail

from fixtures.plans import make_plan
from planner.core import StratagemError
from planner.model import parse_model
from planner.plan import save_plan
from runtime.executor.data import build_data_source
from runtime.executor.metrics import final_step_losses, read_metrics
from runtime.executor.pretrained import INDEX_FILE, check_init_from, checkpoint_tensors
from runtime.models import build_model, is_splittable, layer_paths, loss_fn

transformers = pytest.importorskip("transformers")
from runtime.models.fidelity import tiny_config  # noqa: E402

GLOBAL_BATCH, SEQ = 4, 16
KINDS = {
    "llama": {},
    "qwen2": {},
    "gemma": {},  # tied head, embeddings scaled by sqrt(hidden)
    "olmo": {},  # final LayerNorm without parameters
    "cohere": {"logit_scale": 0.25},
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "gpt_oss": {},  # attention sinks, fused experts (ep 1: every expert on every rank)
    "gemma3_text": {},  # local and global rotary tables
    "gptj": {},  # partial rotary, parallel attention and MLP
    "opt": {"dropout": 0.0, "attention_dropout": 0.0},  # learned positions (offset 2), tied head; no dropout
    "bloom": {},  # ALiBi, embedding LayerNorm (read from word_embeddings_layernorm)
    "falcon": {},  # its own attention
    "nanochat": {},  # one parameter-free norm applied before and after the layers; logit soft-capping
}
LAYOUTS = {
    "dp2": dict(dp=2),
    "pp2": dict(pp=2, schedule="1f1b", num_micro_batches=2),
}
# also TP2 (Qwen2: q/k/v biases; OPT: a head count kept as an attribute; NanoChat: its shared norm must not take
# the final norm's sequence-parallel layout before the layers)
TP_KINDS = ("llama", "qwen2", "opt", "nanochat")


def save_tiny(folder, model_type: str, seed: int = 0, **config):
    """A tiny transformers model of ``model_type`` with seeded weights, saved into ``folder``; returns it."""
    cfg = tiny_config(transformers.AutoConfig.for_model(model_type, **config))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(folder)
    return model


def _batch_loss(model, spec, seed: int) -> float:
    batch = build_data_source(spec, "synthetic", global_batch=GLOBAL_BATCH, seq_len=SEQ, seed=seed)(1)
    with torch.no_grad():
        return float(loss_fn(spec)(model(input_ids=batch.inputs).logits, batch.targets))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("init-from")
    expected, pairs = {}, []
    for kind, config in KINDS.items():
        model = save_tiny(root / kind, kind, **config)
        spec = parse_model("hf:" + str(root / kind / "config.json"))
        folder = root / kind
        if kind == "llama":  # read from a sharded checkpoint (5 files and an index), as large models are saved
            folder = root / "llama-sharded"
            model.save_pretrained(folder, max_shard_size="100KB")
        layouts = dict(LAYOUTS)
        if kind in TP_KINDS:  # each rank reads only its slice of every split weight
            layouts["tp2"] = dict(tp=2, split=[p for p in layer_paths(spec) if is_splittable(spec, p)])
        for layout, cfg in layouts.items():
            plan = make_plan(spec, global_batch=GLOBAL_BATCH, seq_len=SEQ, **cfg)
            check_init_from(folder, plan)  # what launch checks before any process starts
            path = save_plan(plan, root / f"{kind}_{layout}.json")
            pairs.append(f"{path}={folder}")
            expected[f"{kind}_{layout}"] = _batch_loss(model, spec, plan.training.seed)
    argv = [str(REPO / "tests" / "init_from_worker.py"), str(root), *pairs]
    proc = spawn_ranks(2, argv, timeout_s=400, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, tail(proc)
    return root, expected


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "layout"), [(k, lay) for k in KINDS for lay in [*LAYOUTS, *(["tp2"] if k in TP_KINDS else [])]]
)
def test_first_step_loss_is_transformers_loss_on_the_same_batch(job, kind, layout):
    root, expected = job
    losses = final_step_losses(read_metrics(root / f"{kind}_{layout}.jsonl"))
    assert losses[1] == pytest.approx(expected[f"{kind}_{layout}"], abs=1e-5), (kind, layout, losses, expected)


def test_the_loss_check_can_fail(tmp_path):
    """The same batch on a model at another seed's weights is far outside the 1e-5 the test above allows."""
    spec_model = save_tiny(tmp_path / "a", "llama", seed=0)
    other = save_tiny(tmp_path / "b", "llama", seed=1)
    spec = parse_model("hf:" + str(tmp_path / "a" / "config.json"))
    assert abs(_batch_loss(spec_model, spec, 0) - _batch_loss(other, spec, 0)) > 1e-3


def test_a_zoo_model_starts_from_its_own_safetensors(tmp_path, capsys):
    """gpt:tiny's state dict saved with safetensors (its tied head left out), launched through the CLI under DP2:
    step 1's loss is the loss of those weights in one process."""
    from safetensors.torch import save_file

    from planner.cli.main import main

    spec = parse_model("gpt:tiny")
    model = build_model(spec, device="cpu")
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight" or not model.tie_embeddings}
    (tmp_path / "w").mkdir()
    save_file(state, str(tmp_path / "w" / "model.safetensors"))
    plan = make_plan(spec, global_batch=GLOBAL_BATCH, seq_len=SEQ, dp=2)
    path, metrics = save_plan(plan, tmp_path / "plan.json"), tmp_path / "run.jsonl"
    argv = ["launch", str(path), "--steps", "1", "--init-from", str(tmp_path / "w"), "--metrics", str(metrics)]
    assert main([*argv, "--timeout-s", "120"]) == 0, capsys.readouterr().err[-2000:]
    batch = build_data_source(spec, "synthetic", global_batch=GLOBAL_BATCH, seq_len=SEQ, seed=plan.training.seed)(1)
    with torch.no_grad():
        expected = float(loss_fn(spec)(model(batch.inputs), batch.targets))
    assert final_step_losses(read_metrics(metrics))[1] == pytest.approx(expected, abs=1e-5)


# --- bad input: one line before any process starts ------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    save_tiny(root / "ckpt", "llama")
    spec = parse_model("hf:" + str(root / "ckpt" / "config.json"))
    return root, make_plan(spec, global_batch=GLOBAL_BATCH, seq_len=SEQ, dp=2)


def _refused(folder, plan, needle: str) -> None:
    with pytest.raises(StratagemError) as err:
        check_init_from(folder, plan)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_checkpoint_of_another_model_is_refused(tmp_path, llama):
    _, plan = llama
    cfg = tiny_config(transformers.AutoConfig.for_model("llama"))
    cfg.intermediate_size = 96  # tiny_config sets 128
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "wider")
    _refused(tmp_path / "wider", plan, "has shape [96, 64] but")
    save_tiny(tmp_path / "qwen", "qwen2")  # another architecture: q/k/v biases the plan's model does not have
    other = make_plan(parse_model("hf:" + str(tmp_path / "qwen" / "config.json")), global_batch=4, seq_len=16, dp=2)
    _refused(tmp_path / "wider", other, "lacks")


def test_missing_shards_and_torn_files_are_refused(tmp_path, llama):
    _, plan = llama
    folder = tmp_path / "sharded"
    save_tiny(tmp_path / "whole", "llama").save_pretrained(folder, max_shard_size="100KB")  # transformers' sharding
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and (folder / INDEX_FILE).exists()
    check_init_from(folder, plan)  # whole: accepted
    shards[-1].unlink()
    _refused(folder, plan, f"1 of the {len(shards)} shards")
    (folder / INDEX_FILE).unlink()
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) // 2])
    _refused(folder, plan, "torn or truncated")
    shards[0].write_bytes(struct.pack("<Q", 10**12) + b"{}")
    _refused(folder, plan, "not a readable safetensors file")
    _refused(tmp_path / "nowhere", plan, "is not a folder")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", plan, "holds no *.safetensors file")


def test_unsupported_layouts_and_saved_layouts_are_refused(tmp_path, llama):
    from hf_helpers import write_moe_config

    root, plan = llama
    config = write_moe_config(tmp_path / "mixtral", "mixtral")
    spec = parse_model("hf:" + str(config))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config.parent))
    model.save_pretrained(tmp_path / "mixtral")  # transformers saves the legacy per-expert tensors
    assert any(".experts.0.w1." in k for k in checkpoint_tensors(tmp_path / "mixtral"))
    _refused(tmp_path / "mixtral", make_plan(spec, global_batch=4, seq_len=16, dp=2), "conversion_mapping")
    ep2 = make_plan(spec, global_batch=4, seq_len=16, dp=2, experts={"ep": 2})
    _refused(tmp_path / "mixtral", ep2, "expert parallelism (ep=2 etp=1)")


def test_launch_refuses_in_one_line_and_writes_nothing(tmp_path, llama, capsys):
    from planner.cli.main import main

    root, plan = llama
    path, metrics = save_plan(plan, tmp_path / "plan.json"), tmp_path / "run.jsonl"
    status = main(["launch", str(path), "--steps", "1", "--init-from", str(tmp_path), "--metrics", str(metrics)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and "holds no *.safetensors file" in err, err
    assert not metrics.exists()
