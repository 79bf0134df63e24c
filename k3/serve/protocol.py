"""OpenAI request and response schemas, with JSON's types: what we accept is what `/openapi.json` says.

Requests are validated with JSON's rules, not Python's: an integer field takes 1 and 1.0 (JSON Schema's
"integer" is a number with no fraction) but not "1" or true; a number field takes 1 and 1.5 but not "1"
or true; booleans are only true / false. Unknown fields are ignored (clients send many); a value of the
wrong type or outside its range fails validation (HTTP 422). Limits that depend on the server (the
model name, token ids below the vocabulary, image parts only with vision) are written into the document
per server (`k3.serve.openapi`); those that depend on the prompt's token count (it must fit the context)
answer 400 in app.py. Response models exist for the document (and the fuzzer's schema checks); app.py
builds the same shapes as dicts in k3.serve.responses.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool, StrictStr


def _integral(v):
    """JSON's integer: a number without a fraction (1.0 -> 1); strings and booleans stay invalid."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _number(v):
    """JSON's number: integers count (1 -> 1.0); strings and booleans stay invalid."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:  # an integer beyond float range: out of every range we accept
            return float("inf") if v > 0 else float("-inf")
    return v


def Int(**limits):  # noqa: N802 - a type
    """A JSON integer within `limits` (ge / le); the bounds sit inside the conversion, so the JSON
    schema says them as minimum / maximum, also for an optional field."""
    return Annotated[Annotated[int, Strict(), Field(**limits)], BeforeValidator(_integral)]


def Number(**limits):  # noqa: N802 - a type
    """A JSON number within `limits` (ge / gt / le)."""
    return Annotated[Annotated[float, Strict(), Field(**limits)], BeforeValidator(_number)]


JsonInt = Int()
EFFORTS = ("low", "high", "max", "none")  # k3.chat_format.ChatOptions; "none" turns thinking off


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: StrictBool = False


class _Request(_Model):
    model: StrictStr
    max_tokens: Int(ge=0) | None = Field(
        None, description="output tokens at most; generation also ends at the context length"
    )
    temperature: Number(ge=0, le=2) = Field(1.0, description="0: greedy")
    top_p: Number(gt=0, le=1) = 1.0
    top_k: Int(ge=0) = Field(0, description="0: off")
    seed: Int(ge=0, le=2**63 - 1) | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int(ge=1, le=1) = Field(1, description="one choice per request")
    ignore_eos: StrictBool = False
    cache_salt: Annotated[StrictStr, Field(max_length=256)] | None = Field(
        None,
        description="prefix-cache isolation: requests reuse each other's cached prompt state only "
        "with the same API key and the same cache_salt",
    )

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Model):
    url: StrictStr = Field(description="a data: URL (base64 PNG or JPEG); remote URLs are refused")
    detail: StrictStr | None = None


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Model):
    name: StrictStr = Field(min_length=1)
    # a JSON object as text (or text that is not JSON, rendered as it is); JSON of another kind is refused
    arguments: StrictStr = Field("{}", pattern=r"^\s*(\{|$)")


class ToolCall(_Model):
    id: StrictStr = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[ContentPart] | None = None
    reasoning_content: StrictStr | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None


class FunctionDef(_Model):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: StrictStr


class ToolChoiceFunction(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(_Model):
    thinking: StrictBool = True
    thinking_effort: Literal[EFFORTS] | None = None
    preserve_thinking: StrictBool = True


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = Field(
        None, description="accepted for compatibility; the model decides whether to call a tool"
    )
    max_tokens: Int(ge=1) | None = Field(
        None, description="output tokens at most (default: up to the context length)"
    )
    max_completion_tokens: Int(ge=1) | None = Field(None, description="the same as max_tokens")
    logprobs: StrictBool = False
    top_logprobs: Int(ge=0, le=20) | None = None
    reasoning_effort: Literal[EFFORTS] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


TokenIds = Annotated[list[JsonInt], Field(min_length=1)]


class CompletionRequest(_Request):
    prompt: (
        Annotated[StrictStr, Field(min_length=1)]
        | TokenIds
        | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    ) = Field(description="text, token ids, or a list of one of either (one prompt per request)")
    max_tokens: Int(ge=0) | None = Field(16, description="0 with echo and logprobs scores the prompt")
    echo: StrictBool = False
    logprobs: Int(ge=0, le=20) | None = None


# ---- responses (for the OpenAPI document) ------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    reasoning_content: str
    tool_calls: list[ResponseToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: FinishReason | None
    logprobs: None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (the last one may carry only usage)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    vision: bool


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
