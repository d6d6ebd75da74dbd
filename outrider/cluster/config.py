"""The serving config: one pydantic model, the `args` of `cluster.app:build_app`.

Config comes in layers (docs/architecture.md, "How the code reads"): this file is the edge, where a Serve config YAML,
`outrider serve` flags or a KubeRay manifest arrive as plain data and are checked once, with
a message naming the field; the engine and the workers get frozen values built from it.

    OutriderArgs
      model / tokenizer / demo / served_model_name   what is served
      speculative_config                               vLLM's dict (method, num_speculative_tokens, ...)
      no_speculation                                   plain decoding through the same engine
      tensor_parallel_size                             ranks per target replica
      engine: EngineArgs                               KV / batch limits, bounded request queue
      target: TargetDeploymentArgs                     replicas, autoscaling, CPUs per replica
      draft_pool: DraftPoolArgs                        where drafting runs, its replicas, deadline
      gpu_pools: GpuPoolConfig                         which GPUs are draft / target GPUs
      api_key_file                                     the ingress's Bearer key, read from a file
      request_limits: RequestLimitsArgs                body bytes and prompt characters per request

A minimal Serve config (`serve run outrider/cluster/serve_demo.yaml`):

    applications:
      - import_path: outrider.cluster.app:build_app
        args: {demo: tiny, speculative_config: {method: ngram, num_speculative_tokens: 4}}
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from outrider.cluster.gpu_pools import GpuPoolConfig
from outrider.proto import DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_TREE_BUDGET, TreeBudget

DEFAULT_SPECULATIVE_CONFIG: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS,
}


class _Strict(BaseModel):
    # A misspelt key in a YAML file must fail, not be silently ignored.
    model_config = ConfigDict(extra="forbid")


class AutoscalingArgs(_Strict):
    """Ray Serve autoscaling for one deployment; `to_serve()` gives Serve's `autoscaling_config`."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running.")
    max_replicas: int = Field(4, ge=1, description="Most replicas the autoscaler may start.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at start (default: min_replicas).")
    target_ongoing_requests: float = Field(
        8.0,
        gt=0,
        description="Target: requests in flight per replica (running + queued). Draft: the draft queue "
        "wait, in milliseconds, per replica that the policy aims for.",
    )
    metrics_interval_s: float = Field(2.0, gt=0, description="How often replicas report their load.")
    look_back_period_s: float = Field(10.0, gt=0, description="Window the load is averaged over.")
    upscale_delay_s: float = Field(5.0, ge=0, description="Load must stay high this long before scaling up.")
    downscale_delay_s: float = Field(
        60.0, ge=0, description="Load must stay low this long before scaling down."
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self

    def to_serve(self, policy: str | None = None) -> dict[str, Any]:
        config = self.model_dump(exclude_none=True)
        if policy:
            # Serve hands the policy the replicas' `record_autoscaling_stats` values.
            config["policy"] = {"policy_function": policy}
        return config


class EngineArgs(_Strict):
    """Limits of one target replica's engine: bounded batch, bounded queue, bounded KV."""

    max_num_seqs: int = Field(16, ge=1, description="Sequences decoded together in one step (vLLM's name).")
    max_queued_requests: int = Field(
        64,
        ge=0,
        description="Requests waiting for a batch slot per replica; beyond it the API answers 429.",
    )
    max_model_len: int | None = Field(
        None, ge=8, description="Longest prompt + output, in tokens (default: the model's context)."
    )
    kv_cache_rows: int | None = Field(
        None,
        ge=1,
        description="KV-cache slots (tokens) per replica, paged in blocks; sequences take blocks as they "
        "grow (default: max_num_seqs full-length sequences).",
    )
    block_size: int = Field(16, ge=1, le=1024, description="KV-cache slots per block (vLLM's name).")
    enable_prefix_caching: bool = Field(
        True,
        description="Share the KV blocks of equal prompt prefixes between requests, so a shared system "
        "prompt or a multi-turn chat is prefilled once (vLLM's name; off by itself for drafters that "
        "need the target's features of every prompt token).",
    )
    default_max_tokens: int = Field(
        64, ge=1, description="Output tokens when a request does not say (`max_tokens` absent)."
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads for the engine (default: torch's own choice)."
    )
    seed_key_file: str | None = Field(
        None,
        description="File holding a secret (any bytes) from which a seeded request's verification "
        "randomness is derived, so that draft workers, who see only a separately derived seed, cannot "
        "predict it. Set it to make seeded requests reproduce across restarts; default: a random key "
        "per application start, shared by its target replicas.",
    )

    def seed_key(self) -> bytes:
        """The key `seed_key_file` holds (hashed to 64 bytes), or a fresh random one."""
        if self.seed_key_file is None:
            return secrets.token_bytes(32)
        data = Path(self.seed_key_file).read_bytes()
        if not data:
            raise ValueError(f"engine.seed_key_file {self.seed_key_file} is empty")
        return hashlib.blake2b(data).digest()


class TargetDeploymentArgs(_Strict):
    """The target deployment: each replica is one tensor-parallel group running an engine."""

    num_replicas: int = Field(1, ge=1, description="Fixed replica count (ignored with `autoscaling`).")
    autoscaling: AutoscalingArgs | None = Field(
        None,
        description="Scale on requests in flight per replica; recommended: target_ongoing_requests = max_num_seqs.",
    )
    num_cpus: float = Field(
        1.0, ge=0, description="CPUs Ray reserves per replica (0 on small test machines)."
    )
    gpus_per_rank: float = Field(
        1.0, ge=0, description="GPUs per tensor-parallel rank where a target pool exists."
    )
    transport: Literal["grpc", "ray"] = Field(
        "grpc",
        description="How each request's token stream reaches the ingress: `grpc`, one gRPC stream per "
        "request to the replica (Ray Serve's `_by_reference=False`), or `ray`, one Ray object per "
        "streamed chunk (Serve's default). Every chunk costs the same on the way whatever it carries; "
        "over gRPC it costs less (benchmarks/results/http_transport_small.md).",
    )


class DraftPoolArgs(_Strict):
    """Where drafting happens: in the target process, a draft deployment, or external servers."""

    mode: Literal["colocated", "deployment", "external", "shared"] = Field(
        "colocated",
        description="colocated: the proposer runs inside each target replica; deployment: a Ray Serve "
        "draft deployment of gRPC draft servers; external: the `draft_endpoints` addresses; shared: the "
        "draft deployment of another application on the same Ray cluster (`shared_app`).",
    )
    shared_app: str | None = Field(
        None,
        description="The Serve application whose draft deployment this application's targets draft "
        "with (sets mode=shared): one draft pool serving several target deployments, each of its "
        "replicas batching rounds across them. The applications must serve the same vocabulary.",
    )
    draft_endpoints: list[str] = Field(
        default_factory=list,
        description="host:port of draft servers outside Ray (`outrider draft-server`); sets mode=external.",
    )
    num_replicas: int = Field(1, ge=1, description="Draft replicas (ignored with `autoscaling`).")
    autoscaling: AutoscalingArgs | None = Field(
        None,
        description="Scale the draft deployment on its own signal (draft queue wait in ms); "
        "recommended 1 draft replica per 2-4 target replicas to start.",
    )
    round_deadline_ms: float = Field(
        50.0, gt=0, description="How long a target waits for a round's trees before decoding without them."
    )
    trust_draft_distribution: bool | None = Field(
        None,
        description="Whether targets may use the draft distribution q that draft workers send in the "
        "acceptance test (faster at T > 0: a child drawn from q = p is always accepted). Trusting "
        "makes this drafter's sampling part of your correctness: a buggy or hostile drafter could "
        "then bias sampled output (an audit watches for it and revokes trust). Untrusted trees are "
        "verified as deterministic proposals, lossless whatever they hold. Default (null): trusted "
        "for colocated, deployment and shared (the operator's own code on the same Ray cluster), "
        "untrusted for external.",
    )
    target_busy_fraction: float = Field(
        0.6,
        gt=0,
        le=1,
        description="With `autoscaling`: the share of its time each draft replica should spend drafting "
        "(`DraftLoadPolicy`: replicas = total drafting load / this). Above ~0.6 rounds queue behind each "
        "other and miss the target's deadline; a cheap drafter may want a lower value to scale out early.",
    )
    max_sequences: int | None = Field(
        None,
        ge=1,
        description="Sequences each draft replica holds drafting state for at once (a model drafter's KV "
        "cache; past it a sequence decodes without drafts until room frees). Default: every sequence the "
        "targets can run, max_num_seqs x target replicas (the autoscaler's max_replicas), at least 32.",
    )
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per draft replica.")
    gpus_per_replica: float = Field(
        1.0, ge=0, description="GPUs per draft replica where a draft pool exists."
    )
    grpc_port: int = Field(
        0, ge=0, le=65535, description="Port of each draft replica's gRPC server; 0 = any free one."
    )
    token_file: str | None = Field(
        None,
        description="File holding a shared token: draft servers refuse calls without "
        "`authorization: Bearer <token>`, and targets send it (a mounted Secret under Kubernetes).",
    )
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate chain: the draft servers' certificate, also presented by targets "
        "as their client certificate (mutual TLS) when tls_ca_file is set. Needs tls_key_file.",
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_ca_file: str | None = Field(
        None,
        description="PEM CA that signed the draft servers' certificates (targets verify them); with "
        "tls_cert_file, draft servers also require client certificates signed by it.",
    )
    tls_server_name: str | None = Field(
        None,
        description="Name to expect in the draft servers' certificate when it does not name their "
        "addresses (pod IPs rarely appear in certificates).",
    )

    @model_validator(mode="after")
    def _tls_files_pair_up(self) -> DraftPoolArgs:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("draft_pool.tls_cert_file and draft_pool.tls_key_file go together")
        if self.mode == "deployment" and self.tls_ca_file and not self.tls_cert_file:
            raise ValueError(
                "draft_pool.tls_ca_file with a draft deployment needs tls_cert_file/tls_key_file"
            )
        return self

    def server_security(self) -> tuple[Any, str | None]:
        """(ServerTls or None, token or None) for a draft server of this pool."""
        from outrider.draft_worker.server import ServerTls

        tls = None
        if self.tls_cert_file:
            client_ca = Path(self.tls_ca_file).read_bytes() if self.tls_ca_file else None
            tls = ServerTls(
                Path(self.tls_cert_file).read_bytes(), Path(self.tls_key_file).read_bytes(), client_ca
            )
        return tls, self._token()

    def client_security(self) -> tuple[Any, str | None]:
        """(ClientTls or None, token or None) for a target talking to this pool."""
        from outrider.target_worker.draft_client import ClientTls

        tls = None
        if self.tls_ca_file:
            pair = (
                (Path(self.tls_cert_file).read_bytes(), Path(self.tls_key_file).read_bytes())
                if self.tls_cert_file
                else (None, None)
            )
            tls = ClientTls(Path(self.tls_ca_file).read_bytes(), *pair, server_name=self.tls_server_name)
        return tls, self._token()

    @property
    def trusts_drafts(self) -> bool:
        """The operator's decision, or the default: the application's own drafters only."""
        if self.trust_draft_distribution is not None:
            return self.trust_draft_distribution
        return self.mode != "external"

    def _token(self) -> str | None:
        return Path(self.token_file).read_text().strip() if self.token_file else None

    @model_validator(mode="after")
    def _endpoints_mean_external(self) -> DraftPoolArgs:
        if self.shared_app and self.draft_endpoints:
            raise ValueError("draft_pool: shared_app and draft_endpoints exclude each other")
        if self.shared_app:
            self.mode = "shared"
        elif self.mode == "shared":
            raise ValueError("draft_pool.mode 'shared' needs shared_app (the application that owns the pool)")
        if self.draft_endpoints:
            self.mode = "external"
        elif self.mode == "external":
            raise ValueError("draft_pool.mode 'external' needs draft_endpoints (host:port, ...)")
        for address in self.draft_endpoints:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"draft_endpoints: {address!r} is not host:port")
        return self


class TreeBudgetArgs(_Strict):
    """The most a target verifies per sequence per round (sent with every update).

    Defaults are `outrider.proto.DEFAULT_TREE_BUDGET`, the engine's own.
    """

    max_nodes: int = Field(DEFAULT_TREE_BUDGET.max_nodes, ge=1, description="Nodes per tree, root included.")
    max_depth: int = Field(
        DEFAULT_TREE_BUDGET.max_depth, ge=1, description="Draft tokens on any root-to-leaf path."
    )
    top_k: int = Field(DEFAULT_TREE_BUDGET.top_k, ge=1, description="Children per node.")
    q_width: int = Field(
        DEFAULT_TREE_BUDGET.q_width,
        ge=1,
        description="Entries per sparse q row of sampled trees (wider: more of q, higher acceptance).",
    )

    def to_budget(self) -> TreeBudget:
        return TreeBudget(self.max_nodes, self.max_depth, self.top_k, self.q_width)


class RequestLimitsArgs(_Strict):
    """What the HTTP ingress reads of one request before it refuses it: bounded work per request."""

    max_body_bytes: int = Field(
        16 << 20,
        ge=1024,
        description="Largest request body in bytes; a larger one is refused with 413 before it is read "
        "further (the declared Content-Length is checked first).",
    )
    max_prompt_chars: int | None = Field(
        None,
        ge=1,
        description="Longest prompt (or sum of chat message texts) in characters, checked before "
        "tokenizing. Default: the context length x the tokenizer's longest token in characters, beyond "
        "which no prompt can fit. Set it for a tokenizer whose normalizer deletes characters.",
    )


class OutriderArgs(_Strict):
    """Everything `build_app` needs; every field is also a Serve config `args` key."""

    model: str | None = Field(
        None, description="A Hugging Face model folder (config.json + safetensors); default: the demo target."
    )
    tokenizer: str | None = Field(None, description="Tokenizer folder (default: the model folder).")
    demo: Literal["tiny", "small"] = Field(
        "small", description="Which demo family to build/load when `model` is not given."
    )
    served_model_name: str | None = Field(
        None, description="The `model` name clients send (default: outrider-demo-<size> or the folder name)."
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat template overriding the tokenizer's (and the demo default)."
    )
    speculative_config: dict[str, Any] | None = Field(
        None,
        description="vLLM-style speculative config: method, num_speculative_tokens, tree_top_k, "
        "tree_max_nodes, prompt_lookup_min/max, ... (default: ngram with 4 tokens).",
    )
    no_speculation: bool = Field(False, description="Plain decoding through the same engine (the baseline).")
    tree_budget: TreeBudgetArgs | None = Field(
        None, description="Per-round tree budget the target offers (default: the drafter's configured shape)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks per target replica (torch.distributed).")
    engine: EngineArgs = Field(default_factory=EngineArgs, description="Batch, queue and KV limits.")
    target: TargetDeploymentArgs = Field(
        default_factory=TargetDeploymentArgs, description="Target deployment replicas and resources."
    )
    draft_pool: DraftPoolArgs = Field(
        default_factory=DraftPoolArgs, description="Where drafting runs and how it scales."
    )
    gpu_pools: GpuPoolConfig = Field(
        default_factory=GpuPoolConfig, description="Memory thresholds sorting GPUs into draft/target pools."
    )
    ingress_num_cpus: float = Field(0.0, ge=0, description="CPUs Ray reserves for the HTTP ingress replica.")
    api_key_file: str | None = Field(
        None,
        description="A file holding the API key clients must send as `Authorization: Bearer <key>` on the "
        "/v1 routes (e.g. a mounted Kubernetes Secret); read by the ingress replica at start. A file, not "
        "the key itself, so the key stays out of Serve configs and the Ray dashboard. Default: no key.",
    )
    request_limits: RequestLimitsArgs = Field(
        default_factory=RequestLimitsArgs, description="Request body and prompt size limits of the HTTP API."
    )

    @model_validator(mode="after")
    def _check_speculative_config(self) -> OutriderArgs:
        if self.speculative_config is not None:
            config = self.speculative_config
            if self.model is None and "model" not in config and _demo_drafts(config.get("method")):
                # Serving the demo: its own draft LM or trained head is filled in once the family
                # is resolved (`served_model`, `target.speculative_for`).
                config = {**config, "model": "<demo draft>"}
            try:
                parse_speculative(config)
            except ValueError as e:  # a model-level check: name the field in the message
                raise ValueError(f"speculative_config: {e}") from e
        return self

    @property
    def tree_budget_limit(self) -> TreeBudget:
        """The per-round ceiling in force: `tree_budget`, or the engine's default."""
        return self.tree_budget.to_budget() if self.tree_budget else DEFAULT_TREE_BUDGET

    @property
    def speculative(self) -> dict[str, Any] | None:
        """The speculative config in force; None means plain decoding."""
        if self.no_speculation:
            return None
        return self.speculative_config or dict(DEFAULT_SPECULATIVE_CONFIG)


def _demo_drafts(method: str | None) -> bool:
    """Whether the demo family brings this method's drafter: its draft LM, or a head it trains."""
    from outrider.draft_worker.training.demo_heads import head_methods

    return method == "draft_model" or method in head_methods()


def parse_speculative(config: dict[str, Any]):
    """`draft_worker`'s own parser, so the config edge and the drafter agree on every key."""
    from outrider import draft_worker  # noqa: F401 - registers the built-in methods
    from outrider.draft_worker.proposer import parse_speculative_config

    return parse_speculative_config(config)


def load_args(args: OutriderArgs | dict[str, Any] | None) -> OutriderArgs:
    """Serve passes a dict from YAML; Python callers may pass the model itself."""
    if isinstance(args, OutriderArgs):
        return args
    return OutriderArgs.model_validate(args or {})
