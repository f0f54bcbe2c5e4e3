"""``witcert selftest``: run the kernels against the reference on this machine and report the errors."""

from __future__ import annotations

import argparse
import os

import torch


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="check the kernels against the reference on this machine",
        description=(
            "Writes random K/V into a small quantized pool and runs one decode step with mixed sequence "
            "lengths, comparing codes, output and certificate with the reference. Prints which path ran "
            "(GPU Triton, the Triton interpreter on CPU, or the reference) and the largest errors; exits 1 "
            "if a tolerance is exceeded."
        ),
    )
    parser.add_argument(
        "--no-interpret",
        action="store_true",
        help="without a GPU, run the torch reference instead of the Triton interpreter (TRITON_INTERPRET=1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the test data and of the dither")
    parser.set_defaults(handler=_selftest)


def _selftest(args: argparse.Namespace) -> int:
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.no_interpret:
        # Must precede the first import of the Triton kernels (triton.jit reads it at decoration).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from witcert.kernels import KVPool, decode_attention, reference, select_path

    device = torch.device("cuda" if on_gpu else "cpu")
    generator = torch.Generator().manual_seed(args.seed)
    kv_heads, group, head_dim, slots_total = 2, 7, 128, 512
    lengths = [1, 70, 200]
    pool = KVPool(slots_total, 2, kv_heads, head_dim, seed=args.seed, device=device)
    slots = torch.randperm(slots_total, generator=generator)[: sum(lengths)].to(device)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=generator).half().to(device)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=generator).half().to(device)
    pool.write(1, slots, k, v)
    expected = reference.quantize(k.cpu(), seed=args.seed, layer=1, slots=slots.cpu(), kind="k", dither_bits=8)
    code_mismatches = int((pool.codes[1, 0, slots].cpu() != expected.codes).sum())

    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=generator).half().to(device)
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    delta = reference.delta_step(28, kv_heads * group)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=delta)
    out_error = cert_error = 0.0
    for row in range(len(lengths)):
        row_slots = slots[indptr[row] : indptr[row + 1]]
        oracle = reference.decode_attention(
            q[row].float().cpu(),
            pool.quantized(1, row_slots, "k"),
            pool.quantized(1, row_slots, "v"),
            delta_step=delta,
        )
        out_error = max(out_error, float((result.out[row].cpu() - oracle.out).norm() / oracle.out.norm()))
        cert_error = max(cert_error, float(((result.certificate[row].cpu() / oracle.certificate) - 1).abs().max()))
    path = select_path(device)
    print(f"path: {path} ({'GPU ' + torch.cuda.get_device_name() if on_gpu else 'CPU'})")
    print(f"write: {code_mismatches} code mismatches of {expected.codes.numel()}")
    print(f"decode: max relative error out {out_error:.2e} (tolerance 1e-5), certificate {cert_error:.2e} (1e-4)")
    ok = code_mismatches == 0 and out_error <= 1e-5 and cert_error <= 1e-4
    print("selftest " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1
