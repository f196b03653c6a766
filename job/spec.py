"""JobSpec: a job as submitted: its fields, their defaults and the rule each keeps, in this one place (each field is
declared once, with its default and its rule).

Every reader takes the job from here:

- elasticctl's `run` and `local` options take their defaults from `JobSpec`,
  and the command checks what the operator typed with `JobSpec.parse` before
  it submits (a one-line error naming the options); a test checks that every
  field has its option (elasticctl/options.py);
- the registry parses every `submit` with `JobSpec.parse` (a refusal is
  `bad_spec`, or `bad_request` for a spec that is not a map);
- the hosts receive the spec whole in the job's plan (job.plan.JobPlan),
  parsed again by the same rules when it arrives.

The one rule across fields is `min_np` <= `max_np`. A `SpecError` names the
fields it is about as `{field}`: the registry's reply writes them as they are
on the wire, the CLI as its options (`SpecError.named`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

# horovod: the workers enter rounds themselves through libworker; torchrun: each slot's supervisor enters them and
# starts the command with torchrun's environment (slot_processes/torchrun_slot.py).
MODES = ("horovod", "torchrun")
PATH_MAX = 4096


class SpecError(ValueError):
    """A spec that breaks a rule; `code` is the registry's error code for it."""

    def __init__(self, template: str, *names: str, code: str = "bad_spec") -> None:
        self.template, self.names, self.code = template, names, code
        super().__init__(self.named({}))

    def named(self, spelled: Mapping[str, str]) -> str:
        """The message with each field it is about spelled as `spelled` says (by default, the field's own name)."""
        text = self.template
        for name in self.names:
            text = text.replace(f"{{{name}}}", spelled.get(name, name))
        return text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_module_name(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _shown(value: Any) -> str:
    return f"{value:g}" if _is_number(value) else repr(value)


Check = Callable[[str, Any], Any]  # (field, value) -> the value as the spec keeps it, or SpecError


def _count(least: int) -> Check:
    def check(name: str, value: Any) -> int:
        if not _is_int(value):
            raise SpecError(f"{{{name}}} must be an integer (got {_shown(value)})", name)
        if value < least:
            raise SpecError(f"{{{name}}} must be at least {least} (got {value})", name)
        return int(value)

    return check


def _seconds(name: str, value: Any) -> float:
    if not _is_number(value) or value <= 0:
        raise SpecError(f"{{{name}}} must be a positive number of seconds (got {_shown(value)})", name)
    return float(value)


def _optional(check: Check) -> Check:
    return lambda name, value: None if value is None else check(name, value)


def _text(rule: str, keeps: Callable[[str], bool] = lambda _: True) -> Check:
    def check(name: str, value: Any) -> str:
        if not (isinstance(value, str) and keeps(value)):
            raise SpecError(f"{{{name}}} {rule}", name)
        return value

    return check


def _command(name: str, value: Any) -> list[str]:
    if not (isinstance(value, list) and value and all(isinstance(part, str) for part in value)):
        raise SpecError(f"{{{name}}} must be a non-empty list of strings", name)
    return value


def _cooldown(name: str, value: Any) -> tuple[float, float]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(c) for c in value)):
        raise SpecError(f"{{{name}}} must be [min, max] seconds", name)
    low, high = value
    if low < 0 or high < low:
        raise SpecError(f"{{{name}}} needs 0 <= MIN <= MAX (got {low:g} {high:g})", name)
    return float(low), float(high)


def _env(name: str, value: Any) -> dict[str, str]:
    if not (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
        raise SpecError(f"{{{name}}} must map strings to strings", name)
    return value


def _mode(name: str, value: Any) -> str:
    if value not in MODES:
        raise SpecError(f"{{{name}}} must be one of {', '.join(MODES)} (got {_shown(value)})", name)
    return str(value)


def _preload(name: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        raise SpecError(f"{{{name}}} must be a list of module names", name)
    for module in value:
        if not (isinstance(module, str) and is_module_name(module)):
            raise SpecError(f"{{{name}}} must be a list of module names (got {module!r})", name)
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{{{name}}} must be true or false", name)
    return value


def _rule(check: Check, default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    """A field of the spec with its default and the rule it keeps."""
    return field(default=default, default_factory=default_factory, metadata={"check": check})


@dataclass(frozen=True)
class JobSpec:
    command: list[str] = _rule(_command)
    min_np: int = _rule(_count(1), 1)
    max_np: int | None = _rule(_optional(_count(1)), None)
    reset_limit: int | None = _rule(_optional(_count(0)), None)
    elastic_timeout: float = _rule(_seconds, 600.0)
    discovery_script: str | None = _rule(_optional(_text("must be a path")), None)
    cooldown: tuple[float, float] | None = _rule(_optional(_cooldown), (60.0, 600.0))
    probation_clean: float | None = _rule(_optional(_seconds), 600.0)  # a host's failures forgotten after a clean run
    hung_timeout: float = _rule(_seconds, 120.0)
    max_restarts: int = _rule(_count(0), 3)
    restart_window: float = _rule(_seconds, 60.0)
    checkpoint_dir: str | None = _rule(
        _optional(_text("must be an absolute path", lambda path: path.startswith("/") and len(path) <= PATH_MAX)),
        None,
    )
    checkpoint_interval: float = _rule(_seconds, 30.0)
    cwd: str = _rule(_text("must be a string"), "")
    env: dict[str, str] = _rule(_env, default_factory=dict)
    mode: str = _rule(_mode, "horovod")
    preload: list[str] = _rule(_preload, default_factory=list)
    fork_server: bool = _rule(_flag, True)
    hang_detection: bool = _rule(_flag, True)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["cooldown"] = list(self.cooldown) if self.cooldown else None
        return data

    @classmethod
    def parse(cls, raw: Any) -> JobSpec:
        """The spec in `raw` (a map of fields; a field it lacks takes its default, other keys are not read);
        SpecError at the first broken rule."""
        if not isinstance(raw, dict):
            raise SpecError("spec must be a map", code="bad_request")
        values = {}
        for spec_field in fields(cls):
            name = spec_field.name
            if spec_field.default is not MISSING:
                default = spec_field.default
            elif spec_field.default_factory is not MISSING:
                default = spec_field.default_factory()
            else:
                default = None
            values[name] = spec_field.metadata["check"](name, raw.get(name, default))
        if values["max_np"] is not None and values["max_np"] < values["min_np"]:
            raise SpecError(f"{{min_np}} ({values['min_np']}) must not exceed {{max_np}} ({values['max_np']})", *_NP)
        return cls(**values)


FIELDS = tuple(spec_field.name for spec_field in fields(JobSpec))  # the spec's fields, in order
_NP = ("min_np", "max_np")
