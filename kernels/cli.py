"""``witcert selftest``: run the kernels against the reference on this machine and report the errors."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="check the kernels against the reference on this machine",
        description=(
            "Writes random K/V into a small quantized pool, gathers it back dequantized and runs one decode "
            "step with mixed sequence lengths, comparing codes, dequantized values, output and certificate "
            "with the reference. Prints which path ran "
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
    if not on_gpu and not args.no_interpret and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter must be chosen before triton is first imported, and other commands'
        # modules may have imported it already: run the check in a fresh interpreter process.
        command = [sys.executable, "-P", "-m", "witcert.kernels.cli", "--seed", str(args.seed)]
        return subprocess.call(command, env={**os.environ, "TRITON_INTERPRET": "1"})
    return run_selftest(args.seed)


def run_selftest(seed: int) -> int:
    """Kernels against the reference on this machine; prints the path and errors, returns the exit code."""
    from witcert.kernels import KVPool, decode_attention, reference, select_path

    on_gpu = torch.cuda.is_available()

    device = torch.device("cuda" if on_gpu else "cpu")
    generator = torch.Generator().manual_seed(seed)
    kv_heads, group, head_dim, slots_total = 2, 7, 128, 512
    lengths = [1, 70, 200]
    pool = KVPool(slots_total, 2, kv_heads, head_dim, seed=seed, device=device)
    slots = torch.randperm(slots_total, generator=generator)[: sum(lengths)].to(device)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=generator).half().to(device)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=generator).half().to(device)
    pool.write(1, slots, k, v)
    expected = reference.quantize(k.cpu(), seed=seed, layer=1, slots=slots.cpu(), kind="k", dither_bits=8)
    code_mismatches = int((pool.quantized(1, slots, "k").codes.cpu() != expected.codes).sum())
    xi = reference.dither_values(
        seed=seed, layer=1, slots=slots.cpu(), num_kv_heads=kv_heads, head_dim=head_dim, kind="v", dither_bits=8
    )
    dither_mismatches = int((pool.dither(1, slots, "v", 1).cpu() != xi[:, 1]).sum())

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
    # The gather (prefill's keys and values on a GPU) against the reference's x_hat rounded to fp16.
    k_hat, v_hat = pool.gather(1, slots)
    gather_mismatches = sum(
        int((got.cpu() != pool.dequantize(1, slots, kind).half().cpu()).sum())
        for kind, got in (("k", k_hat), ("v", v_hat))
    )
    path = select_path(device)
    print(f"path: {path} ({'GPU ' + torch.cuda.get_device_name() if on_gpu else 'CPU'})")
    print(
        f"write: {code_mismatches} code mismatches of {expected.codes.numel()}; dither: {dither_mismatches} mismatches"
    )
    print(f"gather: {gather_mismatches} mismatches of {k_hat.numel() + v_hat.numel()}")
    print(f"decode: max relative error out {out_error:.2e} (tolerance 1e-5), certificate {cert_error:.2e} (1e-4)")
    exact = code_mismatches == 0 and dither_mismatches == 0 and gather_mismatches == 0
    ok = exact and out_error <= 1e-5 and cert_error <= 1e-4
    print("selftest " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    # Entry point of the fresh process ``witcert selftest`` starts when the interpreter must be chosen.
    cli = argparse.ArgumentParser(description="witcert kernel selftest")
    cli.add_argument("--seed", type=int, default=0)
    sys.exit(run_selftest(cli.parse_args().seed))
