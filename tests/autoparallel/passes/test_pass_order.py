"""The passes run in the explicit PASS_ORDER, whatever the import order."""

import pytest

from autoparallel import passes


def test_every_listed_pass_is_registered_in_order():
    assert [p.name for p in passes.PASSES] == list(passes.PASS_ORDER)


def test_stages_run_plan_then_joint_then_graphs():
    stages = [p.stage for p in passes.PASSES]
    assert stages == sorted(stages, key=("plan", "joint", "graphs").index)


def test_an_unlisted_pass_is_refused():
    with pytest.raises(ValueError, match="not in PASS_ORDER"):
        passes.register_pass("my_pass", "graphs")(lambda gm, ctx: None)
    assert "my_pass" not in passes.pass_names()
