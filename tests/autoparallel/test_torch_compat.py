"""torch_compat: each helper's branch for a torch that has the feature and
one that lacks it (fakes stand in for the other releases), swaps that are
checked and undone, and rule errors that name the op instead of falling
back to replicate."""

from __future__ import annotations

import contextlib
import logging
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from autoparallel import torch_compat
from autoparallel.options import fast_expand

# -- signature-checked swaps -------------------------------------------------


def _orig(a, b, *, flag=False, cb=None):
    return ("orig", a, b, flag, cb)


def _same(a, b, *, flag=False, cb=None):
    return ("mine", a, b, flag, cb)


def _renamed(a, b, *, flag=False, callback=None):
    return ("renamed", a, b)


def _other_default(a, b, *, flag=True, cb=None):
    return ("default", a, b)


def test_accepts_like_compares_names_kinds_and_defaults():
    assert torch_compat.accepts_like(_same, _orig) is None
    why = torch_compat.accepts_like(_renamed, _orig)
    assert "['cb']" in why and "['callback']" in why
    assert "differ in kind or default" in torch_compat.accepts_like(_other_default, _orig)


def test_swapped_installs_only_matching_and_restores_on_exception(caplog):
    owner = types.SimpleNamespace(f=_orig, g=_orig)
    owner.__name__ = "fake_module"
    caplog.set_level(logging.INFO, logger="autoparallel.torch_compat")
    with pytest.raises(ValueError):
        with torch_compat.swapped(
            [torch_compat.Swap(owner, "f", _same), torch_compat.Swap(owner, "g", _renamed)], what="test swap"
        ) as installed:
            assert [s.name for s in installed] == ["f"]
            assert owner.f is _same and owner.g is _orig  # the mismatched one left alone
            raise ValueError("boom")
    assert owner.f is _orig and owner.g is _orig
    assert any("not replacing fake_module.g" in r.getMessage() for r in caplog.records)


def _form_without_uneven(
    mesh,
    op_schema,
    single_mesh_dim_strategies,
    *,
    output_tensor_meta=None,
    input_index=1,
    inplace_op=False,
    allow_unbacked_sharding=None,
    is_valid_strategy_cb=None,
):
    pass


def _form_renamed_filter(
    mesh,
    op_schema,
    single_mesh_dim_strategies,
    *,
    output_tensor_meta=None,
    input_index=1,
    inplace_op=False,
    allow_unbacked_sharding=None,
    allow_uneven_sharding=False,
    full_mesh_strategy_filter=None,
    different_mesh_args=None,
):
    pass


def _form_unknown(
    mesh,
    op_schema,
    single_mesh_dim_strategies,
    *,
    output_tensor_meta=None,
    input_index=1,
    inplace_op=False,
    allow_unbacked_sharding=None,
    allow_uneven_sharding=False,
    full_mesh_strategy_filter=None,
    different_mesh_args=None,
    a_new_option=None,
):
    pass


def test_fast_expansion_adapter_per_form_of_torchs_function():
    from torch.distributed.tensor._ops import utils as ops_utils

    assert fast_expand.adapter_for(_form_without_uneven) is fast_expand.expand_even_single_mesh
    assert fast_expand.adapter_for(_form_renamed_filter) is fast_expand.expand_with_strategy_filter
    assert fast_expand.adapter_for(_form_unknown) is None
    # the running torch's own form is one of them
    assert fast_expand.adapter_for(ops_utils.expand_to_full_mesh_op_strategy) is not None


def test_fast_expansion_leaves_torch_alone_when_no_adapter_fits(monkeypatch, caplog):
    from torch.distributed.tensor._ops import utils as ops_utils

    monkeypatch.setattr(ops_utils, "expand_to_full_mesh_op_strategy", _form_unknown)
    caplog.set_level(logging.INFO, logger="autoparallel.torch_compat")
    with fast_expand.fast_expansion():
        assert ops_utils.expand_to_full_mesh_op_strategy is _form_unknown
    assert any("matches none of the forms" in r.getMessage() for r in caplog.records)


# -- feature present / absent --------------------------------------------------


def test_is_shard_like_with_and_without_torchs_helper(monkeypatch):
    from torch.distributed.tensor import placement_types

    cases = [(Shard(0), True), (_StridedShard(0, split_factor=2), True), (Replicate(), False)]
    if hasattr(placement_types, "_is_shard_like"):
        assert [torch_compat.is_shard_like(p) for p, _ in cases] == [want for _, want in cases]
        monkeypatch.delattr(placement_types, "_is_shard_like")
    assert [torch_compat.is_shard_like(p) for p, _ in cases] == [want for _, want in cases]


def test_propagator_tables_absent_read_as_empty():
    table = {"op": "adjust"}
    assert torch_compat.scalar_shape_adjusters(types.SimpleNamespace(op_to_scalar_shape_adjuster=table)) is table
    assert torch_compat.scalar_shape_adjusters(types.SimpleNamespace()) == {}
    assert torch_compat.squeeze_dims_variants(types.SimpleNamespace()) == {}


def test_strategy_function_reads_records_and_functions():
    record = types.SimpleNamespace(func=_orig, allow_uneven_sharding=False)
    assert torch_compat.strategy_function(record) is _orig
    assert torch_compat.strategy_function(_orig) is _orig
    assert torch_compat.qualified_name(record).endswith("test_torch_compat._orig")


def test_is_opaque_node_without_torchs_helper(monkeypatch):
    from torch._functorch import partitioners

    node = torch.fx.Graph().placeholder("x")
    monkeypatch.delattr(partitioners, "is_opaque_node", raising=False)
    assert torch_compat.is_opaque_node(node) is False


def test_extract_passes_opaque_nodes_only_where_taken(monkeypatch):
    from torch._functorch import partitioners

    calls = []

    def old_form(joint_module, saved_values, saved_sym_nodes, *, num_fwd_outputs):
        calls.append(num_fwd_outputs)
        return "fw", "bw"

    monkeypatch.setattr(partitioners, "_extract_fwd_bwd_modules", old_form)
    assert torch_compat.extract_fwd_bwd_modules(None, [], [], [], num_fwd_outputs=2) == ("fw", "bw")
    assert calls == [2]
    with pytest.raises(RuntimeError, match="cannot save opaque values"):
        torch_compat.extract_fwd_bwd_modules(None, [], [], [torch.fx.Graph().placeholder("mesh")], num_fwd_outputs=2)


def test_current_ranks_int_and_per_rank(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    assert torch_compat.current_ranks() == [3]
    per_rank = types.SimpleNamespace(node=types.SimpleNamespace(_local_ints={0: 2, 1: 0, 2: 1}))
    monkeypatch.setattr(dist, "get_rank", lambda: per_rank)
    assert torch_compat.current_ranks() == [0, 1, 2]


def test_new_group_in_order_where_torch_sorts(monkeypatch):
    made = []

    def sorting_new_group(ranks=None, timeout=None, backend=None, group_desc=None):
        made.append(sorted(ranks))
        return "group"

    monkeypatch.setattr(dist, "new_group", sorting_new_group)
    assert not torch_compat.new_group_keeps_order()
    assert torch_compat.new_group_in_order([0, 1, 2], "g") == "group"
    with pytest.raises(RuntimeError, match="sorts its ranks"):
        torch_compat.new_group_in_order([0, 2, 1], "g")
    assert made == [[0, 1, 2]]


def test_groups_of_a_mesh_dim(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 4))
    assert torch_compat.groups_of(mesh.get_group(0).group_name) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert torch_compat.groups_of(mesh.get_group(1).group_name) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_last_node():
    g = torch.fx.Graph()
    assert torch_compat.last_node(g) is None and torch_compat.last_node(None) is None
    g.placeholder("x")
    y = g.placeholder("y")
    assert torch_compat.last_node(g) is y


# -- planning leaves torch as it was; a raising rule is an error ----------------


def _torch_functions() -> dict:
    """(module, name) -> object for every attribute of the loaded DTensor
    modules, and DTensorSpec's __post_init__."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    found = {("DTensorSpec", "__post_init__"): DTensorSpec.__dict__["__post_init__"]}
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed.tensor") and module is not None:
            for attr, value in list(vars(module).items()):
                if callable(value):
                    found[(name, attr)] = value
    return found


def _enumerate_ffn(mesh_shape=(2, 2)):
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    from autoparallel.capture.tracing import trace_training_step
    from autoparallel.models import FFN
    from autoparallel.options.strategies import StrategyEnumerator

    mesh = init_device_mesh("cpu", mesh_shape)
    with torch.device("meta"):
        model = FFN(16, 32, activation="gelu", bias=True)
    with contextlib.ExitStack() as stack:
        traced = trace_training_step(model, (torch.empty(4, 6, 16, device="meta"),), "cpu", stack=stack)
        with unset_fake_temporarily():
            enumerator = StrategyEnumerator(mesh)
            return enumerator.enumerate(traced.gm, set(traced.param_nodes.values())), enumerator


def test_planning_leaves_torchs_functions_as_they_were(fake_world):
    fake_world(4)
    before = _torch_functions()
    found, enumerator = _enumerate_ffn()
    assert found and not enumerator.stats.fallback_ops
    after = _torch_functions()
    changed = [key for key, value in before.items() if after.get(key) is not value]
    assert not changed


def test_torch_restored_when_planning_raises(fake_world, monkeypatch):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._ops import utils as ops_utils

    from autoparallel.options import strategies

    fake_world(4)
    before = _torch_functions()

    def fail(*args, **kwargs):
        assert ops_utils.expand_to_full_mesh_op_strategy in fast_expand.ADAPTERS  # swapped in
        raise KeyError("enumeration failed")

    monkeypatch.setattr(strategies.StrategyEnumerator, "_enumerate_nodes", fail)
    with pytest.raises(KeyError, match="enumeration failed"):
        _enumerate_ffn()
    after = _torch_functions()
    assert [key for key, value in before.items() if after.get(key) is not value] == []
    assert DTensorSpec.__post_init__ is before[("DTensorSpec", "__post_init__")]


def test_a_rule_raising_type_error_names_op_rule_and_torch(fake_world, monkeypatch):
    from autoparallel.options import strategies

    def broken_gelu_rule(node, candidates, mesh):
        return torch_compat_missing_function(node)  # noqa: F821 - the bug under test

    monkeypatch.setitem(strategies.RULES, torch.ops.aten.gelu.default, broken_gelu_rule)
    fake_world(4)
    with pytest.raises(torch_compat.RuleError) as info:
        _enumerate_ffn()
    message = str(info.value)
    assert "aten.gelu.default" in message
    assert "broken_gelu_rule" in message and torch.__version__ in message and "NameError" in message


def test_a_dtensor_rule_raising_type_error_is_an_error(fake_world, monkeypatch):
    """A changed torch API inside DTensor's rule (here: a keyword it no
    longer takes) is an error, not a replicate fallback."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.gelu.default
    table = prop.op_single_dim_strategy_funcs if op in prop.op_single_dim_strategy_funcs else prop.op_strategy_funcs
    assert op in table

    def gelu_rule_of_another_torch(*args, **kwargs):
        raise TypeError("expand_to_full_mesh_op_strategy() got an unexpected keyword argument 'renamed'")

    fake_world(4)
    monkeypatch.setitem(table, op, gelu_rule_of_another_torch)
    with pytest.raises(torch_compat.RuleError, match="gelu_rule_of_another_torch for aten.gelu.default"):
        _enumerate_ffn()


def test_decomposition_strategy_absent_is_none():
    marker = object()
    assert torch_compat.decomposition_strategy(types.SimpleNamespace(decomp_strategy=marker)) is marker
    assert torch_compat.decomposition_strategy(types.SimpleNamespace()) is None
