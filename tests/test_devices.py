"""The GPU launch path without a GPU: no device is hard-coded in the package (the device comes from accelerate), the
target's attention kernel is selectable, and bf16 autocast trains fp32 master weights."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import drafter_train
from drafter_train.config import TargetConfig
from drafter_train.errors import ConfigError

PACKAGE = Path(drafter_train.__file__).parent
DEVICE_STRING = re.compile(r"(cpu|cuda|mps|xpu|npu|hpu)(:\d+)?")
# Where a device string may appear, and why. Nothing here chooses a device: each entry answers a question about a
# device the code was given.
ALLOWED = {
    "devices.py": "the one module that names device types (on_cpu, device_name); it picks nothing itself",
}


def device_strings(path: Path) -> list[tuple[int, str]]:
    """(line, string) of every string constant in `path` that names a device. Dict keys and subscripts are record
    fields (a result file's "cpu" model name), not devices."""
    tree = ast.parse(path.read_text())
    fields = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            fields.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            fields.add(id(node.slice))
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in fields
                  and DEVICE_STRING.fullmatch(node.value))


def test_the_scan_finds_device_strings_in_every_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('import torch\nx = torch.zeros(1, device="cuda")\ny = x.to("cpu")\nz = torch.device("cuda:0")\n'
                      'def f(device="mps"):\n    return device.type == "cpu"\ninfo = {"cpu": 1}\nv = info["cpu"]\n'
                      's = "runs on the cpu"\n')
    assert device_strings(source) == [(2, "cuda"), (3, "cpu"), (4, "cuda:0"), (5, "mps"), (6, "cpu")]


def test_no_device_is_hard_coded_in_the_package():
    found = [f"{path.relative_to(PACKAGE)}:{line}: {value!r}" for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(PACKAGE)) not in ALLOWED for line, value in device_strings(path)]
    assert not found, "device strings in the package (take the device from accelerate or from a model):\n" + \
        "\n".join(found)


def test_the_target_loads_on_accelerates_device(tiny_data):
    from accelerate import PartialState

    from drafter_train.targets import load_target

    target, _ = load_target(TargetConfig(path=str(tiny_data / "target"), cpu_kernels="default"))
    # accelerate names the device without an index ("cuda") where the model's tensors say "cuda:0" (seen on an H200)
    expected = PartialState().device
    assert target.device.type == expected.type
    assert expected.index is None or target.device.index == expected.index


# ---- attention kernels ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_target_attention_is_selectable_and_gives_the_same_logits(tiny_data, attn):
    from drafter_train.targets import load_target

    target, _ = load_target(TargetConfig(path=str(tiny_data / "target"), attn_implementation=attn,
                                         cpu_kernels="default"))
    reference, _ = load_target(TargetConfig(path=str(tiny_data / "target"), attn_implementation="eager",
                                            cpu_kernels="default"))
    assert target.config._attn_implementation == attn
    ids = torch.arange(1, 17, device=target.device)[None]  # on accelerate's device: the GPU where there is one
    torch.testing.assert_close(target(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_sdpa_gives_eager_logits_in_bf16_within_bf16_rounding(tiny_data):
    """The GPU recipe's target (bf16, sdpa) on accelerate's device (the GPU where there is one): its logits over a
    64-token sequence are eager's within bf16 rounding. Tolerance, in relative error ||a - b|| / ||b|| against the
    fp32 eager logits: below 1e-1 for both kernels (this tiny target's large init amplifies bf16 rounding through
    its layers: eager alone is ~5e-2 on the CPU), and sdpa's at most twice eager's; a wrong mask or head layout
    gives errors of order 1."""
    from drafter_train.targets import load_target

    def logits(attn: str, dtype: str) -> torch.Tensor:
        target, _ = load_target(TargetConfig(path=str(tiny_data / "target"), attn_implementation=attn, dtype=dtype,
                                             cpu_kernels="default"))
        ids = torch.randint(3, target.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            return target(ids.to(target.device)).logits.float()

    reference = logits("eager", "float32")
    sdpa, eager = logits("sdpa", "bfloat16"), logits("eager", "bfloat16")
    errors = {"sdpa": relative_error(sdpa, reference), "eager": relative_error(eager, reference),
              "sdpa vs eager": relative_error(sdpa, eager)}
    assert errors["sdpa"] > 0 and errors["eager"] > 0, errors  # 0: not bf16 at all
    assert all(error < 1e-1 for error in errors.values()) and errors["sdpa"] <= 2 * errors["eager"], errors


def test_an_unknown_attention_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^target\.attn_implementation: must be one of"):
        TargetConfig(attn_implementation="flash")


def test_flash_attention_is_refused_before_loading_where_it_cannot_run(tiny_data, tmp_path):
    from omegaconf import OmegaConf

    from drafter_train.recipes.evaluate import run_eval_job
    from tests.stubs import compose_cfg

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: flash_attention_2 may load")
    cfg = OmegaConf.to_object(compose_cfg("eval", [
        f"target.path={tiny_data / 'target'}", "drafter.path=truncated:1", "target.attn_implementation=flash_attention_2",
        f"eval.output={tmp_path / 'm.json'}"]))
    with pytest.raises(ConfigError, match="^target.attn_implementation=flash_attention_2 needs a CUDA GPU and the "
                                          "flash-attn package") as err:
        run_eval_job(cfg)
    assert "\n" not in str(err.value)


def test_flash_attention_is_refused_for_draft_trees(monkeypatch):
    from drafter_train.config import EvalConfig, TreeConfig
    from drafter_train.preflight import check_attention

    monkeypatch.setattr("drafter_train.preflight.flash_attention_available", lambda: True)  # as on a GPU with flash-attn
    target = TargetConfig(attn_implementation="flash_attention_2")
    check_attention(target, EvalConfig())  # chains: allowed
    with pytest.raises(ConfigError, match="takes no tree masks"):
        check_attention(target, EvalConfig(tree=TreeConfig(top_k=2)))


# ---- bf16 mixed precision --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target_dtype", ["float32", "bfloat16"])
def test_bf16_autocast_trains_fp32_master_weights_through_drafter_train(tiny_data, tmp_path, monkeypatch, target_dtype):
    """train.mixed_precision=bf16 (what the GPU accelerate configs launch): the drafter's matmuls run in bf16 under
    autocast while its weights, their gradients and the optimizer's state stay fp32, and the loss falls; with a bf16
    target too (the GPU recipe's), whose new drafter would otherwise be built, and trained, in bf16."""
    from safetensors.torch import load_file
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from drafter_train.recipes.train import train
    from tests.test_eagle3 import eagle3_cfg
    from tests.test_train import losses

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    matmuls, stepped = [], []

    def on_forward(module, args, output):  # the drafter's trainable layers, in training passes only
        if isinstance(module, torch.nn.Linear) and module.weight.requires_grad and torch.is_grad_enabled():
            matmuls.append((output.dtype, module.weight.dtype))

    def on_step(optimizer, args, kwargs):
        stepped.extend((p.dtype, p.grad.dtype, *(s.dtype for s in optimizer.state[p].values() if s.dim()))
                       for group in optimizer.param_groups for p in group["params"] if p.grad is not None)

    hooks = [torch.nn.modules.module.register_module_forward_hook(on_forward),
             register_optimizer_step_pre_hook(on_step)]
    try:
        cfg = eagle3_cfg(tiny_data, tmp_path, "train.mixed_precision=bf16", "train.max_steps=8", "train.save_every=8",
                         "train.eval_at_start=false", f"target.dtype={target_dtype}")
        metrics = train(cfg)
    finally:
        for hook in hooks:
            hook.remove()
    assert matmuls and set(matmuls) == {(torch.bfloat16, torch.float32)}
    assert stepped and {dtype for row in stepped for dtype in row} == {torch.float32}
    by_step = losses(tmp_path / cfg.train.run_name)
    assert by_step[8] < by_step[1] and metrics["greedy_match"] == 1.0  # the checkpoint evaluates losslessly
    saved = load_file(tmp_path / cfg.train.run_name / "step-8" / "drafter" / "model.safetensors")
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.float32}


def test_the_gpu_smoke_experiment_runs_on_cpu_at_tiny_size(tiny_data, tmp_path, monkeypatch):
    """experiment=gpu_smoke (docs/gpu.md's command for a GPU machine) composes and trains end to end, here on the CPU
    at tiny size: bf16 target, bf16 autocast, offline features, one evaluated checkpoint."""
    from omegaconf import OmegaConf

    from drafter_train.recipes.train import train
    from tests.stubs import compose_cfg
    from tests.test_train import losses

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    cfg = OmegaConf.to_object(compose_cfg("train", [
        "experiment=gpu_smoke", f"target.path={tiny_data / 'target'}", "target.chat_template=false",
        f"train.data_dir={tiny_data / 'data'}", f"train.output_root={tmp_path}", "drafter.draft_vocab_size=16",
        "drafter.target_layers=[0,1,2]", "train.max_steps=4", "train.save_every=4", "train.log_every=1",
        "train.max_seq_len=64", "train.lr=3e-3", "train.warmup_steps=0", "eval.num_prompts=1", "eval.max_new_tokens=8",
        "train.eval_at_start=false"]))
    assert (cfg.target.dtype, cfg.train.mixed_precision, cfg.drafter.features) == ("bfloat16", "bf16", "offline")
    metrics = train(cfg)
    assert "tau" in metrics and len(losses(tmp_path / "gpu-smoke")) == 4
    assert any((tmp_path / "gpu-smoke").glob("step-4/drafter/model.safetensors"))


@pytest.mark.parametrize("precision, target_matmul", [("no", torch.float32), ("bf16", torch.bfloat16)])
def test_bf16_runs_the_targets_training_forward_under_autocast_too(tiny_data, tmp_path, monkeypatch, precision,
                                                                    target_matmul):
    """train.mixed_precision=bf16 puts the float32 target's no-grad forward in training (EAGLE-3's features and
    teacher) under bf16 autocast, where it costs most of a step; no leaves it in the target's dtype."""
    from drafter_train.recipes import train as recipe
    from tests.test_eagle3 import eagle3_cfg

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    in_step, frozen = [], []
    real_step = recipe.accumulate_gradients

    def step(*args, **kwargs):  # record inside training steps only, not in the checkpoint's evaluation
        in_step.append(True)
        try:
            return real_step(*args, **kwargs)
        finally:
            in_step.pop()

    def on_forward(module, args, output):  # the target's layers: frozen
        if in_step and isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
            frozen.append((output.dtype, module.weight.dtype))

    monkeypatch.setattr(recipe, "accumulate_gradients", step)
    cfg = eagle3_cfg(tiny_data, tmp_path, f"train.mixed_precision={precision}", "train.max_steps=2",
                     "train.save_every=2", "train.eval_at_start=false", "eval.num_prompts=1")
    hook = torch.nn.modules.module.register_module_forward_hook(on_forward)
    try:
        recipe.train(cfg)
    finally:
        hook.remove()
    assert frozen and set(frozen) == {(target_matmul, torch.float32)}


@pytest.mark.parametrize("speedup, chosen", [(6.1, "bf16"), (1.2, "no"), (0.3, "no")])
def test_auto_mixed_precision_follows_the_measured_bf16_speedup(monkeypatch, speedup, chosen):
    """train.mixed_precision=auto: bf16 where this device's bf16 matmul measured >= 1.5x float32 (an AMX Xeon ~6x),
    no where it is not (emulated bf16 on AVX2 is slower); an accelerate launch config's precision wins; no and bf16
    stay as given."""
    from drafter_train import distributed

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(distributed, "bf16_matmul_speedup", lambda device: speedup)
    cpu = lambda: torch.device("cpu")  # noqa: E731
    assert distributed.resolve_mixed_precision("auto", cpu)[0] == chosen
    assert f"{speedup:.1f}x" in distributed.resolve_mixed_precision("auto", cpu)[1]
    assert [distributed.resolve_mixed_precision(p, cpu)[0] for p in ("no", "bf16")] == ["no", "bf16"]
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert distributed.resolve_mixed_precision("auto", cpu)[0] == "no"


def test_the_bf16_speedup_is_measured():
    """bf16_matmul_speedup times real matmuls: a positive ratio on any CPU (0.3x on a Xeon VM without avx512_bf16,
    ~6x on AMX); what auto chooses from it is test_auto_mixed_precision_follows_the_measured_bf16_speedup's."""
    from drafter_train.machine import bf16_matmul_speedup

    assert bf16_matmul_speedup(torch.device("cpu")) > 0


def _usable_amx() -> bool:
    from drafter_train.machine import probe_cpu

    return probe_cpu()["bf16_matmul"] == "native (AMX)"


@pytest.mark.skipif(not _usable_amx(), reason="needs AMX listed (amx_bf16, amx_tile) and its tile state granted")
def test_bf16_on_usable_amx_measures_faster_than_float32():
    from drafter_train.machine import bf16_matmul_speedup

    assert bf16_matmul_speedup(torch.device("cpu")) > 1.5
