"""Tied and shared parameters: one ``nn.Parameter`` under several names is one
graph input, one decision and one DTensor in the parallel module, reachable
under every name the original model has; names, ``state_dict`` keys, loading
the original's full state dict, gradients (summing every use) and a DCP round
trip match the single-device model (4 simulated ranks on a 2x2 ("dp", "tp")
mesh, batch on dp; DCP on 4 gloo processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from _dist_utils import run_ranks
from autoparallel import AutoParallel
from autoparallel.passes import PassOptions

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

LOCAL_TENSOR_PASSES = PassOptions(column_major_all_gather="reorder")
N, VOCAB, DIM, BATCH, SEQ = 4, 32, 16, 8, 4
BATCH_ON_DP = (Shard(0), Replicate())


class TiedLM(nn.Module):
    """Embedding tied to the output head, and one layer under two names."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.shared = nn.Linear(DIM, DIM)
        self.again = self.shared  # the same module (and parameters) twice
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        h = self.shared(self.emb(tokens))
        h = self.again(torch.relu(h))
        return self.head(h)


def _tokens(seed=0):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _plan_and_apply(mesh, passes=None, mp_policy=None):
    with torch.device("meta"):
        model = TiedLM()
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    with AutoParallel(model, mesh, tokens, mp_policy=mp_policy) as autop:
        autop.add_input_constraints([BATCH_ON_DP])
        autop.add_output_constraints([BATCH_ON_DP])
        plan = autop.optimize_placement()
        # one decision per parameter object: the aliases are not graph inputs
        assert set(autop.traced.param_nodes) == {"emb.weight", "shared.weight", "shared.bias"}
        assert autop.traced.tied_params == {
            "again.weight": "shared.weight",
            "again.bias": "shared.bias",
            "head.weight": "emb.weight",
        }
        return autop.apply_placement(plan, pass_options=passes)


def _full(t):
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.reconcile() if isinstance(full, LocalTensor) else full


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16"])
def test_tied_parameters(fake_world, mixed_precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fake_world(N)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # bf16 compute: each alias of a tied parameter gets the same cast
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    parallel = _plan_and_apply(mesh, LOCAL_TENSOR_PASSES, mp)
    torch.manual_seed(0)
    ref = TiedLM()

    # names as the original model's, the tied ones one DTensor
    assert [n for n, _ in parallel.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(parallel.state_dict()) == list(ref.state_dict())
    assert parallel.head.weight is parallel.emb.weight
    assert parallel.again.weight is parallel.shared.weight
    assert isinstance(parallel.head.weight, DTensor)

    x = _tokens()
    out = ref(x)
    out.pow(2).mean().backward()
    with LocalTensorMode(N) as lm:
        parallel.to_empty(device="cpu")
        parallel.load_state_dict(ref.state_dict())  # holds both keys of each tie
        assert parallel.head.weight is parallel.emb.weight
        for name, p in ref.named_parameters():
            torch.testing.assert_close(_full(parallel.get_parameter(name)), p.detach(), msg=name)
        per = BATCH // mesh.size(0)
        local_x = lm.rank_map(lambda r: x[(r // mesh.size(1)) * per : (r // mesh.size(1) + 1) * per].clone())
        local_out = parallel(local_x)
        local_out.pow(2).sum().div(out.numel()).backward()
        got = torch.cat([local_out._local_tensors[int(mesh.mesh[i, 0])] for i in range(mesh.size(0))])
        grads = {n: _full(p.grad) for n, p in parallel.named_parameters()}
    # emb.weight: embedding + head; shared: both calls
    if mixed_precision:  # against the fp32 reference, at bf16's precision
        torch.testing.assert_close(got.float(), out.detach(), rtol=0.05, atol=0.05)
        for name, p in ref.named_parameters():
            assert (grads[name] - p.grad).abs().max() <= 0.05 * p.grad.abs().max(), name
        return
    torch.testing.assert_close(got, out.detach(), rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def _dcp_rank(rank, world, path):
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallel = _plan_and_apply(mesh)
    torch.manual_seed(0)
    ref = TiedLM()
    parallel.to_empty(device="cpu")
    parallel.load_state_dict(ref.state_dict())
    # one step on real ranks: the tied gradient sums both uses
    x = _tokens()
    out = ref(x)
    out.pow(2).mean().backward()
    per = BATCH // mesh.size(0)
    dp = mesh.get_local_rank("dp")
    local_out = parallel(x[dp * per : (dp + 1) * per].clone())
    local_out.pow(2).sum().div(out.numel()).backward()
    torch.testing.assert_close(local_out, out.detach()[dp * per : (dp + 1) * per], rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            parallel.get_parameter(name).grad.full_tensor(), p.grad, rtol=1e-4, atol=1e-6, msg=name
        )
    dcp.save(parallel.state_dict(), checkpoint_id=path)
    # a second copy, zeroed, loads the checkpoint in place
    other = _plan_and_apply(mesh)
    other.to_empty(device="cpu")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    assert other.head.weight is other.emb.weight
    for name, p in ref.named_parameters():
        torch.testing.assert_close(other.get_parameter(name).full_tensor(), p.detach(), msg=name)


def test_tied_parameters_dcp_round_trip(fake_world, tmp_path):
    """In one process (rank 0 of a fake world, ``no_dist``): both keys of a
    tie save and load rank 0's shards of the one DTensor."""
    import torch.distributed.checkpoint as dcp

    fake_world(N)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallel = _plan_and_apply(mesh)
    torch.manual_seed(0)
    ref = TiedLM()
    parallel.to_empty(device="cpu")
    parallel.load_state_dict(ref.state_dict())
    dcp.save(parallel.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    other = _plan_and_apply(mesh)
    other.to_empty(device="cpu")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    state = other.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    other.load_state_dict(state)
    assert other.head.weight is other.emb.weight
    for key, value in parallel.state_dict().items():
        torch.testing.assert_close(other.state_dict()[key].to_local(), value.to_local(), rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_tied_parameters_step_and_dcp_round_trip_gloo(tmp_path):
    run_ranks(_dcp_rank, 4, str(tmp_path / "ckpt"), timeout=240)


def _hf_gpt2():
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=DIM,
        n_layer=1,
        n_head=4,
        n_positions=SEQ,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg), ("lm_head.weight", "transformer.wte.weight")


def _hf_bert():
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(cfg), (
        "cls.predictions.decoder.weight",
        "bert.embeddings.word_embeddings.weight",
    )


# GPT-2 is slow: BERT ties its head the same way by default (an alias of
# the embedding's parameter), as does test_llama3_tied_embeddings
@pytest.mark.parametrize("build", [pytest.param(_hf_gpt2, marks=pytest.mark.slow), _hf_bert], ids=["gpt2", "bert"])
def test_hugging_face_tied_heads(fake_world, build):
    pytest.importorskip("transformers")
    fake_world(N)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model, (alias, canonical) = build()
    with AutoParallel(model, mesh, {"input_ids": torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")}) as autop:
        autop.add_input_constraints([BATCH_ON_DP])
        autop.add_output_constraints([BATCH_ON_DP])  # the logits
        parallel = autop.apply_placement(autop.optimize_placement(), pass_options=LOCAL_TENSOR_PASSES)
    torch.manual_seed(0)
    ref, _ = build()
    assert parallel.get_parameter(alias) is parallel.get_parameter(canonical)
    assert list(parallel.state_dict()) == list(ref.state_dict())
    x = _tokens()
    out = ref(input_ids=x).logits
    out.pow(2).mean().backward()
    with LocalTensorMode(N) as lm:
        parallel.to_empty(device="cpu")
        parallel.init_weights()  # Hugging Face's init also computes the non-persistent buffers
        parallel.load_state_dict(ref.state_dict())
        per = BATCH // mesh.size(0)
        local_x = lm.rank_map(lambda r: x[(r // mesh.size(1)) * per : (r // mesh.size(1) + 1) * per].clone())
        local_out = parallel(input_ids=local_x).logits
        local_out.pow(2).sum().div(out.numel()).backward()
        got = torch.cat([local_out._local_tensors[int(mesh.mesh[i, 0])] for i in range(mesh.size(0))])
        grads = {n: _full(p.grad) for n, p in parallel.named_parameters()}
    torch.testing.assert_close(got, out.detach(), rtol=1e-5, atol=1e-6)
    assert grads.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_llama3_tied_embeddings(fake_world):
    import dataclasses

    from autoparallel.models import LLAMA3_CONFIGS, Transformer

    fake_world(N)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # one layer: the tie is between the embedding and the output head
    config = dataclasses.replace(LLAMA3_CONFIGS["debug"], tie_embeddings=True, n_layers=1)
    with torch.device("meta"):
        model = Transformer(config)
    with AutoParallel(model, mesh, torch.empty(BATCH, 16, dtype=torch.long, device="meta")) as autop:
        autop.add_input_constraints([BATCH_ON_DP])
        autop.add_output_constraints([BATCH_ON_DP])
        parallel = autop.apply_placement(autop.optimize_placement(), pass_options=LOCAL_TENSOR_PASSES)
    assert parallel.output.weight is parallel.tok_embeddings.weight
    ref = Transformer(config)
    torch.manual_seed(0)
    ref.init_weights()
    x = torch.randint(0, config.vocab_size, (BATCH, 16), generator=torch.Generator().manual_seed(1))
    out = ref(x)
    out.pow(2).mean().backward()
    with LocalTensorMode(N) as lm:
        parallel.to_empty(device="cpu")
        torch.manual_seed(0)
        parallel.init_weights()  # the same seeded init as the reference
        assert parallel.output.weight is parallel.tok_embeddings.weight
        per = BATCH // mesh.size(0)
        local_x = lm.rank_map(lambda r: x[(r // mesh.size(1)) * per : (r // mesh.size(1) + 1) * per].clone())
        local_out = parallel(local_x)
        local_out.pow(2).sum().div(out.numel()).backward()
        got = torch.cat([local_out._local_tensors[int(mesh.mesh[i, 0])] for i in range(mesh.size(0))])
        grads = {n: _full(p.grad) for n, p in parallel.named_parameters()}
    torch.testing.assert_close(got, out.detach(), rtol=1e-5, atol=1e-5)
    assert grads.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
