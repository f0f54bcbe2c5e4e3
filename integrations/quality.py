"""Teacher-forced quality harness: the witcert cache against the unquantized cache, token for token.

Free greedy decoding diverges after the first differing token and then measures chaos, not quality;
both runs here are fed the same tokens (the reference's own greedy continuation by default), so step
``t`` compares two next-token distributions given the same context. Under teacher forcing assumption
A1 of THEORY.md holds exactly (the query never depends on the dither of the keys it reads), so the
per-(layer, head, step) check "true TV <= certificate" is a test of soundness, not of luck.

Definitions: KL is ``KL(p_ref || p_witcert)`` of the next-token distributions (nats); top-1 agreement
is the fraction of steps whose argmax tokens agree; top-5 agreement is the mean overlap of the two
top-5 sets divided by 5. The true TV of an attention head is ``TV(softmax(sm q.k), softmax(sm q.k^))``
with the query the kernel read, ``k`` the exact keys and ``k^`` the keys it read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from witcert.integrations.gating import CachePolicy
from witcert.integrations.telemetry.step_report import CertificateObserver
from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention
from witcert.kernels import reference


def random_model(
    *,
    layers: int = 2,
    hidden: int = 256,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 512,
    init_std: float | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLM:
    """A randomly initialised Llama-style model (GQA, RoPE): no weights are downloadable here.

    ``init_std`` defaults to ``1.6 / sqrt(hidden)`` (0.1 at hidden 256), which keeps the attention
    logits' spread (about ``init_std**2 * hidden``) the same at every width: peaked enough that
    certificates land near the default tau. transformers' 0.02 gives nearly uniform attention on
    small models (certificates around 1e-3) and saturated attention on wide ones.
    """
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        initializer_range=init_std if init_std is not None else 1.6 / hidden**0.5,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialise in place: a billion parameters take seconds on a GPU, minutes on CPU
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype).eval()


@dataclass
class HeadAudit:
    """True TV against the certificate for every (layer, head, step) of a teacher-forced run."""

    layers: list[int] = field(default_factory=list)
    true_tv: list[torch.Tensor] = field(default_factory=list)  # each [B, H_q]
    certificate: list[torch.Tensor] = field(default_factory=list)  # each [B, H_q]

    def __call__(
        self, cache: WitcertCache, layer: int, query: torch.Tensor, certificate: torch.Tensor, sm_scale: float
    ) -> None:
        num_q_heads = query.shape[1]
        kv_of_q = torch.arange(num_q_heads, device=query.device) // (num_q_heads // cache.kv_heads)
        tvs = []
        for b in range(query.shape[0]):
            q = query[b].double()
            exact = cache.exact_keys(layer, b).double()[:, kv_of_q, :]
            read = cache.keys_read(layer, b).double()[:, kv_of_q, :]
            p = torch.softmax(sm_scale * torch.einsum("hd,shd->hs", q, exact), dim=-1)
            p_tilde = torch.softmax(sm_scale * torch.einsum("hd,shd->hs", q, read), dim=-1)
            tvs.append(reference.total_variation(p, p_tilde))
        self.layers.append(layer)
        self.true_tv.append(torch.stack(tvs).cpu())
        self.certificate.append(certificate.detach().cpu().double())


@dataclass
class QualityReport:
    """What a teacher-forced run measured; ``as_dict`` is what bench/ and docs/ record."""

    steps: int
    kl_mean: float
    kl_max: float
    top1_agreement: float
    top5_agreement: float
    certificates: int
    violations: int
    vacuous: int
    infinite: int
    max_true_tv: float
    median_certificate: float
    median_ratio: float  # certificate / true TV, over heads with true TV > 0
    fallbacks: int
    policy: dict

    def as_dict(self) -> dict:
        return asdict(self)


def _step_log_probs(model: PreTrainedModel, cache, prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities ``[T, B, V]`` after each continuation token, fed one at a time."""
    kwarg = cache_kwarg(model)
    out = []
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, **{kwarg: cache})
        for t in range(continuation.shape[1]):
            logits = model(input_ids=continuation[:, t : t + 1], use_cache=True, **{kwarg: cache}).logits
            out.append(torch.log_softmax(logits[:, -1].double(), dim=-1))
    return torch.stack(out)


def greedy_continuation(model: PreTrainedModel, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """The unquantized model's greedy continuation ``[B, steps]``: the path both runs are forced along."""
    with torch.no_grad():
        generated = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            **{cache_kwarg(model): DynamicCache(config=model.config)},
        )
    return generated[:, prompt.shape[1] :]


def teacher_forced_quality(
    model: PreTrainedModel,
    prompt: torch.Tensor,
    continuation: torch.Tensor,
    policy: CachePolicy,
    *,
    observer: CertificateObserver | None = None,
) -> QualityReport:
    """Run ``prompt`` then ``continuation`` through the unquantized and the witcert cache; compare every step."""
    if prompt.dim() != 2 or continuation.dim() != 2 or prompt.shape[0] != continuation.shape[0]:
        raise ValueError("prompt and continuation must be [B, P] and [B, T] token ids with the same B")
    if continuation.shape[1] == 0:
        raise ValueError("the continuation must hold at least one token")
    use_witcert_attention(model)
    max_len = prompt.shape[1] + continuation.shape[1]
    reference_lp = _step_log_probs(model, DynamicCache(config=model.config), prompt, continuation)
    audit = HeadAudit()
    cache = WitcertCache(model.config, policy, max_cache_len=max_len, observer=observer, keep_exact=True, audit=audit)
    witcert_lp = _step_log_probs(model, cache, prompt, continuation)

    kl = (reference_lp.exp() * (reference_lp - witcert_lp)).sum(-1)  # [T, B]
    top1 = (reference_lp.argmax(-1) == witcert_lp.argmax(-1)).double().mean()
    top5_ref = reference_lp.topk(5, dim=-1).indices
    top5_test = witcert_lp.topk(5, dim=-1).indices
    overlap = (top5_ref[..., :, None] == top5_test[..., None, :]).any(-1).double().sum(-1) / 5.0

    tv = torch.stack(audit.true_tv)
    cert = torch.stack(audit.certificate)
    finite = torch.isfinite(cert)
    positive = tv > 0
    ratio = (cert[positive & finite] / tv[positive & finite]) if bool((positive & finite).any()) else torch.ones(1)
    return QualityReport(
        steps=continuation.shape[1],
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agreement=float(top1),
        top5_agreement=float(overlap.mean()),
        certificates=cert.numel(),
        violations=int((tv > cert).sum()),
        vacuous=int(((cert >= 1) & finite).sum()),
        infinite=int((~finite).sum()),
        max_true_tv=float(tv.max()),
        median_certificate=float(cert.median()),
        median_ratio=float(ratio.median()),
        fallbacks=int(cache.fallback_total),
        policy=policy.model_dump(mode="json"),
    )
