"""Startup checks: refuse, with the fix spelled out, every SGLang feature the witcert cache does not protect.

A feature that reads or moves the KV cache behind the backend's back would serve tokens the
certificate does not cover (or corrupt them: codes are keyed to their slot by the dither), so the
plugin stops the launch instead. The checks read SGLang's raw ``ServerArgs`` (what the operator
asked for), in the launching process and again in every worker process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from witcert.integrations.sglang.config import BACKEND_NAME


class WitcertStartupError(RuntimeError):
    """The launch asks for something the witcert backend cannot serve with its guarantee intact."""


@dataclass(frozen=True)
class ServingFeatures:
    """The launch options the plugin cares about, read off SGLang's ``ServerArgs``."""

    attention_backend: str | None
    prefill_attention_backend: str | None
    decode_attention_backend: str | None
    enable_hierarchical_cache: bool
    disaggregation_mode: str
    speculative_algorithm: str | None
    kv_cache_dtype: str
    decode_cuda_graph: bool
    prefill_cuda_graph: bool
    enable_unified_memory: bool
    enable_page_major_kv_layout: bool
    pp_size: int

    @classmethod
    def from_server_args(cls, server_args: Any) -> ServingFeatures:
        def flag(name: str) -> bool:
            return bool(getattr(server_args, name, False))

        def graph_on(phase: str) -> bool:
            disabled = (
                flag("disable_cuda_graph")
                or flag(f"disable_{phase}_cuda_graph")
                or getattr(server_args, f"cuda_graph_backend_{phase}", None) == "disabled"
            )
            return not disabled

        return cls(
            attention_backend=server_args.attention_backend,
            prefill_attention_backend=server_args.prefill_attention_backend,
            decode_attention_backend=server_args.decode_attention_backend,
            enable_hierarchical_cache=flag("enable_hierarchical_cache"),
            disaggregation_mode=str(getattr(server_args, "disaggregation_mode", "null") or "null"),
            speculative_algorithm=getattr(server_args, "speculative_algorithm", None),
            kv_cache_dtype=str(getattr(server_args, "kv_cache_dtype", "auto")),
            decode_cuda_graph=graph_on("decode"),
            prefill_cuda_graph=graph_on("prefill"),
            enable_unified_memory=flag("enable_unified_memory"),
            enable_page_major_kv_layout=flag("enable_page_major_kv_layout"),
            pp_size=int(getattr(server_args, "pp_size", 1) or 1),
        )

    @property
    def backends(self) -> tuple[str | None, str | None]:
        """The (prefill, decode) backends, each falling back to ``attention_backend`` as SGLang does."""
        return (
            self.prefill_attention_backend or self.attention_backend,
            self.decode_attention_backend or self.attention_backend,
        )

    @property
    def witcert_requested(self) -> bool:
        return BACKEND_NAME in self.backends


def refusals(features: ServingFeatures) -> list[str]:
    """Why this launch cannot run under witcert, one line each with its fix; empty when it can."""
    if not features.witcert_requested:
        return []
    problems = []
    for phase, backend in zip(("prefill", "decode"), features.backends, strict=True):
        if backend != BACKEND_NAME:
            reason = (
                "FlashInfer reads the KV pool as fp16 and cannot read witcert's int8 codes"
                if backend == "flashinfer"
                else f"{backend!r} cannot read witcert's int8 codes"
            )
            problems.append(
                f"the {phase} attention backend is {backend}: {reason}; use --attention-backend {BACKEND_NAME} "
                "for both prefill and decode"
            )
    if features.enable_hierarchical_cache:
        problems.append(
            "hierarchical cache (--enable-hierarchical-cache) copies KV pages to host without their scales and "
            "outliers; remove the flag"
        )
    if features.disaggregation_mode != "null":
        problems.append(
            f"PD disaggregation (--disaggregation-mode {features.disaggregation_mode}) transfers raw KV buffers; "
            "run prefill and decode in one server"
        )
    if features.speculative_algorithm:
        problems.append(
            f"speculative decoding ({features.speculative_algorithm}): the witcert backend has no draft or verify "
            "forward modes, and the pool does not move tokens between slots; remove --speculative-algorithm"
        )
    if features.kv_cache_dtype not in ("auto", "float16", "bfloat16", "fp16", "bf16"):
        problems.append(
            f"--kv-cache-dtype {features.kv_cache_dtype}: witcert is the KV quantizer and stores the model's own "
            "16-bit activations; use --kv-cache-dtype auto"
        )
    if features.decode_cuda_graph or features.prefill_cuda_graph:
        problems.append(
            "CUDA graphs are not supported by the witcert backend yet; add --cuda-graph-backend-decode disabled "
            "--cuda-graph-backend-prefill disabled"
        )
    if features.enable_unified_memory:
        problems.append("the unified memory pool carves its own KV layout; remove --enable-unified-memory")
    if features.enable_page_major_kv_layout:
        problems.append("the page-major KV layout is a different pool; remove --enable-page-major-kv-layout")
    if features.pp_size > 1:
        problems.append("pipeline parallelism (--pp-size > 1) is not covered; use tensor parallelism only")
    return problems


def check_features(features: ServingFeatures) -> None:
    """Raise ``WitcertStartupError`` listing every problem at once, or return when the launch is servable."""
    problems = refusals(features)
    if problems:
        listed = "\n  - ".join(problems)
        raise WitcertStartupError(f"witcert refuses to serve this launch unprotected:\n  - {listed}")


def check_server_args(server_args: Any) -> None:
    """``check_features`` on SGLang's ``ServerArgs``."""
    check_features(ServingFeatures.from_server_args(server_args))
