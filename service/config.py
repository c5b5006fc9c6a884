"""Server settings: one pydantic-settings object, environment prefix ``DLLM_``, the only reader of the environment.

Every field is also a ``python -m service serve`` flag (``--max-batch-size 8`` overrides ``DLLM_MAX_BATCH_SIZE``);
docs/settings.md has the table (the decoding settings are listed with `DecodeSettings`). Validation happens at
start-up, and unsafe combinations are refused (see :meth:`Settings._refuse_unsafe`).

Where a value comes from, first found wins: the flag, the environment, the env file (``.env`` in the working
directory, the file docker compose reads; ``DLLM_ENV_FILE`` names another, empty: none), the default. The env file
is read as compose and a shell's ``set -a; . .env`` read it (python-dotenv: ``KEY=value``, quotes for values with
spaces or JSON); its variables that are no setting (compose's own, ``DLLM_PUBLISH_ADDRESS``, removed settings) are
ignored, as unknown ``DLLM_`` variables of the environment are.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from service.engine.params import N_CEILING, DecodeSettings
from service.quant.config import KVQuantConfig

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
#: Host header names a loopback-bound server answers when ``allowed_hosts`` is empty (a DNS-rebinding page
#: reaches it under its own name, which is refused).
LOOPBACK_HOST_NAMES = ("127.0.0.1", "localhost", "::1")


def effective_allowed_hosts(settings: Settings) -> list[str]:
    """The Host names the server accepts: ``allowed_hosts``, else the loopback names on a loopback bind, else
    any (empty list)."""
    if settings.allowed_hosts:
        return list(settings.allowed_hosts)
    return list(LOOPBACK_HOST_NAMES) if settings.host in LOCAL_HOSTS else []

#: The one default store of every command (server, calibration, evaluation, policies) when neither a flag nor
#: ``DLLM_STORE_URL`` names one: a directory under the working directory.
DEFAULT_STORE_URL = ".dllm-kvq/store"
DEFAULT_STORE_PREFIX = "dllm-kvq"
#: The ``--store`` help of every offline command, so each names the same default.
#: The key values the shipped examples (``.env.example``, ``deploy/k8s/11-secret.yaml``) carry until the operator
#: replaces them: a copied example must not become an open admin or API endpoint, so these are refused at start-up.
PLACEHOLDER_KEYS = frozenset({"replace-with-a-long-random-admin-key", "replace-with-an-api-key"})
#: The shortest admin key accepted.
MIN_ADMIN_KEY_CHARS = 16
STORE_HELP = f"store URL, redis://host:port/db or a directory (default: DLLM_STORE_URL, else {DEFAULT_STORE_URL})"


#: The env file read when ``DLLM_ENV_FILE`` is not set: the working directory's ``.env`` (docker compose's file).
DEFAULT_ENV_FILE = ".env"


def env_file() -> str | None:
    """The env file the settings read (relative to the working directory): ``DLLM_ENV_FILE`` when set (empty:
    none), else ``.env``. A missing file is no error (nothing is read)."""
    return os.environ.get("DLLM_ENV_FILE", DEFAULT_ENV_FILE) or None


class _KnownSettingsFile(DotEnvSettingsSource):
    """The env file's values of this model's fields only: the file also holds compose's variables
    (``DLLM_PUBLISH_ADDRESS``, ``GRAFANA_ADMIN_PASSWORD``) and may hold removed settings, which a model that
    forbids extra fields would refuse."""

    def __call__(self) -> dict[str, Any]:
        return {name: value for name, value in super().__call__().items() if name in self.settings_cls.model_fields}


def _sources(settings_cls: type[BaseSettings], init: PydanticBaseSettingsSource, env: PydanticBaseSettingsSource,
             dotenv: DotEnvSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
    """Flags (the init arguments), then the environment, then the env file (pydantic-settings' ``_env_file``
    argument when one is given, else :func:`env_file`), then defaults."""
    path = dotenv.env_file if dotenv.env_file is not None else env_file()
    return init, env, _KnownSettingsFile(settings_cls, env_file=path, env_file_encoding="utf-8")


def served_model_name(settings: Settings, model_id: str) -> str:
    """The name ``/v1/models`` lists and requests may name (the checkpoint's ``model_id`` is accepted as well).

    ``DLLM_SERVED_MODEL_NAME`` when set (vLLM's ``--served-model-name``: a checkpoint mounted at ``/model`` can
    still be served as ``llada-tiny``); else, for a local checkpoint directory, that directory's name
    (``/models/llada-tiny/`` -> ``llada-tiny``); else ``model_id`` as given (a hub repo id such as
    ``GSAI-ML/LLaDA-8B-Instruct``, whole, or ``embedded``).
    """
    if settings.served_model_name:
        return settings.served_model_name
    path = Path(model_id)
    if path.is_dir():
        return path.resolve().name or model_id
    return model_id


def key_id(key: str) -> str:
    """A short, non-secret name for a bearer key (audit log, logs): first 12 hex of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class Settings(BaseSettings, DecodeSettings):
    """Everything the server can be told. Environment: ``DLLM_<FIELD>`` (case-insensitive).

    The decoding defaults are the fields of `service.engine.params.DecodeSettings` (declared once there): a request
    that leaves one out gets the value set here, else the built-in default.
    """

    model_config = SettingsConfigDict(env_prefix="DLLM_", extra="forbid", validate_default=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flag > environment > env file > default (the module doc)."""
        return _sources(settings_cls, init_settings, env_settings, dotenv_settings)

    # ---- model ---------------------------------------------------------------------------------------------------
    model: str | None = Field(None, description="checkpoint directory or HF repo id; empty: the embedded default")
    served_model_name: str | None = Field(
        None, description="name in /v1/models and responses; default: the directory's name or the hub id"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights and activations")
    device: str = Field("cpu", description="torch device, e.g. cpu, cuda, cuda:1")
    threads: int | None = Field(None, gt=0, description="torch intra-op threads; empty: torch's default")

    # ---- decoding defaults: every field of DecodeSettings (cache_mode, block_length, threshold ...), inherited --
    default_max_tokens: int = Field(64, gt=0, description="response positions when a request gives no max_tokens")
    kv_quant: KVQuantConfig = Field(
        default_factory=KVQuantConfig,
        description="KV quantization used when the store has no active configuration (JSON)",
    )

    # ---- worker ----------------------------------------------------------------------------------------------------
    max_batch_size: int = Field(32, gt=0, description="most rows decoded together (a cap; memory admits)")
    max_batched_tokens: int = Field(
        16384, gt=0, description="most input tokens of one forward (vLLM's max_num_batched_tokens); its activation "
        "memory is measured at start-up and taken off the memory budget before KV admission"
    )
    layer_split_tokens: int = Field(
        512, ge=0, description="a full pass (block-initial, or any of cache mode none) over more input tokens "
        "runs its layers over several iterations, this many tokens' worth at a time, so a short request never "
        "waits for a long one's whole pass (token-exact; docs/architecture.md, head-of-line); 0: never split"
    )
    backfill_s: float | None = Field(
        2.0, ge=0.0, description="how long a request waiting for memory at the head of the queue lets smaller "
        "requests that fit run ahead of it; after that memory is reserved for it; empty: first come, first served"
    )
    max_preemptions: int = Field(
        4, ge=0, description="how often one running request may be preempted at a block "
        "boundary for a smaller request that does not fit beside it (its KV freed, resumed later with the same "
        "output; docs/architecture.md, preemption); 0: never"
    )
    cuda_graphs: bool = Field(
        True, description="on CUDA, the later steps' forwards (dual and prefix cache, full-precision KV) are "
        "captured as CUDA graphs per bucket of rows and key length and replayed (service/engine/graphs.py; "
        "token-identical to eager); false: eager forwards. No effect on CPU"
    )
    cuda_graph_bytes: int = Field(
        2 << 30, ge=0, description="GPU memory the CUDA graphs may hold (their memory pools): taken off the KV "
        "budget at start-up when cuda_graphs is on and the device is CUDA; no graph is captured beyond it"
    )
    max_queue: int = Field(64, gt=0, description="most requests waiting; beyond it: 429")
    kv_budget_bytes: int | None = Field(
        None, gt=0, description="memory for running rows' KV + the largest forward; empty: a fraction of free "
        "GPU memory, 1 GiB on CPU"
    )
    kv_budget_fraction: float = Field(
        0.9, gt=0.0, le=1.0, description="share of free GPU memory (after loading) used when kv_budget_bytes is empty"
    )
    prefix_cache_bytes: int = Field(
        0, ge=0, description="most bytes of the prefix cache across requests (block-causal families: a prompt's "
        "whole blocks' committed K/V, held in the request's KV format, docs/prefix-cache.md); counted in the memory "
        "budget and evicted before a request waits for memory; 0: off"
    )
    max_request_work: int | None = Field(
        None, gt=0, description="most token-forwards (forward calls x tokens) one request may cost, all its n "
        "choices together; beyond: 400 naming steps, max_tokens or the prompt, before any work; empty: 2 x the "
        "model's context squared (service.runtime.scheduler.default_max_work)"
    )
    request_timeout_s: float = Field(300.0, gt=0.0, description="a request waiting + running longer: 504")
    retry_after_s: int = Field(1, gt=0, description="Retry-After seconds sent with 429")
    drain_timeout_s: float = Field(30.0, ge=0.0, description="SIGTERM: how long in-flight requests may finish")
    shadow_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="probability a quantized request is re-decoded unquantized (agreement)"
    )
    shadow_queue: int = Field(16, gt=0, description="most shadow re-decodes waiting; beyond it they are dropped")

    # ---- OpenAI contract (issue 25) --------------------------------------------------------------------------------
    allow_special_tokens_in_content: bool = Field(
        False, description="chat message content may spell control tokens (<|eot_id|> ... become those tokens); "
        "default: such text is tokenized as text, only the chat template makes control tokens"
    )
    max_n: int = Field(8, gt=0, le=N_CEILING, description="most choices (n) of one request: rows of one cohort, "
                       "each costing a response's memory and work")
    likelihood_mc_num: int = Field(
        128, gt=0, description="Monte-Carlo samples of each prompt ELBO of an echo + logprobs completion (a request "
        "may override it with mc_num); the in-process lm-eval model's default"
    )
    likelihood_mc_batch_size: int = Field(
        32, gt=0, description="Monte-Carlo samples per forward of a prompt ELBO (mc_num is rounded up to a multiple)"
    )

    # ---- stores and keys -------------------------------------------------------------------------------------------
    store_url: str = Field(
        DEFAULT_STORE_URL,
        description="redis://, rediss://, unix:// (Redis), file:// or a plain directory path; default "
        f"{DEFAULT_STORE_URL}, the store every command uses",
    )
    store_prefix: str = Field(DEFAULT_STORE_PREFIX, min_length=1, description="Redis key prefix")
    create_store: bool = Field(
        False, description="start a new, empty directory store where store_url names a directory that does not "
        f"exist; default: refuse to start, naming it (the default {DEFAULT_STORE_URL} is always created)"
    )
    store_check_interval_s: float = Field(
        2.0, gt=0.0, le=5.0, description="seconds between store pings (dllm_store_up follows the connection)"
    )
    store_restore_active: bool = Field(
        True, description="when the store comes back without the active configuration this replica serves, "
        "write it back (with its policy or state, and an audit entry) so replicas converge",
    )
    admin_key: SecretStr | None = Field(None, description="bearer key of /admin; empty: admin closed (403)")
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="bearer keys of the serving routes (/v1/*, /generate, /tokenize, /detokenize, /tokenizer_info; not "
        "/health, /metrics, /openapi.json), comma-separated; empty: open"
    )

    allow_unauthenticated: bool = Field(
        False, description="allow empty api_keys on a non-local host (behind an authenticating proxy)"
    )

    # ---- HTTP ------------------------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="bind port")
    max_body_bytes: int | None = Field(
        None, gt=0, description="largest request body in bytes; beyond it: 413 before it is parsed; empty: 256 "
        "bytes per token of the model's context, at least 1 MiB"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="uvicorn log level")
    keep_alive_timeout_s: int = Field(
        5, gt=0, description="seconds a kept-alive connection may stay silent after an answer; beyond: closed"
    )
    header_timeout_s: float = Field(
        10.0, gt=0.0, description="seconds a connection may take to send a whole request head (from connecting, or "
        "from its previous answer), however it trickles; beyond: closed"
    )
    body_timeout_s: float = Field(
        30.0, gt=0.0, description="seconds a request body may go without a byte while it is received; beyond: "
        "the connection is closed and the request cancelled"
    )
    max_connections: int | None = Field(
        None, gt=0, description="open connections at most; beyond: the one that waited longest for a request head "
        "is closed, else 503; empty: the open-file limit minus 128"
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Host header values accepted, comma-separated (*.example.com allowed); "
        "others: 400; empty: localhost names on a loopback bind, any on another"
    )

    @field_validator("api_keys", "allowed_hosts", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("store_url")
    @classmethod
    def _known_store_scheme(cls, value: str) -> str:
        # Imported here: the store module imports torch, and `serve --help` builds its flags from these settings.
        from service.store.base import check_store_url

        check_store_url(value)
        return value

    @field_validator("model", "served_model_name", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("admin_key")
    @classmethod
    def _long_admin_key(cls, value: SecretStr | None) -> SecretStr | None:
        # A field validator, so the error's location names the setting (the serve command turns it into its flag).
        if value is not None and value.get_secret_value() in PLACEHOLDER_KEYS:
            raise ValueError("is the example's placeholder: make your own (openssl rand -hex 32), or leave it "
                             "empty to close admin")
        if value is not None and len(value.get_secret_value()) < MIN_ADMIN_KEY_CHARS:
            raise ValueError(f"must have at least {MIN_ADMIN_KEY_CHARS} characters (or be empty to close admin)")
        return value

    @field_validator("api_keys")
    @classmethod
    def _no_placeholder_api_key(cls, value: list[SecretStr]) -> list[SecretStr]:
        if any(key.get_secret_value() in PLACEHOLDER_KEYS for key in value):
            raise ValueError("holds the example's placeholder: make your own keys (openssl rand -hex 32)")
        return value

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> Settings:
        """Refuse an open API on a non-local address."""
        if self.host not in LOCAL_HOSTS and not self.api_keys and not self.allow_unauthenticated:
            raise ValueError(
                f"host {self.host!r} is not local and api_keys is empty: set DLLM_API_KEYS, bind to "
                f"{' / '.join(LOCAL_HOSTS)}, or set DLLM_ALLOW_UNAUTHENTICATED=true"
            )
        return self


class StoreSettings(BaseSettings):
    """The store settings alone (``DLLM_STORE_URL``, ``DLLM_STORE_PREFIX``) for the offline commands, which default
    to the server's store without validating the server's other settings."""

    model_config = SettingsConfigDict(env_prefix="DLLM_", extra="ignore")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        """As the server's settings: the offline commands default to the store the server uses."""
        return _sources(settings_cls, init_settings, env_settings, dotenv_settings)

    store_url: str = DEFAULT_STORE_URL
    store_prefix: str = Field(DEFAULT_STORE_PREFIX, min_length=1)


def default_store(url: str | None = None, prefix: str | None = None) -> tuple[str, str]:
    """The store URL and Redis key prefix a command uses: the ones given, else the environment's, else the
    defaults (``DEFAULT_STORE_URL``, ``DEFAULT_STORE_PREFIX``).

    Raises: InvalidName naming ``DLLM_STORE_URL`` when the environment's URL has an unknown scheme."""
    from service.store.base import InvalidName, check_store_url

    if url and prefix:
        return url, prefix
    env = StoreSettings()
    if not url:
        try:
            check_store_url(env.store_url)
        except InvalidName as exc:  # a flag is checked by argparse; the environment's value is named here
            raise InvalidName(f"DLLM_STORE_URL: {exc}") from None
    return url or env.store_url, prefix or env.store_prefix
