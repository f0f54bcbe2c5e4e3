"""The SGLang plugin against SGLang 0.5.23's real classes, on CPU (Triton kernels in the interpreter).

Needs ``pip install --no-deps sglang==0.5.23`` and ``integrations/sglang/requirements-test.txt``;
skipped, with that reason, where SGLang is not installed.
"""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest
import torch

from witcert.integrations.sglang.checks import ServingFeatures, WitcertStartupError, refusals
from witcert.kernels import reference, select_path

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "SGLang is not installed: pip install --no-deps sglang==0.5.23 && "
        "pip install -r integrations/sglang/requirements-test.txt",
        allow_module_level=True,
    )

import sglang_torchvision_shim  # noqa: E402

sglang_torchvision_shim.install()

from counting_aggregator import CountingAggregator, assert_same_counts  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator, _PoolSizes  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (  # noqa: E402
    build_attention_backends,
)
from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    DenseAttentionCase,
    MockModelRunner,
    TinyModelConfig,
)

from witcert.integrations import gating  # noqa: E402
from witcert.integrations.sglang import backend as backend_module  # noqa: E402
from witcert.integrations.sglang import plugin  # noqa: E402
from witcert.integrations.sglang.pool import WitcertKVPool  # noqa: E402
from witcert.integrations.telemetry.aggregator import CertificateAggregator  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
MAX_CONTEXT = 32


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    """SGLang's own loader: discovers the entry point, runs ``register`` and applies the hooks."""
    load_plugins()


# --- configuration and launch checks -------------------------------------------------------------------


NO_GRAPHS = {"cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled"}


@pytest.mark.parametrize(
    ("options", "phrase"),
    [
        ({"enable_hierarchical_cache": True}, "hierarchical cache"),
        ({"disaggregation_mode": "decode"}, "PD disaggregation"),
        ({"speculative_algorithm": "EAGLE"}, "speculative decoding"),
        ({"decode_attention_backend": "flashinfer"}, "FlashInfer"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "kv-cache-dtype"),
        ({"cuda_graph_backend_decode": "full"}, "CUDA graphs"),
    ],
)
def test_unsupported_features_are_refused(options, phrase):
    server_args = ServerArgs(model_path="dummy", attention_backend="witcert", **{**NO_GRAPHS, **options})
    with pytest.raises(WitcertStartupError, match=phrase):
        plugin.check_launch(None, server_args)


def test_a_supported_launch_passes_and_other_backends_are_left_alone():
    plugin.check_launch(None, ServerArgs(model_path="dummy", attention_backend="witcert", **NO_GRAPHS))
    features = ServingFeatures.from_server_args(
        ServerArgs(model_path="dummy", attention_backend="triton", enable_hierarchical_cache=True)
    )
    assert not features.witcert_requested and refusals(features) == []


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A local Llama config (no weights): enough for SGLang to resolve its server arguments."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float16",
    )
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"], None),
        (["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
          "--enable-hierarchical-cache"], "hierarchical cache"),
        (["--decode-attention-backend", "flashinfer"], "FlashInfer"),
        ([], "CUDA graphs"),
    ],
)  # fmt: skip
def test_sglangs_launch_path_runs_the_checks(tiny_model_dir, flags, refusal):
    """What ``python -m sglang.launch_server`` does before any worker starts: parse, resolve, check."""
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", str(tiny_model_dir), "--attention-backend", "witcert", "--device", "cpu"]
    server_args = prepare_server_args([*argv, "--skip-tokenizer-init", *flags])
    server_args.resolve_once()
    if refusal is None:
        server_args.check_server_args()
    else:
        with pytest.raises(WitcertStartupError, match=refusal):
            server_args.check_server_args()


# --- plugin loading and hooks ----------------------------------------------------------------------------


def test_entry_point_loads_through_sglangs_loader():
    (entry,) = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "witcert"]
    assert entry.value == "witcert.integrations.sglang:register" and entry.dist.name == "witcert"
    assert ATTENTION_BACKENDS["witcert"] is plugin.create_witcert_backend
    assert "witcert" in ATTENTION_BACKEND_CHOICES
    assert plugin.missing_hooks() == []


def test_a_hook_that_did_not_apply_is_reported():
    hooked = DefaultPoolConfigurator._compute_cell_size
    DefaultPoolConfigurator._compute_cell_size = hooked.__wrapped__
    try:
        assert plugin.missing_hooks() == [plugin.CELL_SIZE_TARGET]
        with pytest.raises(WitcertStartupError, match="_compute_cell_size"):
            plugin.verify_hooks()
    finally:
        DefaultPoolConfigurator._compute_cell_size = hooked
    plugin.verify_hooks()


# --- capacity: SGLang's configurator sizes the pool with the int8 byte account ---------------------------


@pytest.mark.parametrize(("outlier_pairs", "group_size"), [(0, 32), (2, 32), (4, 64)])
def test_capacity_follows_the_int8_layout_to_the_byte(monkeypatch, outlier_pairs, group_size):
    monkeypatch.setenv("WITCERT_OUTLIER_PAIRS", str(outlier_pairs))
    monkeypatch.setenv("WITCERT_GROUP_SIZE", str(group_size))
    layers, kv_heads, head_dim, budget = 6, 2, 128, 10**9
    # Per layer, per side, per KV head: D int8 codes + D/G fp16 scales + 2m fp16 outlier values.
    per_head = head_dim + 2 * head_dim // group_size + 2 * 2 * outlier_pairs
    with (
        get_parallel().override(attn_dcp_size=1),
        get_context().override_server_args(max_total_tokens=None),
    ):
        fp16 = DefaultPoolConfigurator(
            _configurator(layers=layers, kv_heads=kv_heads, head_dim=head_dim, backend="triton")
        )
        ours = DefaultPoolConfigurator(_configurator(layers=layers, kv_heads=kv_heads, head_dim=head_dim))
        assert fp16._cell_size == layers * 2 * kv_heads * head_dim * 2
        assert ours._cell_size == layers * 2 * kv_heads * per_head
        tokens = ours.calculate_pool_sizes(budget, 1).max_total_num_tokens
        fp16_tokens = fp16.calculate_pool_sizes(budget, 1).max_total_num_tokens
    assert tokens == budget // (layers * 2 * kv_heads * per_head)
    if (outlier_pairs, group_size) == (0, 32):
        assert tokens / fp16_tokens == pytest.approx(256 / 136, rel=1e-4)  # the 1.88x of the byte account

    pool = _pool_from_configurator(num_rows=tokens // 1000, layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    assert sum(pool.get_kv_size_bytes()) == pool.num_rows * ours._cell_size == pool.num_rows * pool.bytes_per_token
    assert pool.witcert.bytes_per_token == ours._cell_size


def _configurator(*, layers: int, kv_heads: int, head_dim: int, backend: str = "witcert") -> KVCacheConfigurator:
    """A real ``KVCacheConfigurator`` holding what its pool-building path reads for a plain MHA model (its
    constructor would profile a GPU). ``kv_heads``: this rank's."""
    tp_size = get_parallel().attn_tp_size
    configurator = object.__new__(KVCacheConfigurator)
    fields = {
        "server_args": ServerArgs(model_path="dummy", attention_backend=backend),
        "is_draft_worker": False,
        "use_mla_backend": False,
        "is_hybrid_swa": False,
        "mambaish_config": None,
        "kv_cache_dtype": torch.float16,
        "kv_cache_dtype_str": "auto",
        "post_capture_kv_active": False,
        "kv_shard_rank": None,
        "kv_shard_size": 1,
        "kv_shard_spec": None,
        "kv_shard_group": None,
        "device": "cpu",
        "page_size": 1,
        "attn_dp_size": 1,
        "pp_size": 1,
        "draft_parallel_layout": None,
        "spec_algorithm": SpeculativeAlgorithm.NONE,
        # The whole model's heads: SGLang divides them by the attention TP width in force.
        "model_config": TinyModelConfig(
            num_heads=4 * kv_heads * tp_size,
            num_kv_heads=kv_heads * tp_size,
            head_dim=head_dim,
            hidden_size=1024,
            context_len=4096,
        ),
        "layer_info": SimpleNamespace(num_effective_layers=layers, start_layer=0, end_layer=layers),
    }
    for name, value in fields.items():
        setattr(configurator, name, value)
    return configurator


def _pool_from_configurator(*, num_rows: int, layers: int, kv_heads: int, head_dim: int):
    """The pool SGLang's own ``KVCacheConfigurator._build_token_to_kv_pool`` builds for an MHA model: it
    resolves every pool kind (through the hook) and constructs the MHA one with its production arguments."""
    configurator = _configurator(layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    sizes = _PoolSizes(
        max_total_num_tokens=num_rows - 1,
        max_running_requests=4,
        full_max_total_num_tokens=None,
        swa_max_total_num_tokens=None,
        c4_max_total_num_tokens=0,
        c128_max_total_num_tokens=0,
        c4_state_pool_size=0,
        c128_state_pool_size=0,
        c4_state_dtype=None,
        c128_state_dtype=None,
    )
    with (
        get_parallel().override(attn_dcp_size=1),
        get_context().override_server_args(
            attention_backend="witcert",
            page_size=1,
            prefill_only_disable_kv_cache=False,
            enable_memory_saver=False,
            speculative_algorithm=None,
        ),
    ):
        pool = configurator._build_token_to_kv_pool(
            sizes=sizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=None
        )
    assert type(pool) is WitcertKVPool
    return pool


@pytest.mark.parametrize("backend", ["triton", "witcert"])
def test_sglangs_pool_setup_sizes_and_builds_the_witcert_pool(monkeypatch, backend):
    """SGLang's configurator from a byte budget to pools: capacity from the cell size, pool, allocator."""
    monkeypatch.setattr(plugin, "_capacity_accounted", False)  # the flow itself must set it
    layers, kv_heads, head_dim, budget = 2, KV_HEADS, HEAD_DIM, 10**6
    configurator = _configurator(layers=layers, kv_heads=kv_heads, head_dim=head_dim, backend=backend)
    with (
        get_parallel().override(attn_dcp_size=1),
        get_context().override_server_args(
            attention_backend=backend,
            page_size=1,
            prefill_only_disable_kv_cache=False,
            enable_memory_saver=False,
            speculative_algorithm=None,
            max_total_tokens=None,
            max_running_requests=None,
        ),
    ):
        config = configurator.config_from_budget(budget)
        config.max_running_requests = configurator.resolve_max_num_reqs(config.max_total_num_tokens)
        sizes = configurator._derive_pool_sizes(config=config)
        pools = configurator._init_pools(sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None)
    pool = pools.token_to_kv_pool
    if backend == "triton":
        assert type(pool) is MHATokenToKVPool and not plugin._capacity_accounted
        assert config.max_total_num_tokens == budget // (layers * 2 * kv_heads * head_dim * 2)
        return
    cell = layers * 2 * kv_heads * (head_dim + 2 * head_dim // 32)
    assert type(pool) is WitcertKVPool and pool.size == config.max_total_num_tokens == budget // cell
    assert sum(pool.get_kv_size_bytes()) == pool.num_rows * cell <= budget + cell  # + the padding slot
    slots = pools.token_to_kv_pool_allocator.alloc(5)
    layer = RadixAttention(num_heads=HEADS, head_dim=head_dim, scaling=1.0, num_kv_heads=kv_heads, layer_id=1)
    k, v = torch.randn(2, 5, kv_heads, head_dim).half()
    pool.set_kv_buffer(layer, slots, k, v)
    # What was written decodes to within half a quantization step of each channel's group scale.
    error = (pool.witcert.dequantize(1, slots, "k") - k.float()).abs()
    steps = pool.witcert.scales[1, 0, slots].float().repeat_interleave(32, -1)
    assert bool((error <= steps / 2 + 1e-6).all())


def test_pool_hook_refuses_mla_and_an_unaccounted_capacity(monkeypatch):
    monkeypatch.setattr(plugin, "_capacity_accounted", True)
    configurator = _configurator(layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    # Every model resolves the MLA class too; for an MHA model that is SGLang's own, never built.
    assert configurator._resolve_kv_pool_class(kind="mla", default=MHATokenToKVPool) is MHATokenToKVPool
    configurator.use_mla_backend = True
    with pytest.raises(WitcertStartupError, match="MLA"):
        configurator._resolve_kv_pool_class(kind="mha", default=MHATokenToKVPool)
    configurator.use_mla_backend = False
    monkeypatch.setattr(plugin, "_capacity_accounted", False)
    with pytest.raises(WitcertStartupError, match="savings would sit idle"):
        configurator._resolve_kv_pool_class(kind="mha", default=MHATokenToKVPool)
    other = _configurator(layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM, backend="triton")
    assert other._resolve_kv_pool_class(kind="mha", default=MHATokenToKVPool) is MHATokenToKVPool


def test_moving_a_token_between_slots_is_refused(monkeypatch):
    monkeypatch.setattr(plugin, "_capacity_accounted", True)
    pool = _pool_from_configurator(num_rows=8, layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    assert pool.get_key_buffer(0).dtype == torch.uint8
    with pytest.raises(RuntimeError, match="dither"):
        pool.move_kv_cache(torch.tensor([1]), torch.tensor([2]))


# --- attention through SGLang's backend registry --------------------------------------------------------


def _slot(sequence: int, position: int) -> int:
    return 1 + sequence * MAX_CONTEXT + position


def _runner_and_backend(
    monkeypatch, mode: str, prefix_lens: tuple[int, ...], forward_mode: ForwardMode, tp_size: int = 1, layers: int = 1
):
    """A TP worker's view: the model has HEADS / KV_HEADS heads, this rank ``1 / tp_size`` of them; every
    layer's pool holds the prefixes. Returns layer 0's ``RadixAttention``."""
    monkeypatch.setenv("WITCERT_MODE", mode)
    monkeypatch.setattr(plugin, "_capacity_accounted", True)
    case = DenseAttentionCase(
        name="witcert",
        backend="witcert",
        forward_mode=forward_mode,
        num_heads=HEADS // tp_size,
        num_kv_heads=KV_HEADS // tp_size,
        page_size=1,
        prefix_lens=prefix_lens,
        extend_lens=(3,) * len(prefix_lens),
    )
    model_config = TinyModelConfig(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_size=HEADS * HEAD_DIM, context_len=MAX_CONTEXT
    )
    runner = MockModelRunner(
        case=case,
        model_config=model_config,
        dtype=torch.float16,
        device="cpu",
        max_context_len=MAX_CONTEXT,
        head_dim=HEAD_DIM,
    )
    runner.token_to_kv_pool = _pool_from_configurator(
        num_rows=runner.token_to_kv_pool.size + 1, layers=layers, kv_heads=case.num_kv_heads, head_dim=HEAD_DIM
    )
    backend = build_attention_backends(model_runner=runner).attn_backend
    generator = torch.Generator().manual_seed(len(prefix_lens) * 7 + len(mode))
    for sequence, length in enumerate(prefix_lens):
        slots = torch.tensor([_slot(sequence, i) for i in range(length)])
        for layer_id in range(layers):
            k, v = torch.randn(2, length, case.num_kv_heads, HEAD_DIM, generator=generator).half()
            runner.token_to_kv_pool.set_kv_buffer(_radix_layer(case, layer_id), slots, k, v)
    return case, runner, backend, _radix_layer(case, 0), generator


def _radix_layer(case: DenseAttentionCase, layer_id: int) -> RadixAttention:
    return RadixAttention(
        num_heads=case.num_heads,
        head_dim=HEAD_DIM,
        scaling=HEAD_DIM**-0.5,
        num_kv_heads=case.num_kv_heads,
        layer_id=layer_id,
    )


def _forward_batch(case: DenseAttentionCase, runner) -> ForwardBatch:
    seq_lens = case.seq_lens
    out_cache_loc, positions = [], []
    for sequence, (prefix, new) in enumerate(zip(case.prefix_lens, case.input_lens, strict=True)):
        for position in range(prefix + new):
            runner.req_to_token_pool.req_to_token[sequence, position] = _slot(sequence, position)
        positions += list(range(prefix, prefix + new))
        out_cache_loc += [_slot(sequence, p) for p in range(prefix, prefix + new)]
    batch = ForwardBatch(
        forward_mode=case.forward_mode,
        batch_size=case.batch_size,
        input_ids=torch.zeros(case.num_input_tokens, dtype=torch.int64),
        req_pool_indices=torch.arange(case.batch_size, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        positions=torch.tensor(positions, dtype=torch.int64),
    )
    if case.forward_mode.is_extend():
        batch.extend_prefix_lens = torch.tensor(case.prefix_lens, dtype=torch.int32)
        batch.extend_seq_lens = torch.tensor(case.input_lens, dtype=torch.int32)
        batch.extend_prefix_lens_cpu = list(case.prefix_lens)
        batch.extend_seq_lens_cpu = list(case.input_lens)
        batch.extend_num_tokens = case.num_input_tokens
    runner.kv_index_translator.bind_own_plan(batch)
    return batch


def _new_tokens(case: DenseAttentionCase, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    rows = case.num_input_tokens
    q = torch.randn(rows, case.num_heads * HEAD_DIM, generator=generator).half()
    k, v = torch.randn(2, rows, case.num_kv_heads * HEAD_DIM, generator=generator).half()
    return q, k, v


def test_decode_through_the_backend_matches_the_reference(monkeypatch):
    case, runner, backend, layer, generator = _runner_and_backend(monkeypatch, "observe", (5, 11), ForwardMode.DECODE)
    batch = _forward_batch(case, runner)
    q, k, v = _new_tokens(case, generator)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)
    assert out.shape == (2, HEADS * HEAD_DIM) and out.dtype == torch.float16
    assert select_path(torch.device("cpu")) == "triton-interpreter"  # the Triton kernels ran, not the reference

    pool = runner.token_to_kv_pool.witcert
    covered = 0
    for sequence, length in enumerate(case.seq_lens):
        slots = torch.tensor([_slot(sequence, i) for i in range(length)])
        expected = reference.decode_attention(
            q[sequence].view(HEADS, HEAD_DIM).float(),
            pool.quantized(0, slots, "k"),
            pool.quantized(0, slots, "v"),
            sm_scale=layer.scaling,
            delta_step=backend.delta_step,
        )
        torch.testing.assert_close(out[sequence].view(HEADS, HEAD_DIM).float(), expected.out, atol=2e-3, rtol=0)
        covered += int((expected.certificate <= backend.policy.tau).sum())
    snapshot = backend.aggregator.snapshot()
    assert int(snapshot.samples.sum()) == 2 * HEADS
    assert int(snapshot.covered.sum()) == covered
    assert int(snapshot.fallbacks.sum()) == 0


def test_extend_through_the_backend_is_causal_over_the_pool(monkeypatch):
    case, runner, backend, layer, generator = _runner_and_backend(monkeypatch, "off", (4,), ForwardMode.EXTEND)
    batch = _forward_batch(case, runner)
    q, k, v = _new_tokens(case, generator)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)
    pool = runner.token_to_kv_pool.witcert
    for token in range(case.num_input_tokens):
        slots = torch.tensor([_slot(0, i) for i in range(case.prefix_lens[0] + token + 1)])
        expected = reference.decode_attention(
            q[token].view(HEADS, HEAD_DIM).float(),
            pool.quantized(0, slots, "k"),
            pool.quantized(0, slots, "v"),
            sm_scale=layer.scaling,
            delta_step=0.5,
        )
        torch.testing.assert_close(out[token].view(HEADS, HEAD_DIM).float(), expected.out, atol=2e-3, rtol=0)
    assert backend.aggregator is None


def test_gate_mode_repairs_heads_above_tau_from_the_exact_backup(monkeypatch):
    monkeypatch.setenv("WITCERT_TAU", "1e-4")  # far below any certificate of an int8 cache: every head repairs
    case, runner, backend, layer, generator = _runner_and_backend(monkeypatch, "gate", (6,), ForwardMode.DECODE)
    batch = _forward_batch(case, runner)
    q, k, v = _new_tokens(case, generator)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)

    pool = runner.token_to_kv_pool
    slots = torch.tensor([_slot(0, i) for i in range(case.seq_lens[0])])
    exact_k, exact_v = (pool.exact[side][0, slots].float() for side in (0, 1))
    group = HEADS // KV_HEADS
    logits = layer.scaling * torch.einsum(
        "hd,shd->hs", q[0].view(HEADS, HEAD_DIM).float(), exact_k.repeat_interleave(group, 1)
    )
    exact_out = torch.einsum("hs,shd->hd", logits.softmax(-1), exact_v.repeat_interleave(group, 1))
    # Repaired until the certificate is below 1e-4: the output is the exact attention, up to fp16 rounding.
    torch.testing.assert_close(out[0].view(HEADS, HEAD_DIM).float(), exact_out, atol=2e-3, rtol=0)
    snapshot = backend.aggregator.snapshot()
    first_bytes = int(snapshot.repaired_bytes.sum())
    assert int(snapshot.fallbacks.sum()) >= 1 and first_bytes > 0
    assert int(snapshot.covered.sum()) == HEADS

    # The next step of the same sequence reuses what was paged in: only its new token can cost bytes.
    next_case = DenseAttentionCase(**{**case.__dict__, "prefix_lens": (case.seq_lens[0],)})
    next_batch = _forward_batch(next_case, runner)
    q, k, v = _new_tokens(next_case, generator)
    backend.init_forward_metadata(next_batch)
    backend.forward(q, k, v, layer, next_batch)
    second_bytes = int(backend.aggregator.snapshot().repaired_bytes.sum()) - first_bytes
    assert 0 <= second_bytes <= KV_HEADS * HEAD_DIM * 2 * 2  # one token's K and V rows, fp16, every KV head
    assert int(pool.repaired[0, slots].sum()) == KV_HEADS * case.seq_lens[0]
    # SGLang reusing a slot for another token makes it a quantized slot again.
    pool.set_kv_buffer(layer, slots[:1], *torch.randn(2, 1, KV_HEADS, HEAD_DIM, generator=generator).half())
    assert not bool(pool.repaired[0, slots[0]].any()) and bool(pool.repaired[0, slots[1]].all())


def _reports(monkeypatch, backend) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Every (certificate, fallback, repaired bytes) the backend records, one entry per decode layer call."""
    reported = []
    record = backend._report.record

    def keep(local, certificate, fallback, repaired):
        reported.append(tuple(None if x is None else x.clone() for x in (certificate, fallback, repaired)))
        record(local, certificate, fallback, repaired)

    monkeypatch.setattr(backend._report, "record", keep)
    return reported


def _repair_calls(monkeypatch) -> list[int]:
    """The rows handed to the repair path, one entry per call (the real function still runs)."""
    calls = []
    real = gating.certified_decode_rows

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(gating, "certified_decode_rows", counted)
    return calls


def _mixed_oracle(runner, layer: RadixAttention, query: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:
    """Float64 attention of each row (request ``b`` is row ``b``) over the slots it reads at layer 0: exact K/V
    at the (slot, KV head) pairs the pool marks repaired, dequantized K/V elsewhere. ``[B, H_q, D]``."""
    pool = runner.token_to_kv_pool
    group = HEADS // KV_HEADS
    outs = []
    for row, length in enumerate(seq_lens):
        slots = runner.req_to_token_pool.req_to_token[row, :length].long()
        exact = pool.repaired[0, slots][..., None]
        k, v = (
            torch.where(exact, pool.exact[side][0, slots].double(), pool.witcert.dequantize(0, slots, name).double())
            for side, name in ((0, "k"), (1, "v"))
        )
        q = query[row].view(HEADS, HEAD_DIM).double()
        logits = layer.scaling * torch.einsum("hd,shd->hs", q, k.repeat_interleave(group, 1))
        outs.append(torch.einsum("hs,shd->hd", logits.softmax(-1), v.repeat_interleave(group, 1)))
    return torch.stack(outs)


def _assert_relative(out: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    error = float((out.double().view_as(expected) - expected).abs().max())
    assert error <= rtol * float(expected.abs().max()), f"max error {error:.3g} vs scale {expected.abs().max():.3g}"


def test_gate_mode_reads_repaired_pairs_through_the_kernel_at_the_next_step(monkeypatch):
    tau = 0.012  # between the certificates of these rows (about 0.013 to 0.017): some blocks repair, not all
    monkeypatch.setenv("WITCERT_TAU", str(tau))
    monkeypatch.setenv("WITCERT_REPAIR_BLOCK", "4")
    case, runner, backend, layer, generator = _runner_and_backend(monkeypatch, "gate", (20, 25), ForwardMode.DECODE)
    reported = _reports(monkeypatch, backend)
    calls = _repair_calls(monkeypatch)
    batch = _forward_batch(case, runner)
    q, k, v = _new_tokens(case, generator)
    q = q.float()  # fp16 values, but the output comes back in float32
    backend.init_forward_metadata(batch)
    first = backend.forward(q, k, v, layer, batch)
    pool = runner.token_to_kv_pool
    repaired = pool.repaired[0].clone()
    assert sum(calls) == 2 and 0 < int(repaired.sum()) < KV_HEADS * sum(case.seq_lens)
    assert bool(reported[-1][1].any()) and int(reported[-1][2].sum()) > 0

    # The same step again (nothing written): the kernel skips the repaired pairs and the store's exact rows
    # are merged in; no row goes back to the repair path, and nothing more is paged in.
    calls.clear()
    backend.init_forward_metadata(batch)
    second = backend.forward(q, k, v, layer, batch, save_kv_cache=False)
    assert calls == []
    certificate, fallback, repaired_bytes = reported[-1]
    assert bool((certificate <= tau).all())
    assert not bool(fallback.any()) and int(repaired_bytes.sum()) == 0
    assert torch.equal(pool.repaired[0], repaired)
    _assert_relative(second, first.double())
    _assert_relative(second, _mixed_oracle(runner, layer, q, case.seq_lens))


def test_a_slot_rewritten_after_its_repair_is_read_quantized_again(monkeypatch):
    monkeypatch.setenv("WITCERT_TAU", "1e-4")  # every head repairs: every pair of the row ends up exact
    case, runner, backend, layer, generator = _runner_and_backend(monkeypatch, "gate", (6,), ForwardMode.DECODE)
    batch = _forward_batch(case, runner)
    q, k, v = _new_tokens(case, generator)
    q = q.float()
    backend.init_forward_metadata(batch)
    backend.forward(q, k, v, layer, batch)
    pool = runner.token_to_kv_pool
    store = pool.exact_store[0]
    slots = torch.tensor([_slot(0, i) for i in range(case.seq_lens[0])])
    assert bool(pool.repaired[0, slots].all()) and len(store) == KV_HEADS * len(slots)

    # SGLang gives slot 2 to another token: its stale exact entry must not be read, the new code must.
    stale = _mixed_oracle(runner, layer, q, case.seq_lens)
    pool.set_kv_buffer(layer, slots[2:3], *(8 * torch.randn(2, 1, KV_HEADS, HEAD_DIM, generator=generator)).half())
    assert not bool(pool.repaired[0, slots[2]].any()) and len(store) == KV_HEADS * len(slots)  # dead, not yet dropped
    expected = _mixed_oracle(runner, layer, q, case.seq_lens)
    assert float((expected - stale).abs().max()) > 1e-2 * float(expected.abs().max())  # the test can tell them apart
    monkeypatch.setattr(backend, "policy", backend.policy.model_copy(update={"tau": 0.9}))  # no repair now
    calls = _repair_calls(monkeypatch)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch, save_kv_cache=False)
    assert calls == []
    _assert_relative(out, expected)

    # Repaired again, the slot's new exact rows replace the dead entry (one entry per pair, never two).
    monkeypatch.setattr(backend, "policy", backend.policy.model_copy(update={"tau": 1e-4}))
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch, save_kv_cache=False)
    assert calls == [1] and bool(pool.repaired[0, slots].all()) and len(store) == KV_HEADS * len(slots)
    _assert_relative(out, _mixed_oracle(runner, layer, q, case.seq_lens))
    held, exact_k, _ = store.dense(pool.repaired[0], slots)
    assert bool(held.all()) and torch.equal(exact_k, pool.exact[0][0, slots])


def test_gate_mode_output_is_attention_over_mixed_keys_with_a_shared_prefix(monkeypatch):
    """Two requests share their first 8 slots (a radix-cache hit): a repaired shared pair is skipped by the
    kernel for both rows, and both get its exact part."""
    tau, shared = 0.012, 8
    monkeypatch.setenv("WITCERT_TAU", str(tau))
    monkeypatch.setenv("WITCERT_REPAIR_BLOCK", "4")
    case, runner, backend, layer, generator = _runner_and_backend(monkeypatch, "gate", (20, 25), ForwardMode.DECODE)
    reported = _reports(monkeypatch, backend)
    calls = _repair_calls(monkeypatch)
    pool = runner.token_to_kv_pool
    req_to_token = runner.req_to_token_pool.req_to_token

    def step(step_case: DenseAttentionCase) -> tuple[torch.Tensor, torch.Tensor]:
        batch = _forward_batch(step_case, runner)
        req_to_token[1, :shared] = req_to_token[0, :shared]
        q, k, v = _new_tokens(step_case, generator)
        q = q.float()
        backend.init_forward_metadata(batch)
        return q, backend.forward(q, k, v, layer, batch)

    q, out = step(case)
    assert calls and bool(pool.repaired[0, req_to_token[0, :shared].long()].any())
    _assert_relative(out, _mixed_oracle(runner, layer, q, case.seq_lens))

    # The next token, above tau or not, through the kernel and the merge (and the repair path if it must).
    calls.clear()
    next_case = DenseAttentionCase(**{**case.__dict__, "prefix_lens": case.seq_lens})
    q, out = step(next_case)
    assert bool((reported[-1][0] <= tau).all())
    _assert_relative(out, _mixed_oracle(runner, layer, q, next_case.seq_lens))

    # With tau out of reach, nothing repairs: the output is the kernel's and the merge's alone.
    calls.clear()
    monkeypatch.setattr(backend, "policy", backend.policy.model_copy(update={"tau": 0.9}))
    q, out = step(DenseAttentionCase(**{**case.__dict__, "prefix_lens": next_case.seq_lens}))
    assert calls == []
    _assert_relative(out, _mixed_oracle(runner, layer, q, tuple(n + 1 for n in next_case.seq_lens)))


@pytest.mark.usefixtures("reference_kernels")  # what is streamed, not how the kernel computes it
def test_each_tp_rank_streams_its_own_aggregator_to_the_collector(monkeypatch, collector):
    monkeypatch.setenv("WITCERT_COLLECTOR_ENDPOINT", f"http://127.0.0.1:{collector.ports.http}/v1/metrics")
    models = set()
    for rank in (0, 1):
        # One backend per TP worker process; here the two "processes" are two parallel-context states.
        with get_parallel().override(tp_size=2, tp_rank=rank, attn_tp_size=2, attn_tp_rank=rank, moe_tp_size=2):
            case, runner, backend, layer, generator = _runner_and_backend(
                monkeypatch, "observe", (3, 4), ForwardMode.DECODE, tp_size=2
            )
            batch = _forward_batch(case, runner)
            backend.init_forward_metadata(batch)
            backend.forward(*_new_tokens(case, generator), layer, batch)
            backend.stream.close()
            assert backend.stream.stats.export_failures == 0 and backend.stream.stats.points_dropped == 0
            models.add(backend.stream.identity.model)
    assert collector.wait_stored(30), "the collector did not store everything"
    (model,) = models
    _, rows = collector.store.query(
        "SELECT TpRank, sum(Certificates), min(Head), max(Head) FROM witcert_counts_1m "
        "WHERE Model = {m:String} AND Layer != 65535 GROUP BY TpRank ORDER BY TpRank",
        {"m": model},
    )
    # Two sequences x this rank's heads, per rank; the head attribute is the global index.
    local = HEADS // 2
    assert rows == [(0, 2 * local, 0, local - 1), (1, 2 * local, local, HEADS - 1)]


@pytest.mark.usefixtures("reference_kernels")  # what is reported, not how the kernel computes it
@pytest.mark.parametrize(("mode", "tau"), [("observe", "0.05"), ("gate", "1e-4")])
def test_one_aggregator_launch_per_decode_step_with_the_per_layer_counts(monkeypatch, mode, tau):
    monkeypatch.setenv("WITCERT_TAU", tau)
    monkeypatch.setenv("WITCERT_STRIDE", "2")
    monkeypatch.setattr(backend_module, "CertificateAggregator", CountingAggregator)  # the backend builds it
    layers = 2
    case, runner, backend, _, generator = _runner_and_backend(
        monkeypatch, mode, (5, 11), ForwardMode.DECODE, layers=layers
    )
    radix_layers = [_radix_layer(case, i) for i in range(layers)]
    aggregator = backend.aggregator
    per_layer = CertificateAggregator(layers, HEADS, tau=float(tau), stride=2, device="cpu")
    record = backend._report.record

    def per_layer_too(local, certificate, fallback, repaired):
        # What the backend used to report at this point: one observe call per layer, same tensors.
        per_layer.observe(local, certificate, fallback=fallback, repaired_bytes=repaired)
        record(local, certificate, fallback, repaired)

    monkeypatch.setattr(backend._report, "record", per_layer_too)

    def forward(step_case: DenseAttentionCase, upto: int = layers) -> None:
        batch = _forward_batch(step_case, runner)
        backend.init_forward_metadata(batch)
        q, k, v = _new_tokens(step_case, generator)
        for layer in radix_layers[:upto]:
            backend.forward(q, k, v, layer, batch)

    def step(mode: ForwardMode, prefix_lens: tuple[int, ...]) -> DenseAttentionCase:
        lens = {"forward_mode": mode, "prefix_lens": prefix_lens, "extend_lens": (3,) * len(prefix_lens)}
        return DenseAttentionCase(**{**case.__dict__, **lens})

    forward(case)  # two sequences
    forward(step(ForwardMode.DECODE, (6,)))  # the batch shrinks to one
    assert aggregator.calls == {"observe_layers": 2}
    forward(step(ForwardMode.EXTEND, (7,)))  # three prompt tokens: no certificate, no report
    assert aggregator.calls == {"observe_layers": 2}
    forward(step(ForwardMode.DECODE, (10, 12)), upto=1)  # a forward pass that stopped after its first layer
    assert aggregator.calls == {"observe_layers": 2}
    forward(step(ForwardMode.DECODE, (11, 13)))  # reports the interrupted step's layers first, then its own
    assert aggregator.calls == {"observe_layers": 4}
    forward(step(ForwardMode.DECODE, (12,)), upto=1)
    backend.flush_certificates()  # what the worker's exit does before its last export
    backend.flush_certificates()
    assert aggregator.calls == {"observe_layers": 5}
    snapshot = aggregator.snapshot()
    assert_same_counts(snapshot, per_layer.snapshot())
    assert snapshot.step == 5
    assert snapshot.samples[:, 0].tolist() == [2 + 1 + 2 + 2 + 1, 2 + 1 + 2]  # layer 1 ran in the 3 complete steps
    if mode == "gate":
        assert int(snapshot.fallbacks.sum()) > 0 and int(snapshot.repaired_bytes.sum()) > 0
