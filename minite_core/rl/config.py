"""One run configuration: every knob of an RL run, declared once, read the same way by `minite train`,
`minite learner` and `minite up`.

A value comes from, in rising precedence: the field's default, a config file (`--config run.toml`, or a
.json file: the same keys), a `MINITE_<NAME>` environment variable, a `--kebab-case-name` flag. The GRPO
names are TRL's GRPOConfig names (`num_generations`, `max_prompt_length`, `max_completion_length`,
`beta`, `epsilon`, `epsilon_high`, `loss_type`, `scale_rewards`, `reward_weights`, `eval_steps`, ...), so
a TRL recipe carries over by name. An unknown key (in the file or as a keyword) or a value of the wrong
type is an error that names the key; nothing starts half-configured.

The services add their own fields (ports, auth, replicas) by subclassing RunConfig, so a run file works
unchanged for `minite train` (one process) and `minite up` (the rollout and learner services).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict, SettingsError

from .grpo import CORRECTIONS, LOSS_TYPES, SCALE_REWARDS, GRPOConfig

BUILTIN_MODEL = Path("runs/tiny-model")  # where the built-in tiny model is built on first use
BUILTIN_MOE_MODEL = Path("runs/tiny-moe")

CHOICES = {  # the settings that take one of a few words
    "precision": ("nvfp4", "bf16", "fp32"),
    "backend": ("torch", "triton"),
    "backward": ("ste", "nvfp4", "fp8"),
    "data_parallel": ("none", "ddp", "fsdp"),
    "loss_type": LOSS_TYPES,
    "weight_sync": ("grpc", "shared", "auto"),  # (the learner service's)
}


def one_of(v, info):
    """Field validator for the one-of-a-few-words settings (CHOICES)."""
    allowed = CHOICES[info.field_name]
    if v not in allowed:
        raise ValueError(f"{info.field_name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, not {v!r}")
    return v


def usable_device(v: str) -> str:
    """A torch device this machine has ("cpu", "cuda", "cuda:1"), else a ValueError saying why."""
    import torch

    try:
        d = torch.device(v)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {v!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {v!r}: this machine has no CUDA device torch can use "
                             "(torch.cuda.is_available() is False); use cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device {v!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif d.type != "cpu":
        raise ValueError(f"device {v!r}: only cpu and cuda are supported")
    return v


SETTINGS = dict(env_prefix="MINITE_", cli_kebab_case=True, cli_implicit_flags=True, cli_exit_on_error=False)


class RunConfig(BaseSettings):
    """Every setting of an RL run, from --config FILE (TOML/JSON), MINITE_<NAME> and flags (docs/tasks.md)."""
    model_config = SettingsConfigDict(**SETTINGS, extra="forbid")

    # -- the model -------------------------------------------------------------------------------
    model_dir: Path | None = Field(None, description="a local HF Qwen3 / Qwen3-MoE checkpoint directory (config.json, "
                                   "*.safetensors, tokenizer files); unset: the built-in tiny model, built on first use")
    moe: bool = Field(False, description="with no model_dir: the MoE variant of the built-in tiny model")
    precision: str = Field("nvfp4", description="nvfp4 (W4A4), bf16 or fp32")
    backward: str = Field("ste", description="gradient recipe of the NVFP4 linears: ste, nvfp4 or fp8 "
                          "(minite_core/backward.py)")
    backend: str = Field("torch", description="kernel backend: torch or triton")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda (a data-parallel rank takes its own GPU)")
    data_parallel: str = Field("none", description="none, ddp or fsdp: one learner over the ranks torchrun starts")
    rollout_knobs: dict[str, str] = Field(default_factory=dict, description="misalign the rollout engine on purpose, "
                                          'e.g. {"matmul": "library"} (see docs/consistency.md)')
    # -- data, rewards, evaluation -----------------------------------------------------------------
    dataset: str = Field("addition", description="prompts: a .jsonl / .json / .parquet / .csv file or a "
                         "datasets.save_to_disk folder with a `prompt` column; `addition` (the built-in task); "
                         "`reasoning_gym:<name>`")
    task: str | None = Field(None, description="package.module:factory returning a Task (instead of dataset + reward)")
    reward: list[str] = Field(default_factory=list, description="reward functions: path/to/file.py:name, "
                              "package.module:name or a built-in name (repeat the flag); unset: the dataset's own")
    reward_weights: list[float] | None = Field(None, description="one weight per reward function (default: 1 each)")
    eval_dataset: str | None = Field(None, description="prompts to evaluate on (same forms as dataset); unset: the "
                                     "dataset's own evaluation set, if it has one")
    eval_steps: int = Field(0, ge=0, description="evaluate every N steps (0: before the first and after the last only)")
    eval_max_rows: int = Field(256, ge=1, description="evaluate on at most this many rows of the eval dataset")
    num_generations_eval: int = Field(1, ge=1, description="samples per eval prompt: 1 = greedy; k > 1 adds the "
                                      "sampled mean and pass@k")
    pass_threshold: float = Field(1.0, description="a sample passes (pass@k) when its total reward is at least this")
    chat_template_kwargs: dict = Field(default_factory=dict, description='passed to the chat template, e.g. '
                                       '{"enable_thinking": false}')
    stop: list[str] = Field(default_factory=list, description="stop strings: a completion ends after the first")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end a completion (default: the "
                                             "model's eos ids from generation_config.json)")
    # -- GRPO (TRL's names) -------------------------------------------------------------------------
    steps: int = Field(150, ge=0, description="GRPO steps")
    prompts_per_step: int = Field(16, ge=1, description="prompts per step (x num_generations completions)")
    num_generations: int = Field(8, ge=2, description="completions per prompt (the GRPO group)")
    max_prompt_length: int = Field(512, ge=1, description="longer prompts are skipped (and counted in the log)")
    max_completion_length: int | None = Field(None, ge=1, description="tokens sampled per completion (default: the "
                                              "dataset's own: 4 for addition, else 256)")
    temperature: float = Field(1.0, gt=0, le=100, description="sampling temperature of the rollouts (and of their logprobs)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the rollouts: keep the most likely tokens up to this mass")
    learning_rate: float = Field(5e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="clip the gradient's global norm to this")
    beta: float = Field(0.0, ge=0, description="KL penalty to the initial policy (0: no reference model)")
    epsilon: float = Field(0.2, ge=0, description="PPO clip range of the importance ratio (lower side; and upper unless epsilon_high)")
    epsilon_high: float | None = Field(None, ge=0, description="upper clip (DAPO's clip-higher); unset: = epsilon")
    loss_type: str = Field("grpo", description="grpo, dapo or dr_grpo")
    scale_rewards: str = Field("group", description="TRL's: group (divide advantages by the group's reward std), "
                               "batch (by the whole batch's), none (Dr. GRPO); true / false read as group / none")
    rollout_correction: str | None = Field("tis", description="tis, mis_token, mis_seq or none")
    tis_cap: float = Field(2.0, ge=1, description="truncation of the rollout-correction importance weights")
    seed: int = Field(0, description="sampling seeds and the order of the dataset's rows")
    # -- the run -------------------------------------------------------------------------------------
    run_dir: Path = Field(Path("runs/train"), description="metrics.jsonl, checkpoints, the trajectory log, the plot")
    checkpoint_every: int = Field(10, ge=1, description="steps between checkpoints")
    resume: bool = Field(False, description="continue from the run directory's checkpoint")

    @field_validator("precision", "backend", "backward", "data_parallel", "loss_type")
    @classmethod
    def _choices(cls, v, info):
        return one_of(v, info)

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        return usable_device(v)

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale(cls, v):
        v = {True: "group", False: "none", "true": "group", "false": "none"}.get(v, v) if isinstance(v, (bool, str)) else v
        if v not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be group, batch or none (or true / false), not {v!r}")
        return v

    @field_validator("rollout_correction", mode="before")
    @classmethod
    def _correction(cls, v):
        v = None if v in (None, "none", "") else v
        if v not in CORRECTIONS:
            raise ValueError(f"rollout_correction must be tis, mis_token, mis_seq or none, not {v!r}")
        return v

    @field_validator("learning_rate", "temperature", "top_p", "weight_decay", "max_grad_norm", "beta", "epsilon",
                     "tis_cap", "pass_threshold")
    @classmethod
    def _finite(cls, v, info):
        if not math.isfinite(v):
            raise ValueError(f"{info.field_name} must be a finite number")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.reward_weights is not None and self.reward and len(self.reward_weights) != len(self.reward):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} values for {len(self.reward)} reward "
                             "functions")
        if self.task is not None and ":" not in self.task:
            raise ValueError(f"task must be package.module:factory, got {self.task!r}")
        return self

    # -- derived -------------------------------------------------------------------------------------
    @property
    def builtin_model(self) -> bool:
        return self.model_dir is None

    @property
    def model_path(self) -> Path:
        """The checkpoint directory (the built-in tiny model's when model_dir is unset)."""
        if self.model_dir is not None:
            return Path(self.model_dir)
        return BUILTIN_MOE_MODEL if self.moe else BUILTIN_MODEL

    def grpo(self, max_completion_length: int) -> GRPOConfig:
        g = GRPOConfig(num_generations=self.num_generations, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
                       beta=self.beta, loss_type=self.loss_type, scale_rewards=self.scale_rewards,
                       temperature=self.temperature, max_completion_length=max_completion_length,
                       rollout_correction=self.rollout_correction, tis_cap=self.tis_cap)
        g.validate()
        return g

    def run_fields(self) -> dict:
        """The RunConfig fields of this object (a service's settings hold more), JSON-ready."""
        return json.loads(self.model_dump_json(include=set(RunConfig.model_fields)))


# -- reading -----------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config file, flag or environment variable that cannot be used (the message names it)."""


def read_file(path) -> dict:
    """The keys of a TOML or JSON config file (a flat table; section names are ignored, keys are merged)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except ValueError as e:  # (tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors)
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of keys")
    flat, where = {}, {}
    for k, v in data.items():  # [grpo] / [data] sections are for the reader's eye: their keys are merged
        for key, value, place in ([(kk, vv, f"[{k}]") for kk, vv in v.items()]
                                  if isinstance(v, dict) and k not in RunConfig.model_fields else [(k, v, "the top level")]):
            key = key.replace("-", "_")
            if key in flat:  # (which one wins would be the file's order: say so instead)
                raise ConfigError(f"{path}: {key} is set twice, at {where[key]} and in {place}")
            flat[key], where[key] = value, place
    return flat


def load(cls: type[BaseSettings], argv: list[str], prog: str, *, defaults: dict | None = None):
    """Settings of `cls` from `--config FILE` (if given), MINITE_* env vars and the flags in `argv` (in that
    rising order). Raises ConfigError naming the key or flag that is wrong."""
    argv = list(argv)
    file_values: dict = {}
    path = None
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        i = next(i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config="))
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file")
            path = argv[i + 1]
            del argv[i:i + 2]
        else:
            path = argv.pop(i).split("=", 1)[1]
        if "--config" in argv or any(a.startswith("--config=") for a in argv):
            raise ConfigError("give one --config file (put the settings in one file; flags override it)")
        file_values = read_file(path)
        unknown = sorted(set(file_values) - set(cls.model_fields))
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)} (see `{prog} --help`)")
    try:
        cli = CliSettingsSource(cls, cli_parse_args=argv, cli_prog_name=prog, cli_kebab_case=True,
                                cli_implicit_flags=True, cli_exit_on_error=False, cli_hide_none_type=True,
                                add_argument_method=_add_argument)()
    except SettingsError as e:
        raise ConfigError(str(e)) from None
    env = _env(cls)
    try:
        return cls(**{**(defaults or {}), **file_values, **env, **cli})
    except ValidationError as e:
        def origin(key) -> str:  # where the offending value came from
            if key in cli:
                return f" (flag --{str(key).replace('_', '-')})"
            if key in env:
                return f" (MINITE_{str(key).upper()})"
            return f" (in {path})" if key in file_values else ""
        lines = [f"{'.'.join(str(x) for x in err['loc']) or 'settings'}{origin(err['loc'][0] if err['loc'] else '')}: "
                 f"{err['msg'].removeprefix('Value error, ')}"  # (our validators' messages quote the value)
                 + (f" (got {err['input']!r})" if err["type"] not in ("missing", "value_error") else "")
                 for err in e.errors()]
        raise ConfigError("invalid settings\n  " + "\n  ".join(lines)) from None


# --help shows what a flag takes in words, not Python type names ({Path,null}, list[str], dict[str,str])
_METAVARS = {"int": "N", "float": "X", "str": "TEXT", "Path": "PATH", "SecretStr": "TOKEN", "dict": "JSON",
             "dict[str,str]": "JSON", "list[str]": "TEXT ...", "list[int]": "N ...", "list[float]": "X ..."}


def _add_argument(parser, *names, **kw):
    """argparse's add_argument, with the metavar pydantic-settings derives from the type made readable."""
    meta = kw.get("metavar")
    if isinstance(meta, str):
        kw["metavar"] = _METAVARS.get(meta.strip("{}").removesuffix(",null").removeprefix("null,"), meta)
    return parser.add_argument(*names, **kw)


def _env(cls) -> dict:
    from pydantic_settings import EnvSettingsSource

    try:
        return EnvSettingsSource(cls)()
    except SettingsError as e:
        raise ConfigError(str(e)) from None


def parse(cls, argv: list[str], prog: str, **kw):
    """load(), for a command line: on a bad setting print what is wrong and exit 2 (`--help` exits 0)."""
    try:
        return load(cls, argv, prog, **kw)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
    raise SystemExit(2)
