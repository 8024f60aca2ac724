"""A block checkpointed by ``apply_ac`` with the selective policy runs under
``torch.compile``: dynamo is handed a plain context function (a bound method
lost its ``self`` there), and the policy's decisions are what the compiled
block uses."""

from __future__ import annotations

import pickle

import torch
import torch.nn as nn

from autoparallel.capture.activation_checkpointing import SACPolicy, apply_ac


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sin()


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_selective_ac_block_under_torch_compile(monkeypatch):
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(4, 16)
    model(x).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    calls = []
    original = SACPolicy.context_fn

    def counting(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(SACPolicy, "context_fn", counting)
    policy = SACPolicy(recompute_every=3)
    apply_ac(model, "selective", policy=policy)
    for block in model.layers:
        block.compile(backend="aot_eager")
    model(x).sum().backward()
    for expected, p in zip(reference, model.parameters()):
        torch.testing.assert_close(p.grad, expected)
    # the compiled blocks asked this policy for their checkpoint contexts
    assert calls and all(c is policy for c in calls)


def test_policy_still_pickles_and_compares_by_fields():
    policy = SACPolicy(recompute_every=3)
    again = pickle.loads(pickle.dumps(policy))
    assert again == policy and hash(again) == hash(policy)
    assert again.checkpoint_context_fn is not policy.checkpoint_context_fn
