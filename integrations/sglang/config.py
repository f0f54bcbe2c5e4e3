"""The plugin's configuration: the ``WITCERT_*`` environment variables, validated once.

The attention backend is chosen by its name on SGLang's command line (``--attention-backend witcert``);
everything else comes from the environment, because SGLang starts its scheduler and TP workers as
fresh processes that inherit the environment but not Python objects. Every variable has a default;
a malformed value, or a ``WITCERT_``-prefixed variable this plugin does not know (a typo would
otherwise be ignored silently), is refused with a message naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, ValidationError

from witcert.integrations.gating import CachePolicy, GateMode

ENV_PREFIX = "WITCERT_"
BACKEND_NAME = "witcert"


class ConfigError(ValueError):
    """A ``WITCERT_*`` variable is malformed or unknown."""


class WitcertSGLangSettings(BaseModel):
    """Every knob of the SGLang plugin; each field is read from ``WITCERT_<FIELD NAME IN CAPITALS>``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: GateMode = Field(
        GateMode.OBSERVE, description="off: int8 cache only; observe: report certificates; gate: also repair heads"
    )
    tau: float = Field(0.05, gt=0.0, lt=1.0, description="TV bound: above it a head is uncovered (and repaired)")
    stride: int = Field(32, ge=1, description="the aggregator keeps raw samples every stride-th decode step")
    collector_endpoint: AnyHttpUrl | None = Field(
        None,
        description="OTLP metrics endpoint, e.g. http://host:4318 (shorthand for OTEL_EXPORTER_OTLP_METRICS_ENDPOINT); "
        "unset and no OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT: no export",
    )
    flush_seconds: float | None = Field(
        None, gt=0.0, description="seconds between telemetry flushes; unset: OTEL_METRIC_EXPORT_INTERVAL, else 10"
    )
    outlier_pairs: int = Field(0, ge=0, description="RoPE pairs per head stored exactly (lowest frequencies)")
    dither_bits: Literal[8, 16, 24] = Field(8, description="bits per dither value (only 8 has a fused Triton kernel)")
    group_size: int = Field(32, gt=0, description="channels sharing one fp16 scale")
    v_dither: bool = Field(
        False, description="dither V as well as K: only the output-error bound's stochastic term uses it; slower decode"
    )
    outlier_file: Path | None = Field(
        None, description="exact RoPE pairs per (layer, KV head) from `witcert calibrate`; excludes outlier_pairs"
    )
    seed: int | None = Field(
        None, ge=0, lt=2**64, description="Philox key of the dither streams; unset: drawn at random per pool"
    )
    delta_req: float = Field(1e-2, gt=0.0, lt=1.0, description="failure probability allowed per request")
    horizon: int = Field(256, gt=0, description="decode steps the per-request union bound covers")
    repair_block: int = Field(16, gt=0, description="tokens per block paged in from the exact backup (gate mode)")

    def policy(self) -> CachePolicy:
        """The cache policy shared with the other integrations (``witcert.integrations.gating``)."""
        return CachePolicy(
            mode=self.mode,
            tau=self.tau,
            outlier_pairs=self.outlier_pairs,
            outlier_file=self.outlier_file,
            group_size=self.group_size,
            dither_bits=self.dither_bits,
            v_dither=self.v_dither,
            seed=self.seed,
            delta_req=self.delta_req,
            horizon=self.horizon,
            repair_block=self.repair_block,
            stride=self.stride,
        )


def known_variables() -> list[str]:
    return sorted(ENV_PREFIX + name.upper() for name in WitcertSGLangSettings.model_fields)


def load_settings(environ: Mapping[str, str] | None = None) -> WitcertSGLangSettings:
    """Read and validate the ``WITCERT_*`` variables of ``environ`` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    ours = {key: value for key, value in environ.items() if key.upper().startswith(ENV_PREFIX)}
    unknown = sorted(key for key in ours if key.upper() not in known_variables())
    if unknown:
        raise ConfigError(
            f"unknown witcert setting(s) {', '.join(unknown)}; the SGLang plugin reads {', '.join(known_variables())}"
        )
    values = {key.upper()[len(ENV_PREFIX) :].lower(): value for key, value in ours.items()}
    try:
        return WitcertSGLangSettings.model_validate(values)
    except ValidationError as error:
        problems = "; ".join(
            f"{ENV_PREFIX}{str(issue['loc'][0]).upper()}={values.get(str(issue['loc'][0]))!r}: {issue['msg']}"
            for issue in error.errors()
        )
        raise ConfigError(f"invalid witcert setting(s): {problems}") from None
