"""JobSpec: a submitted job, validated once at the door."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bus.service import RequestError

# horovod: the workers join rounds themselves through libworker; torchrun: each slot's supervisor joins them and
# starts the command with torchrun's environment (agent/torchrun_slot.py).
MODES = ("horovod", "torchrun")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_module_name(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class JobSpec:
    command: list[str]
    min_np: int = 1
    max_np: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600.0
    discovery_script: str | None = None
    cooldown: tuple[float, float] | None = (60.0, 600.0)
    hung_timeout: float = 120.0
    max_restarts: int = 3
    restart_window: float = 60.0
    checkpoint_dir: str | None = None
    checkpoint_interval: float = 30.0
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    mode: str = "horovod"
    preload: list[str] = field(default_factory=list)
    fork_server: bool = True

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["cooldown"] = list(self.cooldown) if self.cooldown else None
        return data

    @classmethod
    def parse(cls, raw: Any) -> JobSpec:
        if not isinstance(raw, dict):
            raise RequestError("bad_request", "spec must be a map")

        def bad(message: str) -> RequestError:
            return RequestError("bad_spec", message)

        command = raw.get("command")
        if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
            raise bad("command must be a non-empty list of strings")
        min_np, max_np = raw.get("min_np", 1), raw.get("max_np")
        if not _is_int(min_np) or min_np < 1:
            raise bad("min_np must be an integer >= 1")
        if max_np is not None and (not _is_int(max_np) or max_np < min_np):
            raise bad(f"max_np ({max_np}) must be an integer >= min_np ({min_np})")
        reset_limit = raw.get("reset_limit")
        if reset_limit is not None and (not _is_int(reset_limit) or reset_limit < 0):
            raise bad("reset_limit must be an integer >= 0")
        max_restarts = raw.get("max_restarts", cls.max_restarts)
        if not _is_int(max_restarts) or max_restarts < 0:
            raise bad("max_restarts must be an integer >= 0")
        numbers = {}
        for name in ("elastic_timeout", "hung_timeout", "restart_window", "checkpoint_interval"):
            value = raw.get(name, getattr(cls, name))
            if not _is_number(value) or value <= 0:
                raise bad(f"{name} must be a positive number of seconds")
            numbers[name] = float(value)
        cooldown = raw.get("cooldown", list(cls.cooldown or ()))
        if cooldown is not None:
            if not (
                isinstance(cooldown, list)
                and len(cooldown) == 2
                and all(_is_number(c) and c >= 0 for c in cooldown)
                and cooldown[0] <= cooldown[1]
            ):
                raise bad("cooldown must be [min, max] seconds with 0 <= min <= max")
            cooldown = (float(cooldown[0]), float(cooldown[1]))
        script = raw.get("discovery_script")
        if script is not None and not isinstance(script, str):
            raise bad("discovery_script must be a path")
        checkpoint_dir = raw.get("checkpoint_dir")
        if checkpoint_dir is not None and not (
            isinstance(checkpoint_dir, str) and checkpoint_dir.startswith("/") and len(checkpoint_dir) <= 4096
        ):
            raise bad("checkpoint_dir must be an absolute path")
        env = raw.get("env", {})
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise bad("env must map strings to strings")
        mode = raw.get("mode", cls.mode)
        if mode not in MODES:
            raise bad(f"mode must be one of {', '.join(MODES)}")
        cwd = raw.get("cwd", "")
        if not isinstance(cwd, str):
            raise bad("cwd must be a string")
        preload = raw.get("preload", [])
        if not (isinstance(preload, list) and all(isinstance(name, str) and _is_module_name(name) for name in preload)):
            raise bad("preload must be a list of module names")
        fork_server = raw.get("fork_server", True)
        if not isinstance(fork_server, bool):
            raise bad("fork_server must be true or false")
        return cls(
            command=command,
            min_np=min_np,
            max_np=max_np,
            reset_limit=reset_limit,
            discovery_script=script,
            cooldown=cooldown,
            max_restarts=max_restarts,
            checkpoint_dir=checkpoint_dir,
            cwd=cwd,
            env=env,
            mode=mode,
            preload=preload,
            fork_server=fork_server,
            **numbers,
        )
