"""Where the certificate loses on keys without attention sinks: the token held apart or the cells?

On ``kernels.soundness``'s ``outlier_channels`` law (random keys with 4 channels 20-50x larger, no exact pairs:
radii of several units, where T4 and PA decide), the same decode certificates three ways: the product's (cells, the
end tiles' argmax held apart: ``reference.accumulate_certificate``), and per-token sums of the same radii holding
apart the global argmax or the end tiles' argmax. Prints the share of vacuous certificates (>= 1) and the median.

    python bench/lab/soundness_held_token.py [--caches 24]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402

from witcert.kernels import reference  # noqa: E402
from witcert.kernels.soundness import _keys  # noqa: E402


def _per_token_accumulators():
    """``certificate_variants.per_token_accumulators``, imported by path (lab scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(
        "certificate_variants", Path(__file__).with_name("certificate_variants.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.per_token_accumulators


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", type=int, default=24, help="caches of S = 512 .. 4096, 2 steps of 14 heads each")
    args = parser.parse_args()
    per_token = _per_token_accumulators()
    generator = torch.Generator().manual_seed(1)
    kv_heads, group, head_dim = 2, 7, 128
    delta = reference.delta_step(28, kv_heads * group)
    found: dict[str, list[torch.Tensor]] = {"product": [], "per-token, global argmax": [], "per-token, end tiles": []}
    for cache in range(args.caches):
        tokens = (512, 1024, 2048, 4096)[cache % 4]
        keys = _keys("outlier_channels", tokens, kv_heads, head_dim, generator)
        common = dict(seed=cache, layer=cache % 28, slots=torch.randperm(4 * tokens, generator=generator)[:tokens])
        k = reference.quantize(keys, kind="k", dither_bits=8, **common)
        v = reference.quantize(keys, kind="v", dither_bits=8, **common)
        ends = reference.end_tokens(tokens)
        for _ in range(2):
            temperature = float(torch.empty(1).uniform_(0.5, 4.0, generator=generator))
            q = temperature * torch.randn(kv_heads * group, head_dim, generator=generator, dtype=torch.float64)
            result = reference.decode_attention(q, k, v, sm_scale=1 / math.sqrt(head_dim), delta_step=delta)
            found["product"].append(result.certificate)
            found["per-token, global argmax"].append(per_token(result.probs, result.radius).certificate)
            end_argmax = result.probs.masked_fill(~ends, -1.0).argmax(-1)
            found["per-token, end tiles"].append(per_token(result.probs, result.radius, end_argmax).certificate)
    for name, certificates in found.items():
        joined = torch.cat(certificates)
        vacuous = float((joined >= 1).double().mean())
        print(f"{name:26s} {joined.numel()} certificates, vacuous {vacuous:.3f}, median {float(joined.median()):.3g}")


if __name__ == "__main__":
    main()
