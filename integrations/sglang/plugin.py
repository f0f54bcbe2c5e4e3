"""The ``sglang.srt.plugins`` entry point: registers the ``witcert`` backend and the hooks it depends on.

SGLang calls ``register()`` in every process it starts (launcher, scheduler, TP workers), then
applies the registered hooks. Three hooks, all inert unless ``witcert`` is the requested backend:

- ``DefaultPoolConfigurator._compute_cell_size`` returns the witcert byte account
  (``capacity.cell_size_bytes``), so SGLang's token capacity grows with the savings;
- ``KVCacheConfigurator._resolve_kv_pool_class`` hands SGLang ``WitcertKVPool`` for MHA, refuses
  MLA, hybrid sliding-window and Mamba-style models, and refuses to build the pool if the capacity
  was not computed by the hook above in this process (the bytes saved would sit idle);
- ``ServerArgs.check_server_args`` refuses unsupported features in the launching process
  (``checks.py``); the backend factory repeats the checks, and verifies the hooks, in each worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from witcert.integrations.sglang.checks import WitcertStartupError, check_server_args
from witcert.integrations.sglang.config import BACKEND_NAME, load_settings

if TYPE_CHECKING:
    from witcert.integrations.sglang.backend import WitcertAttnBackend

logger = logging.getLogger("witcert.sglang")

CELL_SIZE_TARGET = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
POOL_CLASS_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class"
SERVER_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.check_server_args"

# Set by the cell-size hook when it sized a witcert pool in this process; the pool hook insists on it.
_capacity_accounted = False


def _requested(server_args: Any) -> bool:
    names = (
        getattr(server_args, "attention_backend", None),
        getattr(server_args, "prefill_attention_backend", None),
        getattr(server_args, "decode_attention_backend", None),
    )
    return BACKEND_NAME in names


def witcert_cell_size(original: Callable[..., int], self: Any, kvc: Any, num_layers: int) -> int:
    """AROUND hook of ``DefaultPoolConfigurator._compute_cell_size``: the witcert account when witcert serves."""
    global _capacity_accounted
    if not _requested(kvc.server_args):
        return original(self, kvc, num_layers)
    from sglang.srt.runtime_context import get_parallel

    from witcert.integrations.sglang.capacity import cell_size_bytes

    if kvc.use_mla_backend:
        raise WitcertStartupError("witcert covers multi-head / grouped-query attention, not MLA models")
    model_config = kvc.model_config
    if model_config.head_dim != model_config.v_head_dim:
        raise WitcertStartupError("witcert needs equal K and V head dims")
    policy = load_settings().policy()
    parallel = get_parallel()
    cell = cell_size_bytes(
        num_layers=num_layers,
        num_kv_heads=model_config.get_num_kv_heads(parallel.attn_tp_size, parallel.attn_dcp_size),
        head_dim=model_config.head_dim,
        group_size=policy.group_size,
        outlier_pairs=policy.exact_pairs(),
    )
    _capacity_accounted = True
    logger.info("witcert KV account: %d bytes per token over %d layers", cell, num_layers)
    return cell


def witcert_pool_class(original: Callable[..., type], self: Any, *, kind: str, default: type) -> type:
    """AROUND hook of ``KVCacheConfigurator._resolve_kv_pool_class``: ``WitcertKVPool`` when witcert serves."""
    if not _requested(self.server_args):
        return original(self, kind=kind, default=default)
    if self.use_mla_backend:
        raise WitcertStartupError("witcert provides an MHA/GQA KV pool; this model needs an MLA pool")
    if self.is_hybrid_swa or getattr(self, "mambaish_config", None) is not None:
        raise WitcertStartupError("witcert does not cover hybrid sliding-window or Mamba-style models")
    if kind != "mha":
        # SGLang resolves the MLA and DSA classes for every model; an MHA model (all we serve) never builds them.
        return original(self, kind=kind, default=default)
    if not _capacity_accounted:
        raise WitcertStartupError(
            "SGLang sized the KV pool without the witcert byte account (the cell-size hook did not run); "
            "refusing to build a pool whose savings would sit idle"
        )
    from witcert.integrations.sglang.pool import WitcertKVPool

    return WitcertKVPool


def check_launch(result: Any, server_args: Any) -> None:
    """AFTER hook of ``ServerArgs.check_server_args``: refuse unsupported features before any worker starts."""
    if _requested(server_args):
        load_settings()  # a malformed WITCERT_* variable stops the launch here, with its name
        check_server_args(server_args)
        verify_hooks()


def create_witcert_backend(model_runner: Any) -> WitcertAttnBackend:
    """SGLang's backend factory for ``--attention-backend witcert`` (runs in each TP worker)."""
    verify_hooks()
    check_server_args(model_runner.server_args)
    from witcert.integrations.sglang.backend import WitcertAttnBackend

    return WitcertAttnBackend(model_runner)


HOOKS: dict[str, tuple[str, Callable[..., Any]]] = {
    CELL_SIZE_TARGET: ("around", witcert_cell_size),
    POOL_CLASS_TARGET: ("around", witcert_pool_class),
    SERVER_ARGS_TARGET: ("after", check_launch),
}


def _wraps_hook(function: Any, hook: Callable[..., Any]) -> bool:
    """Whether ``function`` is one of SGLang's hook wrappers (possibly nested) around ``hook``."""
    while function is not None:
        cells = getattr(function, "__closure__", None) or ()
        if any(cell.cell_contents is hook for cell in cells):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def missing_hooks() -> list[str]:
    """The targets not (or no longer) wrapped by this plugin's hooks, plus a missing backend registration."""
    import pkgutil

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    missing = []
    for target, (_, hook) in HOOKS.items():
        owner_path, name = target.rsplit(".", 1)
        if not _wraps_hook(getattr(pkgutil.resolve_name(owner_path), name, None), hook):
            missing.append(target)
    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not create_witcert_backend:
        missing.append(f"attention backend registry entry {BACKEND_NAME!r}")
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        missing.append(f"--attention-backend choice {BACKEND_NAME!r}")
    return missing


def verify_hooks() -> None:
    missing = missing_hooks()
    if missing:
        raise WitcertStartupError(
            "the witcert plugin's hooks are not in place, so the pool, its capacity or the launch checks would be "
            f"SGLang's own: {', '.join(missing)} (an SGLang version other than 0.5.23, or another plugin replacing "
            "them?)"
        )


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group; SGLang applies the hooks right after it returns."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    register_attention_backend(BACKEND_NAME)(create_witcert_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    kinds = {"around": HookType.AROUND, "after": HookType.AFTER}
    for target, (kind, hook) in HOOKS.items():
        HookRegistry.register(target, hook, kinds[kind])
