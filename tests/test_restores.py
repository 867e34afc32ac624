"""A what-if run, an estimate or the panel given the user's own model (``run(lambda: model,
...)``) leaves the session as it found it, for every lever and mode, also when the run fails
(the loss or the inputs raise) or is interrupted (``KeyboardInterrupt`` from inside the user's
forward, in a warm-up, in the measured step, in a recomputation in backward, in a decode).

After each call the test compares, with a snapshot taken before it: every parameter and buffer
(the same object, values, dtype, device, ``requires_grad``; the gradient: the same tensor, the
same values), each module's train/eval flag, its own ``forward`` (set on the instance or not),
its forward, pre-forward and backward hooks and its children, the parameters' tensor hooks and
post-accumulate-grad hooks; for a Hugging Face model its config (``use_cache``) and its
gradient-checkpointing flags; and torch's global state: grad and inference mode, the default
dtype and device, autocast, saved-tensor hooks, dispatch and function modes, global module and
optimizer hooks, and the random state (docs/reliability.md, promise 2). Then the model trains
as an untouched copy of it does: the same loss and the same weights after a plain step.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.optim.optimizer as optimizer_module
import torch.utils._python_dispatch as python_dispatch
from torch import nn
from torch.nn.modules import module as module_module

import memlab
from memlab.estimate import estimate
from memlab.step import RunConfig, WhatIfError, run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 128


# -- the user's models: hooks, a forward of its own, buffers its forward updates -----------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.linear(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("calls", torch.zeros(()))  # updated in place by each forward
        self.register_buffer("seen", torch.zeros(()), persistent=False)  # rebound by each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen = self.seen + 1
        x = self.norm(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.scale


def users_net() -> Net:
    """A model as a notebook holds it: gradients from an earlier step, one block in eval mode,
    a forward set on one block itself (as accelerate's hooks do), hooks of every kind."""
    torch.manual_seed(0)
    model = Net()
    model.blocks[1].eval()
    first = model.blocks[0]
    first.forward = functools.partial(Block.forward, first)  # type: ignore[method-assign]
    first.register_forward_hook(lambda *a: None)
    first.register_forward_pre_hook(lambda *a: None)
    model.head.register_full_backward_hook(lambda *a: None)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
        p.register_post_accumulate_grad_hook(lambda p: None)
        p.register_hook(lambda g: g)
    return model


def batch(n: int) -> torch.Tensor:
    return torch.randn(n, 16)


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        attn_implementation="eager", use_cache=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    return model


def lora() -> nn.Module:
    base = llama()
    for p in base.parameters():
        p.grad = None
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, config)


def tokens(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, 8))
    return {"input_ids": ids, "labels": ids}


def prompt(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, 8))


def interrupted(make: Callable[[], nn.Module], where: str, at: int) -> Callable[[], nn.Module]:
    """``make()`` whose module at path ``where`` raises KeyboardInterrupt on its ``at``-th call
    (a hook of the user's, so the interrupt comes from inside the user's forward)."""

    def build() -> nn.Module:
        model = make()
        calls = [0]

        def pre(module: nn.Module, args: Any) -> None:
            calls[0] += 1
            if calls[0] == at:
                raise KeyboardInterrupt

        model.get_submodule(where).register_forward_pre_hook(pre)
        return model

    return build


def raising(out: Any) -> torch.Tensor:
    raise ValueError("the user's loss failed after the forward")


def no_batch(n: int) -> Any:
    raise ValueError("the user's inputs failed")


# -- the snapshot -------------------------------------------------------------------------------
def global_state() -> dict[str, Any]:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return {
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "default dtype": torch.get_default_dtype(),
        "default device": torch.get_default_device(),
        "autocast cpu": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "saved-tensor hooks": None if top is None else top(False),
        "dispatch modes": list(python_dispatch._get_current_dispatch_mode_stack()),
        "function modes": list(torch.overrides._get_current_function_mode_stack()),
        "global forward hooks": dict(module_module._global_forward_hooks),
        "global forward pre-hooks": dict(module_module._global_forward_pre_hooks),
        "global backward hooks": dict(module_module._global_backward_hooks),
        "optimizer hooks": (
            dict(optimizer_module._global_optimizer_pre_hooks),
            dict(optimizer_module._global_optimizer_post_hooks),
        ),
        "checkpoint": torch.utils.checkpoint.checkpoint,
        "saved-tensor hooks refused": torch.autograd.graph.disable_saved_tensors_hooks,
        "saved-tensor hooks pushed, popped": (
            torch._C._autograd._push_saved_tensors_default_hooks,
            torch._C._autograd._pop_saved_tensors_default_hooks,
        ),
        "random state": torch.get_rng_state().tolist(),
    }


def snapshot(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {"global": global_state()}
    for name, p in model.named_parameters(remove_duplicate=False):
        g = p.grad
        out[f"parameter {name}"] = (
            p, p.detach().clone(), p.dtype, p.device, p.requires_grad,
            g, None if g is None else g.clone(),
            list(getattr(p, "_post_accumulate_grad_hooks", None) or {}),
            list(p._backward_hooks or {}),
        )  # fmt: skip
    for name, b in model.named_buffers(remove_duplicate=False):
        out[f"buffer {name}"] = (b, b.clone(), b.dtype, b.device)
    for name, m in model.named_modules(remove_duplicate=False):
        out[f"module {name!r}"] = (
            m, m.training, m.__dict__.get("forward"), dict(m._modules),
            list(m._forward_hooks), list(m._forward_pre_hooks), list(m._backward_hooks),
            getattr(m, "gradient_checkpointing", None),
        )  # fmt: skip
    config = getattr(model, "config", None)
    if config is not None:
        out["config"] = config.to_dict()
        newer = hasattr(type(model), "is_activation_checkpointing")  # transformers >= 5.x
        name = "is_activation_checkpointing" if newer else "is_gradient_checkpointing"
        out["gradient checkpointing"] = getattr(model, name)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a is b or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


def _identical(a: Any, b: Any) -> bool:
    """Objects the same object, values the same value: tensors (and modules, functions) by
    identity where they are the snapshot's own objects, by value where they are its copies."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return all(
            (x is y) if isinstance(x, (nn.Module, nn.Parameter)) else _same(x, y)
            for x, y in zip(a, b, strict=True)
        )
    return _same(a, b)


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = [k for k in before.keys() | after.keys() if k not in before or k not in after]
    found += [
        k for k in before if k in after and k != "global" and not _identical(before[k], after[k])
    ]
    g, h = before["global"], after["global"]
    found += [f"global {k}" for k in g if not _same(g[k], h[k])]
    # a parameter or buffer held by identity: same object, checked apart from its value
    for k, v in before.items():
        if k.startswith(("parameter", "buffer")) and k in after and v[0] is not after[k][0]:
            found.append(f"{k} (another object)")
        if k.startswith("parameter") and k in after and v[5] is not after[k][5]:
            found.append(f"{k}'s .grad (another tensor)")
    return sorted(set(found))


def plain_step(model: nn.Module, inputs: Callable[[int], Any]) -> tuple[float, list[torch.Tensor]]:
    """One ordinary training step, seeded: the loss and the weights after it."""
    torch.manual_seed(1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    value = inputs(4)
    out = model(**value) if isinstance(value, dict) else model(value)
    loss = out.loss if hasattr(out, "loss") else out.float().pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item(), [p.detach().clone() for p in model.parameters()]


def assert_left_alone(
    make: Callable[[], nn.Module],
    call: Callable[[nn.Module], Any],
    inputs: Callable[[int], Any] = batch,
    raises: type[BaseException] | None = None,
) -> None:
    model = make()
    untouched = copy.deepcopy(model)
    before = snapshot(model)
    if raises is None:
        call(model)
    else:
        with pytest.raises(raises):
            call(model)
    assert changes(before, snapshot(model)) == []
    # the model trains afterwards as a copy memlab never saw does
    for p, q in zip(model.parameters(), untouched.parameters(), strict=True):
        p.grad = q.grad = None
    loss, weights = plain_step(model, inputs)
    loss_untouched, weights_untouched = plain_step(untouched, inputs)
    assert loss == loss_untouched
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_untouched, strict=True))


def whatif(inputs: Callable[[int], Any] = batch, loss: Any = None, **fields: Any) -> Any:
    config = RunConfig(device="cpu", batch_size=4, **fields)
    return lambda model: run(lambda: model, inputs, loss, config)


# -- the checker itself ---------------------------------------------------------------------------
LEAKS: dict[str, Callable[[nn.Module], Any]] = {
    "a value": lambda m: m.head.weight.data.add_(1),
    "a buffer's value": lambda m: m.calls.add_(1),
    "a rebound buffer": lambda m: setattr(m, "seen", m.seen.clone()),
    "a gradient replaced": lambda m: setattr(m.head.weight, "grad", m.head.weight.grad.clone()),
    "a gradient's value": lambda m: m.head.weight.grad.add_(1),
    "requires_grad": lambda m: m.head.weight.requires_grad_(False),
    "a train flag": lambda m: m.blocks[1].train(),
    "an own forward removed": lambda m: m.blocks[0].__dict__.pop("forward"),
    "a forward set": lambda m: setattr(m.head, "forward", lambda x: x),
    "a module swapped": lambda m: setattr(m, "head", nn.Linear(16, 4)),
    "a forward hook": lambda m: m.head.register_forward_hook(lambda *a: None),
    "a post-accumulate hook": lambda m: m.head.bias.register_post_accumulate_grad_hook(print),
    "a tensor hook": lambda m: m.head.bias.register_hook(lambda g: g),
    "the random state": lambda m: torch.rand(1),
    "grad mode": lambda m: torch.set_grad_enabled(False),
    "the default dtype": lambda m: torch.set_default_dtype(torch.float64),
    "saved-tensor hooks": lambda m: _entered(torch.autograd.graph.save_on_cpu()),
    "a dispatch mode": lambda m: _entered(Passing()),
    "the default device (a function mode)": lambda m: _entered(torch.device("meta")),
}


class Passing(python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _entered(context: Any) -> Any:
    context.__enter__()
    return context


@pytest.mark.parametrize("leak", list(LEAKS))
def test_the_snapshot_sees_each_kind_of_leak(leak: str) -> None:
    model = users_net()
    before = snapshot(model)
    state = (torch.is_grad_enabled(), torch.get_default_dtype())
    left = None
    try:
        left = LEAKS[leak](model)
        assert changes(before, snapshot(model)), leak
    finally:
        torch.set_grad_enabled(state[0])
        torch.set_default_dtype(state[1])
        if hasattr(left, "__exit__"):
            left.__exit__(None, None, None)


# -- what-if runs on the user's model: each lever and mode ----------------------------------------
LEVERS = {
    "train": {},
    "checkpoint auto": {"checkpoint": "auto"},
    "checkpoint_saves matmuls": {"checkpoint": "auto", "checkpoint_saves": "matmuls"},
    "amp bf16": {"amp": "bf16"},
    "no_grad": {"mode": "no_grad"},
    "inference_mode": {"mode": "inference_mode"},
    "eval_with_grad": {"mode": "eval_with_grad"},
    "offload activations": {"offload": "activations"},
    "offload optimizer": {"offload": "optimizer"},
    "offload both": {"offload": "both", "amp": "bf16"},
    "optimizer_in_backward": {"optimizer_in_backward": True},
    "optimizer_state_bits 8": {"optimizer_state_bits": 8},
    "fsdp on 2 ranks": {"world_size": 2, "sharding": "fsdp"},
    "expandable_segments": {"expandable_segments": True},
    "accumulation": {"accumulation": 2, "checkpoint": "auto"},
}


def skip_without_selective_checkpointing(fields: dict[str, Any]) -> None:
    if fields.get("checkpoint_saves") == "matmuls" and not hasattr(
        torch.utils.checkpoint, "create_selective_checkpoint_contexts"
    ):
        pytest.skip("selective checkpointing is new in torch 2.5 (the run says so instead)")


@pytest.mark.parametrize("lever", list(LEVERS))
def test_a_run_leaves_the_users_model_and_torch_as_they_were(lever: str) -> None:
    skip_without_selective_checkpointing(LEVERS[lever])
    assert_left_alone(users_net, whatif(**LEVERS[lever]))


@pytest.mark.parametrize("lever", ["train", "checkpoint auto", "offload both", "no_grad"])
def test_a_run_whose_loss_raises_after_the_forward_leaves_them(lever: str) -> None:
    # optimizer_in_backward with a checkpoint: its hooks must go when the loss raises
    fields = {"optimizer_in_backward": True, **LEVERS[lever]} if lever != "no_grad" else {}
    if lever == "offload both":  # which steps the optimizer itself, after the backward
        fields.pop("optimizer_in_backward")
    call = (
        whatif(loss=raising, **fields) if lever != "no_grad" else whatif(no_batch, mode="no_grad")
    )
    assert_left_alone(users_net, call, raises=WhatIfError)


def test_a_run_whose_inputs_raise_leaves_them() -> None:
    assert_left_alone(
        users_net, whatif(no_batch, checkpoint="auto", offload="activations"), raises=WhatIfError
    )


# The user's block 2 is called once per forward (its forward is checkpointed, not its call);
# its Linear once per forward and once per recomputation in backward under checkpointing.
INTERRUPTS = {
    "in the warm-up, all levers": ("blocks.2", 1, {
        "checkpoint": "auto", "optimizer_in_backward": True, "offload": "activations",
        "amp": "bf16",
    }),
    "in the measured step, offload both": ("blocks.2", 2, {"offload": "both"}),
    "in a recomputation in backward": ("blocks.2.linear", 4, {
        "checkpoint": "auto", "checkpoint_saves": "matmuls", "optimizer_in_backward": True,
        "offload": "activations",
    }),
    "in no_grad": ("blocks.2", 2, {"mode": "no_grad", "amp": "bf16"}),
    "in eval_with_grad": ("blocks.2", 2, {"mode": "eval_with_grad"}),
    "with 8-bit state": ("blocks.2", 2, {"optimizer_state_bits": 8}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(INTERRUPTS))
def test_an_interrupt_from_the_users_forward_leaves_them(case: str) -> None:
    where, at, fields = INTERRUPTS[case]
    skip_without_selective_checkpointing(fields)
    assert_left_alone(interrupted(users_net, where, at), whatif(**fields), raises=KeyboardInterrupt)


# -- a Hugging Face model: use_cache and gradient checkpointing flags too ----------------------
HF = {
    "train": (tokens, {}),
    "checkpoint auto": (tokens, {"checkpoint": "auto"}),
    "checkpoint auto, loss raises": (tokens, {"checkpoint": "auto"}),
    "no_grad": (tokens, {"mode": "no_grad"}),
    "inference_mode": (tokens, {"mode": "inference_mode"}),
    "eval_with_grad": (tokens, {"mode": "eval_with_grad", "amp": "bf16"}),
    "generate": (prompt, {"mode": "generate", "new_tokens": 3}),
    "generate, static cache": (prompt, {"mode": "generate", "new_tokens": 2, "cache": "static"}),
}


@pytest.mark.parametrize("case", list(HF))
def test_a_hugging_face_model_is_left_as_it_was(case: str) -> None:
    inputs, fields = HF[case]
    loss = raising if "raises" in case else None
    assert_left_alone(
        llama, whatif(inputs, loss, **fields), tokens, raises=WhatIfError if loss else None
    )


def test_a_checkpointed_hugging_face_run_interrupted_in_backward_turns_use_cache_back_on() -> None:
    # layer 1's forward runs once in the forward and once again in backward (recomputed)
    make = interrupted(llama, "model.layers.1.mlp", 4)
    assert_left_alone(make, whatif(tokens, checkpoint="auto"), tokens, raises=KeyboardInterrupt)


def test_a_generation_interrupted_in_a_decode_leaves_the_model() -> None:
    make = interrupted(llama, "model.layers.0", 4)  # warm-up: prefill and one token; then ...
    assert_left_alone(
        make, whatif(prompt, mode="generate", new_tokens=3), tokens, raises=KeyboardInterrupt
    )


@pytest.mark.parametrize("how", ["trained", "loss raises", "interrupted"])
def test_a_lora_model_gets_its_base_layers_back_after_nf4(how: str) -> None:
    make = interrupted(lora, "base_model.model.model.layers.1", 2) if how == "interrupted" else lora
    fields = {"base_weights": "nf4", "checkpoint": "auto"}
    loss = raising if how == "loss raises" else None
    raises = {"trained": None, "loss raises": WhatIfError, "interrupted": KeyboardInterrupt}[how]
    assert_left_alone(make, whatif(tokens, loss, **fields), tokens, raises=raises)


# -- the estimator and the panel ------------------------------------------------------------------
def test_an_estimate_given_the_users_model_refuses_it_and_leaves_it() -> None:
    config = RunConfig(batch_size=4, checkpoint="auto", offload="activations")
    call = lambda model: estimate(lambda: model, batch, None, config)  # noqa: E731
    assert_left_alone(users_net, call, raises=WhatIfError)


@pytest.mark.parametrize("how", ["ok", "loss raises", "interrupted"])
def test_an_estimate_leaves_torch_as_it_was(how: str) -> None:
    """The estimator puts torch on meta (the default device, a function mode, patched kernels)
    while it runs, and takes all of it away."""
    make = interrupted(Net, "blocks.1", 2) if how == "interrupted" else Net
    loss = raising if how == "loss raises" else None
    config = RunConfig(batch_size=4, checkpoint="auto", offload="both", amp="fp16")
    raises = {"ok": None, "loss raises": WhatIfError, "interrupted": KeyboardInterrupt}[how]
    call = lambda model: estimate(make, batch, loss, config)  # noqa: E731
    assert_left_alone(users_net, call, raises=raises)


@pytest.mark.parametrize("how", ["run", "loss raises", "largest batch", "simulated GPU"])
def test_the_panel_leaves_the_users_model(how: str) -> None:
    def call(model: nn.Module) -> None:
        loss = raising if how == "loss raises" else None
        config = RunConfig(device="cpu", batch_size=4, checkpoint="auto", budget=2**20)
        panel = memlab.Explorer(lambda: model, batch, loss, config=config)
        if how == "simulated GPU":  # an estimate: refuses a model already built, says so
            panel.simulate.value = "T4"
        result = panel.largest_batch() if how == "largest batch" else panel.run()
        # a batch of 1 fails in the user's BatchNorm: the search starts at 2 and says why
        assert (result is None) == (how not in ("run", "largest batch"))
        said = {"loss raises": "ValueError", "largest batch": "ValueError"}
        assert (
            said.get(how, "already exist" if how == "simulated GPU" else "") in panel.status.value
        )

    assert_left_alone(users_net, call)


# -- torch.compile -------------------------------------------------------------------------------
def test_a_compiled_run_leaves_the_model_uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """What dynamo leaves on a module (a compiled call, an OptimizedModule) is the same whichever
    backend compiles its graphs: here AOT autograd without inductor's C++ kernels, a few seconds
    where inductor takes 30 to 100 on two cores (test_compile_lever measures inductor's steps)."""
    real = torch.compile

    def without_inductor(model: Any, mode: str | None = None, **kwargs: Any) -> Any:
        assert mode == "default" and not kwargs  # (what memlab.step.compiled asks for)
        return real(model, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", without_inductor)

    def call(model: nn.Module) -> None:
        result = run(
            lambda: model, batch, None, RunConfig(device="cpu", batch_size=4, compile=True)
        )
        assert result.report is not None
        # dynamo left nothing on the model: no compiled call, not an OptimizedModule
        assert type(model) is Net and model._compiled_call_impl is None
        assert not torch.compiler.is_compiling()

    assert_left_alone(users_net, call)


# -- the random state ----------------------------------------------------------------------------
def test_a_run_on_the_main_thread_draws_nothing_from_the_notebooks_random_sequence() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    run(users_net, batch, None, RunConfig(device="cpu", batch_size=4))  # inputs, dropout, init
    assert torch.equal(torch.rand(3), expected)


def test_a_run_on_another_thread_leaves_the_random_state_to_the_program() -> None:
    """The panel's buttons run on a thread while the kernel stays free: the state is not put
    back when such a run ends, which would rewind (and so repeat) what a cell drew meanwhile
    (docs/reliability.md)."""
    started, drawn = threading.Event(), threading.Event()

    def inputs(n: int) -> torch.Tensor:
        started.set()
        assert drawn.wait(30)
        return torch.randn(n, 16)

    torch.manual_seed(7)
    first = torch.rand(3)  # what the state the run starts from draws first
    torch.manual_seed(7)
    config = RunConfig(device="cpu", batch_size=4)
    worker = threading.Thread(target=run, args=(Net, inputs, None, config))
    worker.start()
    assert started.wait(30)
    torch.rand(3)  # a cell's draw while the run is on
    drawn.set()
    worker.join(60)
    assert not worker.is_alive()
    assert not torch.equal(torch.rand(3), first)  # not rewound to where the run started
