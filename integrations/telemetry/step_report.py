"""One decode step's certificates, buffered on the device and reported in one call once its last layer is in.

Both integrations (the transformers cache and the SGLang backend) decode layer by layer; each layer's
certificates ``[B, H_q]`` (and in gate mode its fallback flags and repaired bytes) are copied into
``[L, B_max, H_q]`` buffers, and the observer (``CertificateAggregator``) counts the whole step with
one ``observe_layers`` launch instead of one per layer. No host sync, no allocation: the decode kernel writes each
layer's certificates into the buffer itself (``destination``, ``decode_attention``'s ``certificate_out``), and
``record`` copies only what was computed elsewhere (gating's merged and repaired certificates, fallbacks, bytes).
"""

from __future__ import annotations

from typing import Protocol

import torch


class CertificateObserver(Protocol):
    """What an integration reports to (``witcert.integrations.telemetry.CertificateAggregator`` satisfies it)."""

    def observe_layers(
        self,
        first_layer: int,
        certificates: torch.Tensor,
        fallback: torch.Tensor | None = None,
        repaired_bytes: torch.Tensor | None = None,
    ) -> None: ...


class StepReport:
    """Per-step report buffers ``[num_layers, max_rows, num_q_heads]`` in front of an observer.

    Layers ``0 .. pending_layers - 1`` of the current step (their first ``rows`` rows) are written and not
    yet reported. ``gate``: also buffer fallback flags and repaired bytes. ``owner`` names the caller in
    the errors (layers out of order, a batch larger than the buffers).
    """

    def __init__(
        self,
        observer: CertificateObserver,
        num_layers: int,
        max_rows: int,
        num_q_heads: int,
        *,
        gate: bool,
        device: torch.device,
        owner: str,
    ) -> None:
        self.observer = observer
        self.owner = owner
        shape = (num_layers, max_rows, num_q_heads)
        self.certificates = torch.zeros(shape, dtype=torch.float32, device=device)
        self.fallbacks = torch.zeros(shape, dtype=torch.bool, device=device) if gate else None
        self.repaired_bytes = torch.zeros(shape, dtype=torch.int64, device=device) if gate else None
        # Layers whose fallback / repaired-bytes rows hold a repair (not zero): cleared lazily.
        self._repairs_written = [False] * num_layers
        self.pending_layers = 0
        self.rows = 0
        self._destination: torch.Tensor | None = None  # the rows handed out by ``destination``, until recorded

    def destination(self, layer: int, rows: int) -> torch.Tensor:
        """The buffer's ``[rows, H_q]`` for layer ``layer``'s certificates (contiguous float32), for the kernel to
        write in place; ``record`` of that tensor then copies nothing. Checks the layer's order and the batch as
        ``record`` does, and first reports a step that stopped before its last layer (its rows are about to be
        overwritten)."""
        self._check(layer, rows)
        self._destination = self.certificates[layer, :rows]
        return self._destination

    def record(
        self, layer: int, certificate: torch.Tensor, fallback: torch.Tensor | None, repaired: torch.Tensor | None
    ) -> None:
        """Put one layer's ``[rows, H_q]`` into the buffers (a copy, unless ``certificate`` is this layer's
        ``destination``); report the step once its last layer is in.

        ``fallback`` and ``repaired`` are ``None`` in observe mode, and in gate mode when nothing was
        repaired: a gated layer that repaired nothing costs nothing more unless its rows still hold a repair.
        """
        rows = certificate.shape[0]
        self._check(layer, rows)
        if certificate is not self._destination:
            self.certificates[layer, :rows].copy_(certificate)
        self._destination = None
        if self.fallbacks is not None:
            if fallback is not None:
                self.fallbacks[layer, :rows].copy_(fallback)
                self.repaired_bytes[layer, :rows].copy_(repaired)
            elif self._repairs_written[layer]:
                self.fallbacks[layer].zero_()
                self.repaired_bytes[layer].zero_()
            self._repairs_written[layer] = fallback is not None
        self.pending_layers, self.rows = layer + 1, rows
        if self.pending_layers == self.certificates.shape[0]:
            self.flush()

    def _check(self, layer: int, rows: int) -> None:
        """Layer ``layer`` of ``rows`` sequences comes next: in order, the batch of the step's layer 0, within the
        buffers; at layer 0, an unfinished step before it is reported first."""
        if layer != self.pending_layers:
            if layer != 0:
                raise RuntimeError(
                    f"layer {layer} decoded after layers 0..{self.pending_layers - 1} of this step: {self.owner} "
                    "reports a step per forward pass and needs its layers in order"
                )
            self.flush()  # the previous step stopped before its last layer (its forward raised)
        elif layer > 0 and rows != self.rows:
            raise RuntimeError(f"layer {layer} decoded {rows} sequences, layer 0 of this step {self.rows}")
        if rows > self.certificates.shape[1]:
            raise RuntimeError(
                f"a decode batch of {rows} sequences exceeds the {self.certificates.shape[1]} rows "
                f"{self.owner} sized its certificate buffers for"
            )

    def flush(self) -> None:
        """Report the layers of the current step written so far, in one ``observe_layers`` call.

        A complete step is reported by its last layer, so this only matters for a step whose forward pass
        raised before its last layer: its first layers are reported when the next step starts, or by this
        call; nothing is reported twice. A no-op when nothing is pending.
        """
        if self.pending_layers == 0:
            return
        cells = (slice(0, self.pending_layers), slice(0, self.rows))
        self.pending_layers = 0
        self.observer.observe_layers(
            0,
            self.certificates[cells],
            fallback=None if self.fallbacks is None else self.fallbacks[cells],
            repaired_bytes=None if self.repaired_bytes is None else self.repaired_bytes[cells],
        )
