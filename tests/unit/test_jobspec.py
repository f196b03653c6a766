"""job.spec: a good spec, defaults, every bad field refused with SpecError (code bad_spec), messages naming the
fields as each reader spells them, and every field declared once with its rule."""

from __future__ import annotations

from dataclasses import fields

import pytest

from elastic_control_plane.job.spec import FIELDS, JobSpec, SpecError

GOOD = {
    "command": ["python", "train.py", "--epochs", "3"],
    "min_np": 2,
    "max_np": 4,
    "reset_limit": 3,
    "elastic_timeout": 30,
    "discovery_script": "/opt/discover.sh",
    "cooldown": [1, 10.5],
    "hung_timeout": 45.5,
    "cwd": "/work/job",
    "env": {"NCCL_DEBUG": "INFO", "SEED": "1"},
}


def test_good_spec_parses_every_field():
    spec = JobSpec.parse(GOOD)
    assert spec.command == ["python", "train.py", "--epochs", "3"]
    assert (spec.min_np, spec.max_np, spec.reset_limit) == (2, 4, 3)
    assert spec.elastic_timeout == 30.0 and isinstance(spec.elastic_timeout, float)
    assert spec.hung_timeout == 45.5
    assert spec.discovery_script == "/opt/discover.sh"
    assert spec.cooldown == (1.0, 10.5)
    assert spec.cwd == "/work/job"
    assert spec.env == {"NCCL_DEBUG": "INFO", "SEED": "1"}


def test_minimal_spec_takes_the_defaults():
    spec = JobSpec.parse({"command": ["true"]})
    assert spec == JobSpec(command=["true"])
    assert (spec.min_np, spec.max_np, spec.reset_limit) == (1, None, None)
    assert spec.elastic_timeout == 600.0
    assert spec.cooldown == (60.0, 600.0)
    assert spec.env == {} and spec.cwd == "" and spec.discovery_script is None


def test_to_dict_parses_back_to_the_same_spec():
    spec = JobSpec.parse(GOOD)
    data = spec.to_dict()
    assert data["cooldown"] == [1.0, 10.5]
    assert JobSpec.parse(data) == spec


def test_cooldown_none_means_blacklist_forever_and_survives_to_dict():
    spec = JobSpec.parse({"command": ["x"], "cooldown": None})
    assert spec.cooldown is None
    assert spec.to_dict()["cooldown"] is None
    assert JobSpec.parse(spec.to_dict()).cooldown is None


def test_min_np_equal_to_max_np_is_fine():
    assert JobSpec.parse({"command": ["x"], "min_np": 3, "max_np": 3}).max_np == 3


def test_reset_limit_zero_is_fine():
    assert JobSpec.parse({"command": ["x"], "reset_limit": 0}).reset_limit == 0


def test_cooldown_equal_bounds_and_zero_are_fine():
    assert JobSpec.parse({"command": ["x"], "cooldown": [0, 0]}).cooldown == (0.0, 0.0)
    assert JobSpec.parse({"command": ["x"], "cooldown": [5, 5]}).cooldown == (5.0, 5.0)


def test_spec_not_a_map_is_bad_request():
    with pytest.raises(SpecError) as info:
        JobSpec.parse(["python", "train.py"])
    assert info.value.code == "bad_request"


BAD = {
    "min_np_above_max_np": {"min_np": 4, "max_np": 2},
    "min_np_zero": {"min_np": 0},
    "min_np_negative": {"min_np": -1},
    "min_np_not_int": {"min_np": "2"},
    "min_np_float": {"min_np": 2.0},
    "max_np_not_int": {"max_np": "8"},
    "max_np_below_default_min_np": {"max_np": 0},
    "command_empty": {"command": []},
    "command_missing": {"command": None},
    "command_a_string": {"command": "python train.py"},
    "command_with_non_string": {"command": ["python", 3]},
    "cooldown_min_above_max": {"cooldown": [10, 1]},
    "cooldown_one_number": {"cooldown": [5]},
    "cooldown_three_numbers": {"cooldown": [1, 2, 3]},
    "cooldown_negative": {"cooldown": [-1, 5]},
    "cooldown_not_numbers": {"cooldown": ["1", "5"]},
    "cooldown_a_number": {"cooldown": 60},
    "reset_limit_negative": {"reset_limit": -1},
    "reset_limit_not_int": {"reset_limit": "3"},
    "elastic_timeout_zero": {"elastic_timeout": 0},
    "elastic_timeout_negative": {"elastic_timeout": -5},
    "elastic_timeout_string": {"elastic_timeout": "600"},
    "hung_timeout_zero": {"hung_timeout": 0},
    "discovery_script_not_str": {"discovery_script": ["a.sh"]},
    "env_value_not_string": {"env": {"SEED": 1}},
    "env_key_not_string": {"env": {1: "a"}},
    "env_not_a_map": {"env": [["A", "1"]]},
    "cwd_not_string": {"cwd": 5},
}


@pytest.mark.parametrize("overrides", list(BAD.values()), ids=list(BAD))
def test_bad_field_is_bad_spec(overrides):
    raw = {"command": ["python", "train.py"], **overrides}
    if raw["command"] is None:
        del raw["command"]
    with pytest.raises(SpecError) as info:
        JobSpec.parse(raw)
    assert info.value.code == "bad_spec"
    assert str(info.value)


def test_min_np_above_max_np_message_names_both():
    with pytest.raises(SpecError) as info:
        JobSpec.parse({"command": ["x"], "min_np": 5, "max_np": 2})
    assert str(info.value) == "min_np (5) must not exceed max_np (2)"
    assert info.value.named({"min_np": "--min-np", "max_np": "--max-np"}) == "--min-np (5) must not exceed --max-np (2)"


def test_a_message_names_the_field_and_the_value_it_got():
    with pytest.raises(SpecError) as info:
        JobSpec.parse({"command": ["x"], "restart_window": 0})
    assert str(info.value) == "restart_window must be a positive number of seconds (got 0)"
    with pytest.raises(SpecError) as info:
        JobSpec.parse({"command": ["x"], "cooldown": [10, 1]})
    assert info.value.named({"cooldown": "--blacklist-cooldown MIN MAX"}) == (
        "--blacklist-cooldown MIN MAX needs 0 <= MIN <= MAX (got 10 1)"
    )


def test_every_field_is_declared_once_with_its_rule_and_a_default_that_keeps_it():
    assert FIELDS == tuple(spec_field.name for spec_field in fields(JobSpec))
    default = JobSpec.parse({"command": ["x"]})
    for spec_field in fields(JobSpec):
        check, value = spec_field.metadata["check"], getattr(default, spec_field.name)
        assert check(spec_field.name, value) == value, f"{spec_field.name}'s default keeps its rule"
        with pytest.raises(SpecError):
            check(spec_field.name, object())
