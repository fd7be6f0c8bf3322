"""A GenerateRequest checked and completed with the gateway's defaults (docs/gateway.md).

Every problem raises `specmesh.rpc.wire.WireError`, whose message starts with the request's field
path (`prompt`, `max_new_tokens`, `sampling.temperature`, `speculation.branching`, ...); the
gateway answers it with INVALID_ARGUMENT before anything is stored or sent to a replica.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from gateway.config import GatewayConfig
from specmesh.core.drafting import TreeSpec
from specmesh.core.grammar import Grammar
from specmesh.core.logprobs import MAX_TOP_LOGPROBS
from specmesh.core.methods import METHODS, Method
from specmesh.core.rounds import session_seed
from specmesh.core.sampling import SamplingParams
from specmesh.rpc import wire
from specmesh.rpc.flags import default_of

DEFAULT_METHOD = Method.CHAIN  # a request that names no method but sets depth etc.
# A request with no speculation field at all: adaptive chains, each round's depth (0 = plain
# decoding) chosen from the session's acceptance and the replicas' measured costs
# (specmesh.core.adaptive); this is the first round's depth. Chains, because on a CPU every tree
# node costs the target a sizeable share of a forward (docs/decisions.md).
AUTO_SPEC = TreeSpec(Method.CHAIN, depth=3)
# The tree each method drafts when the request leaves a field unset (0 / empty).
METHOD_DEFAULTS: dict[Method, TreeSpec] = {
    Method.NONE: TreeSpec(Method.NONE),
    Method.CHAIN: TreeSpec(Method.CHAIN, depth=3),
    Method.MCSD: TreeSpec(Method.MCSD, depth=3, branching=(2, 2, 1)),
    Method.RSD_C: TreeSpec(Method.RSD_C, depth=3, branching=(2, 2, 1)),
    Method.RSD_S: TreeSpec(Method.RSD_S, depth=3, beam_width=3),
    Method.MTAD: TreeSpec(Method.MTAD, depth=3, beam_width=3, mtad_threshold=0.1),
    Method.NGRAM: TreeSpec(Method.NGRAM, depth=4),
    # at most 8 * 2 = 16 nodes: each node costs the target a row (docs/decisions.md, "Suffix drafts")
    Method.SUFFIX: TreeSpec(Method.SUFFIX, depth=8, beam_width=2),
}


REPLICA_LIMITS = wire.Limits()  # the replicas' default --max-* flags, the gateway's defaults too


# A chat message's role goes into the chat template as it is: no markup, newlines or spaces (a role
# like "user<|im_end|>" would write the template's control tokens); docs/decisions.md.
MAX_ROLE_LENGTH = 32
_ROLE = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_ROLE_LENGTH}}}", re.ASCII)


@dataclass(frozen=True)
class ModelLimits:
    """What the gateway knows about the served model and its own limits."""

    vocab_size: int
    eos_token_id: int | None
    max_context: int  # prompt + generated tokens; 0 = unknown (no check)
    max_new_tokens_limit: int
    default_max_new_tokens: int
    tree: wire.Limits = REPLICA_LIMITS  # the largest tree a request may ask for (checked before planning)
    max_stop_sequences: int = default_of(GatewayConfig, "max_stop_sequences")
    max_stop_length: int = default_of(GatewayConfig, "max_stop_length")  # characters of one stop sequence
    # UTF-8 bytes of a text prompt or of a chat's contents, before tokenizing
    max_prompt_bytes: int = default_of(GatewayConfig, "max_prompt_bytes")


@dataclass(frozen=True)
class DsiSettings:
    """A DSI request's settings (docs/gateway.md, "DSI"); 0 = the gateway chooses."""

    lookahead: int = 0
    parallel: int = 0


@dataclass(frozen=True)
class GenerationPlan:
    """A valid request with every default filled in; the seed is fixed here, once."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]  # the request's and the tokenizer's end-of-sequence token
    params: SamplingParams
    spec: TreeSpec
    adaptive: bool = False  # spec is then the tree family and the first round's depth
    auto: bool = False  # the request asked for no speculation: the gateway chose (AUTO_SPEC)
    dsi: DsiSettings | None = None  # DSI mode; spec is then a chain of the lookahead's depth
    top_logprobs: int | None = None  # logprobs asked for, with this many alternatives (None: not)
    grammar: Grammar | None = None  # structured output (Constraint), for the tokens after the prompt
    prefix_salt: bytes = b""  # the prefix cache's namespace: its API key's and its cache_salt (`prefix_salt`)
    private: bool = False  # its output never teaches other sessions' drafts (GenerateRequest.private)


def stored_plan(plan: GenerationPlan) -> dict[str, Any]:
    """What Redis keeps of a plan (SessionStore.create's fields), so that another gateway can go
    on with the session (`plan_from_session`)."""
    grammar = {"text": plan.grammar.text, "start": plan.grammar.start} if plan.grammar else None
    extra = {
        "stop": list(plan.stop), "stop_token_ids": list(plan.stop_token_ids),
        "top_logprobs": plan.top_logprobs, "grammar": grammar, "auto": plan.auto,
        "dsi": asdict(plan.dsi) if plan.dsi else None, "prefix_salt": plan.prefix_salt.hex(),
        "private": plan.private,
    }  # fmt: skip
    return {
        "sampling": asdict(plan.params),
        "speculation": {**asdict(plan.spec), "adaptive": plan.adaptive},
        "max_new_tokens": plan.max_new_tokens,
        "extra": extra,
    }


def plan_from_session(session: Any) -> GenerationPlan:
    """session: a gateway.session_store.Session -> the plan that started it (`stored_plan`)."""
    spec = dict(session.speculation)
    adaptive = bool(spec.pop("adaptive", False))
    extra, grammar, dsi = session.extra, session.extra.get("grammar"), session.extra.get("dsi")
    return GenerationPlan(
        prompt_ids=session.tokens[: session.prompt_len],
        max_new_tokens=session.max_new_tokens,
        stop=tuple(extra.get("stop", ())),
        stop_token_ids=tuple(extra.get("stop_token_ids", ())),
        params=SamplingParams(**session.sampling),
        spec=TreeSpec(**spec),
        adaptive=adaptive,
        auto=bool(extra.get("auto", False)),
        # a gateway before DSI resume stored only `true`: the gateway chooses the shape again
        dsi=DsiSettings(**dsi) if isinstance(dsi, dict) else DsiSettings() if dsi else None,
        top_logprobs=extra.get("top_logprobs"),
        grammar=Grammar(grammar["text"], grammar["start"]) if grammar else None,
        prefix_salt=bytes.fromhex(extra.get("prefix_salt", "")),
        private=bool(extra.get("private", False)),
    )


MAX_CACHE_SALT = 256  # bytes of GenerateRequest.cache_salt


def prefix_salt(tenant: bytes, cache_salt: str) -> bytes:
    """A request's prefix cache namespace: its API key's (`tenant`: b"" without keys) and its own
    cache_salt, hashed (the replicas never see the key). Both empty: the shared namespace b""."""
    if not tenant and not cache_salt:
        return b""
    salt = cache_salt.encode()
    if len(salt) > MAX_CACHE_SALT:
        raise wire.WireError("cache_salt", f"{len(salt)} bytes, at most {MAX_CACHE_SALT}")
    return hashlib.blake2b(tenant + b"\0" + salt, digest_size=16).digest()


def parse_generate_request(
    request: Any, tokenizer: Any, limits: ModelLimits, tenant: bytes = b"", private: bool = False
) -> GenerationPlan:
    """request: a specmesh.v1.GenerateRequest; tenant: its API key's namespace (`prefix_salt`);
    private: its key's requests are all private (--private-api-keys)."""
    salt = prefix_salt(tenant, request.cache_salt)
    _check_prompt_bytes(request, limits.max_prompt_bytes)
    prompt_ids = prompt_token_ids(request, tokenizer, limits.vocab_size)
    stop_ids = tuple(_token_ids(request.stop_token_ids, limits.vocab_size, "stop_token_ids"))
    if limits.eos_token_id is not None and limits.eos_token_id not in stop_ids:
        stop_ids += (limits.eos_token_id,)
    shape = speculation(request.speculation, limits.tree)
    dsi = shape.get("dsi") is not None
    return GenerationPlan(
        prompt_ids=prompt_ids,
        max_new_tokens=_max_new_tokens(request, len(prompt_ids), limits),
        stop=_stop_strings(request.stop, limits),
        stop_token_ids=stop_ids,
        params=sampling_params(request.sampling),
        top_logprobs=_top_logprobs(request, dsi),
        grammar=_grammar(request.constraint, len(prompt_ids), dsi),
        prefix_salt=salt,
        private=private or request.private,
        **shape,
    )


def _grammar(constraint: Any, prompt_len: int, dsi: bool) -> Grammar | None:
    """A specmesh.v1.Constraint -> its llguidance grammar, checked here (a grammar that does not
    compile is refused before any replica sees it), for the tokens after the prompt."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    field = f"constraint.{kind}"
    if dsi:
        raise wire.WireError(field, "not available with speculation.dsi")
    from llguidance import LLMatcher

    value = getattr(constraint, kind)
    try:
        if kind == "json_schema":
            text = LLMatcher.grammar_from_json_schema(json.loads(value))
        elif kind == "json_object":
            text = LLMatcher.grammar_from_json_schema({"type": "object"})
        elif kind == "regex":
            text = LLMatcher.grammar_from_regex(value)
        else:
            text = LLMatcher.grammar_from_lark(value)
    except ValueError as exc:  # json.JSONDecodeError is one
        raise wire.WireError(field, f"not a valid JSON schema: {exc}") from None
    error = LLMatcher.validate_grammar(text)
    if error:
        raise wire.WireError(field, error.strip())
    return Grammar(text, prompt_len)


def _top_logprobs(request: Any, dsi: bool) -> int | None:
    if not request.HasField("logprobs"):
        return None
    if request.logprobs > MAX_TOP_LOGPROBS:
        raise wire.WireError("logprobs", f"at most {MAX_TOP_LOGPROBS} alternatives, got {request.logprobs}")
    if dsi:  # DSI's verifications run outside the round client; they do not carry them (yet)
        raise wire.WireError("logprobs", "not available with speculation.dsi")
    return request.logprobs


# ---- prompt ------------------------------------------------------------------------------------


def _check_prompt_bytes(request: Any, limit: int) -> None:
    """Before anything is tokenized: a huge prompt costs the tokenizer seconds and memory."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        size, field = len(request.prompt.encode()), "prompt"
    elif kind == "chat":
        chat = request.chat
        parts = [chat.tools_json] + [m.content + m.role + m.tool_calls_json for m in chat.messages]
        size = sum(len(p.encode()) for p in parts)
        field = "chat.messages"
    else:
        return
    if size > limit:
        raise wire.WireError(
            field, f"{size} bytes is above the gateway's limit of {limit} (--max-prompt-bytes)"
        )


def prompt_token_ids(request: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt as token ids, whichever of its three forms the request used."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise wire.WireError("prompt", "must be set (send prompt, prompt_token_ids or chat)")
    if kind == "prompt":
        if not request.prompt:
            raise wire.WireError("prompt", "must not be empty")
        ids = tokenizer(request.prompt)["input_ids"]
        if not ids:
            raise wire.WireError("prompt", "tokenizes to no tokens")
        return list(ids)
    if kind == "prompt_token_ids":
        if not request.prompt_token_ids.ids:
            raise wire.WireError("prompt_token_ids.ids", "must not be empty")
        return _token_ids(request.prompt_token_ids.ids, vocab_size, "prompt_token_ids.ids")
    return _chat_token_ids(request.chat, tokenizer)


def _chat_token_ids(chat: Any, tokenizer: Any) -> list[int]:
    if not chat.messages:
        raise wire.WireError("chat.messages", "must not be empty")
    for i, m in enumerate(chat.messages):
        if not _ROLE.fullmatch(m.role):
            raise wire.WireError(
                f"chat.messages[{i}].role",
                f"{m.role[: MAX_ROLE_LENGTH + 1]!r} is not a role: 1 to {MAX_ROLE_LENGTH} ASCII letters, "
                "digits, '_' or '-' (system, user, assistant, tool, ...)",
            )
    if not getattr(tokenizer, "chat_template", None):
        raise wire.WireError("chat", "the model's tokenizer has no chat template; send prompt instead")
    messages = [_chat_message(i, m) for i, m in enumerate(chat.messages)]
    tools = _json_field(chat.tools_json, "chat.tools_json", list) if chat.tools_json else None
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, return_dict=True
        )
    except Exception as exc:  # the template's own checks (e.g. roles must alternate)
        raise wire.WireError("chat.messages", f"the chat template refused them: {exc}") from None
    if not rendered["input_ids"]:  # would reach the replicas as an empty prompt
        raise wire.WireError("chat.messages", "render to no tokens with the model's chat template")
    return list(rendered["input_ids"])


def _chat_message(i: int, m: Any) -> dict[str, Any]:
    """A ChatMessage as the chat template takes it (OpenAI's message shape)."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        field = f"chat.messages[{i}].tool_calls_json"
        message["tool_calls"] = [
            _template_call(f"{field}[{j}]", c)
            for j, c in enumerate(_json_field(m.tool_calls_json, field, list))
        ]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _template_call(field: str, call: Any) -> dict[str, Any]:
    """An earlier call as chat templates take it: OpenAI sends its arguments as JSON text, a
    template writes them with `tojson` and expects an object (vLLM converts them the same way)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise wire.WireError(field, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _json_field(arguments, f"{field}.function.arguments", dict)
    if not isinstance(arguments, dict):
        raise wire.WireError(f"{field}.function.arguments", "must be a JSON object")
    return {**call, "function": {**function, "arguments": arguments}}


def _json_field(text: str, field: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise wire.WireError(field, f"not valid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise wire.WireError(field, f"must be a JSON {'object' if kind is dict else kind.__name__}")
    return value


def _token_ids(values: Sequence[int], vocab_size: int, field: str) -> list[int]:
    tokens = [int(t) for t in values]
    for i, t in enumerate(tokens):
        if t >= vocab_size:
            raise wire.WireError(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})")
    return tokens


# ---- lengths and stops -------------------------------------------------------------------------


def _max_new_tokens(request: Any, prompt_len: int, limits: ModelLimits) -> int:
    """The requested number, or the default; prompt + max_new_tokens must fit the context (a
    default is shortened to fit, an explicit value is refused)."""
    context = limits.max_context
    if context and prompt_len >= context:
        raise wire.WireError(
            "prompt", f"{prompt_len} tokens leave no room in the model's context of {context} tokens"
        )
    room = context - prompt_len if context else limits.max_new_tokens_limit
    if not request.HasField("max_new_tokens"):
        return min(limits.default_max_new_tokens, limits.max_new_tokens_limit, room)
    n = request.max_new_tokens
    if n < 1:
        raise wire.WireError("max_new_tokens", f"must be >= 1, got {n}")
    if n > limits.max_new_tokens_limit:
        raise wire.WireError(
            "max_new_tokens",
            f"{n} is above the gateway's limit of {limits.max_new_tokens_limit} (--max-new-tokens-limit)",
        )
    if n > room:
        raise wire.WireError(
            "max_new_tokens",
            f"{n} new tokens after a {prompt_len}-token prompt exceed the model's context of {context} "
            f"tokens; at most {room}",
        )
    return n


def _stop_strings(values: Sequence[str], limits: ModelLimits) -> tuple[str, ...]:
    if len(values) > limits.max_stop_sequences:
        raise wire.WireError(
            "stop",
            f"{len(values)} stop sequences is above the gateway's limit of {limits.max_stop_sequences} "
            "(--max-stop-sequences)",
        )
    for i, text in enumerate(values):
        if not text:
            raise wire.WireError(f"stop[{i}]", "must not be empty")
        if len(text) > limits.max_stop_length:
            raise wire.WireError(
                f"stop[{i}]",
                f"{len(text)} characters is above the gateway's limit of {limits.max_stop_length} "
                "(--max-stop-length)",
            )
    return tuple(values)


# ---- sampling and speculation ------------------------------------------------------------------


def sampling_params(msg: Any) -> SamplingParams:
    """msg: specmesh.v1.Sampling. An unset seed is drawn here, once: stored with the session, it
    makes a failover reproduce the same randomness."""
    params = wire.sampling_from_proto(msg, "sampling")
    return replace(params, seed=session_seed(params))


def speculation(msg: Any, limits: wire.Limits = REPLICA_LIMITS) -> dict[str, Any]:
    """msg: specmesh.v1.Speculation -> the plan's spec, adaptive and auto. The tree is checked
    against `limits` before anything is planned (an adaptive policy enumerates every depth)."""
    if not msg.ListFields():
        return {"spec": AUTO_SPEC, "adaptive": True, "auto": True}
    whose = "the gateway's"
    wire.check_depth(msg.depth, limits, "speculation", whose)
    wire.check_depth(len(msg.branching), limits, "speculation", whose)
    if msg.dsi:
        return {"spec": TreeSpec(Method.CHAIN, depth=msg.depth or 1), "dsi": dsi_settings(msg)}
    if msg.parallel:
        raise wire.WireError("speculation.parallel", "applies only with speculation.dsi")
    spec = tree_spec(msg)
    wire.check_tree_limits(spec, limits, "speculation", whose)
    return {"spec": spec, "adaptive": msg.adaptive}


def dsi_settings(msg: Any) -> DsiSettings:
    """msg: a specmesh.v1.Speculation with dsi set. DSI verifies chains of `depth` tokens."""
    if msg.method not in ("", Method.CHAIN):
        raise wire.WireError(
            "speculation.method", f"DSI drafts chains; method {msg.method!r} is not supported"
        )
    for name, wrong in {
        "branching": bool(msg.branching),
        "beam_width": msg.beam_width > 0,
        "replacement": msg.replacement,
        "mtad_threshold": msg.HasField("mtad_threshold"),
        "adaptive": msg.adaptive,
    }.items():
        if wrong:
            raise wire.WireError(f"speculation.{name}", "does not apply with speculation.dsi")
    return DsiSettings(lookahead=msg.depth, parallel=msg.parallel)


def tree_spec(msg: Any) -> TreeSpec:
    """msg: specmesh.v1.Speculation; unset fields take METHOD_DEFAULTS[method]."""
    if msg.method and msg.method not in METHODS:
        raise wire.WireError(
            "speculation.method", f"unknown method {msg.method!r}; use one of {', '.join(METHODS)}"
        )
    method = Method(msg.method or DEFAULT_METHOD)
    _check_applicable(msg, method)
    base = METHOD_DEFAULTS[method]
    if not method.drafts:
        return base
    branching = tuple(msg.branching)
    depth = msg.depth or len(branching) or base.depth
    if method.branched:
        branching = branching or default_branching(depth)
        if len(branching) != depth:
            raise wire.WireError(
                "speculation.branching", f"has {len(branching)} levels but speculation.depth is {depth}"
            )
    threshold = msg.mtad_threshold if msg.HasField("mtad_threshold") else base.mtad_threshold
    try:
        return TreeSpec(
            method, depth, branching, msg.beam_width or base.beam_width, msg.replacement, threshold
        )
    except ValueError as exc:
        raise wire.core_error("speculation", exc) from None


def default_branching(depth: int) -> tuple[int, ...]:
    """(2, 2, 1, 1, ...): two children on the first two levels, then chains."""
    return tuple(2 if level < 2 else 1 for level in range(depth))


def _check_applicable(msg: Any, method: Method) -> None:
    """Refuse a field the method does not use, rather than silently ignoring it."""
    given = {
        "depth": msg.depth > 0 and not method.drafts,
        "branching": bool(msg.branching) and not method.branched,
        "beam_width": msg.beam_width > 0 and not method.beamed,
        "replacement": msg.replacement and method is not Method.MCSD,
        "mtad_threshold": msg.HasField("mtad_threshold") and method is not Method.MTAD,
        "adaptive": msg.adaptive and not method.drafts,
    }
    for name, wrong in given.items():
        if wrong:
            raise wire.WireError(f"speculation.{name}", f"does not apply to method {method!r}")
