"""vLLM's OpenAI wire protocol (0.32, checked against a real server), for every server here.

The simulator (``backends.sim``), the engine's servers and its router (``backends.engine``)
answer through this package as peers, so a client -- the gateway, its evaluators, the OpenAI
SDK -- cannot tell them from vLLM, nor one from another, by the bytes:

- requests: ``decode_body`` (integers exact, as vLLM reads them; ``encode_body`` writes a body
  again), ``request_object``, ``stream_options``, ``chat_template_kwargs``, the typed field
  readers (pydantic's lax ``int``, with its bounds), ``requested_max_tokens``, ``check_room``,
  ``request_seed``, ``sampling_fields`` and ``stop_fields``, refusing with vLLM's statuses and
  wording (``RequestError``);
- answers: the bodies (``_bodies``: chunks, the usage chunk, whole responses, embeddings, the
  model list) and ``AnswerWriter``, which writes them as a JSON body or an SSE stream;
- the app: ``install_openai_app`` (FastAPI-style errors, ``/v1/models``, ``/version``),
  ``serve_app``, ``serve_until_signalled`` (the command line's loop);
- the command line's settings: ``config_error`` turns a ``ValidationError`` into a
  ``ConfigError``, one ``Error: <field>: <message>`` line per field and exit status 2, for every
  ``understudy`` command alike; ``validation_problems`` words those fields (the admin API's
  422s too) in plain words;
- metrics: ``VLLMSeries``, vLLM's Prometheus series, named and bucketed as vLLM does.
"""

from ._answer import (
    DONE_EVENT,
    JSON_CONTENT_TYPE,
    SSE_CONTENT_TYPE,
    AnswerWriter,
    ClientGone,
    client_left,
    json_response,
    response_id,
    sse_event,
)
from ._app import ServedApp, ServedModel, install_openai_app, serve_app, serve_until_signalled
from ._bodies import (
    SIMULATED_VLLM_VERSION,
    RequestKind,
    ResponseIdentity,
    Usage,
    embedding_response,
)
from ._config_error import ConfigError, config_error, validation_problems
from ._errors import RequestError, error_body, invalid_value, schema_error
from ._fields import (
    SamplingFields,
    StopFields,
    choice_count,
    is_token_ids,
    optional_bool,
    optional_float,
    optional_int,
    request_seed,
    sampling_fields,
    stop_fields,
)
from ._metrics import LABELS, RequestOutcome, VLLMSeries, metrics_response
from ._requests import (
    StreamOptions,
    chat_messages,
    chat_template_kwargs,
    check_message_content,
    check_message_role,
    check_room,
    completion_prompt,
    decode_body,
    encode_body,
    request_object,
    requested_max_tokens,
    stream_options,
)

__all__ = [
    "DONE_EVENT",
    "JSON_CONTENT_TYPE",
    "LABELS",
    "SIMULATED_VLLM_VERSION",
    "SSE_CONTENT_TYPE",
    "AnswerWriter",
    "ClientGone",
    "ConfigError",
    "RequestError",
    "RequestKind",
    "RequestOutcome",
    "ResponseIdentity",
    "SamplingFields",
    "ServedApp",
    "ServedModel",
    "StopFields",
    "StreamOptions",
    "Usage",
    "VLLMSeries",
    "chat_messages",
    "chat_template_kwargs",
    "check_message_content",
    "check_message_role",
    "check_room",
    "choice_count",
    "client_left",
    "completion_prompt",
    "config_error",
    "decode_body",
    "embedding_response",
    "encode_body",
    "error_body",
    "install_openai_app",
    "invalid_value",
    "is_token_ids",
    "json_response",
    "metrics_response",
    "optional_bool",
    "optional_float",
    "optional_int",
    "request_object",
    "request_seed",
    "requested_max_tokens",
    "response_id",
    "sampling_fields",
    "schema_error",
    "serve_app",
    "serve_until_signalled",
    "sse_event",
    "stop_fields",
    "stream_options",
    "validation_problems",
]
