"""Hostile round 8, the step's findings: a step_fn that casts the user's model (``.half()``,
``.to(torch.bfloat16)``, ``.double()``) or registers hooks on it gets it back as it was;
fp16 parameters with amp='fp16' are refused alike by a run and an estimate; a LoRA (peft) model
generates; input_fn's mapping with keys that are not names, numpy integers as settings, and
estimate's switches given as strings."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_DECODER
from torch import nn

from memlab.core.categories import Category
from memlab.estimate import estimate
from memlab.step import RunConfig, WhatIfError, run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _state(model: nn.Module) -> dict[str, Any]:
    """Each parameter's and buffer's object, its storage's address, dtype, device,
    requires_grad, values and gradient (clones: the truth the run must give back)."""
    return {
        name: (
            t,
            t.untyped_storage().data_ptr(),
            t.dtype,
            t.device,
            t.requires_grad,
            t.detach().clone(),
            None if t.grad is None else t.grad.clone(),
        )
        for name, t in (*model.named_parameters(), *model.named_buffers())
    }


def _same_state(model: nn.Module, before: dict[str, Any]) -> None:
    now = dict((*model.named_parameters(), *model.named_buffers()))
    assert now.keys() == before.keys()
    for name, (t, address, dtype, device, requires_grad, values, grad) in before.items():
        assert now[name] is t, name
        assert (t.dtype, t.device, t.requires_grad) == (dtype, device, requires_grad), name
        assert t.untyped_storage().data_ptr() == address, name  # the same storage, not a copy
        assert torch.equal(t.detach(), values), name  # bitwise
        assert (t.grad is None) == (grad is None) and (grad is None or torch.equal(t.grad, grad))


CASTS: dict[str, Callable[[nn.Module], Any]] = {
    "half": lambda m: m.half(),
    "bf16 through .to": lambda m: m.to(torch.bfloat16),
    "double": lambda m: m.double(),
}


@pytest.mark.parametrize("mode", ["train", "no_grad"])
@pytest.mark.parametrize("cast", list(CASTS))
def test_a_step_fn_that_casts_the_model_gets_it_back_as_it_was(cast: str, mode: str) -> None:
    model = _net()
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)  # the user's own gradient
    model[3].bias.requires_grad_(False)
    before = _state(model)

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        CASTS[cast](m)
        return m(x.to(next(m.parameters()).dtype)).float().square().mean()

    run(lambda: model, lambda n: torch.randn(n, 8), step_fn=step, device="cpu", mode=mode)
    _same_state(model, before)


def _hooks(model: nn.Module) -> list[Any]:
    return [
        (list(m._forward_hooks), list(m._forward_pre_hooks), list(m._backward_hooks))
        for m in model.modules()
    ] + [
        (list(p._backward_hooks or {}), list(getattr(p, "_post_accumulate_grad_hooks", {}) or {}))
        for p in model.parameters()
    ]


def test_hooks_a_step_fn_registers_are_removed_and_the_users_stay() -> None:
    model = _net()
    called: list[str] = []
    model[0].register_forward_hook(lambda *a: called.append("user's"))
    model[3].weight.register_hook(lambda g: None)
    before = _hooks(model)

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        m[0].register_forward_hook(lambda *a: called.append("step_fn's"))
        m[3].register_forward_pre_hook(lambda *a: None)
        m[3].weight.register_hook(lambda g: None)  # a tensor's own hooks: on top of the user's
        m[0].bias.register_post_accumulate_grad_hook(lambda p: called.append("post"))
        return m(x).square().mean()

    run(lambda: model, lambda n: torch.randn(n, 8), step_fn=step, device="cpu")
    assert _hooks(model) == before
    called.clear()
    model(torch.randn(2, 8)).sum().backward()  # the user's own step, after the run
    assert called == ["user's"]


def _half_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).half()


@pytest.mark.parametrize("how", ["run", "estimate"])
def test_fp16_parameters_with_amp_fp16_are_refused_alike(how: str) -> None:
    call = run if how == "run" else estimate
    where = {"device": "cpu"} if how == "run" else {"gpu": "T4"}
    with pytest.raises(WhatIfError) as caught:
        call(_half_linear, lambda b: torch.randn(b, 16).half(), amp="fp16", batch_size=4, **where)
    said = str(caught.value)
    assert "amp='fp16'" in said and "'0.weight'" in said and "4 trainable" in said
    assert "amp='bf16'" in said and "amp='off'" in said and "fp32" in said
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert not any("/memlab/" in f.filename for f in frames)


def test_fp16_parameters_with_amp_bf16_or_a_step_fn_s_own_backward_still_run() -> None:
    def own(m: nn.Module, x: torch.Tensor) -> None:
        m(x).float().square().mean().backward()  # no scaler: memlab steps without one

    x = lambda b: torch.randn(b, 16).half()  # noqa: E731
    assert run(_half_linear, x, amp="bf16", device="cpu", batch_size=4).report is not None
    assert run(_half_linear, x, step_fn=own, amp="fp16", device="cpu", batch_size=4).peak > 0


LLAMA = dict(vocab_size=100, **TINY_DECODER)


def _lora() -> nn.Module:
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(base, lora)


def test_a_lora_model_generates_with_its_kv_cache() -> None:
    prompt, new, batch = 5, 3, 2
    r = run(
        _lora,
        lambda b: torch.randint(0, 100, (b, prompt)),
        mode="generate",
        new_tokens=new,
        batch_size=batch,
        device="cpu",
    )
    head_dim = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    keys_and_values = 2 * LLAMA["num_hidden_layers"] * LLAMA["num_key_value_heads"] * head_dim
    want = keys_and_values * 4 * (prompt + new - 1) * batch  # fp32; the last token not fed back
    assert r.report is not None
    assert r.report.breakdown.at_end[Category.KV_CACHE] == want


@pytest.mark.parametrize("mode", ["train", "generate"])
def test_an_input_mapping_with_keys_that_are_not_names_is_refused(mode: str) -> None:
    with pytest.raises(WhatIfError, match=r"keys that are not strings \(1 first\)") as caught:
        run(_net, lambda n: {1: torch.randn(n, 8)}, device="cpu", mode=mode, new_tokens=1)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert not any("/memlab/" in f.filename for f in frames)


def test_numpy_integers_are_whole_numbers_and_bools_are_not() -> None:
    config = RunConfig(batch_size=np.int64(8), accumulation=np.int32(2), budget=np.int64(2**30))
    assert (type(config.batch_size), config.batch_size, config.budget) == (int, 8, 2**30)
    json.dumps(config.to_dict())
    assert run(_net, lambda n: torch.randn(n, 8), batch_size=np.int64(4), device="cpu").peak > 0
    for bad in (True, np.bool_(True), torch.tensor(True), 8.0):
        with pytest.raises(WhatIfError, match="batch_size must be a whole number"):
            RunConfig(batch_size=bad)


@pytest.mark.parametrize("switch", ["cuda_kernels", "trace"])
def test_estimate_s_switches_take_true_or_false_only(switch: str) -> None:
    with pytest.raises(WhatIfError, match=f"{switch} must be True or False, not 'no'"):
        estimate(_net, lambda n: torch.randn(n, 8), **{switch: "no"})


def test_global_hooks_a_step_fn_registers_are_removed_and_the_users_stay() -> None:
    from torch.nn.modules import module as mm
    from torch.optim import optimizer as om

    called: list[str] = []
    users = mm.register_module_forward_hook(lambda *a: called.append("user's"))
    dicts = (mm._global_forward_hooks, mm._global_forward_pre_hooks, om._global_optimizer_pre_hooks)
    try:
        before = [dict(d) for d in dicts]

        def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            mm.register_module_forward_hook(lambda *a: None, always_call=True)
            mm.register_module_forward_pre_hook(lambda *a: called.append("step_fn's"))
            om.register_optimizer_step_pre_hook(lambda *a: called.append("step_fn's"))
            return m(x).square().mean()

        model = _net()
        run(lambda: model, lambda n: torch.randn(n, 8), step_fn=step, device="cpu")
        assert [dict(d) for d in dicts] == before
        assert set(mm._global_forward_hooks_always_called) <= set(mm._global_forward_hooks)
        called.clear()
        model(torch.randn(2, 8))
        assert called and set(called) == {"user's"}  # the user's own hook, called still
    finally:
        users.remove()


def test_a_global_hook_another_thread_registers_during_a_run_stays() -> None:
    # the panel's run on a thread of its own while the user's cell registers a global hook
    import threading

    from torch.nn.modules import module as mm

    inside, registered = threading.Event(), threading.Event()
    handles: list[Any] = []
    torchs = mm.register_module_forward_hook

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        inside.set()
        registered.wait(30)
        return m(x).square().mean()

    def register_meanwhile() -> None:
        inside.wait(30)
        handles.append(mm.register_module_forward_hook(lambda *a: None))
        registered.set()

    other = threading.Thread(target=register_meanwhile)
    other.start()
    try:
        run(_net, lambda n: torch.randn(n, 8), step_fn=step, device="cpu", warmup=False)
        other.join(30)
        assert handles and handles[0].id in mm._global_forward_hooks  # the user's: kept
    finally:
        for h in handles:
            h.remove()
    assert mm.register_module_forward_hook is torchs  # (memlab's recording one taken out)
