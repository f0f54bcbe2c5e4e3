"""Launch parameters of the attention kernels: tiles, register caps and which path takes a call.

One module-level ``LAUNCH`` is read at every launch, so an engine (or the benchmark) can retune it once.
``bench/bench_kernels.py --sweep {gluon,triton}`` times the alternatives on a GPU; docs/KERNELS.md has the
measurements behind the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LaunchConfig:
    """Tile and launch parameters of the decode stages and the extend paths."""

    # The Triton stage 1's tile: the fastest of the tiles, warps and stages swept on the H200 (head dim 128)...
    block_n: int = 128
    # ...and for heads wider than 128 (Gemma 3's 256), where a 128-token tile spills 27 values a tile in the loop
    # and a 64-token one 2 with the certificate, 5 without (Triton 3.6, sm_90): 64 is 5-6% faster without the
    # certificate and 11-17% with it on an H100 (bench/lab/wide_heads.py).
    block_n_wide: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # A register cap for the Triton int8 stage 1 (ptxas .maxnreg): more programs per SM against spills.
    maxnreg: int | None = None
    # The Gluon stage 1 (kernels/gluon_decode.py) where it covers the call; False forces the Triton one.
    gluon: bool = True
    # ... on calls reading at least this many tokens (kv_indices' length, a shape: graph-safe). Below, its fixed
    # cost (operand set-up, the merge of four warps) loses to the Triton kernel; above, it is the faster one.
    gluon_min_tokens: int = 16384
    # Its tile is fixed (128 tokens, 4 warps); its register caps (with and without the certificate) decide how
    # many of its programs an SM holds (gluon_programs_per_sm) and so the default number of splits. At 168 an SM
    # holds three, with at most a few spilled values; at 128 (four) both variants are slower, also where the loop
    # fits (docs/KERNELS.md, "Four programs per SM"); uncapped, the certified loop (two) times within a run's noise
    # of 168.
    gluon_maxnreg: int | None = 168
    gluon_maxnreg_nocert: int | None = 168
    # The warp-specialised form of the Gluon stage 1 (kernels/gluon_decode_ws.py) in its place, on Hopper: opt-in,
    # since it is faster without the certificate and slower with it (docs/KERNELS.md, "Warp-specialised stage 1").
    # Its register cap covers all 8 warps (4 consumers, a producer warpgroup at gluon_decode_ws.PRODUCER_REGS): 80
    # holds three programs per SM, the consumers at 136 registers.
    gluon_ws: bool = False
    gluon_ws_maxnreg: int = 80
    # The tiled extend kernel (triton_extend), with or without the certificate; False runs one decode row per
    # new token, which re-reads the prefix for every new token. 128 rows (16 new tokens of 8 padded heads),
    # 64-key tiles and 8 warps: the fastest tiling with the certificate; the tilings that need more registers
    # per thread (4 warps, 128-key tiles, 256 rows) spill.
    extend_tiled: bool = True
    extend_rows: int = 128
    extend_block_n: int = 64
    extend_num_warps: int = 8
    # Extend without the certificate on PyTorch's SDPA over K/V gathered from the pool (kernels/extend_sdpa.py):
    # not exact (fp16/bf16 rounding; tested within 4e-3 / 2e-2), but near the time of SDPA on an fp16 cache,
    # where the exact tiled kernel takes several times that. False keeps every extend on the exact kernels.
    extend_sdpa: bool = True
    # Batches of more runs of equal sequences than this (extend_bounds.equal_runs) take one FlashAttention 2
    # varlen call instead of one SDPA call per run: each SDPA call costs host time, and from 4 runs on the one
    # varlen call is the faster.
    extend_sdpa_max_calls: int = 3
    # The gathered K/V are allocated per call, unknown to the engine's memory planner: at most this many bytes of
    # consecutive sequences at a time (256 MiB: 256k keys of 4 KV heads at head_dim 128, fp16)...
    extend_sdpa_chunk_bytes: int = 2**28
    # ...and of one sequence, which is gathered whole (2 GiB: 2M keys); a longer one runs the tiled kernel.
    extend_sdpa_max_bytes: int = 2**31

    # Stage 2 (the merge of the splits, the certificate's evaluation): warps a program, one program per row and
    # query head. Its split vectors are copied in every warp, so fewer warps issue fewer instructions in all: timed
    # alone on an H100 (bench/lab/stage2_variants.py, B = 8, 12 splits) 2 warps took 2.18 / 2.59 us without / with the
    # certificate against 4's 2.40 / 2.94, but inside the decode call (after stage 1, profile_decode.py
    # --kernel-times, another H100, not paired) 3.04 / 3.25 against 2.58 / 3.42 at 4: where the two disagree, 4
    # stays until a paired run inside the call decides.
    stage2_num_warps: int = 4

    def programs_per_sm(self) -> int:
        """Triton stage-1 programs an SM holds, which the default splits fill (default_num_kv_splits): 65536
        registers over its threads at the cap, or at 256 uncapped (it compiles to 255)."""
        return max(1, 65536 // (32 * self.num_warps * (self.maxnreg or 256)))

    def gluon_programs_per_sm(self, certificate: bool) -> int:
        """Gluon stage-1 programs an SM holds: 65536 registers over 128 threads at the cap; uncapped, the
        certified kernel compiles to 200-255 registers (Triton 3.6-3.9), two programs (taken for both variants:
        the one without the certificate, 136 registers with Triton 3.6, would fit three). Shared memory (about
        40 KB per program) allows five."""
        if self.gluon_ws:
            return 65536 // (256 * self.gluon_ws_maxnreg)
        cap = self.gluon_maxnreg if certificate else self.gluon_maxnreg_nocert
        return 65536 // (128 * cap) if cap else 2

    def triton_block_n(self, head_dim: int) -> int:
        """The Triton stage 1's tokens a tile at this head dim."""
        return self.block_n if head_dim <= 128 else self.block_n_wide


LAUNCH = LaunchConfig()
