"""Fill `PipelineConfig` from a preset, a YAML file, environment variables and CLI flags.

Precedence, lowest first: field defaults < preset < ``--config-file`` YAML < environment
variables < CLI flags. pydantic-settings parses the environment and the command line
(``--train.epochs 3``, ``PIPELINE_TRAIN__EPOCHS=3``); this module only layers the two files
underneath whatever those gave. Every entry point reads the ``PIPELINE_`` prefix
(``PIPELINE_WORKLOAD=flowers``, ``PIPELINE_TRAIN__EPOCHS=3``). ``flows.mnist`` and ``flows.tune`` read
``MNIST_`` before; they still do, below ``PIPELINE_``, and the command line names each such variable
with its new name (`old_prefix_lines`). ``flows.train`` never read ``MNIST_``, so an MNIST setup's
variables stay out of its runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import AliasChoices, BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, CliApp, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from pipeline_config.model import PipelineConfig
from pipeline_config.tune import TunePipelineConfig

PRESET_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = ("default", "smoke", "nightly")
_CLI_ONLY = {"preset", "config_file", "summary_out", "verbose", "print_json", "lost_api_wait_s"}


# What a config file may cost to refuse: its size, and how many values it holds once YAML's
# anchors and aliases are expanded (a 2 KB file of nested aliases stands for billions of values;
# refusing it by its expanded form took minutes and gigabytes). A real config holds about a hundred.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 10_000
MAX_CONFIG_DEPTH = 32


def _check_size(data: Any, path: Path) -> None:
    """Refuse ``data`` when its expanded form exceeds the limits above; the walk stops at the limit, so it costs little."""
    budget = MAX_CONFIG_VALUES
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise ValueError(
                f"config file {path} expands to more than {MAX_CONFIG_VALUES:,} values (YAML anchors and aliases "
                "repeating each other?); a config holds a few hundred at most"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ValueError(f"config file {path} nests deeper than {MAX_CONFIG_DEPTH} levels; a config has three")
        if isinstance(value, dict):
            stack += [(item, depth + 1) for pair in value.items() for item in pair]
        elif isinstance(value, (list, tuple, set)):
            stack += [(item, depth + 1) for item in value]


def _read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, naming the file in every error; the cost of refusing it is bounded."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MB; a config holds a few KB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {str(exc)[:1000]}") from None
    except RecursionError:
        raise ValueError(f"config file {path} nests deeper than {MAX_CONFIG_DEPTH} levels") from None
    _check_size(data, path)
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of fields, not {type(data).__name__}")
    return data


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_preset(name: str, flow: str = "mnist") -> dict[str, Any]:
    """The field values a named preset sets (``default`` sets none).

    ``flow="tune"``: the tune flow's presets, ``presets/tune-<name>.yaml`` (when there is one)
    layered over the pipeline's own preset of that name.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    values = _read_yaml(PRESET_DIR / f"{name}.yaml")
    tune_preset = PRESET_DIR / f"tune-{name}.yaml"
    if flow == "tune" and tune_preset.exists():
        values = _deep_merge(values, _read_yaml(tune_preset))
    return values


def preset_with_file(preset: str, path: Path) -> dict[str, Any]:
    """The field values of ``preset`` with a YAML config file over them, as ``--preset P --config-file F`` layer them."""
    return preset_with(preset, _read_yaml(Path(path)))


def preset_with(preset: str, values: dict[str, Any]) -> dict[str, Any]:
    """The field values of ``preset`` with ``values`` over them, section by section."""
    return _deep_merge(load_preset(preset), values)


# The environment prefix of every entry point (issue 68), and the one flows.mnist and flows.tune read before.
ENV_PREFIX = "PIPELINE_"
OLD_ENV_PREFIX = "MNIST_"

_SETTINGS = {
    "env_prefix": ENV_PREFIX,
    "env_nested_delimiter": "__",
    "extra": "forbid",
    "cli_kebab_case": True,
    "cli_implicit_flags": True,
    "cli_avoid_json": True,
    "cli_hide_none_type": True,
    "nested_model_default_partial_update": True,
}


class CliOptions(BaseModel):
    """The command line's own options (not flow parameters) and the layering of preset and config file."""

    _flow: ClassVar[str] = "mnist"

    preset: Literal["default", "smoke", "nightly"] = Field(
        "default",
        description="Named starting values: default (the quality run), smoke (a minutes-long check) or nightly (the scheduled run).",
    )
    config_file: Path | None = Field(
        None, description="YAML file with any of the fields; env vars and flags override it, it overrides the preset."
    )
    summary_out: Path | None = Field(None, description="Also write the run summary JSON to this path.")
    verbose: bool = Field(
        False,
        description="Show everything in the terminal: Prefect's engine messages, and Ray's and Ray Data's logs (sets ray.log_to_driver).",
    )
    # Named print_json (a field called json would shadow BaseModel.json); the flag is --json.
    print_json: bool = Field(
        False,
        validation_alias=AliasChoices("json", "print_json"),
        description="Print the whole run summary as JSON at the end instead of the short summary.",
    )

    lost_api_wait_s: float = Field(
        180.0,
        ge=5,
        le=86_400,
        description=(
            "Seconds the run waits for a Prefect API that stopped answering; then it ends with the outcome it "
            "reached (summary.json) and says the orchestrator could not be told."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _layer_files(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        layered = load_preset(data.get("preset", "default"), cls._flow)
        if data.get("config_file"):
            layered = _deep_merge(layered, _read_yaml(Path(data["config_file"])))
        return _deep_merge(layered, data)

    def flow_values(self) -> dict[str, Any]:
        """The flow parameters' values, without the CLI-only fields (``--verbose`` turns on ``ray.log_to_driver``)."""
        values = self.model_dump(exclude=_CLI_ONLY)
        if self.verbose:
            values["ray"]["log_to_driver"] = True
        return values


class ReadsOldPrefix:
    """Settings that also read their fields from ``OLD_ENV_PREFIX`` variables, below ``ENV_PREFIX``'s ones."""

    old_env_prefix: ClassVar[str] = OLD_ENV_PREFIX

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource, file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        old = EnvSettingsSource(settings_cls, env_prefix=cls.old_env_prefix)
        return init_settings, env_settings, old, dotenv_settings, file_secret_settings


def old_prefix_lines(settings: type, environ: Mapping[str, str] | None = None) -> list[str]:
    """One line for each variable of the old prefix that ``settings`` still reads, naming what to set instead."""
    if not issubclass(settings, ReadsOldPrefix):
        return []
    old, new = settings.old_env_prefix, settings.model_config["env_prefix"]
    fields = {name.lower() for name in settings.model_fields}
    environ = os.environ if environ is None else environ
    return [
        f"{key}: read as {new}{key[len(old):]} (the {old} prefix is deprecated; set {new}{key[len(old):]} instead)"
        for key in sorted(environ) if key.upper().startswith(old) and key[len(old):].split("__", 1)[0].lower() in fields
    ]


class PipelineSettings(ReadsOldPrefix, BaseSettings, CliOptions, PipelineConfig):
    """Run the MNIST training pipeline (a Prefect flow on Ray) once and print its summary."""

    model_config = SettingsConfigDict(cli_prog_name="python -m flows.mnist", **_SETTINGS)

    def pipeline_config(self) -> PipelineConfig:
        """The flow's parameter: every field but the CLI-only ones."""
        return PipelineConfig.model_validate(self.flow_values())


class TrainSettings(BaseSettings, CliOptions, PipelineConfig):
    """Run the training pipeline for any workload (a Prefect flow on Ray) once and print its summary."""

    model_config = SettingsConfigDict(cli_prog_name="python -m flows.train", **_SETTINGS)

    def pipeline_config(self) -> PipelineConfig:
        """The flow's parameter: every field but the CLI-only ones."""
        return PipelineConfig.model_validate(self.flow_values())


class TuneSettings(ReadsOldPrefix, BaseSettings, CliOptions, TunePipelineConfig):
    """Search the training recipe with Ray Tune (a Prefect flow on Ray) and print the best trial."""

    _flow: ClassVar[str] = "tune"
    model_config = SettingsConfigDict(cli_prog_name="python -m flows.tune", **_SETTINGS)

    def pipeline_config(self) -> TunePipelineConfig:
        """The flow's parameter: every field but the CLI-only ones."""
        return TunePipelineConfig.model_validate(self.flow_values())


def parse_cli(argv: list[str] | None = None, settings: type[CliOptions] = PipelineSettings) -> CliOptions:
    """Parse flags and environment into validated ``settings`` (``--help`` lists every field)."""
    return CliApp.run(settings, cli_args=argv)
